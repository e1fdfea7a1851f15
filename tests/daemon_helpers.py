"""A daemon in a subprocess, and engine processes that use it (spawned, so nothing is shared
but the daemon's pools)."""

from __future__ import annotations

import os
import subprocess
import time

import numpy as np
import torch

from hicache.client import HiCacheClient
from hicache.daemon import launch
from hicache.daemon.launch import stop_daemon  # noqa: F401  (re-exported for tests)

SMALL = [
    "--num-layers",
    "2",
    "--num-kv-heads",
    "2",
    "--head-dim",
    "4",
    "--dtype",
    "float32",
    "--page-size",
    "4",
    "--device-tokens",
    "256",
    "--host-tokens",
    "1024",
    "--load-back-threshold",
    "1",
]


def start_daemon(
    endpoint: str, *extra: str, lease: float = 3.0, quarantine: float = 1.0, drain: float = 0.0
) -> subprocess.Popen:
    """A small daemon. ``drain``: its --shutdown-timeout (0: SIGTERM stops at once, as the
    restart tests want; a later --shutdown-timeout in ``extra`` wins)."""
    flags = ("--lease-seconds", str(lease), "--quarantine-seconds", str(quarantine))
    flags += ("--shutdown-timeout", str(drain), "--keep-host", "false")  # (tests that keep: on)
    return launch.start_daemon(endpoint, *flags, *SMALL, *extra)


def wait_until(predicate, timeout: float = 20.0, what: str = "condition") -> None:
    """Poll ``predicate`` (a daemon query) until true; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not reached in {timeout} s"
        time.sleep(0.02)


def kv_value(tokens: np.ndarray) -> torch.Tensor:
    """The KV an engine writes for ``tokens``: a function of the whole prefix."""
    h = np.cumsum(np.asarray(tokens, dtype=np.int64) * 7 + 1) % 65521
    return torch.from_numpy(h.astype(np.float32))


def write_sequence(endpoint: str, tokens: list[int]) -> list[int]:
    """Engine A: compute (here: write) KV for ``tokens`` and insert them; returns the slots."""
    with HiCacheClient(endpoint, name="writer") as hc:
        pools = hc.attach()
        m = hc.match_prefix(tokens)
        new = hc.alloc(len(tokens) - m.device_hit_length)
        value = kv_value(np.array(tokens))[m.device_hit_length :]
        for layer in range(len(pools.k_buffer)):
            pools.k_buffer[layer][new] = value[:, None, None] + layer
            pools.v_buffer[layer][new] = -value[:, None, None] - layer
        hc.insert(tokens, torch.cat([m.device_indices, new]))
        hc.release(m)
        return new.tolist()


def busy_engine(endpoint: str, seed: int, requests: int) -> int:
    """An engine serving a stream of chat-like requests; returns tokens it recomputed."""
    rng = np.random.default_rng(seed)
    shared = list(range(1, 41))
    recomputed = 0
    with HiCacheClient(endpoint, name=f"busy-{seed}") as hc:
        history = list(shared)
        for _ in range(requests):
            prompt = history + rng.integers(100, 200, 12).tolist()
            m = hc.match_prefix(prompt)
            loaded = hc.load_back(m)
            have = torch.cat([m.device_indices, loaded]) if loaded is not None else m.device_indices
            new = hc.alloc(len(prompt) - len(have))
            hc.insert(prompt, torch.cat([have, new]))
            hc.release(m)
            recomputed += len(new)
            history = prompt if len(prompt) < 80 else list(shared)
    return recomputed


def hold_and_wait(endpoint: str, ready_path: str) -> None:
    """Allocate, lock a match, tell the parent, then wait to be killed."""
    hc = HiCacheClient(endpoint, name="victim")
    hc.alloc(20)
    hc.match_prefix(list(range(1, 41)))
    with open(ready_path, "w") as fh:
        fh.write(str(os.getpid()))
    while True:
        time.sleep(60)


def serve_chats(endpoint: str, seed: int, requests: int) -> list[list[int]]:
    """Chat-like traffic with loads, backups and evictions on both tiers; returns the prompts."""
    rng = np.random.default_rng(seed)
    shared = list(range(1, 41))
    prompts = []
    with HiCacheClient(endpoint, name=f"chat-{seed}") as hc:
        history = list(shared)
        for i in range(requests):
            prompt = history + rng.integers(100, 300, 12).tolist()
            if i % 4 == 3:  # an old conversation comes back (its KV may be on the host only)
                prompt = prompts[rng.integers(len(prompts))] + [7] * 8
            m = hc.match_prefix(prompt)
            loaded = hc.load_back(m)
            have = torch.cat([m.device_indices, loaded]) if loaded is not None else m.device_indices
            hc.insert(prompt, torch.cat([have, hc.alloc(len(prompt) - len(have))]))
            hc.release(m)
            prompts.append(prompt)
            if i % 4 != 3:
                history = prompt if len(prompt) < 120 else list(shared)
    return prompts
