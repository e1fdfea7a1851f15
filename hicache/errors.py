"""Exceptions of the core. Caller bugs raise these (or ValueError); exhaustion returns None."""

from __future__ import annotations


class HiCacheError(RuntimeError):
    """Base class: the cache refused an operation and changed nothing."""


class InvalidIndicesError(HiCacheError, ValueError):
    """Slots that are out of range, the padding slot, duplicated, not owned, or not page-shaped."""


class DoubleFreeError(InvalidIndicesError):
    """A slot or page freed twice."""


class InsufficientMemoryError(HiCacheError, MemoryError):
    """A pool does not fit in the memory this machine has available; nothing was allocated."""


class IntegrityError(AssertionError):
    """check_integrity() found a broken invariant: always a bug in hicache, never the caller's."""
