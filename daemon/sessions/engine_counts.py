"""EngineCounts: an engine's lookups as the engine itself counts them, and what it loaded.

The cache's own counters (``hit_*_tokens``, ``miss_tokens``) count every token of every MATCH:
the part an engine already had in its own prefix cache included, a lookup the engine makes
again (its blocks were not free yet, a prefix still coming from the third tier) each time. An
engine with a prefix cache of its own counts otherwise, so it reports its own figures on any
request (the client library's heartbeat carries them, at most 2 s late, and its goodbye the
rest), and the daemon adds them up per session and in total:

- ``engine_queried_tokens``: tokens engines asked about beyond their own hit (vLLM:
  ``vllm:external_prefix_cache_queries``: ``request.num_tokens`` less vLLM's own hit);
- ``engine_hit_tokens``: of them, what hicache had (``vllm:external_prefix_cache_hits``);
- ``engine_loaded_tokens``: tokens the engines copied from the pool into their device tier
  (loads that failed on some rank left out).

One per session, and one total per daemon (ended sessions included). Mutated on the control
thread only.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from hicache.protocol import ENGINE_REPORT, ReportRequest

SATURATED = (1 << 62) - 1  # totals stop here: every figure stays an int64 on the wire


@dataclass
class EngineCounts:
    queried: int = 0  # tokens engines asked about beyond their own hit
    hit: int = 0  # of them, found in hicache
    loaded: int = 0  # tokens engines copied from the pool

    def add(self, other: EngineCounts) -> None:
        """Add a report (totals saturate at SATURATED: no report can make stats unsendable)."""
        self.queried = min(SATURATED, self.queried + other.queried)
        self.hit = min(SATURATED, self.hit + other.hit)
        self.loaded = min(SATURATED, self.loaded + other.loaded)

    def as_dict(self) -> dict[str, int]:
        """The stats fields (also the names a report uses)."""
        return {f"engine_{f.name}_tokens": getattr(self, f.name) for f in fields(self)}


REPORT_FIELDS = ENGINE_REPORT  # (the wire's names: EngineCounts.as_dict's, in field order)
assert tuple(EngineCounts().as_dict()) == REPORT_FIELDS


def reported(request: dict) -> EngineCounts | None:
    """What a request's fields report (None: nothing; any request may carry a report).
    Raises ProtocolError (BAD_FIELD) as ``ReportRequest.read`` does."""
    if not any(name in request for name in REPORT_FIELDS):
        return None
    return EngineCounts(*ReportRequest.read(request).counts)
