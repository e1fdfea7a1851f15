import os

import torch

# Triton reads this when a kernel is defined: the CPU has no Triton backend, only the interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import pytest

from hicache import HiCacheConfig, HiRadixCache
from hicache.transfers import ManualTransferEngine


def make_cache(manual=True, **overrides) -> HiRadixCache:
    fields = dict(
        num_layers=2,
        num_kv_heads=1,
        head_dim=2,
        dtype="float32",
        page_size=1,
        device_tokens=32,
        host_tokens=96,
        load_back_threshold=0,
    )
    fields.update(overrides)
    engine = ManualTransferEngine if manual else None
    kwargs = {"transfer_engine": engine} if engine else {}
    return HiRadixCache(HiCacheConfig(**fields), **kwargs)


def put(cache: HiRadixCache, tokens, namespace=None) -> torch.Tensor:
    """Allocate, write a value per token (token * 10 + position), insert; returns the slots."""
    tokens = np.asarray(tokens, dtype=np.int32)
    slots = cache.alloc(len(tokens))
    values = torch.tensor(tokens * 10 + np.arange(len(tokens)), dtype=torch.float32)
    cache.device_pool.layers[:, :, slots] = values[None, None, :, None, None]
    cache.insert(tokens, slots, namespace=namespace)
    return slots


def values_at(cache: HiRadixCache, slots: torch.Tensor) -> torch.Tensor:
    return cache.device_pool.layers[:, :, slots, 0, 0]


def settle(cache: HiRadixCache) -> None:
    """Run every queued copy and process the acks."""
    if cache.engine is not None:
        cache.engine.wait(list(cache.records))
    cache.poll()


@pytest.fixture
def cache():
    c = make_cache()
    yield c
    c.check_integrity()
    c.close()


def pytest_terminal_summary(terminalreporter) -> None:  # noqa: ANN001
    """Say what was not tested because it was declared absent (tests/optional.py)."""
    from tests.optional import SKIPPED

    for name, needs in sorted(SKIPPED.items()):
        for what in sorted(needs):
            terminalreporter.write_line(f"NOT TESTED: {what} ({name} declared absent)", yellow=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):  # noqa: ANN001, ANN201
    """Every daemon a test's body started is stopped when the body ends, also when it failed
    before its own ``finally`` (a daemon started before a failing setup line would outlive
    the run). Daemons of fixtures start outside the body and are the fixtures' to stop."""
    from hicache.daemon import launch

    started = []
    real = launch.DaemonProcess.start_draining

    def tracked(self, before):  # noqa: ANN001, ANN202
        started.append(self)
        return real(self, before)

    launch.DaemonProcess.start_draining = tracked
    try:
        yield
    finally:
        launch.DaemonProcess.start_draining = real
        for proc in started:
            if proc.poll() is None:
                launch.stop_daemon(proc)
