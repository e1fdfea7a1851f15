"""hicache.observe.capacity: the exact LRU curve against hand counts and a naive LRU, the prefix
property, SHARDS accuracy against the exact curve on the project's traces, the estimator's
memory bound, and bad input.

Every trace is replayed the same way for both models: a request looks up its prompt's full
pages (``access``, counted), then its prompt and answer are inserted (``insert``, a touch that
is not counted).
"""

from __future__ import annotations

import json
from collections import OrderedDict

import numpy as np
import pytest

from hicache.observe import (
    COLD,
    ExactCurve,
    ShardsEstimator,
    TierPoint,
    chain_seed,
    page_hashes,
    recommend,
)
from scripts.traces import chat, doc_qa

U64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
FACTORS = (0.25, 0.5, 1, 2, 4, 8)


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def mix_int(x: int) -> int:
    """splitmix64's finalizer, written again here as the scalar reference."""
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & U64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & U64
    return x ^ (x >> 31)


def ref_page_hashes(tokens: list[int], page_size: int, seed: bytes = b"") -> list[int]:
    """The documented recurrence, one page at a time in Python ints."""
    keys = [mix_int(((c + 1) * GOLDEN) & U64) | 1 for c in range(page_size)]
    state, out = chain_seed(seed), []
    for i in range(len(tokens) // page_size):
        page = tokens[i * page_size : (i + 1) * page_size]
        h = mix_int(sum(k * (t & 0xFFFFFFFF) for k, t in zip(keys, page, strict=True)) & U64)
        state = (state * GOLDEN + h) & U64
        out.append(mix_int(state))
    return out


Request = tuple[np.ndarray, np.ndarray]  # (prompt page hashes, prompt+answer page hashes)


def requests_of(trace: list[dict], page_size: int, offset: int = 0) -> list[Request]:
    out = []
    for req in trace:
        prompt = np.asarray(req["prompt"], np.int64) + offset
        answer = np.asarray(req["answer"], np.int64) + offset
        out.append(
            (
                page_hashes(prompt, page_size),
                page_hashes(np.concatenate([prompt, answer]), page_size),
            )
        )
    return out


def replay(requests: list[Request], *models) -> None:
    for prompt, finished in requests:
        for model in models:
            model.access(prompt)
            model.insert(finished)


def synthetic(tenants: int, page_size: int, seed: int = 0) -> list[Request]:
    """Several seeds of the chat and doc-QA generators, each tenant on its own vocabulary
    (token offsets), interleaved request by request in a fixed random order: a working set
    much larger than one trace's, so the estimator really samples."""
    streams = []
    for t in range(tenants):
        streams.append(requests_of(chat(seed=100 + t), page_size, offset=t * 1024))
        streams.append(requests_of(doc_qa(seed=500 + t), page_size, offset=t * 1024 + 512))
    owner = np.concatenate([np.full(len(s), i) for i, s in enumerate(streams)])
    np.random.default_rng(seed).shuffle(owner)
    at = [0] * len(streams)
    out = []
    for o in owner:
        out.append(streams[o][at[o]])
        at[o] += 1
    return out


def capacities(exact: ExactCurve) -> list[int]:
    """0.25x .. 8x of a base of a quarter of the trace's distinct pages."""
    base = exact.distinct_pages // 4
    return [round(f * base) for f in FACTORS]


def mae(exact: ExactCurve, est: ShardsEstimator, caps: list[int]) -> float:
    want = np.array([h for _, h in exact.curve(caps)])
    got = np.array([h for _, h in est.curve(caps)])
    return float(np.abs(want - got).mean())


def naive_lru_hits(requests: list[Request], capacity: int) -> list[np.ndarray]:
    """An actual LRU of ``capacity`` pages (OrderedDict) on the same touches: per request, which
    of its prompt pages hit."""
    lru: OrderedDict[int, None] = OrderedDict()

    def touch(keys: np.ndarray) -> np.ndarray:
        hit = np.zeros(len(keys), bool)
        for i in range(len(keys) - 1, -1, -1):
            k = int(keys[i])
            if k in lru:
                hit[i] = True
                lru.move_to_end(k)
            else:
                lru[k] = None
                if len(lru) > capacity:
                    lru.popitem(last=False)
        return hit

    out = []
    for prompt, finished in requests:
        out.append(touch(prompt))
        touch(finished)
    return out


@pytest.fixture(scope="module")
def small_traces() -> dict[tuple[str, int], list[Request]]:
    return {
        (name, ps): requests_of(gen(), ps)
        for name, gen in (("chat", chat), ("doc_qa", doc_qa))
        for ps in (16, 8)
    }


@pytest.fixture(scope="module")
def big_trace() -> tuple[list[Request], ExactCurve, ShardsEstimator]:
    reqs = synthetic(tenants=40, page_size=16)
    exact, est = ExactCurve(), ShardsEstimator()
    replay(reqs, exact, est)
    return reqs, exact, est


# --------------------------------------------------------------------------------------------
# the exact curve
# --------------------------------------------------------------------------------------------


def test_exact_curve_on_a_hand_made_trace():
    # stack after each request, most recent first: [1, 2]; [1, 3, 2]; [1, 2, 3]
    exact = ExactCurve()
    assert exact.access([1, 2]).tolist() == [COLD, COLD]
    assert exact.access([1, 3]).tolist() == [1, COLD]  # 3 was touched first, above 1
    assert exact.access([1, 2]).tolist() == [1, 2]  # 2 under 1 and 3; then 1 under 2
    # six counted page accesses: distances COLD, COLD, 1, COLD, 1, 2
    assert [exact.hit_ratio(c) for c in (0, 1, 2, 3, 100)] == [0, 0, 2 / 6, 3 / 6, 3 / 6]
    assert exact.curve([2, 3]) == [(2, 2 / 6), (3, 3 / 6)]
    assert exact.distinct_pages == 3


def test_insert_touches_without_counting():
    exact = ExactCurve()
    exact.insert([1, 2])
    assert exact.hit_ratio(10) == 0.0  # nothing counted yet
    assert exact.access([1, 2]).tolist() == [1, 1]
    assert exact.hit_ratio(1) == 0.0 and exact.hit_ratio(2) == 1.0


def test_exact_curve_is_the_lru_of_the_touches(small_traces):
    """Page hit iff distance < C, checked against an OrderedDict LRU at several sizes."""
    reqs = small_traces[("chat", 16)]
    exact = ExactCurve()
    dists = []
    for prompt, finished in reqs:
        dists.append(exact.access(prompt))
        exact.insert(finished)
    for capacity in (1, 40, 150, 300, 700):
        lru = naive_lru_hits(reqs, capacity)
        for d, hit in zip(dists, lru, strict=True):
            assert ((d < capacity) == hit).all()
        hits = sum(int(h.sum()) for h in lru)
        accesses = sum(len(h) for h in lru)
        assert exact.hit_ratio(capacity) == pytest.approx(hits / accesses)


def naive_distances(requests: list[list[int]]) -> list[list[int]]:
    stack: list[int] = []  # most recent first
    out = []
    for keys in requests:
        dist = [0] * len(keys)
        for i in range(len(keys) - 1, -1, -1):
            if keys[i] in stack:
                dist[i] = stack.index(keys[i])
                stack.remove(keys[i])
            else:
                dist[i] = COLD
            stack.insert(0, keys[i])
        out.append(dist)
    return out


def test_stack_matches_a_naive_stack_on_any_order():
    """Requests that are not prefix-ordered (and repeat keys) take the key-by-key path."""
    rng = np.random.default_rng(7)
    reqs = [rng.integers(0, 40, rng.integers(1, 12)).tolist() for _ in range(300)]
    exact = ExactCurve()
    got = [exact.access(r).tolist() for r in reqs]
    assert got == naive_distances(reqs)


def test_hits_form_a_prefix(small_traces):
    for name in ("chat", "doc_qa"):
        exact = ExactCurve()
        for prompt, finished in small_traces[(name, 16)]:
            dist = exact.access(prompt)
            assert (np.diff(dist) >= 0).all()  # never decreasing from the first page
            for capacity in (1, 8, 64, 200, 500, 1000, 5000):
                hit = dist < capacity
                assert (hit == (np.arange(len(hit)) < hit.sum())).all()
            exact.insert(finished)


# --------------------------------------------------------------------------------------------
# SHARDS against the exact curve
# --------------------------------------------------------------------------------------------


def test_unsampled_estimator_is_exact_on_the_hand_trace():
    est = ShardsEstimator()
    for req in ([1, 2], [1, 3], [1, 2]):
        est.access(req)
    assert [est.hit_ratio(c) for c in (0, 1, 2, 3, 100)] == pytest.approx(
        [0, 0, 2 / 6, 3 / 6, 3 / 6]
    )
    assert est.rate == 1.0 and est.samples == 3


@pytest.mark.parametrize("name", ["chat", "doc_qa"])
@pytest.mark.parametrize("page_size", [16, 8])
def test_shards_accuracy_on_the_traces(small_traces, name, page_size):
    """The traces hold only 800-2,100 distinct pages: 512 samples make the estimator sample
    (rate 0.2-0.6). Over 30 estimator seeds the worst MAE was 0.016 (256 samples: up to 0.05)."""
    reqs = small_traces[(name, page_size)]
    exact, est = ExactCurve(), ShardsEstimator(max_samples=512)
    replay(reqs, exact, est)
    assert est.rate < 0.7 and est.samples <= 512 < exact.distinct_pages
    assert mae(exact, est, capacities(exact)) < 0.02


def test_unsampled_estimator_is_exact_below_its_fine_buckets(small_traces):
    """At rate 1 every page is sampled: one histogram bucket per page below 256 pages."""
    reqs = small_traces[("chat", 16)]
    exact, est = ExactCurve(), ShardsEstimator()
    replay(reqs, exact, est)
    assert est.rate == 1.0 and est.samples == exact.distinct_pages
    caps = list(range(0, 257, 4))
    assert [h for _, h in est.curve(caps)] == pytest.approx([h for _, h in exact.curve(caps)])


def test_shards_accuracy_on_a_large_synthetic_trace(big_trace):
    _, exact, est = big_trace
    assert exact.distinct_pages > 70_000
    assert est.rate < 0.1 and est.samples <= est.max_samples
    caps = capacities(exact)
    assert mae(exact, est, caps) < 0.02
    # the two-tier view: device at the base size, host 4x that
    base = caps[2]
    want = exact.device_host_curve(base, 4 * base)
    got = est.device_host_curve(base, 4 * base)
    for w, g in zip(want, got, strict=True):
        assert (w.factor, w.device_pages, w.host_pages) == (g.factor, g.device_pages, g.host_pages)
        assert abs(w.device_hit - g.device_hit) < 0.02
        assert abs(w.host_hit - g.host_hit) < 0.02
        assert g.total_hit == pytest.approx(g.device_hit + g.host_hit)
    assert "host tier" in est.recommend(base, 4 * base)


def test_to_dict_is_json(big_trace):
    _, _, est = big_trace
    out = json.loads(json.dumps(est.to_dict()))
    assert out["samples"] == est.samples and out["rate"] == est.rate
    assert out["accesses"] == est.accesses > out["sampled_accesses"] > 0
    ratios = [h for _, h in out["curve"]]
    assert ratios == sorted(ratios) and 0 < ratios[-1] <= 1
    assert out["curve"][-1][0] >= out["distinct_pages"]


def test_memory_stays_bounded():
    """200k distinct pages (and re-reads of some): the sample never exceeds max_samples and
    the estimator's memory does not grow with the traffic."""
    rng = np.random.default_rng(3)
    pages = rng.integers(0, 1 << 64, 200_000, dtype=np.uint64, endpoint=False)
    est = ShardsEstimator(max_samples=4096)
    sizes = []
    for i, chunk in enumerate(np.split(pages, 2_000)):
        est.access(chunk)
        est.insert(chunk)
        if i >= 10:
            est.access(pages[(i - 10) * 100 : (i - 9) * 100])  # seen ten requests ago
        assert est.samples <= 4096
        if i % 500 == 499:
            sizes.append(est.memory_bytes())
    assert est.rate < 0.03
    assert abs(est.distinct_pages - 200_000) < 0.1 * 200_000
    # 3 arrays of max_samples 8-byte entries + a fixed histogram: under 1% of a 1M-page
    # cache's page ids alone (device and host int64 per page: 16 MB)
    assert max(sizes) <= 3 * 8 * 4096 + 16 * 1024 < 0.01 * 16 * 1_000_000
    assert max(sizes) - min(sizes) <= 3 * 8 * 4096 // 8


# --------------------------------------------------------------------------------------------
# recommend
# --------------------------------------------------------------------------------------------


def points(total: list[float], device: list[float]) -> list[TierPoint]:
    return [
        TierPoint(f, round(f * 1000), round(f * 4000), d, t - d, t)
        for f, t, d in zip(FACTORS, total, device, strict=True)
    ]


def test_recommend_names_the_knee():
    pts = points([0.2, 0.3, 0.41, 0.55, 0.63, 0.635], [0.1, 0.15, 0.2, 0.3, 0.31, 0.312])
    assert recommend(pts) == (
        "host tier at 4x (16000 pages) would raise host+device hit ratio from 0.41 to 0.63; "
        "beyond 4x adds < 0.01. device tier at 4x (4000 pages) would raise device hit ratio "
        "from 0.20 to 0.31; beyond 4x adds < 0.01."
    )
    flat = points([0.6, 0.7, 0.7, 0.705, 0.705, 0.705], [0.3, 0.5, 0.6, 0.6, 0.6, 0.6])
    assert recommend(flat) == (
        "host tier could shrink to 0.5x (2000 pages) with the same host+device hit ratio "
        "(0.70); even 8x adds < 0.01. device tier is where gains flatten: device hit ratio "
        "0.60; 8x would add < 0.01."
    )
    with pytest.raises(ValueError, match="factor 1"):
        recommend(pts[:2])
    alone = [TierPoint(p.factor, 0, p.host_pages, 0.0, p.total_hit, p.total_hit) for p in pts]
    assert recommend(alone) == (  # (a daemon for engines: its one pool is their host tier)
        "host tier at 4x (16000 pages) would raise host hit ratio from 0.41 to 0.63; "
        "beyond 4x adds < 0.01."
    )


# --------------------------------------------------------------------------------------------
# page hashes
# --------------------------------------------------------------------------------------------


def test_page_hashes_follow_the_recurrence():
    rng = np.random.default_rng(11)
    tokens = rng.integers(0, 1 << 31, 16 * 40 + 5).astype(np.int32)
    got = page_hashes(tokens, 16)
    assert got.dtype == np.uint64 and len(got) == 40  # the partial page is not named
    assert got.tolist() == ref_page_hashes(tokens.tolist(), 16)
    assert page_hashes(tokens[: 16 * 7], 16).tolist() == got[:7].tolist()  # a prefix's names
    assert page_hashes(tokens.tolist(), 16).tolist() == got.tolist()
    other = page_hashes(tokens, 16, seed=b"tenant-2")
    assert other.tolist() == ref_page_hashes(tokens.tolist(), 16, b"tenant-2")
    assert not set(other.tolist()) & set(got.tolist())  # another namespace, other names
    changed = tokens.copy()
    changed[16 * 3 + 2] += 1
    moved = page_hashes(changed, 16)
    assert (moved[:3] == got[:3]).all() and not (moved[3:] == got[3:]).any()
    assert page_hashes(tokens[:10], 16).tolist() == []
    assert page_hashes(tokens, 1).tolist() == ref_page_hashes(tokens.tolist(), 1)


# --------------------------------------------------------------------------------------------
# bad input
# --------------------------------------------------------------------------------------------


def state_of(est: ShardsEstimator) -> tuple:
    s = est._stack
    return json.dumps(est.to_dict()), s.keys.tolist(), s.last.tolist(), s.times.tolist()


BAD_HASHES = [
    np.array([1.5, 2.0]),
    np.array([[1, 2]], np.uint64),
    np.array([True]),
    [1, 2.0],
    [1, "2"],
    [True, 1],
    [[1, 2]],
    "12",
    7,
    None,
]


@pytest.mark.parametrize("bad", BAD_HASHES, ids=lambda b: repr(b)[:20])
def test_non_integer_hashes_are_refused_and_change_nothing(bad):
    est, exact = ShardsEstimator(max_samples=16), ExactCurve()
    for model in (est, exact):
        model.access(np.arange(20, dtype=np.uint64))
    before = state_of(est), exact.curve(range(25))
    for model in (est, exact):
        for call in (model.access, model.insert):
            with pytest.raises(ValueError, match="hash"):
                call(bad)
    assert (state_of(est), exact.curve(range(25))) == before


def test_hashes_use_their_low_64_bits():
    exact = ExactCurve()
    exact.access([5, (1 << 64) - 1])
    assert exact.access([(1 << 64) + 5, np.int64(-1)]).tolist() == [1, 1]
    assert exact.access(np.array([5, -1], np.int64)).tolist() == [1, 1]


@pytest.mark.parametrize("bad", [-1, -0.5, float("nan"), "3", None, True])
def test_bad_capacities_are_refused(bad):
    est, exact = ShardsEstimator(), ExactCurve()
    for model in (est, exact):
        model.access([1, 2, 3])
        with pytest.raises(ValueError, match="capacity"):
            model.hit_ratio(bad)
        with pytest.raises(ValueError, match="capacity"):
            model.curve([4, bad])
        with pytest.raises(ValueError, match="capacity"):
            model.device_host_curve(10, bad)
        assert model.hit_ratio(4) == 0.0  # the refused queries counted nothing


def test_bad_construction_and_page_sizes():
    for kwargs in ({"max_samples": 0}, {"max_samples": 1.5}, {"initial_rate": 0}):
        with pytest.raises(ValueError):
            ShardsEstimator(**kwargs)
    with pytest.raises(ValueError, match="page_size"):
        page_hashes(np.arange(32), 0)
    with pytest.raises(ValueError, match="tokens"):
        page_hashes(np.linspace(0, 1, 32), 16)
