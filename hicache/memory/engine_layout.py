"""EngineLayout: the KV layout of an engine that owns its device tier (vLLM), and the pool for it.

Such an engine keeps KV in its own blocks; the daemon keeps whole blocks, as opaque bytes, in
one shared host pool, one page per block (page size = block size). Page ``p`` of layer ``l``
holds the block's bytes of every tensor-parallel rank: rank ``r``'s at element offset
``r * rank_elems``, in the engine's own order (``block_shape``). Nothing reads single tokens, so
any block format works as long as every engine sharing the pool writes the same one.

Two engines share KV only when their ``identity()`` is equal: same model, layers, dtype, block
size, attention backend and block format. With ``shard="heads"`` (a rank's block starts with
its own KV heads, and ranks hold consecutive heads, as vLLM's CPU backend does) the ranks'
bytes concatenate into the whole model's block, so engines of any tensor-parallel size share
KV; otherwise (``shard="rank"``) the tensor-parallel size is part of the identity.

Pure data: validated once, compared, turned into the cache's config. No I/O.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from hicache.config import DTYPES, HiCacheConfig, KVFormat

SHARDS = ("heads", "rank")
MAX_TEXT = 512  # characters of model and backend names


@dataclass(frozen=True)
class EngineLayout:
    """What one engine rank registers; every field is checked on construction (ValueError)."""

    model: str  # model identity: name or path, and revision
    num_layers: int  # layers with KV (one registered tensor each)
    num_kv_heads: int  # KV heads on this rank
    head_size: int  # elements per head
    dtype: str  # element type, a key of hicache.config.DTYPES
    block_size: int  # tokens per engine block (= the pool's page size)
    block_shape: tuple[int, ...]  # one block of one layer on one rank, the engine's order
    tp_size: int = 1  # tensor-parallel ranks, each registering its own shard
    shard: str = "heads"  # heads: ranks' blocks concatenate (TP-independent); rank: they don't
    backend: str = ""  # the engine's attention backend and cache layout (byte format)
    kv_parts: int = field(default=1)  # separately strided parts of a block (K and V apart: 2)

    def __post_init__(self) -> None:
        for name in ("model", "backend"):
            value = getattr(self, name)
            if not isinstance(value, str) or len(value) > MAX_TEXT:
                raise ValueError(f"layout.{name}: expected a str of at most {MAX_TEXT} chars")
        for name in ("num_layers", "num_kv_heads", "head_size", "block_size", "tp_size"):
            _positive(name, getattr(self, name))
        _positive("kv_parts", self.kv_parts)
        if self.dtype not in DTYPES:
            raise ValueError(f"layout.dtype: {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.shard not in SHARDS:
            raise ValueError(f"layout.shard: {self.shard!r} is not one of {', '.join(SHARDS)}")
        shape = self.block_shape
        if not isinstance(shape, (tuple, list)) or not 1 <= len(shape) <= 8:
            raise ValueError("layout.block_shape: expected 1 to 8 sizes")
        for size in shape:
            _positive("block_shape", size)
        object.__setattr__(self, "block_shape", tuple(shape))
        if self.shard == "heads" and shape[0] != self.num_kv_heads:
            raise ValueError(
                "layout.shard: 'heads' needs a block that starts with the rank's KV heads "
                f"(block_shape {list(shape)}, {self.num_kv_heads} heads)"
            )
        if self.page_elems % self.block_size:
            raise ValueError(
                f"layout.block_shape: {list(shape)} x {self.tp_size} ranks is not a whole "
                f"number of elements per token of a {self.block_size}-token block"
            )
        if self.page_elems >= 1 << 40:
            raise ValueError("layout.block_shape: a block that large is not a KV block")

    # ---- sizes ----------------------------------------------------------------------------
    @property
    def rank_elems(self) -> int:
        """Elements of one block of one layer on one rank."""
        return math.prod(self.block_shape)

    @property
    def page_elems(self) -> int:
        """Elements of one page of one layer in the pool (every rank's block)."""
        return self.rank_elems * self.tp_size

    @property
    def page_bytes(self) -> int:
        """Bytes of one page over all layers: one block of the whole model."""
        return self.page_elems * self.num_layers * DTYPES[self.dtype].itemsize

    def tokens_for_bytes(self, num_bytes: int) -> int:
        """The pool size, in whole pages' tokens, that ``num_bytes`` of host memory hold."""
        return num_bytes // self.page_bytes * self.block_size

    # ---- identity ---------------------------------------------------------------------------
    def identity(self) -> dict[str, Any]:
        """What must be equal for two engines to share KV (the model's whole block with
        shard="heads"; the per-rank block and the rank count otherwise)."""
        out: dict[str, Any] = {
            "model": self.model,
            "num_layers": self.num_layers,
            "head_size": self.head_size,
            "dtype": self.dtype,
            "block_size": self.block_size,
            "backend": self.backend,
            "shard": self.shard,
            "kv_parts": self.kv_parts,
        }
        if self.shard == "heads":
            out["num_kv_heads"] = self.num_kv_heads * self.tp_size
            out["block_shape"] = [self.block_shape[0] * self.tp_size, *self.block_shape[1:]]
        else:
            out["num_kv_heads"] = self.num_kv_heads
            out["block_shape"] = list(self.block_shape)
            out["tp_size"] = self.tp_size
        return out

    def mismatch(self, other: EngineLayout) -> str | None:
        """None when ``other`` may share this layout's pool, else a message naming both."""
        mine, theirs = self.identity(), other.identity()
        differ = [k for k in sorted(mine.keys() | theirs.keys()) if mine.get(k) != theirs.get(k)]
        if not differ:
            return None
        served = ", ".join(f"{k}={mine.get(k)!r}" for k in differ)
        offered = ", ".join(f"{k}={theirs.get(k)!r}" for k in differ)
        return (
            f"KV layout mismatch: this daemon serves {served}; the engine has {offered} "
            "(one daemon serves one model's KV layout: start another daemon for this engine)"
        )

    # ---- the pool ---------------------------------------------------------------------------
    def pool_config(self, tokens: int, **policies: Any) -> HiCacheConfig:
        """The cache config of a pool of ``tokens`` for this layout: one opaque row of
        ``page_elems / block_size`` elements per token and layer (the MLA form), in CPU shared
        memory, with no second tier below it (the engine's blocks are the tier above)."""
        return HiCacheConfig(
            num_layers=self.num_layers,
            kv_format=KVFormat.MLA,
            kv_lora_rank=self.page_elems // self.block_size,
            dtype=self.dtype,
            page_size=self.block_size,
            device="cpu",
            device_tokens=tokens,
            host_tokens=0,
            **policies,
        )

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["block_shape"] = list(self.block_shape)
        return out

    @classmethod
    def from_dict(cls, raw: Any) -> EngineLayout:
        """From the wire (msgpack) or a config: unknown or missing keys raise ValueError."""
        if not isinstance(raw, dict):
            raise ValueError("layout: expected a map of its fields")
        names = set(cls.__dataclass_fields__)
        unknown = set(raw) - names
        if unknown:
            raise ValueError(f"layout: unknown fields {sorted(map(str, unknown))}")
        try:
            return cls(**raw)
        except TypeError as exc:  # a missing field
            raise ValueError(f"layout: {exc}") from None


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 1 << 31:
        raise ValueError(f"layout.{name}: expected a positive int, got {value!r}")
