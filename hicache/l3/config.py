"""L3Config: how the third tier behaves (validated once, like HiCacheConfig)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class L3WritePolicy(StrEnum):
    """When host pages go to the store."""

    WRITE_THROUGH = "write_through"  # once their host copy exists
    WRITE_THROUGH_SELECTIVE = "write_through_selective"  # once they were hit write_threshold times
    # as selective, and every page at first sight while pages that left unreused come back
    WRITE_THROUGH_ADAPTIVE = "write_through_adaptive"
    WRITE_BACK = "write_back"  # when the host tier evicts them
    NONE = "none"  # never: the store is only read (filled before, or by other daemons)


class PrefetchPolicy(StrEnum):
    """How long a match waits for pages coming from the store (SGLang's three)."""

    BEST_EFFORT = "best_effort"  # not at all: a later match finds what arrived
    WAIT_COMPLETE = "wait_complete"  # until the fetch ends (bounded by timeout_max_s)
    TIMEOUT = "timeout"  # up to timeout_s + timeout_per_ki_s per 1024 tokens, at most max


WRITE_BACK_NEEDS_HOST = (
    "l3_write_policy: write_back needs a host tier; under the engines' pool "
    "(device_tier=engine) an evicted page is needed at once and cannot wait for its write: "
    "use write_through or write_through_selective"
)


@dataclass(frozen=True)
class L3Config:
    url: str = field(
        metadata={"help": "memory://NAME, redis://HOST:PORT[,...], mooncake://HOST:PORT"}
    )
    model: str = field(
        metadata={
            "help": "model identity (name and revision), part of every key: required with --l3 "
            "and --disk"
        }
    )
    shard: str = field(
        default="0",
        metadata={"help": "tensor-parallel shard of the KV this daemon holds: part of every key"},
    )
    write_policy: L3WritePolicy | str = field(
        default=L3WritePolicy.WRITE_THROUGH, metadata={"help": "when pages go to it"}
    )
    write_threshold: int = field(
        default=2,
        metadata={"help": "write_through_selective and _adaptive: hits before a page is written"},
    )
    prefetch_policy: PrefetchPolicy | str = field(
        default=PrefetchPolicy.TIMEOUT, metadata={"help": "how long matches wait"}
    )
    timeout_s: float = field(default=0.5, metadata={"help": "timeout policy: the base wait"})
    timeout_per_ki_s: float = field(
        default=0.1, metadata={"help": "timeout policy: more per 1024 tokens fetched"}
    )
    timeout_max_s: float = field(
        default=5.0, metadata={"help": "no match ever waits longer (wait_complete too)"}
    )
    min_tokens: int = field(
        default=0,
        metadata={"help": "fetch only when at least this many tokens could come (0: one page)"},
    )
    prefill_tokens_per_s: float = field(
        default=0.0, metadata={"help": "cost model: engines recompute this fast (0: no model)"}
    )
    queue_pages: int = field(
        default=8192,
        metadata={"help": "pages waiting to be written; past this, writes are dropped"},
    )
    batch_pages: int = field(default=128, metadata={"help": "pages per store call"})
    close_drain_s: float = field(
        default=0.0,
        metadata={
            "help": "at a clean stop, queued writes still run for up to this long (0: they end "
            "unrun; --disk: 10 s by default, so a restart finds them)"
        },
    )
    breaker_failures: int = field(
        default=3, metadata={"help": "failed calls in a row that open the breaker"}
    )
    breaker_cooldown_s: float = field(
        default=2.0, metadata={"help": "first wait before a probe (doubles up to 60 s)"}
    )
    options: dict[str, Any] = field(
        default_factory=dict, metadata={"help": "store-specific (segment_bytes, ...)"}
    )

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        for name, cls in (("write_policy", L3WritePolicy), ("prefetch_policy", PrefetchPolicy)):
            value = getattr(self, name)
            try:
                set_(self, name, cls(value))
            except ValueError:
                choices = ", ".join(m.value for m in cls)
                raise ValueError(f"l3_{name}: {value!r} is not one of {choices}") from None
        if "://" not in self.url:
            raise ValueError(f"l3: {self.url!r} is not SCHEME://ADDRESS")
        if not self.model:
            raise ValueError(
                "l3_model: name the model (and revision) the KV belongs to: it is part of every "
                "key, so daemons of other models never read it"
            )
        for name in ("write_threshold", "queue_pages", "batch_pages", "breaker_failures"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"l3_{name}: must be an integer >= 1, got {value!r}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int):
            raise ValueError(f"l3_min_tokens: must be an integer, got {self.min_tokens!r}")
        if self.min_tokens < 0:
            raise ValueError(f"l3_min_tokens: must be >= 0, got {self.min_tokens}")
        names = ("timeout_s", "timeout_per_ki_s", "timeout_max_s", "prefill_tokens_per_s")
        for name in (*names, "close_drain_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 <= value < math.inf):
                raise ValueError(f"l3_{name}: must be a finite number >= 0, got {value!r}")
        if not (
            isinstance(self.breaker_cooldown_s, (int, float))
            and 0 < self.breaker_cooldown_s <= 3600
        ):
            raise ValueError(
                f"l3_breaker_cooldown_s: must be in (0, 3600], got {self.breaker_cooldown_s!r}"
            )

    def wait_bound(self, tokens: int) -> float:
        """How long a match may wait for ``tokens`` coming from the store."""
        if self.prefetch_policy is PrefetchPolicy.BEST_EFFORT:
            return 0.0
        if self.prefetch_policy is PrefetchPolicy.WAIT_COMPLETE:
            return self.timeout_max_s
        return min(self.timeout_max_s, self.timeout_s + self.timeout_per_ki_s * tokens / 1024)

    def replace(self, **changes: Any) -> L3Config:
        return dataclasses.replace(self, **changes)
