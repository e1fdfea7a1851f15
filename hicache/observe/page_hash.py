"""Page hashes for the capacity estimator: a 64-bit name per full page of a prompt, chained
over every earlier page and a namespace seed, computed for all pages at once (numpy).

Not store keys (``hicache.l3.keys`` has the cryptographic ones): cheap estimator keys, equal
for equal prefixes. Pure; the module's caches of powers and per-position multipliers only
grow (replaced whole, safe to read from any thread).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

__all__ = ["chain_seed", "page_hashes"]

_U64 = (1 << 64) - 1

_GOLDEN = 0x9E3779B97F4A7C15  # odd: the chain's multiplier B
_GOLDEN_INV = pow(_GOLDEN, -1, 1 << 64)
_powers: tuple[np.ndarray, np.ndarray] = (np.ones(1, np.uint64), np.ones(1, np.uint64))
_columns: dict[int, np.ndarray] = {}  # page_size -> the per-position multipliers K


# 0-d arrays, not numpy scalars: numpy applies them to an array faster
_S30, _S27, _S31 = (np.array(v, np.uint64) for v in (30, 27, 31))
_M1, _M2 = (np.array(v, np.uint64) for v in (0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on a uint64 array (a bijection; every output bit depends on all
    input bits). Returns a new array."""
    x = x ^ (x >> _S30)
    x *= _M1
    x ^= x >> _S27
    x *= _M2
    x ^= x >> _S31
    return x


def _chain_powers(n: int) -> tuple[np.ndarray, np.ndarray]:
    """B**i and B**-i mod 2**64 for i < n (a module cache that only grows, replaced whole)."""
    global _powers
    if len(_powers[0]) < n:
        size = max(n, 2 * len(_powers[0]))
        pos = np.full(size, _GOLDEN, np.uint64)
        neg = np.full(size, _GOLDEN_INV, np.uint64)
        pos[0] = neg[0] = 1
        _powers = (np.cumprod(pos, dtype=np.uint64), np.cumprod(neg, dtype=np.uint64))
    return _powers


def _column_keys(page_size: int) -> np.ndarray:
    """The odd multiplier of each token position within a page (fixed, derived by _mix)."""
    keys = _columns.get(page_size)
    if keys is None:
        keys = _mix(np.arange(1, page_size + 1, dtype=np.uint64) * np.uint64(_GOLDEN))
        keys |= np.uint64(1)
        _columns[page_size] = keys
    return keys


def chain_seed(seed: bytes) -> int:
    """The chain's starting state for a namespace ``seed`` (blake2b, 64 bits)."""
    digest = hashlib.blake2b(b"hicache.observe.capacity\0" + seed, digest_size=8).digest()
    return int.from_bytes(digest, "little")


def page_hashes(
    tokens: np.ndarray | Sequence[int], page_size: int, seed: bytes = b""
) -> np.ndarray:
    """64-bit names of the full pages of ``tokens`` (uint64, one per full page, prefix order).

    ``page_i = mix(sum_c K_c * token_{i,c})`` (tokens as 32-bit values, ``K_c = mix((c + 1) *
    B) | 1``), ``state_i = B * state_{i-1} + page_i`` from ``state_-1 = chain_seed(seed)``,
    ``key_i = mix(state_i)``, all mod 2**64 (``mix``: splitmix64's finalizer; ``B``: the odd
    0x9E3779B97F4A7C15). A key names the page's tokens, every token before them and the
    namespace, and ``page_hashes(t[:k * page_size])`` is a prefix of ``page_hashes(t)``. The
    chain is a linear recurrence, so it is computed for all pages at once with a prefix sum.
    These are estimator keys, not store keys: not cryptographic (``hicache.l3.keys`` has
    those), but cheap (about 20 us for 2,000 tokens). Pure.
    """
    if isinstance(page_size, bool) or not isinstance(page_size, int | np.integer):
        raise ValueError(f"page_size must be an int, got {page_size!r}")
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    arr = np.asarray(tokens)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError(f"tokens must be a 1-D integer array, got {arr.dtype} {arr.shape}")
    n = len(arr) // page_size
    if n == 0:
        return np.empty(0, np.uint64)
    pages = arr[: n * page_size].astype(np.uint32).astype(np.uint64).reshape(n, page_size)
    per_page = _mix(pages @ _column_keys(page_size))
    pos, neg = _chain_powers(n)
    start = np.array([chain_seed(seed) * _GOLDEN & _U64], np.uint64)
    state = pos[:n] * (start + np.cumsum(per_page * neg[:n], dtype=np.uint64))
    return _mix(state)
