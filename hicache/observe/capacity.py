"""Hit ratio versus capacity: what would each tier hit at other sizes (SHARDS, exact reference).

The model. The cache is an LRU over *pages*: a page is ``page_size`` consecutive tokens of a
prompt, named by a chained hash of its tokens, every earlier page's tokens and a namespace
(``page_hashes``), so equal names mean equal prefixes. A request's lookup accesses its full
pages, and each request touches them from its LAST page to its FIRST, so that a page's
ancestors are always more recent than the page: a cached page implies its ancestors are
cached (the prefix property of the radix tree). Under that order, LRU at ``C`` pages hits a
page exactly when its stack (reuse) distance, the number of distinct other pages touched since
its previous touch, is below ``C``; a request's distances never decrease from its first page to
its last, so its hits form a prefix, and its hit tokens at size ``C`` are ``page_size`` times
its pages with distance below ``C``. A page never seen before is a miss at every size.

What the model counts is the LRU of that access sequence, in which a request's missing tail is
touched before its head is looked at: a request needs room for its own pages to hit, as the
real cache needs room to insert them. ``insert`` touches pages the same way without counting
them (the daemon inserts a request's prompt and answer after serving it). The daemon's real
eviction is leaf-LRU over a tree of nodes of several pages each, with locks and a backup
policy; this model approximates it.

Two tiers: the host tier holds everything the device holds (write-through), so a page is a
device hit when its distance is below the device size and a host hit when it lies between the
device size and the host size.

``ExactCurve`` is Mattson's stack algorithm over every page (memory grows with distinct pages:
tests and offline use). ``ShardsEstimator`` is fixed-size SHARDS (Waldspurger et al., FAST'15):
it keeps only pages whose hash falls below a threshold, at most ``max_samples`` of them, and
scales their distances by the sampling rate; its memory is bounded (about 110 KiB by default).
Both run the same stack engine (``LruStack``, ``lru_stack.py``): sorted numpy arrays, one
vectorized step per request.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hicache.observe.lru_stack import U64, LruStack, as_keys
from hicache.observe.page_hash import chain_seed, page_hashes

__all__ = [
    "COLD",
    "FACTORS",
    "ExactCurve",
    "ShardsEstimator",
    "TierPoint",
    "chain_seed",
    "page_hashes",
    "recommend",
]

COLD = np.iinfo(np.int64).max  # the distance ExactCurve reports for a page never seen before
FACTORS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)  # sizes relative to today's that the daemon reports

# ---------------------------------------------------------------------------------------------
# Curves
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TierPoint:
    """The predicted hit ratios (of page accesses, equal to token hit ratios) at ``factor``
    times today's tier sizes. ``device_hit`` answers "device resized"; ``total_hit`` answers
    "host resized" (a host at least as large as the device holds all the device holds, so the
    total depends only on the larger tier); ``host_hit = total_hit - device_hit`` is the share
    the host serves when both are scaled."""

    factor: float  # the size relative to today's
    device_pages: int  # round(factor * today's device pages)
    host_pages: int  # round(factor * today's host pages)
    device_hit: float  # accesses with distance < device_pages
    host_hit: float  # accesses with device_pages <= distance < host_pages
    total_hit: float  # device_hit + host_hit: distance < max(device_pages, host_pages)


def _check_capacity(capacity_pages: object) -> float:
    if isinstance(capacity_pages, bool) or not isinstance(
        capacity_pages, int | float | np.integer | np.floating
    ):
        raise ValueError(f"capacity must be a number of pages, got {capacity_pages!r}")
    value = float(capacity_pages)
    if math.isnan(value) or value < 0:
        raise ValueError(f"capacity must be >= 0 pages, got {capacity_pages!r}")
    return value


class _Curve:
    """What both curves share: queries over a distance histogram (subclasses say how)."""

    def _below(self, capacities: np.ndarray) -> np.ndarray:
        """Estimated counted accesses with distance < each capacity (float64 array)."""
        raise NotImplementedError

    def _total(self) -> float:
        """Counted page accesses."""
        raise NotImplementedError

    def hit_ratio(self, capacity_pages: float) -> float:
        """Fraction of counted page accesses that hit an LRU of ``capacity_pages`` pages
        (0.0 before any access). ValueError for a negative or non-numeric capacity. Pure."""
        cap = _check_capacity(capacity_pages)
        return self._ratios([cap])[0]

    def curve(self, capacities: Sequence[float]) -> list[tuple[int | float, float]]:
        """``[(capacity, hit_ratio), ...]`` for each capacity, in the order given. Pure."""
        caps = [_check_capacity(c) for c in capacities]
        return list(zip(capacities, self._ratios(caps), strict=True))

    def _ratios(self, caps: Sequence[float]) -> list[float]:
        total = self._total()
        if total <= 0 or not caps:
            return [0.0] * len(caps)
        below = self._below(np.asarray(caps, np.float64))
        return [min(1.0, max(0.0, float(b) / total)) for b in below]

    def device_host_curve(
        self, device_pages: int, host_pages: int, factors: Sequence[float] = FACTORS
    ) -> list[TierPoint]:
        """One ``TierPoint`` per factor for tiers of ``device_pages`` and ``host_pages`` pages
        today (the host inclusive of the device). Pure."""
        device = _check_capacity(device_pages)
        host = _check_capacity(host_pages)
        points = []
        for f in factors:
            f = _check_capacity(f)
            d, h = round(f * device), round(f * host)
            dev, tot = self._ratios([d, max(d, h)])
            points.append(TierPoint(f, d, h, dev, tot - dev, tot))
        return points

    def recommend(
        self, device_pages: int, host_pages: int, factors: Sequence[float] = FACTORS
    ) -> str:
        """``recommend`` on this curve's ``device_host_curve``. Pure."""
        return recommend(self.device_host_curve(device_pages, host_pages, factors))


class ExactCurve(_Curve):
    """Exact LRU hit ratios at every size (Mattson's stack algorithm over all pages).

    Memory and time per request grow with the distinct pages seen (about 24 bytes each, plus
    one copy of the arrays per request): a reference for tests and offline traces, not for the
    daemon. Not thread-safe. ``access`` and ``insert`` mutate; the queries are pure.
    """

    def __init__(self) -> None:
        self._stack = LruStack()  # every page seen
        self._counts = np.zeros(64, np.int64)  # counted accesses per exact distance
        self._accesses = 0  # counted page accesses (cold ones included)

    def access(self, page_hashes: Sequence[int] | np.ndarray) -> np.ndarray:
        """Count one request's lookup of its full pages (prefix order, first page first).
        Returns each page's distance in prefix order, ``COLD`` for a page never seen: the
        page hits at ``C`` pages iff its distance < C. ValueError (nothing changed) for
        non-integer hashes."""
        dist = self._stack.touch(as_keys(page_hashes))
        warm = dist[dist >= 0]
        if len(warm):
            top = int(warm.max())
            if top >= len(self._counts):
                grown = np.zeros(max(top + 1, 2 * len(self._counts)), np.int64)
                grown[: len(self._counts)] = self._counts
                self._counts = grown
            self._counts += np.bincount(warm, minlength=len(self._counts))
        self._accesses += len(dist)
        dist[dist < 0] = COLD
        return dist

    def insert(self, page_hashes: Sequence[int] | np.ndarray) -> None:
        """Touch pages (prefix order) as a lookup would, without counting them."""
        self._stack.touch(as_keys(page_hashes))

    def _total(self) -> float:
        return float(self._accesses)

    def _below(self, capacities: np.ndarray) -> np.ndarray:
        cum = np.concatenate([[0], np.cumsum(self._counts)])
        upto = np.minimum(np.ceil(capacities), len(self._counts)).astype(np.int64)
        return cum[upto].astype(np.float64)

    @property
    def distinct_pages(self) -> int:
        """Distinct pages touched so far."""
        return len(self._stack)


# Histogram buckets of estimated distance (pages): one per page below _FINE, then _SUB per
# octave for _OCTAVES octaves (2.2% wide; up to 256 * 2**36 pages). 1,408 float64 buckets.
_FINE = 256
_SUB = 32
_OCTAVES = 36
_EDGES = np.concatenate(
    [np.arange(_FINE, dtype=np.float64), _FINE * 2.0 ** (np.arange(_SUB * _OCTAVES + 1) / _SUB)]
)
_BUCKETS = len(_EDGES) - 1


def _bucket(dist: np.ndarray) -> np.ndarray:
    """The histogram bucket of each estimated distance (float pages, >= 0)."""
    return np.minimum(_EDGES.searchsorted(dist, "right") - 1, _BUCKETS - 1)


class ShardsEstimator(_Curve):
    """Fixed-size SHARDS: the LRU hit ratio at every size from a bounded sample of pages.

    A page is sampled iff the low 64 bits of its hash are below a threshold ``T`` (rate
    ``R = T / 2**64``): spatial sampling, so every access to a sampled page is seen. Distances
    are counted exactly among sampled pages and scaled by ``1 / R`` (plus the request's own
    later pages, known exactly: ``access``) into a histogram whose entries each weigh ``1 / R``
    (R at the time of the access). When more than ``max_samples``
    pages are sampled, the ones with the largest hashes are dropped (down to 15/16 of
    ``max_samples``, in one step) and ``T`` is lowered to the smallest dropped hash, so ``R``
    only falls. The hit ratio at ``C`` is the weight with distance below ``C`` over the weight of
    all sampled accesses. ``correction=True`` instead divides by all page accesses and credits
    the difference (accesses the sample missed or over-counted) to distance 0, as SHARDS_adj
    does; on this project's traces (``tests/test_capacity.py``) it was as good or worse, so it
    is off by default.

    Memory: three int64/uint64 arrays of at most ``max_samples`` entries plus a fixed
    1,408-bucket histogram, about 110 KiB at the default 4,096, whatever the traffic: well
    under 1% of the metadata of a 1M-page cache (its device and host page ids alone are 16 MB).

    Not thread-safe: every call mutates or reads shared arrays. The daemon calls ``access`` and
    ``insert`` from its control thread, which owns the cache; anything else (a stats thread)
    must take the same lock the control thread holds around those calls, or ask the control
    thread for ``to_dict()``. ``access``/``insert`` mutate; the queries are pure.
    """

    def __init__(
        self,
        max_samples: int = 4096,
        initial_rate: float = 1.0,
        seed: int = 0,
        correction: bool = False,
    ) -> None:
        if isinstance(max_samples, bool) or not isinstance(max_samples, int) or max_samples < 16:
            raise ValueError(f"max_samples must be an int >= 16, got {max_samples!r}")
        if not 0 < initial_rate <= 1:
            raise ValueError(f"initial_rate must be in (0, 1], got {initial_rate!r}")
        self.max_samples = max_samples  # most sampled pages kept
        self.seed = seed & U64  # xored into every hash before sampling (a different sample)
        self.correction = correction  # SHARDS_adj: credit missed accesses to distance 0
        self._threshold = min(1 << 64, round(initial_rate * 2.0**64))  # T: sample iff h < T
        self._top = np.uint64(self._threshold - 1)  # T - 1, as a uint64 comparand
        self._stack = LruStack()  # the sampled pages
        self._hist = np.zeros(_BUCKETS, np.float64)  # weight (1/R each) per distance bucket
        self._weight = 0.0  # weight of every sampled counted access (cold ones included)
        self._accesses = 0  # counted page accesses, sampled or not
        self._sampled = 0  # counted sampled page accesses
        self._requests = 0  # access() calls

    @property
    def rate(self) -> float:
        """The sampling rate R now."""
        return self._threshold / 2.0**64

    @property
    def samples(self) -> int:
        """Sampled pages held now (<= max_samples)."""
        return len(self._stack)

    @property
    def accesses(self) -> int:
        """Page accesses counted so far."""
        return self._accesses

    def _sample(self, keys: np.ndarray) -> np.ndarray | None:
        """Positions of the sampled ones of ``keys`` (as the stack names them), None for all.
        Pure."""
        if self._threshold > U64:
            return None
        return np.flatnonzero(keys <= self._top)

    def access(self, page_hashes: Sequence[int] | np.ndarray) -> None:
        """Count one request's lookup of its full pages (hashes in prefix order, first page
        first; a uint64/int64 array is the fast path, unsampled pages are dropped by one
        vectorized compare). Mutates the sample, the histogram and the counters. ValueError
        (nothing changed) for non-integer hashes.

        A sampled page's distance is estimated as (sampled pages touched since its last touch,
        before this request) / R + (this request's pages after it): the second part is known
        exactly, since all of them are touched before it (the prefix order)."""
        pages = as_keys(page_hashes)
        m = len(pages)
        self._requests += 1
        self._accesses += m
        if self.seed:
            pages = pages ^ np.uint64(self.seed)
        where = self._sample(pages)
        keys = pages if where is None else pages[where]
        k = len(keys)
        if k == 0:
            return
        dist = self._stack.touch(keys)
        rate = self.rate
        warm = dist >= 0
        if warm.any():
            own_sampled = np.arange(k - 1, -1, -1)[warm]  # sampled pages after it
            own = own_sampled if where is None else m - 1 - where[warm]  # all pages after it
            est = np.maximum(dist[warm] - own_sampled, 0) / rate + own
            np.add.at(self._hist, _bucket(est), 1.0 / rate)
        self._weight += k / rate
        self._sampled += k
        self._shrink()

    def insert(self, page_hashes: Sequence[int] | np.ndarray) -> None:
        """Touch pages (prefix order) as a lookup would, without counting them (a request's
        prompt and answer once served). Mutates the sample. ValueError as ``access``."""
        keys = as_keys(page_hashes)
        if self.seed:
            keys = keys ^ np.uint64(self.seed)
        where = self._sample(keys)
        if where is not None:
            keys = keys[where]
        if len(keys):
            self._stack.touch(keys)
            self._shrink()

    def _shrink(self) -> None:
        """Over ``max_samples``: drop the largest hashes and lower T to the smallest dropped."""
        if len(self._stack) > self.max_samples:
            keep = self.max_samples - self.max_samples // 16
            self._threshold = int(self._stack.keys[keep])
            self._top = np.uint64(self._threshold - 1)
            self._stack.drop_from(keep)

    def _total(self) -> float:
        return float(self._accesses) if self.correction else self._weight

    def _below(self, capacities: np.ndarray) -> np.ndarray:
        hist = self._hist
        if self.correction:
            hist = hist.copy()
            hist[0] += self._accesses - self._weight
        cum = np.concatenate([[0.0], np.cumsum(hist)])
        b = _bucket(capacities)
        lo, hi = _EDGES[b], _EDGES[b + 1]
        part = np.clip((capacities - lo) / (hi - lo), 0.0, 1.0)
        out = cum[b] + hist[b] * part
        return np.where(capacities >= _EDGES[-1], cum[-1], out)

    @property
    def distinct_pages(self) -> float:
        """Estimated distinct pages seen so far (samples / R)."""
        return len(self._stack) / self.rate

    def memory_bytes(self) -> int:
        """Bytes held: the sample's arrays (at most ``max_samples`` + one request's pages each),
        the histogram and the object itself. Bounded whatever the traffic."""
        return self._stack.nbytes() + self._hist.nbytes + 512

    def to_dict(self, capacities: Sequence[int] | None = None) -> dict[str, object]:
        """A JSON-ready summary: sample size, rate, counts and the curve at ``capacities``
        (default: powers of two up to twice the estimated distinct pages). Pure."""
        if capacities is None:
            top = max(2.0, 2 * self.distinct_pages)
            capacities = [1 << k for k in range(min(48, math.ceil(math.log2(top))) + 1)]
        return {
            "samples": self.samples,
            "max_samples": self.max_samples,
            "rate": self.rate,
            "requests": self._requests,
            "accesses": self._accesses,
            "sampled_accesses": self._sampled,
            "distinct_pages": round(self.distinct_pages),
            "memory_bytes": self.memory_bytes(),
            "curve": [[c, round(h, 4)] for c, h in self.curve(capacities)],
        }


def _knee(values: Sequence[float], flat: float) -> int:
    """Index of the first value within ``flat`` of the last one (where the curve flattens)."""
    return next(i for i, v in enumerate(values) if values[-1] - v < flat)


def recommend(points: Sequence[TierPoint], flat: float = 0.01) -> str:
    """A short plain-English reading of a ``device_host_curve``: for the host tier (total hit
    ratio) and the device tier (device hit ratio; left out when it has 0 pages), the smallest
    factor past which larger sizes add less than ``flat``, and what moving there from today's
    size (factor 1) gains or costs. Deterministic. ValueError if no point has factor 1. Pure."""
    if not flat > 0:
        raise ValueError(f"flat must be > 0, got {flat!r}")
    pts = sorted(points, key=lambda p: p.factor)
    now = next((p for p in pts if p.factor == 1), None)
    if now is None:
        raise ValueError("recommend needs the point at factor 1 (today's sizes)")
    lines = []
    tiers = [("host", "host+device", lambda p: p.total_hit, lambda p: p.host_pages)]
    if now.device_pages:
        tiers.append(("device", "device", lambda p: p.device_hit, lambda p: p.device_pages))
    else:  # no device tier (a daemon for engines that keep their own: the host tier alone)
        tiers = [("host", "host", lambda p: p.total_hit, lambda p: p.host_pages)]
    for tier, what, value, pages in tiers:
        values = [value(p) for p in pts]
        best = pts[_knee(values, flat)]
        top = pts[-1]
        if best.factor > 1:
            lines.append(
                f"{tier} tier at {best.factor:g}x ({pages(best)} pages) would raise {what} hit "
                f"ratio from {value(now):.2f} to {value(best):.2f}; beyond {best.factor:g}x "
                f"adds < {flat:g}"
            )
        elif best.factor < 1:
            cost = (
                f"the same {what} hit ratio ({value(now):.2f})"
                if f"{value(best):.2f}" == f"{value(now):.2f}"
                else f"{what} hit ratio {value(best):.2f} instead of {value(now):.2f}"
            )
            lines.append(
                f"{tier} tier could shrink to {best.factor:g}x ({pages(best)} pages) with "
                f"{cost}; even {top.factor:g}x adds < {flat:g}"
            )
        else:
            lines.append(
                f"{tier} tier is where gains flatten: {what} hit ratio {value(now):.2f}; "
                f"{top.factor:g}x would add < {flat:g}"
            )
    return ". ".join(lines) + "."
