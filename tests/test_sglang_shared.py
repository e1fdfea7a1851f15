"""A property test: two SGLang instances (different host layouts) and a vLLM-style engine (token
keys) share one daemon whose pool holds far less than they write. SGLang's calls carry prefix
keys (chains) in every other example and not (one-page keys) in the rest. Whatever the order of
their writes, lookups, pins and reads, every page read is the page written for its key, the
engines never see each other's pages, a chain is held from its first page, and the daemon's
invariants hold after every step."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from tests import optional

optional.require_module(
    "sglang.srt.mem_cache.hicache_storage", "sglang", "the SGLang storage backend's tests"
)

from hicache.client import HiCacheClient  # noqa: E402
from hicache.client.sglang.pages import daemon_view, key_words, page_format  # noqa: E402
from tests import sglang_rig as rig  # noqa: E402
from tests.daemon_helpers import start_daemon, stop_daemon  # noqa: E402
from tests.reach import run_until_reached  # noqa: E402

POOL_PAGES = 12
PROMPTS = 6  # prompt families; each one's pages are a chain, and families share first pages
PAGES = 6  # pages per prompt


def after(keys: list[str]):
    """SGLang's extra_info for a call whose keys follow ``keys`` (its prefix keys)."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    return HiCacheStorageExtraInfo(prefix_keys=list(keys))


def kv_for(name: str, fmt) -> torch.Tensor:
    """The page an engine computes for ``name`` (a key or a token prefix): a function of it,
    as real KV is a function of the prefix. ``[kv, L, P, width]``."""
    gen = torch.Generator().manual_seed(int.from_bytes(name.encode()[-8:], "little") % (1 << 62))
    shape = (fmt.kv, fmt.layers, fmt.page_size, fmt.width)
    return torch.randn(shape, generator=gen).to(torch.float16)


class Shared(RuleBasedStateMachine):
    endpoint = ""
    examples = itertools.count()
    seen = {"evicted": 0, "read": 0, "chain_read": 0, "vllm_read": 0}

    def __init__(self) -> None:
        super().__init__()
        n = next(self.examples)
        more = {"hicache.namespace": f"ex{n}", "hicache.pin_s": 0.5}
        self.chain = n % 2 == 1  # SGLang passes prefix keys (every call of this example)
        self.hosts, self.backends = [], []
        for layout in ("page_first", "layer_first"):
            _, host = rig.host_pool(layout, pages=POOL_PAGES)
            self.hosts.append(host)
            extra = rig.extra_config(self.endpoint, chains=self.chain, **more)
            self.backends.append(rig.backend(host, extra))
        self.fmt = page_format(host, rig.MODEL)
        self.vllm = HiCacheClient(self.endpoint, name=f"vllm-style-{n}")
        self.vllm.register_layout(self.fmt.engine_layout())
        self.vllm_ns = f"vllm-{n}"
        rng = np.random.default_rng(n)
        base = rng.integers(0, 30000, PAGES * rig.PAGE).tolist()
        self.prompts = []
        for i in range(PROMPTS):  # families share their first i % 3 pages
            own = rng.integers(0, 30000, PAGES * rig.PAGE).tolist()
            keep = (i % 3) * rig.PAGE
            self.prompts.append(base[:keep] + own[keep:])
        self.found: set[str] = set()  # keys some lookup found (a later miss: evicted)
        with HiCacheClient(self.endpoint, name="admin", admin=True) as admin:
            admin.flush()

    # ---- SGLang ------------------------------------------------------------------------------
    @rule(
        op=st.sampled_from(["backup", "prefetch", "exists"]),
        inst=st.integers(0, 1),
        prompt=st.integers(0, PROMPTS - 1),
        pages=st.integers(1, PAGES),
    )
    def sglang(self, op, inst, prompt, pages):
        """backup: SGLang's backup thread writes the prompt's first ``pages``; prefetch: its
        prefetch threads ask from page ``PAGES - pages`` on (its host hit; mid-chain) and read
        what was found; exists: they ask, and the read never comes (a pin left to pin_s).
        In every other example the calls carry the keys before theirs (prefix keys)."""
        if op == "backup":
            self.backup(inst, prompt, pages, self.chain)
        else:
            self.prefetch(inst, prompt, PAGES - pages, op == "prefetch", self.chain)

    def backup(self, inst, prompt, pages, chain):
        keys = rig.chain_hashes(self.prompts[prompt][: pages * rig.PAGE])
        host = self.hosts[inst]
        src = host.alloc(pages * rig.PAGE)
        for i, key in enumerate(keys):
            rig.set_canonical(host, int(src[i * rig.PAGE]), kv_for(key, self.fmt))
        ok = self.backends[inst].batch_set_v1(keys, src, after([]) if chain else None)
        assert ok in ([True] * pages, [False] * pages)  # False: the pool is pinned full
        host.free(src)

    def prefetch(self, inst, prompt, start, get, chain):
        every = rig.chain_hashes(self.prompts[prompt])
        keys = every[start:]
        info = after(every[:start]) if chain else None
        # as SGLang 0.5.23's server asks: a lookup from the prompt's start names no prefix
        # (None), its get and the sets name the empty one
        asked = None if chain and not start else info
        be, host = self.backends[inst], self.hosts[inst]
        hit = be.batch_exists(keys, asked)
        assert 0 <= hit <= len(keys)
        self.seen["evicted"] += any(k in self.found for k in keys[hit:])
        self.found.update(keys[:hit])
        if chain and hit:  # held from the first page: the chain from its start is found
            words = key_words(every, rig.PAGE).reshape(-1)
            m = self.vllm.match_prefix(words, namespace=be.chains.namespace, lock=False)
            assert m.device_hit_length >= (start + hit) * rig.PAGE
        if not get or not hit:
            return
        dst = host.alloc(hit * rig.PAGE)
        poison = torch.full_like(kv_for("", self.fmt), float("nan"))
        for i in range(hit):
            rig.set_canonical(host, int(dst[i * rig.PAGE]), poison)
        got = be.batch_get_v1(keys[:hit], dst, info)
        done = got.index(False) if False in got else hit
        assert got == [True] * done + [False] * (hit - done)
        for i, key in enumerate(keys[:done]):
            assert torch.equal(
                rig.canonical_page(host, int(dst[i * rig.PAGE])), kv_for(key, self.fmt)
            )
        self.seen["chain_read" if chain else "read"] += done
        host.free(dst)

    # ---- a vLLM-style engine on the same daemon ----------------------------------------------
    @rule(prompt=st.integers(0, PROMPTS - 1), pages=st.integers(1, PAGES))
    def vllm_store(self, prompt, pages):
        tokens = self.prompts[prompt][: pages * rig.PAGE]
        hc = self.vllm
        try:
            slots = hc.alloc(len(tokens))
        except Exception:  # noqa: BLE001 (OUT_OF_MEMORY under pins: a refused store)
            return
        pool = daemon_view(self.fmt, "layer_first", hc.attach().layers)
        for i in range(pages):
            name = "v" + repr(tokens[: (i + 1) * rig.PAGE])
            pool[:, :, int(slots[i * rig.PAGE]) // rig.PAGE] = kv_for(name, self.fmt)
        hc.insert(tokens, slots, namespace=self.vllm_ns)

    @rule(prompt=st.integers(0, PROMPTS - 1))
    def vllm_read(self, prompt):
        tokens = self.prompts[prompt]
        m = self.vllm.match_prefix(tokens, namespace=self.vllm_ns)
        try:
            pool = daemon_view(self.fmt, "layer_first", self.vllm.attach().layers)
            for i, page in enumerate(m.device_pages.tolist()):
                name = "v" + repr(tokens[: (i + 1) * rig.PAGE])
                assert torch.equal(pool[:, :, page], kv_for(name, self.fmt))
            self.seen["vllm_read"] += len(m.device_pages)
        finally:
            self.vllm.release(m)

    @invariant()
    def integrity(self) -> None:
        """The daemon's check_integrity() after every step."""
        stats = self.vllm.stats(check=True)
        assert stats["integrity"] == "ok", stats["integrity"]

    def teardown(self) -> None:
        for be in self.backends:
            be.close()
        self.vllm.close()


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory):
    ep = f"ipc://{tmp_path_factory.mktemp('shared')}/h.sock"
    proc = start_daemon(ep, "--device-tier", "engine", "--host-tokens", str(POOL_PAGES * rig.PAGE))
    try:
        yield ep
    finally:
        stop_daemon(proc)


def test_two_sglang_instances_and_a_vllm_style_engine_share_one_small_pool(endpoint):
    Shared.endpoint = endpoint
    Shared.TestCase.settings = settings(
        max_examples=60,
        stateful_step_count=50,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    run_until_reached(Shared)
