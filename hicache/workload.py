"""Synthetic traces and the request loop an engine runs against the cache.

Used by the demo, the benchmarks and the tests, so that all of them exercise the cache the way
an engine does: match, lock, load back a host hit, allocate the rest, write KV, insert, release.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hicache.cache import HiRadixCache


@dataclass(frozen=True)
class Request:
    prompt: np.ndarray  # int32 token ids the engine must prefill
    finished: np.ndarray  # prompt + generated tokens, inserted when the request ends


def chat_trace(
    n_systems: int = 4,
    system_len: int = 2048,
    n_convs: int = 32,
    turns: int = 4,
    user_len: int = 200,
    answer_len: int = 100,
    seed: int = 0,
    vocab: int = 32000,
) -> list[Request]:
    """Multi-turn chats over shared system prompts; each request is the whole history.

    Conversations are interleaved turn by turn in a shuffled order, so the working set of live
    conversations is large and caches are exercised under pressure.
    """
    rng = np.random.default_rng(seed)
    systems = [rng.integers(1, vocab, system_len, dtype=np.int32) for _ in range(n_systems)]
    history = [systems[i % n_systems] for i in range(n_convs)]
    requests = []
    for _ in range(turns):
        for conv in rng.permutation(n_convs):
            user = rng.integers(1, vocab, user_len, dtype=np.int32)
            prompt = np.concatenate([history[conv], user])
            answer = rng.integers(1, vocab, answer_len, dtype=np.int32)
            finished = np.concatenate([prompt, answer])
            requests.append(Request(prompt, finished))
            history[conv] = finished
    return requests


@dataclass
class LoopStats:
    prompt_tokens: int = 0
    recomputed_tokens: int = 0  # prompt tokens the engine had to prefill itself
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0  # loaded back from the host
    failed_allocs: int = 0


def fill_kv(cache: HiRadixCache, slots: torch.Tensor, tokens: np.ndarray, start: int) -> None:
    """Write a KV value determined by (token, position) into ``slots`` (layer 0, K and V)."""
    value = torch.from_numpy(tokens.astype(np.float64) * 7 + np.arange(start, start + len(tokens)))
    pool = cache.device_pool
    pool.layers[:, 0, slots] = value.to(pool.layers.dtype)[None, :, None, None]


def serve(cache: HiRadixCache, requests: list[Request], write_kv: bool = False) -> LoopStats:
    """Run ``requests`` through ``cache`` as an engine would, one at a time."""
    stats = LoopStats()
    for req in requests:
        m = cache.match_prefix(req.prompt)
        lock = m.last_device_node
        prefix = m.device_indices
        if m.host_hit_length:
            loaded = cache.load_back(m.last_host_node)
            if loaded is not None:
                cache.wait_load(m.last_host_node)
                lock, prefix = m.last_host_node, torch.cat([prefix, loaded])
                stats.host_hit_tokens += len(loaded)
        cache.inc_lock_ref(lock)
        stats.device_hit_tokens += m.device_hit_length
        stats.prompt_tokens += len(req.prompt)
        stats.recomputed_tokens += len(req.prompt) - len(prefix)
        new = cache.alloc(len(req.finished) - len(prefix))
        if new is None:
            stats.failed_allocs += 1
        else:
            if write_kv:
                fill_kv(cache, new, req.finished[len(prefix) :], len(prefix))
            cache.insert(req.finished, torch.cat([prefix, new]))
        cache.dec_lock_ref(lock)
        cache.poll()
    return stats
