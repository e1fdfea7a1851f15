"""vLLM's registered KV caches as whole blocks, and block copies to and from the daemon's pool.

vLLM registers one tensor per attention layer; backends differ (CPU: ``[blocks, heads, block,
2 * head]``, K transposed inside; FlashAttention: ``[2, blocks, block, heads, head]``) and a
layer's tensor may be a strided view of one allocation. Nothing here reads single tokens: a
block is found by the dimension whose size is the block count, and its bytes are copied in the
engine's own order (the dimensions before the block dimension, then those after it). The pool
keeps, per layer and page, every rank's block one after another (``EngineLayout``).

``BlockCopier`` picks its path once: the C page copy (``hicache/transfers/cpu_copy.py``) for
CPU caches whose blocks are contiguous runs, else torch indexing (any device, any strides;
CUDA caches read and write the pinned pool through a staging copy).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np
import torch

from hicache.config import DTYPES
from hicache.memory import EngineLayout
from hicache.transfers import copy_pages_c, cpu_copy

_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_LAYER_RE = re.compile(r"(\d+)")


@dataclass(frozen=True)
class BlockFormat:
    """Where the blocks are in every registered tensor (all layers alike)."""

    block_dim: int  # the dimension indexed by block id
    shape: tuple[int, ...]  # one layer's tensor shape
    dtype: torch.dtype

    @property
    def kv_parts(self) -> int:
        """Separately strided parts of one block (the dimensions before the block's)."""
        return math.prod(self.shape[: self.block_dim])

    @property
    def block_shape(self) -> tuple[int, ...]:
        return self.shape[: self.block_dim] + self.shape[self.block_dim + 1 :]

    @property
    def num_blocks(self) -> int:
        return self.shape[self.block_dim]


def ordered_layers(kv_caches: dict[str, torch.Tensor]) -> list[str]:
    """Layer names in model order (by the layer number in the name, else as given)."""
    names = list(kv_caches)

    def number(name: str) -> tuple[int, ...]:
        return tuple(int(n) for n in _LAYER_RE.findall(name))

    return sorted(names, key=number) if all(number(n) for n in names) else names


def block_format(tensors: list[torch.Tensor], num_blocks: int | None) -> BlockFormat:
    """The common block format of the layers' tensors; ValueError for what cannot be served
    (layers of different shapes or dtypes: hybrid models; a dtype the pool cannot hold)."""
    if not tensors:
        raise ValueError("vLLM registered no KV cache tensors")
    first = tensors[0]
    for t in tensors:
        if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
            raise ValueError(
                "KV caches of different shapes, dtypes or devices per layer (a hybrid model?) "
                f"are not supported: {tuple(first.shape)} {first.dtype} vs {tuple(t.shape)} "
                f"{t.dtype}"
            )
    if first.dtype not in _DTYPE_NAMES:
        raise ValueError(f"KV cache dtype {first.dtype} is not one of {', '.join(DTYPES)}")
    dims = [d for d, size in enumerate(first.shape) if size == num_blocks]
    if num_blocks is None or not dims:
        raise ValueError(
            f"no dimension of the KV cache {tuple(first.shape)} has the block count "
            f"{num_blocks}: unknown layout"
        )
    return BlockFormat(dims[0], tuple(first.shape), first.dtype)


def engine_layout(
    fmt: BlockFormat,
    *,
    model: str,
    num_layers: int,
    num_kv_heads: int,
    total_kv_heads: int,
    head_size: int,
    block_size: int,
    tp_size: int,
    backend: str,
) -> EngineLayout:
    """This rank's EngineLayout. Ranks shard by heads when a block starts with this rank's
    heads and the ranks split the model's heads without replicas: then engines of any
    tensor-parallel size share KV."""
    shape = fmt.block_shape
    heads_first = fmt.block_dim == 0 and shape[0] == num_kv_heads
    by_heads = heads_first and num_kv_heads * tp_size == total_kv_heads
    return EngineLayout(
        model=model,
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        dtype=_DTYPE_NAMES[fmt.dtype],
        block_size=block_size,
        block_shape=shape,
        tp_size=tp_size,
        shard="heads" if by_heads else "rank",
        backend=backend,
        kv_parts=fmt.kv_parts,
    )


class BlockCopier:
    """Copies whole blocks of every layer between vLLM's caches and this rank's share of the
    pool. The path is chosen once (``path``): ``c`` (CPU caches, ``hicache.transfers.cpu_copy``),
    ``triton`` (CUDA caches: the page-copy kernel reads and writes the pinned, mapped pool on
    the current stream) or ``torch`` (any strides, any device). Not thread-safe: the worker's
    model-runner thread calls it."""

    def __init__(
        self, tensors: list[torch.Tensor], fmt: BlockFormat, rank_offset: int, block_size: int
    ):
        self.fmt = fmt
        self.tensors = tensors
        self.rank_offset = rank_offset  # elements into a page's layer row where this rank starts
        self.block_size = block_size  # tokens per block = pool slots per page
        self.elems = math.prod(fmt.block_shape)  # of one block of one layer on this rank
        part = self.elems // fmt.kv_parts
        self.rows = block_size if part % block_size == 0 else 1  # a part as rows x width
        self.width = part // self.rows
        self.engine_views = [self._engine_view(t) for t in tensors]
        self.path = self._choose_path()

    def _choose_path(self) -> str:
        if any(v is None for v in self.engine_views):
            return "torch"
        if self.tensors[0].is_cuda:
            from hicache.kernels import triton_copy

            return "triton" if triton_copy.available() else "torch"
        return "c" if cpu_copy.available() else "torch"

    def _engine_view(self, t: torch.Tensor) -> torch.Tensor | None:
        """``[kv_parts, 1, blocks, rows, width]`` over the tensor's own memory, when a block's
        part is one contiguous run (what the page copies need), else None."""
        parts, d = self.fmt.kv_parts, self.fmt.block_dim
        try:
            view = t.view(parts, self.fmt.num_blocks, self.rows, self.width)
        except RuntimeError:  # not expressible over these strides
            return None
        if view.stride(3) != 1 or view.stride(2) != self.width or (d > 0 and not view.stride(0)):
            return None
        return view.unsqueeze(1)

    def pool_views(self, kv_buffers: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per layer, this rank's part of every page: ``[kv_parts, 1, pages, rows, width]``."""
        out = []
        parts = self.fmt.kv_parts
        for buf in kv_buffers:  # [slots, 1, width] per layer, a page = block_size slots
            pages = buf.view(-1, self.block_size * buf.shape[1] * buf.shape[2])
            mine = pages[:, self.rank_offset : self.rank_offset + self.elems]
            view = mine.reshape(-1, parts, self.rows, self.width).permute(1, 0, 2, 3)
            out.append(view.unsqueeze(1))
        return out

    def store(self, pool: list[torch.Tensor], block_ids: np.ndarray, pages: np.ndarray) -> None:
        """pool[pages] = vLLM[block_ids], every layer. Raises IndexError, copying nothing, for
        an id out of range."""
        self.check(block_ids, pages, pool)
        for layer, (src, dst) in enumerate(zip(self.engine_views, pool, strict=True)):
            self._copy(layer, src, dst, block_ids, pages, to_pool=True)

    def load(self, pool: list[torch.Tensor], block_ids: np.ndarray, pages: np.ndarray) -> None:
        """vLLM[block_ids] = pool[pages], every layer (see store)."""
        self.check(block_ids, pages, pool)
        for layer in range(len(self.tensors)):
            self.load_layer(layer, pool, block_ids, pages)

    def load_layer(
        self, layer: int, pool: list[torch.Tensor], block_ids: np.ndarray, pages: np.ndarray
    ) -> None:
        """One layer of ``load``; the caller ran ``check`` on these ids first."""
        self._copy(layer, pool[layer], self.engine_views[layer], pages, block_ids, to_pool=False)

    def _copy(self, layer, src, dst, src_ids, dst_ids, to_pool: bool) -> None:  # noqa: ANN001
        if self.path == "c" and copy_pages_c(src, dst, src_ids, dst_ids):
            return
        if self.path == "triton":
            from hicache.kernels.triton_copy import copy_pages_triton

            device = self.tensors[layer].device
            src_t, dst_t = [torch.from_numpy(x).to(device) for x in (src_ids, dst_ids)]
            copy_pages_triton(src, dst, src_t, dst_t, check=False)  # (checked: check)
            return
        engine_ids, pages = (src_ids, dst_ids) if to_pool else (dst_ids, src_ids)
        pool_view = dst if to_pool else src
        self._torch_copy(self.tensors[layer], pool_view, engine_ids, pages, to_pool)

    def check(self, block_ids: np.ndarray, pages: np.ndarray, pool: list[torch.Tensor]) -> None:
        """Raise (IndexError, ValueError) unless every id is in range for a copy."""
        if len(block_ids) != len(pages):
            raise ValueError(f"{len(block_ids)} blocks for {len(pages)} pages")
        if len(pool) != len(self.tensors):
            raise ValueError(f"a pool of {len(pool)} layers for {len(self.tensors)}")
        for ids, low, bound, what in (
            (block_ids, 0, self.fmt.num_blocks, "block id"),
            (pages, 1, pool[0].shape[2], "page"),  # page 0 is the pool's padding page
        ):
            if len(ids) and (int(ids.min()) < low or int(ids.max()) >= bound):
                raise IndexError(f"{what} outside [{low}, {bound})")

    def _torch_copy(
        self,
        tensor: torch.Tensor,
        pool_view: torch.Tensor,
        block_ids: np.ndarray,
        pages: np.ndarray,
        to_pool: bool,
    ) -> None:
        """Any strides, any device: blocks first, then [parts, part] per block."""
        blocks = tensor.movedim(self.fmt.block_dim, 0)  # [blocks, *before, *after]
        rows = pool_view[:, 0].flatten(2).permute(1, 0, 2)  # [pages, parts, part]
        ids = torch.from_numpy(block_ids).to(tensor.device)
        at = torch.from_numpy(pages)
        if to_pool:
            data = blocks.index_select(0, ids).reshape(len(pages), *rows.shape[1:])
            rows.index_copy_(0, at, data.to(rows.device))
        else:
            data = rows.index_select(0, at).reshape(len(pages), *blocks.shape[1:])
            blocks.index_copy_(0, ids, data.to(tensor.device, non_blocking=True))
