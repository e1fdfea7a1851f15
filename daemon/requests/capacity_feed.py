"""CapacityFeed: the daemon's hit-ratio-against-capacity estimate, fed off the request path.

The handlers note each match's and insert's tokens (``saw``: one deque append); the control
loop runs the SHARDS estimator (hicache/observe/capacity.py) over what piled up in short
slices: 0.3 ms per housekeeping pass while requests keep coming (so a request waits at most
that for it), 5 ms when the socket has been quiet. Under a flood the deque keeps the newest
requests up to ``MAX_PENDING`` of them and ``MAX_PENDING_BYTES`` of tokens, and counts what it
dropped. The byte
bound matters: every noted request keeps its token bytes alive, and 8,192 prompts of 4,096
tokens held 128 MiB, which also made each new request's buffer fresh memory (page faults on the
request path). ``report`` answers `hicache capacity`.

Runs on the control thread only (it owns the estimator).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any

import numpy as np

from hicache.observe import FACTORS, ShardsEstimator, page_hashes

MAX_PENDING = 8192  # requests noted and not yet counted
MAX_PENDING_BYTES = 4 << 20  # their token bytes (a few hundred long prompts)
MAX_SEEDS = 4096  # namespaces whose hash seed is kept
BUSY_BUDGET_S = 0.0003  # estimator time per housekeeping pass while requests keep coming
IDLE_BUDGET_S = 0.005  # ... when the socket was quiet for a poll period (nobody waits)


def _nbytes(tokens: Any) -> int:
    return tokens.nbytes if isinstance(tokens, (np.ndarray, memoryview)) else len(tokens)


class CapacityFeed:
    @classmethod
    def for_cache(cls, cache: Any, engine_tier: Any = None) -> CapacityFeed:
        """Today's sizes from ``cache``'s pools (a daemon's device pool, host pool if any).
        ``engine_tier`` (a daemon for engines that own their device tier): the one pool is the
        engines' host tier, so the curve has no device tier (tier_names.py)."""
        if engine_tier:
            return cls(cache.page_size, 0, cache.device_capacity_pages)
        return cls(cache.page_size, cache.device_capacity_pages, cache.host_capacity_pages)

    def __init__(self, page_size: int, device_pages: int, host_pages: int):
        self.page_size = page_size
        self.device_pages = device_pages  # today's sizes, the curve's factor 1
        self.host_pages = host_pages
        self.estimator = ShardsEstimator()
        # (True: a lookup, False: an insert; int32 token bytes or array; namespace)
        self.pending: collections.deque[tuple[bool, Any, Any]] = collections.deque()
        self.pending_bytes = 0  # token bytes the pending requests hold
        self.dropped = 0  # requests noted but never counted (the deque overflowed)
        self._seeds: dict[Any, bytes] = {}

    def saw(self, lookup: bool, tokens: Any, namespace: Any) -> None:
        """Note a match (``lookup``) or an insert of ``tokens`` (int32 bytes, a view or an
        array: kept as bytes of their own, never as a view that pins a whole request frame)."""
        pending, size = self.pending, _nbytes(tokens)
        if size > MAX_PENDING_BYTES:  # one prompt over the whole budget: not kept
            self.dropped += 1
            return
        while pending and (
            len(pending) >= MAX_PENDING or self.pending_bytes + size > MAX_PENDING_BYTES
        ):
            self.pending_bytes -= _nbytes(pending.popleft()[1])
            self.dropped += 1
        if type(tokens) is not bytes:  # a view keeps its whole frame alive (64 MiB at most)
            tokens = tokens.tobytes() if isinstance(tokens, np.ndarray) else bytes(tokens)
        pending.append((lookup, tokens, namespace))
        self.pending_bytes += size

    def run(self, budget_s: float = BUSY_BUDGET_S) -> int:
        """Count noted requests until none is left or ``budget_s`` passed; returns how many."""
        pending, est, done = self.pending, self.estimator, 0
        deadline = time.perf_counter() + budget_s
        while pending and time.perf_counter() < deadline:
            lookup, tokens, ns = pending.popleft()
            self.pending_bytes -= _nbytes(tokens)
            tokens = np.frombuffer(tokens, dtype=np.int32)
            seed = self._seeds.get(ns)
            if seed is None:
                if len(self._seeds) >= MAX_SEEDS:  # (namespaces are the client's to invent)
                    self._seeds.clear()
                seed = self._seeds[ns] = repr(ns).encode()
            hashes = page_hashes(tokens, self.page_size, seed)
            if lookup:
                est.access(hashes)
            else:
                est.insert(hashes)
            done += 1
        return done

    def points(self) -> list[dict[str, float]]:
        """The curve as it stands (no counting): ``{factor, device_hit, total_hit}`` each."""
        if not self.estimator.accesses:
            return []
        host = max(self.host_pages, self.device_pages)
        return [
            {"factor": p.factor, "device_hit": p.device_hit, "total_hit": p.total_hit}
            for p in self.estimator.device_host_curve(self.device_pages, host, FACTORS)
        ]

    def report(self, disk_pages: int = 0) -> dict[str, Any]:
        """The curve at 0.25x-8x of today's sizes, a recommendation and the sample's state;
        and what a disk under the host pool would add: at 0.25x-8x of today's disk
        (``disk_pages``; with none, of a disk the host pool's size), the total hit ratio of an
        LRU of the host's and the disk's pages (the disk holds what the host let go, as with
        admission ``all``; ``reused`` writes less, and hits at most that). No recommendation
        until the page accesses counted reach today's host pool's pages (``accesses_needed``):
        before that the curve is cold misses (a restarted daemon's estimate starts over, the
        disk's pages not in it)."""
        self.run(budget_s=1.0)
        est = self.estimator
        host = max(self.host_pages, self.device_pages)
        points = est.device_host_curve(self.device_pages, host, FACTORS)
        unit = disk_pages or host
        # (no recommendation before the traffic could have filled today's host pool once:
        # every point is cold misses until then, after a restart too)
        warm = est.accesses >= host > 0
        sizes = [round(f * unit) for f in FACTORS]
        hits = est.curve([host + d for d in sizes]) if est.accesses else [(0, 0.0)] * len(sizes)
        return {
            "page_size": self.page_size,
            "device_pages": self.device_pages,
            "host_pages": self.host_pages,
            "disk_pages": disk_pages,
            "disk_points": [
                {"factor": f, "disk_pages": d, "total_hit": hit}
                for f, d, (_, hit) in zip(FACTORS, sizes, hits, strict=True)
            ],
            "points": [dataclasses.asdict(p) for p in points],
            "recommendation": est.recommend(self.device_pages, host) if warm else "",
            "accesses_needed": host,
            "dropped_requests": self.dropped,
            "estimator": {k: v for k, v in est.to_dict().items() if k != "curve"},
        }
