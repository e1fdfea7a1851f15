"""HiCacheConfig: the one frozen, validated description of a cache instance.

Every choice that changes behaviour (KV format, host layout, write and eviction policy) is an
enum resolved here, once; the rest of the code dispatches on the enum's strategy object and never
re-parses strings. A bad value raises ``ValueError`` naming the field.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from typing import Any

import torch


class KVFormat(StrEnum):
    """How a model stores KV per token and layer."""

    MHA = "mha"  # separate K and V, each [num_kv_heads, head_dim]
    MLA = "mla"  # one latent row of kv_lora_rank + qk_rope_head_dim (DeepSeek style)


class HostLayout(StrEnum):
    """Order of the host pool's dimensions; the device pool is always layer-first."""

    LAYER_FIRST = "layer_first"  # [kv, layer, token, ...]: same as the device pool
    PAGE_FIRST = "page_first"  # [kv, token, layer, ...]: one token's layers are contiguous
    PAGE_FIRST_DIRECT = "page_first_direct"  # [kv, page, layer, page_size, ...]


class TransferBackend(StrEnum):
    """How pages move between the pools (copiers live in copiers.py)."""

    AUTO = "auto"  # cpu for CPU pools, kernel on CUDA
    KERNEL = "kernel"  # Triton page-copy kernels (on the CPU only under TRITON_INTERPRET=1)
    DIRECT = "direct"  # one copy per run of consecutive pages (cudaMemcpyAsync on a GPU)
    CPU = "cpu"  # C memcpy per page across threads; CPU pools only


class WritePolicyName(StrEnum):
    """When device KV is backed up to the host pool (strategies live in write_policy.py)."""

    WRITE_THROUGH = "write_through"
    WRITE_THROUGH_SELECTIVE = "write_through_selective"
    WRITE_BACK = "write_back"


class EvictionPolicyName(StrEnum):
    """Which leaf goes first (strategies live in eviction_policy.py)."""

    LRU = "lru"
    LFU = "lfu"
    FIFO = "fifo"


DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}

_DEVICE_RE = re.compile(r"^(cpu|cuda|cuda:\d+)$")


def _enum(field: str, cls: type[Enum], value: object) -> Enum:
    try:
        return cls(value)
    except ValueError:
        choices = ", ".join(m.value for m in cls)
        raise ValueError(f"{field}: {value!r} is not one of {choices}") from None


def _int(field: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{field}: expected an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{field}: must be >= {minimum}, got {value}")
    return value


@dataclass(frozen=True)
class HiCacheConfig:
    """Model KV shape, pool sizes and policies of one cache. Immutable once built."""

    num_layers: int = field(metadata={"help": "transformer layers whose KV is cached"})
    num_kv_heads: int = field(
        default=0, metadata={"help": "KV heads per layer (MHA; ignored for MLA)"}
    )
    head_dim: int = field(default=0, metadata={"help": "head dimension (MHA; ignored for MLA)"})
    dtype: str = field(
        default="float16", metadata={"help": "element type of the KV pools, a key of DTYPES"}
    )
    kv_format: KVFormat | str = field(
        default=KVFormat.MHA, metadata={"help": "mha: separate K and V; mla: one latent row"}
    )
    kv_lora_rank: int = field(default=0, metadata={"help": "MLA latent width"})
    qk_rope_head_dim: int = field(default=0, metadata={"help": "MLA rotary part width"})
    page_size: int = field(
        default=1,
        metadata={"help": "tokens per page; tree keys and all allocations are page multiples"},
    )
    device: str = field(
        default="cpu", metadata={"help": 'where the "device" pool lives: cpu, cuda or cuda:N'}
    )
    device_tokens: int = field(
        default=65536,
        metadata={"help": "device pool capacity (a page multiple, padding page not counted)"},
    )
    host_tokens: int | None = field(
        default=None,
        metadata={"help": "host pool capacity; None: device_tokens * host_ratio; 0: off"},
    )
    host_ratio: float = field(
        default=2.0,
        metadata={"help": "host/device size ratio when host_tokens is None (must be > 1)"},
    )
    host_layout: HostLayout | str = field(
        default=HostLayout.LAYER_FIRST, metadata={"help": "order of the host pool's dims"}
    )
    transfer_backend: TransferBackend | str = field(
        default=TransferBackend.AUTO, metadata={"help": "how pages move between pools"}
    )
    write_policy: WritePolicyName | str = field(
        default=WritePolicyName.WRITE_THROUGH, metadata={"help": "when KV is backed up"}
    )
    eviction_policy: EvictionPolicyName | str = field(
        default=EvictionPolicyName.LRU, metadata={"help": "which leaf goes first"}
    )
    write_through_threshold: int = field(
        default=2, metadata={"help": "hits before a backup under write_through_selective"}
    )
    load_back_threshold: int = field(
        default=10, metadata={"help": "host hits shorter than this (tokens) are recomputed instead"}
    )
    verify_pages: bool = field(
        default=False,
        metadata={"help": "checksum each host page when written, check it before reading"},
    )

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "kv_format", _enum("kv_format", KVFormat, self.kv_format))
        set_(self, "host_layout", _enum("host_layout", HostLayout, self.host_layout))
        set_(self, "write_policy", _enum("write_policy", WritePolicyName, self.write_policy))
        backend = _enum("transfer_backend", TransferBackend, self.transfer_backend)
        set_(self, "transfer_backend", backend)
        set_(
            self,
            "eviction_policy",
            _enum("eviction_policy", EvictionPolicyName, self.eviction_policy),
        )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if not isinstance(self.device, str) or not _DEVICE_RE.match(self.device):
            raise ValueError(f"device: {self.device!r} is not cpu, cuda or cuda:N")
        if backend is TransferBackend.CPU and self.device != "cpu":
            raise ValueError("transfer_backend: cpu copies only CPU pools; use kernel or direct")
        _int("num_layers", self.num_layers, 1)
        _int("page_size", self.page_size, 1)
        _int("write_through_threshold", self.write_through_threshold, 1)
        if not isinstance(self.verify_pages, bool):
            raise ValueError(f"verify_pages: expected true or false, got {self.verify_pages!r}")
        _int("load_back_threshold", self.load_back_threshold, 0)
        self._check_shape()
        self._check_sizes()

    def _check_shape(self) -> None:
        if self.kv_format is KVFormat.MHA:
            _int("num_kv_heads", self.num_kv_heads, 1)
            _int("head_dim", self.head_dim, 1)
            if self.kv_lora_rank or self.qk_rope_head_dim:
                raise ValueError("kv_lora_rank: only valid with kv_format='mla'")
        else:
            _int("kv_lora_rank", self.kv_lora_rank, 1)
            _int("qk_rope_head_dim", self.qk_rope_head_dim, 0)

    def _check_sizes(self) -> None:
        ps = self.page_size
        _int("device_tokens", self.device_tokens, ps)
        if self.device_tokens % ps:
            raise ValueError(f"device_tokens: {self.device_tokens} is not a multiple of {ps}")
        if isinstance(self.host_ratio, bool) or not isinstance(self.host_ratio, (int, float)):
            raise ValueError(f"host_ratio: expected a number, got {self.host_ratio!r}")
        if self.host_tokens is None:
            if not self.host_ratio > 1.0:
                raise ValueError(f"host_ratio: must be > 1, got {self.host_ratio}")
            return
        _int("host_tokens", self.host_tokens, 0)
        if self.host_tokens == 0:
            return
        if self.host_tokens % ps:
            raise ValueError(f"host_tokens: {self.host_tokens} is not a multiple of {ps}")
        if self.host_tokens <= self.device_tokens:
            raise ValueError(
                f"host_tokens: the host pool ({self.host_tokens}) must be larger than the "
                f"device pool ({self.device_tokens}), or 0 to switch the host tier off"
            )

    # ---- derived values -------------------------------------------------------------------
    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def num_kv(self) -> int:
        """Buffers per layer: 2 (K and V) for MHA, 1 for MLA."""
        return 2 if self.kv_format is KVFormat.MHA else 1

    @property
    def head_shape(self) -> tuple[int, int]:
        """Per-token, per-layer shape of one buffer: (heads, dim)."""
        if self.kv_format is KVFormat.MHA:
            return (self.num_kv_heads, self.head_dim)
        return (1, self.kv_lora_rank + self.qk_rope_head_dim)

    @property
    def token_bytes(self) -> int:
        """Bytes of KV for one token over all layers (what a backup or load moves)."""
        heads, dim = self.head_shape
        return self.num_kv * self.num_layers * heads * dim * self.torch_dtype.itemsize

    @property
    def host_capacity_tokens(self) -> int:
        """Resolved host pool size in tokens (0 when the host tier is off)."""
        if self.host_tokens is not None:
            return self.host_tokens
        tokens = int(self.device_tokens * self.host_ratio)
        return tokens // self.page_size * self.page_size

    @property
    def host_enabled(self) -> bool:
        return self.host_capacity_tokens > 0

    def replace(self, **changes: Any) -> HiCacheConfig:
        """A copy with some fields changed, validated again (any value: __post_init__ checks)."""
        return dataclasses.replace(self, **changes)
