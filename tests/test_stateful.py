"""Random interleavings of every cache operation against the naive reference model.

Copies run only when a rule completes them (ManualTransferEngine), in random order, so any use
of pages before their ack shows up as wrong KV values. check_integrity() runs after every step.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hicache import HiCacheConfig, HiRadixCache, InvalidIndicesError
from hicache.observe import TierEvents
from hicache.transfers import Direction, ManualTransferEngine
from tests.event_model import TierModel, tree_blocks
from tests.reach import run_until_reached
from tests.reference import ReferenceCache, expected_kv, read_kv, write_kv

NAMESPACES = (None, "tenant-b")
REACH = ("loads_completed", "failed_load_under_a_lock", "host_eviction_during_a_load")


class CacheMachine(RuleBasedStateMachine):
    page_size = 1
    write_policy = "write_through"
    eviction_policy = "lru"
    verify_pages = False
    seen: dict[str, int]  # what the runs reached (REACH), per machine class: checked after

    def __init__(self) -> None:
        super().__init__()
        ps = self.page_size
        self.config = HiCacheConfig(
            num_layers=2,
            num_kv_heads=1,
            head_dim=2,
            dtype="float32",
            page_size=ps,
            device_tokens=24 * ps if ps == 1 else 8 * ps,
            host_tokens=64 * ps if ps == 1 else 20 * ps,
            write_policy=self.write_policy,
            eviction_policy=self.eviction_policy,
            load_back_threshold=0,
            write_through_threshold=2,
            verify_pages=self.verify_pages,
        )
        self.cache = HiRadixCache(self.config, transfer_engine=ManualTransferEngine)
        self.engine: ManualTransferEngine = self.cache.engine  # type: ignore[assignment]
        self.pool = self.cache.device_pool
        self.ref = ReferenceCache(ps)
        self.cache.attach_events(TierEvents(ps))
        self.router = TierModel()  # what a router that saw every KV event holds
        self.seqs: list[tuple[np.ndarray, object]] = []
        self.locks: list = []
        self.owned: list[torch.Tensor] = []

    # ---- helpers ----------------------------------------------------------------------------
    def draw_seq(self, data, min_extra: int = 1) -> tuple[np.ndarray, object]:  # noqa: ANN001
        """A new prompt, or (3 times in 4) one that starts with a cached one: the whole of it
        (then a hit reaches what eviction left on the host) or a cut at a page boundary."""
        ps = self.page_size
        vocab = 3 if ps == 1 else 2
        extra = data.draw(st.lists(st.integers(0, vocab - 1), min_size=min_extra, max_size=3 * ps))
        if self.seqs and data.draw(st.integers(0, 3)):
            base, ns = self.seqs[data.draw(st.integers(0, len(self.seqs) - 1))]
            if data.draw(st.booleans()):
                base = base[: data.draw(st.integers(0, len(base) // ps)) * ps]
        else:
            base, ns = np.empty(0, np.int32), data.draw(st.sampled_from(NAMESPACES))
        return np.concatenate([base, np.array(extra, np.int32)]).astype(np.int32), ns

    def host_hit(self, data, seq: np.ndarray, ns: object) -> object:  # noqa: ANN001
        """The match of ``seq``; when it sits on the device only, the device lets it go first
        (3 times in 4, drawn): every copy in flight completes (a write-back's backup among
        them) and the device is evicted, so the prefix becomes a host hit. Without this the
        states that need one hang on the other rules' timing, and some runs never reach them."""
        m = self.cache.match_prefix(seq, namespace=ns)
        if m.host_hit_length or not m.device_hit_length or not data.draw(st.integers(0, 3)):
            return m
        self.cache.evict(self.config.device_tokens)
        self.engine.complete_all()
        self.cache.poll()
        self.cache.evict(self.config.device_tokens)  # (write-back: freed at the ack above)
        return self.cache.match_prefix(seq, namespace=ns)

    def nothing_lost(self) -> bool:
        s = self.cache.stats()
        return s.evicted_device_tokens == 0 and s.evicted_host_tokens == 0

    def check_match(self, seq: np.ndarray, ns: object, m):  # noqa: ANN001, ANN201
        """Check a match's KV against the model; returns it settled (loads landed)."""
        dev = m.device_hit_length
        total = dev + m.host_hit_length
        assert total % self.page_size == 0
        assert self.ref.contains(seq[:total], ns), "matched a prefix that was never inserted"
        if m.loading:  # let the load land, then look again: it may have failed
            self.cache.wait_load(m.last_device_node)
            m = self.cache.match_prefix(seq, namespace=ns)
            dev = m.device_hit_length
            assert not m.loading and dev + m.host_hit_length == total
        got = read_kv(self.pool, m.device_indices)
        want = expected_kv(seq[:dev], self.config.num_kv, self.config.num_layers)
        assert torch.equal(got, want), "device slots hold another prefix's KV"
        if self.nothing_lost():
            assert total == self.ref.longest(seq, ns), "a cached prefix was not found"
        return m

    # ---- rules --------------------------------------------------------------------------------
    @initialize(data=st.data(), count=st.integers(1, 4))
    def warm_host(self, data, count: int) -> None:  # noqa: ANN001
        """Start with prompts that only the host holds (inserted, hit twice so that every
        write policy backs them up, then evicted from the device): loads, their failures and
        host eviction under them are a few steps away from the first step."""
        for _ in range(count):
            seq, ns = self.draw_seq(data, min_extra=self.page_size)  # a whole page at least
            slots = self.cache.alloc(len(seq))
            if slots is None:
                break
            write_kv(self.pool, slots, seq, 0, seq)
            self.cache.insert(seq, slots, namespace=ns)
            self.ref.insert(seq, ns)
            self.seqs.append((seq, ns))
            for _ in range(2):
                self.cache.match_prefix(seq, namespace=ns)
        for _ in range(2):  # backups land; eviction (write_back: backs up first) ends on the host
            self.engine.complete_all()
            self.cache.poll()
            self.cache.evict(self.config.device_tokens)

    @rule(data=st.data(), load=st.booleans(), wait=st.booleans())
    def serve_request(self, data, load, wait) -> None:  # noqa: ANN001
        """The engine loop: match, load back, lock, allocate the rest, write KV, insert."""
        seq, ns = self.draw_seq(data)
        m = self.check_match(seq, ns, self.cache.match_prefix(seq, namespace=ns))
        lock, prefix = m.last_device_node, m.device_indices
        if load and m.host_hit_length:
            loaded = self.cache.load_back(m.last_host_node)
            if loaded is not None:
                lock, prefix = m.last_host_node, torch.cat([prefix, loaded])
                if wait:
                    self.cache.wait_load(lock)
        self.cache.inc_lock_ref(lock)
        new = self.cache.alloc(len(seq) - len(prefix))
        if new is not None:
            write_kv(self.pool, new, seq, len(prefix), seq)
            self.cache.insert(seq, torch.cat([prefix, new]), namespace=ns)
            self.ref.insert(seq, ns)
            self.seqs.append((seq, ns))
        self.cache.dec_lock_ref(lock)

    @rule(data=st.data())
    def insert_fresh(self, data) -> None:  # noqa: ANN001
        """Insert with fresh slots for every token: duplicates must be freed by insert."""
        seq, ns = self.draw_seq(data)
        slots = self.cache.alloc(len(seq))
        if slots is not None:
            write_kv(self.pool, slots, seq, 0, seq)
            self.cache.insert(seq, slots, namespace=ns)
            self.ref.insert(seq, ns)
            self.seqs.append((seq, ns))

    @rule(data=st.data())
    def match_and_lock(self, data) -> None:  # noqa: ANN001
        seq, ns = self.draw_seq(data)
        m = self.check_match(seq, ns, self.cache.match_prefix(seq, namespace=ns))
        if m.last_device_node.parent is not None:
            self.cache.inc_lock_ref(m.last_device_node)
            self.locks.append(m.last_device_node)

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data) -> None:  # noqa: ANN001
        node = self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1)))
        self.cache.dec_lock_ref(node)

    @rule(data=st.data())
    def load_back_and_verify(self, data) -> None:  # noqa: ANN001
        seq, ns = self.draw_seq(data)
        # a match whose prefix is still loading: wait, then match again (the API's rule: a
        # load that fails takes its nodes off the device, and the chain to load grows)
        m = self.check_match(seq, ns, self.cache.match_prefix(seq, namespace=ns))
        if not m.host_hit_length:
            return
        loaded = self.cache.load_back(m.last_host_node)
        if loaded is None:
            return
        self.cache.wait_load(m.last_host_node)
        start = m.device_hit_length
        got = read_kv(self.pool, loaded)
        want = expected_kv(seq[: start + len(loaded)], self.config.num_kv, self.config.num_layers)
        assert torch.equal(got, want[:, :, start:]), "loaded-back KV differs from what was inserted"

    @rule(data=st.data())
    def load_and_hold(self, data) -> None:  # noqa: ANN001
        """Start a load-back and lock the loaded node without waiting (what the daemon does
        for load_back_async): the copy may later fail under the lock."""
        seq, ns = self.draw_seq(data)
        m = self.cache.match_prefix(seq, namespace=ns)
        if m.host_hit_length and self.cache.load_back(m.last_host_node) is not None:
            self.cache.inc_lock_ref(m.last_host_node)
            self.locks.append(m.last_host_node)

    @precondition(lambda self: self.engine.queued())
    @rule(data=st.data())
    def fail_transfer(self, data) -> None:  # noqa: ANN001
        """A copy fails (its destination is left as it was): never readable afterwards."""
        self.fail(data.draw(st.sampled_from(self.engine.queued())))

    def fail(self, ticket) -> None:  # noqa: ANN001
        job = self.engine._queued[ticket]
        if job.direction is Direction.LOAD:  # what a copy that died half-way leaves behind
            ps = self.page_size
            slots = (job.device_pages[:, None] * ps + torch.arange(ps)).reshape(-1)
            self.pool.layers[:, :, slots] = -1.0
        self.engine.fail(ticket)
        self.engine.complete(ticket)

    @rule(data=st.data())
    def failed_load_under_a_lock(self, data) -> None:  # noqa: ANN001
        """The daemon's load_back: load, lock the loaded node; the copy fails; then anyone's
        match of that prefix must not see the garbage."""
        seq, ns = self.draw_seq(data)
        m = self.host_hit(data, seq, ns)
        node = m.last_host_node
        if not m.host_hit_length or self.cache.load_back(node) is None:
            return
        self.cache.inc_lock_ref(node)
        self.locks.append(node)
        self.fail(self.cache.load_ticket(node))
        self.seen["failed_load_under_a_lock"] += 1
        self.cache.poll()
        self.check_match(seq, ns, self.cache.match_prefix(seq, namespace=ns))

    @rule(data=st.data(), pages=st.integers(1, 12))
    def evict_host_while_loading(self, data, pages: int) -> None:  # noqa: ANN001
        """Host room is wanted while a load still reads its host pages (nested eviction, an
        L3 fetch making room, another engine's request): those pages must survive it."""
        if not self.seqs:
            return
        seq, ns = data.draw(st.sampled_from(self.seqs))  # a cached prompt: a host hit, likely
        m = self.host_hit(data, seq, ns)
        if not m.host_hit_length or self.cache.load_back(m.last_host_node) is None:
            return
        self.cache.evict_host(pages * self.page_size)
        self.seen["host_eviction_during_a_load"] += bool(self.engine.queued())
        self.check_match(seq, ns, self.cache.match_prefix(seq, namespace=ns))

    @rule(pages=st.integers(1, 8), part=st.booleans())
    def evict_device(self, pages: int, part: bool) -> None:
        self.cache.evict(pages * self.page_size - (part and self.page_size > 1))

    @rule(pages=st.integers(1, 12), part=st.booleans())
    def evict_host(self, pages: int, part: bool) -> None:
        loading = any(j.direction is Direction.LOAD for j in self.engine._queued.values())
        if self.cache.evict_host(pages * self.page_size - (part and self.page_size > 1)):
            self.seen["host_eviction_during_a_load"] += loading

    @precondition(lambda self: self.engine.queued())
    @rule(data=st.data())
    def complete_transfer(self, data) -> None:  # noqa: ANN001
        self.engine.complete(data.draw(st.sampled_from(self.engine.queued())))

    @rule()
    def poll(self) -> None:
        self.cache.poll()

    @rule(pages=st.integers(0, 8))
    def settle_and_evict(self, pages: int) -> None:
        """Every copy lands, then device room is made: what was backed up becomes host-only
        (the way to host hits, loads and their failures in few steps)."""
        self.engine.complete_all()
        self.cache.poll()
        self.cache.evict(pages * self.page_size)

    @rule(n=st.integers(0, 20))
    def alloc_owned(self, n: int) -> None:
        slots = self.cache.alloc(n)
        if slots is not None:
            self.owned.append(slots)

    @precondition(lambda self: self.owned)
    @rule(data=st.data())
    def free_owned(self, data) -> None:  # noqa: ANN001
        slots = self.owned.pop(data.draw(st.integers(0, len(self.owned) - 1)))
        self.cache.free(slots)
        if len(slots):
            with pytest.raises(InvalidIndicesError):
                self.cache.free(slots)  # double free changes nothing

    @rule(data=st.data())
    def bad_insert(self, data) -> None:  # noqa: ANN001
        seq, ns = self.draw_seq(data)
        before = self.cache.stats()
        with pytest.raises(ValueError):
            self.cache.insert(seq, torch.zeros(len(seq) + 1, dtype=torch.int64), namespace=ns)
        with pytest.raises(ValueError):
            self.cache.match_prefix(np.array([1, -2, 3]))
        after = self.cache.stats()
        assert (after.device_free_tokens, after.device_cached_tokens) == (
            before.device_free_tokens,
            before.device_cached_tokens,
        )

    @invariant()
    def integrity(self) -> None:
        self.cache.check_integrity()
        for event in self.cache.events.take():
            self.router.apply(event)
        self.cache.check_integrity()  # now with nothing left to announce
        assert self.router.normalized() == tree_blocks(self.cache)

    def teardown(self) -> None:
        self.seen["loads_completed"] += self.cache.stats().load_tokens > 0
        for node in self.locks:
            self.cache.dec_lock_ref(node)
        self.engine.complete_all()
        self.cache.poll()
        self.cache.check_integrity()
        for slots in self.owned:
            self.cache.free(slots)
        s = self.cache.stats()
        assert s.device_protected_tokens == 0 and s.device_owned_tokens == 0
        assert s.device_free_tokens + s.device_cached_tokens == s.device_capacity_tokens
        self.cache.close()


SETTINGS = settings(
    max_examples=60,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def _machine(ps: int, policy: str, eviction: str, verify: bool = False) -> type[CacheMachine]:
    name = f"Machine_{policy}_{ps}_{eviction}_{verify}"
    attrs = {"page_size": ps, "write_policy": policy, "eviction_policy": eviction}
    attrs["verify_pages"] = verify
    attrs["seen"] = dict.fromkeys(REACH, 0)
    return type(name, (CacheMachine,), attrs)


def _run(machine: type[CacheMachine]) -> None:
    """The random runs, then what they must have reached: a property test that never loads,
    never fails a load under a lock or never evicts the host while a load runs proves nothing
    about the rules for those states."""
    machine.TestCase.settings = SETTINGS
    run_until_reached(machine)


CASES = [
    (ps, policy, "lfu" if (ps, policy) == (4, "write_back") else "lru")
    for policy in ("write_through", "write_through_selective", "write_back")
    for ps in (1, 4, 16)
]


@pytest.mark.parametrize(("ps", "policy", "eviction"), CASES)
def test_random_interleavings(ps: int, policy: str, eviction: str) -> None:
    _run(_machine(ps, policy, eviction))


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_random_interleavings_with_verified_pages(policy: str) -> None:
    """verify_pages: every host page the tree holds keeps its checksum (check_integrity reads
    them all after every step), and failed copies never leave a page unsealed."""
    _run(_machine(4, policy, "lru", verify=True))
