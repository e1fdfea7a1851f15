"""A naive reference model of the cache and the KV values tests write.

The model is a plain dict: namespace -> set of every page-aligned prefix ever inserted. KV values
depend on the whole prefix (as real attention KV does), so a slot that belongs to another prefix
holds a different value and a soundness check catches it.
"""

from __future__ import annotations

import numpy as np
import torch

HASH_MOD = 65536  # rolling prefix hash range; with the layer/kv offsets it stays exact in fp32


def prefix_hashes(tokens: np.ndarray) -> np.ndarray:
    """h[i] depends on tokens[: i + 1] only."""
    out = np.empty(len(tokens), dtype=np.int64)
    h = 17
    for i, t in enumerate(tokens.tolist()):
        h = (h * 131 + int(t) + 1) % HASH_MOD
        out[i] = h
    return out


def expected_kv(tokens: np.ndarray, num_kv: int, num_layers: int) -> torch.Tensor:
    """[num_kv, num_layers, len(tokens)] float32 values written for ``tokens``."""
    h = torch.from_numpy(prefix_hashes(tokens)).to(torch.float32)
    offsets = torch.arange(num_kv * num_layers, dtype=torch.float32).view(num_kv, num_layers, 1)
    return h.view(1, 1, -1) + offsets * HASH_MOD


def write_kv(pool, slots: torch.Tensor, tokens: np.ndarray, start: int, full: np.ndarray) -> None:
    """Write the values of ``full[start:start+len(slots)]`` (a whole sequence's prefix hashes)."""
    kv = expected_kv(full[: start + len(slots)], pool.layers.shape[0], pool.layers.shape[1])
    pool.layers[:, :, slots] = kv[:, :, start:, None, None].expand(
        -1, -1, -1, *pool.layers.shape[3:]
    )


def read_kv(pool, slots: torch.Tensor) -> torch.Tensor:
    return pool.layers[:, :, slots, 0, 0]


class ReferenceCache:
    def __init__(self, page_size: int):
        self.page_size = page_size
        self.prefixes: dict[object, set[tuple[int, ...]]] = {}

    def insert(self, tokens: np.ndarray, namespace: object = None) -> None:
        seen = self.prefixes.setdefault(namespace, set())
        ps = self.page_size
        for end in range(ps, len(tokens) // ps * ps + 1, ps):
            seen.add(tuple(tokens[:end].tolist()))

    def contains(self, prefix: np.ndarray, namespace: object = None) -> bool:
        return len(prefix) == 0 or tuple(prefix.tolist()) in self.prefixes.get(namespace, ())

    def longest(self, tokens: np.ndarray, namespace: object = None) -> int:
        ps, best = self.page_size, 0
        for end in range(ps, len(tokens) // ps * ps + 1, ps):
            if tuple(tokens[:end].tolist()) in self.prefixes.get(namespace, ()):
                best = end
            else:
                break
        return best
