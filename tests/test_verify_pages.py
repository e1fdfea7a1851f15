"""Verified restores (verify_pages): a checksum per host page, sealed when a backup or a fetch
writes it, checked before a load-back or a write to the third tier reads it. Bits flipped in
the host pool behind the cache's back are never served: the chain is dropped, the request
recomputes, and the loss is counted."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hicache.errors import IntegrityError
from hicache.memory import HostPool, PageSums
from tests.conftest import make_cache, put, settle, values_at


def cached_on_host_only(cache, tokens):  # noqa: ANN001, ANN201
    """Insert ``tokens``, let the backup land, and evict the device copy."""
    put(cache, tokens)
    cache.match_prefix(tokens)  # write_through backs up on the first hit
    cache.engine.complete_all()
    cache.poll()
    cache.evict(len(tokens))
    settle(cache)
    m = cache.match_prefix(tokens)
    assert m.device_hit_length == 0 and m.host_hit_length == len(tokens)
    return m


def flip(cache, page: int) -> None:  # noqa: ANN001
    value = cache.host_pool.page_view[1, 1, page, 0, 1:2]  # one value of one layer's V
    value.view(torch.int32 if value.element_size() == 4 else torch.int16).bitwise_xor_(1)


@pytest.mark.parametrize("c_helper", [True, False])
def test_a_flipped_bit_is_never_served_and_the_chain_is_dropped(c_helper, monkeypatch):
    cache = make_cache(page_size=4, device_tokens=32, host_tokens=96, verify_pages=True)
    cache.engine.sums._c = c_helper and cache.engine.sums._c
    tokens = np.arange(1, 17, dtype=np.int32)
    other = np.arange(100, 108, dtype=np.int32)
    m = cached_on_host_only(cache, tokens)
    cached_on_host_only(cache, other)
    cache.check_integrity()
    flip(cache, int(m.last_host_node.host_pages[2]))
    with pytest.raises(IntegrityError, match="differ from their checksums"):
        cache.check_integrity()  # the invariant sees it too
    slots = cache.load_back(m.last_host_node)
    assert slots is not None  # the load starts; its check runs on the copy thread
    settle(cache)
    after = cache.match_prefix(tokens)
    assert (after.device_hit_length, after.host_hit_length) == (0, 0)  # gone, recomputed
    s = cache.stats()
    assert s.corrupt_host_tokens == 16 and s.transfer_errors == 1
    cache.check_integrity()
    # the untouched prefix still loads, with its own values
    m2 = cache.match_prefix(other)
    loaded = cache.load_back(m2.last_host_node)
    settle(cache)
    expect = torch.tensor(other * 10 + np.arange(8), dtype=torch.float32)
    assert torch.equal(values_at(cache, loaded)[0, 0], expect)
    cache.check_integrity()
    cache.close()


def test_without_verify_pages_nothing_is_computed():
    cache = make_cache(page_size=4)
    assert cache.engine.sums is None
    cache.close()


def test_the_c_helper_and_numpy_agree_on_every_layout():
    from hicache import HiCacheConfig

    for layout in ("layer_first", "page_first"):
        shape = dict(num_layers=3, num_kv_heads=2, head_dim=8, dtype="bfloat16", page_size=4)
        cfg = HiCacheConfig(**shape, device_tokens=64, host_tokens=256, host_layout=layout)
        pool = HostPool(cfg)
        gen = torch.Generator().manual_seed(len(layout))  # (this test's own random state)
        pool.buffer.copy_(
            torch.randint(0, 256, pool.buffer.shape, dtype=torch.uint8, generator=gen)
        )
        sums = PageSums(pool.page_view)
        pages = np.array([0, 5, 63, 17])
        fast = sums.compute(pages)
        sums._c = False
        assert np.array_equal(fast, sums.compute(pages)), layout
        assert len(set(fast.tolist())) == 4
        sums.seal(pages)
        # one bit of one value: changes the bytes whatever the value (adding 1 to a bfloat16
        # of 256 or more, inf or NaN changes nothing)
        pool.page_view[0, 2, 17, 3, 7:8].view(torch.int16).bitwise_xor_(1)
        assert sums.bad(pages).tolist() == [17]
    with pytest.raises(IndexError):
        sums.compute(np.array([64]))


def test_verify_pages_must_be_a_bool():
    with pytest.raises(ValueError, match="verify_pages"):
        make_cache(verify_pages="yes")


def test_a_daemon_serves_no_byte_of_a_host_pool_changed_behind_its_back(tmp_path):
    """End to end: an engine's prefix is backed up and evicted from the device, then the host
    pool's shared memory is scribbled on; the load is refused (None: recompute), the daemon
    counts it, and the prefix is gone rather than wrong."""
    from hicache.client import HiCacheClient
    from tests.daemon_helpers import start_daemon, stop_daemon, wait_until, write_sequence

    ep = f"ipc://{tmp_path}/v.sock"
    proc = start_daemon(ep, "--verify-pages", "true")
    try:
        tokens = list(range(1, 65))
        write_sequence(ep, tokens)
        with HiCacheClient(ep, name="admin", admin=True) as hc:
            hc.match_prefix(tokens, lock=False)  # a hit: write_through backs it up
            wait_until(lambda: hc.stats()["backup_tokens"] >= 64, what="the backup")
            hc.evict(device_tokens=10**6)
            m = hc.match_prefix(tokens)
            assert (m.device_hit_length, m.host_hit_length) == (0, 64)
            name = hc.info["pools"]["host"]["name"]
            with open(f"/dev/shm/{name}", "r+b") as fh:  # behind the daemon's back
                size = fh.seek(0, 2)
                fh.seek(0)
                data = bytearray(fh.read(size))
                for i in range(0, size, 4093):
                    data[i] ^= 0x10
                fh.seek(0)
                fh.write(data)
            assert hc.load_back(m) is None  # refused: recompute
            hc.release(m)
            stats = hc.stats()
            assert stats["corrupt_host_tokens"] == 64 and stats["load_tokens"] == 0
            again = hc.match_prefix(tokens, lock=False)
            assert (again.device_hit_length, again.host_hit_length) == (0, 0)
    finally:
        stop_daemon(proc)
