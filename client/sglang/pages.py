"""SGLang's host KV pool seen as pages, the daemon's page format for it, and page keys.

SGLang keeps host KV in one of three layouts (``--hicache-mem-layout``); the daemon keeps every
SGLang page in one format whatever the layout, so instances with different layouts share KV:
one contiguous run per page, in SGLang's page_first order: K then V (``kv`` parts: MHA 2, MLA
1), each ``page_size`` tokens of every layer's ``width`` elements (``heads * head_dim``; MLA
``kv_lora_rank + rope``). The daemon's pool then has one "layer" of ``kv * layers * width``
elements per token. Every copy is written against 5-D views ``[kv, layers, pages,
page_size, width]`` (rows contiguous), the form hicache's C page copy takes; for a page_first
host both sides fold the layers into the row (``[kv, 1, pages, P, layers * width]``), so a
page moves as one copy per part:

    SGLang MHA kv_buffer                        view
    layer_first        [2, L, tokens, H, D]     view(2, L, pages, P, HD)
    page_first         [2, tokens, L, H, D]     view(2, pages, P, L * HD)[:, None]   (folded)
    page_first_direct  [2, pages, L, P, H, D]   view(2, pages, L, P, HD).permute(0, 2, 1, 3, 4)
    SGLang MLA kv_buffer (one part)
    layer_first        [L, tokens, 1, W]        view(1, L, pages, P, W)
    page_first         [tokens, L, 1, W]        view(1, 1, pages, P, L * W)           (folded)
    page_first_direct  [pages, L, P, 1, W]      view(pages, L, P, W).permute(1, 0, 2, 3)[None]
    daemon pool        [1, pages * P, 1, kv * L * W]
                       folded:   view(pages, kv, 1, P, L * W).permute(1, 2, 0, 3, 4)
                       per layer: view(pages, kv, P, L, W).permute(1, 3, 0, 2, 4)

A flat page of SGLang's generic path (``get_data_page(i).flatten()``) is a pool of one page of
the same layout. Keys: SGLang names a page by a 64-hex-digit sha256 chained over the prefix;
the daemon's tree keys a page by ``page_size`` non-negative int32 words, so a digest's eight
32-bit words lose their top bit (the low 31 bits each fill a word) and, from a page of 9 tokens
on, the ninth word packs the eight top bits: all 256 bits (below 9, ``31 * page_size`` of them
are kept; the rest zero).

Pure torch and numpy: duck-typed on SGLang's pool (``layout``, ``kv_buffer``, ``page_size``,
``layer_num``, ``dtype`` and the head or MLA dims), never importing SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hicache.config import DTYPES
from hicache.memory import EngineLayout
from hicache.transfers import copy_pages_c

LAYOUTS = ("layer_first", "page_first", "page_first_direct")
FORMAT = "sglang-v1"  # the daemon's page format (part of the layout identity)
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_INDEX_DTYPES = (torch.int64, torch.int32)


@dataclass(frozen=True)
class PageFormat:
    """One rank's SGLang page: what the daemon's layout is made of."""

    model: str  # SGLang's model name (served name or path)
    mla: bool  # one latent part per token (MLA) or K and V
    layers: int
    page_size: int  # tokens per page
    heads: int  # KV heads on this rank (1 for MLA)
    head_dim: int  # elements per head (MLA: kv_lora_rank + rope dims)
    dtype: str  # a key of hicache.config.DTYPES

    @property
    def kv(self) -> int:
        return 1 if self.mla else 2

    @property
    def width(self) -> int:
        """Elements of one token's K (or V, or latent) on one layer."""
        return self.heads * self.head_dim

    def engine_layout(self) -> EngineLayout:
        """The daemon's layout: one pool page per SGLang page of this rank, in FORMAT, as one
        run (a single pool "layer"; the model's layers are in ``block_shape``). Ranks keep
        their pages apart by namespace (tensor parallel size and rank), so the layout is one
        rank's page."""
        return EngineLayout(
            model=self.model,
            num_layers=1,
            num_kv_heads=self.heads,
            head_size=self.head_dim,
            dtype=self.dtype,
            block_size=self.page_size,
            block_shape=(self.kv, self.page_size, self.layers, self.heads, self.head_dim),
            tp_size=1,
            shard="rank",
            backend=f"{FORMAT}-{'mla' if self.mla else 'mha'}",
        )


def page_format(pool: Any, model: str) -> PageFormat:  # (SGLang's HostKVCache: untyped)
    """The page format of SGLang's host pool; ValueError for what the daemon cannot hold
    (another layout, a dtype outside DTYPES, pages of fewer than 2 tokens)."""
    layout = getattr(pool, "layout", None)
    if layout not in LAYOUTS:
        raise ValueError(
            f"hicache: SGLang host layout {layout!r} is not one of {', '.join(LAYOUTS)} "
            "(--hicache-mem-layout)"
        )
    dtype = _DTYPE_NAMES.get(pool.kv_buffer.dtype)
    if dtype is None:
        raise ValueError(f"hicache: KV dtype {pool.kv_buffer.dtype} is not one of {list(DTYPES)}")
    page = int(pool.page_size)
    if page < 2:
        raise ValueError(
            "hicache: SGLang's page size is 1: a page key would be 31 bits of its hash "
            "(collisions); use --page-size 2 or more (64 is usual with a storage backend)"
        )
    mla = hasattr(pool, "kv_lora_rank")
    if mla:
        width = getattr(pool, "kv_cache_dim", None)  # (wider than lora + rope for fp8 DSA)
        heads, dim = 1, int(width or int(pool.kv_lora_rank) + int(pool.qk_rope_head_dim))
    else:
        heads, dim = int(pool.head_num), int(pool.head_dim)
    return PageFormat(model, mla, int(pool.layer_num), page, heads, dim, dtype)


def folded(layout: str) -> bool:
    """Whether views for this host layout fold the layers into the row (page_first: a page
    is then one run per part on both sides)."""
    return layout == "page_first"


def host_view(fmt: PageFormat, layout: str, buffer: torch.Tensor) -> torch.Tensor:
    """SGLang's ``kv_buffer`` (or one flat page of it) as ``[kv, L, pages, P, width]``
    (``[kv, 1, pages, P, L * width]`` when ``folded(layout)``)."""
    kv, layers, page, width = fmt.kv, fmt.layers, fmt.page_size, fmt.width
    pages = buffer.numel() // (kv * layers * page * width)
    flat = buffer.reshape(-1)
    if folded(layout):
        return flat.view(kv, pages, page, layers * width)[:, None]
    if fmt.mla:
        if layout == "layer_first":
            return flat.view(1, layers, pages, page, width)
        return flat.view(pages, layers, page, width).permute(1, 0, 2, 3)[None]
    if layout == "layer_first":
        return flat.view(2, layers, pages, page, width)
    return flat.view(2, pages, layers, page, width).permute(0, 2, 1, 3, 4)


def daemon_view(fmt: PageFormat, layout: str, rows: torch.Tensor) -> torch.Tensor:
    """The daemon's pool (``rows``: the one layer ``attach()`` maps, ``[1, rows, 1, kv * L *
    width]``) in the form ``host_view`` gives for ``layout``."""
    kv, layers, page, width = fmt.kv, fmt.layers, fmt.page_size, fmt.width
    pages = rows.numel() // (kv * layers * page * width)
    flat = rows.reshape(-1)
    if folded(layout):
        return flat.view(pages, kv, 1, page, layers * width).permute(1, 2, 0, 3, 4)
    return flat.view(pages, kv, page, layers, width).permute(1, 3, 0, 2, 4)


def copy_pages(src: torch.Tensor, dst: torch.Tensor, src_pages: np.ndarray, dst_pages: np.ndarray):
    """dst[:, :, dst_pages[i]] = src[:, :, src_pages[i]]: the C copy (threads, no GIL) when
    it takes the views, else torch. IndexError, copying nothing, for a page outside a view."""
    if copy_pages_c(src, dst, src_pages, dst_pages):
        return
    for pages, view in ((src_pages, src), (dst_pages, dst)):
        if len(pages) and (int(pages.min()) < 0 or int(pages.max()) >= view.shape[2]):
            raise IndexError("page outside the view")
    s = torch.from_numpy(np.ascontiguousarray(src_pages, dtype=np.int64))
    d = torch.from_numpy(np.ascontiguousarray(dst_pages, dtype=np.int64))
    dst[:, :, d] = src[:, :, s]


def host_pages(host_indices: Any, count: int, page_size: int, pool_pages: int) -> np.ndarray:
    """The host pool page of each of ``count`` pages from SGLang's ``host_indices``: token
    slots as an integer tensor (or array), ``page_size`` consecutive ones per page, starting
    pages. ValueError, naming it, for anything else (nothing may be read from or written to a
    page the indices do not name whole)."""
    if isinstance(host_indices, np.ndarray):
        host_indices = torch.from_numpy(host_indices)
    if not isinstance(host_indices, torch.Tensor) or host_indices.dtype not in _INDEX_DTYPES:
        raise ValueError("host indices must be an integer tensor")
    idx = host_indices.reshape(-1).to(torch.int64).cpu()
    if idx.numel() != count * page_size:
        raise ValueError(f"{idx.numel()} host indices for {count} pages of {page_size} tokens")
    if count == 0:
        return np.empty(0, dtype=np.int64)
    rows = idx.view(count, page_size)
    firsts = rows[:, 0]
    if (firsts % page_size).any() or not torch.equal(
        rows, firsts[:, None] + torch.arange(page_size)
    ):
        raise ValueError("host indices are not whole pages (page-aligned runs)")
    pages = (firsts // page_size).numpy()
    if int(pages.min()) < 0 or int(pages.max()) >= pool_pages:
        raise ValueError(f"host indices outside the host pool's {pool_pages} pages")
    return pages


def key_words(keys: list[str], page_size: int) -> np.ndarray:
    """``[len(keys), page_size]`` int32 tree tokens, one row per SGLang page hash.
    ValueError naming the first key that is not 64 hex digits."""
    raw = b""
    if all(type(key) is str and len(key) == 64 for key in keys):  # one C call for a chain
        try:
            raw = bytes.fromhex("".join(keys))
        except ValueError:
            pass  # (found below, by key)
    if len(raw) != 32 * len(keys):  # (fromhex skips whitespace: a short result is bad too)
        parts = []
        for i, key in enumerate(keys):  # one by one: which key is bad (or a str subclass)
            part = _hex(key) if isinstance(key, str) and len(key) == 64 else b""
            if len(part) != 32:
                raise ValueError(f"key {i} is not a 64-hex-digit page hash: {key!r:.80}")
            parts.append(part)
        raw = b"".join(parts)
    words = np.frombuffer(raw, dtype=">u4").reshape(len(keys), 8).astype(np.int64)
    out = np.zeros((len(keys), page_size), dtype=np.int32)
    low = words & 0x7FFFFFFF  # 31 bits of each word
    n = min(8, page_size)
    out[:, :n] = low[:, :n]
    if page_size > 8:  # the 8 top bits, packed into one more word: all 256 bits
        top = (words >> 31) & 1
        out[:, 8] = (top << np.arange(8)).sum(axis=1)
    return out


def page_hashes(token_ids: Any, page_size: int) -> list[str]:
    """SGLang's page hashes back from tree tokens (``key_words``' inverse): what a KV event's
    ``token_ids`` for SGLang pages name, a hash per ``page_size`` words. From a page of 9
    tokens on every hash comes back whole; below, ValueError (the words hold only
    ``31 * page_size`` of its 256 bits)."""
    if page_size < 9:
        raise ValueError(f"a page of {page_size} tokens holds {31 * page_size} of a hash's bits")
    words = np.asarray(token_ids, dtype=np.int64)
    if words.ndim != 1 or len(words) % page_size or (words < 0).any() or (words >> 31).any():
        raise ValueError(f"token ids must be whole pages of {page_size} 31-bit words")
    rows = words.reshape(-1, page_size)
    top = (rows[:, 8:9] >> np.arange(8)) & 1  # the high bit of each of the 8 words
    full = (rows[:, :8] | (top << 31)).astype(">u4")
    return [row.tobytes().hex() for row in full]


def _hex(key: str) -> bytes:
    """``key``'s bytes, or b"" when it is not hex digits only."""
    try:
        return bytes.fromhex(key) if key.isascii() and key.isalnum() else b""
    except ValueError:
        return b""


def page_bytes(fmt: PageFormat) -> int:
    return fmt.kv * fmt.layers * fmt.page_size * fmt.width * DTYPES[fmt.dtype].itemsize


__all__ = [
    "LAYOUTS",
    "PageFormat",
    "copy_pages",
    "daemon_view",
    "folded",
    "host_pages",
    "host_view",
    "key_words",
    "page_bytes",
    "page_hashes",
    "page_format",
]
