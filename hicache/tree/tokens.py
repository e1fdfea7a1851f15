"""Validation of caller input: token ids and slot indices. Raises before anything changes."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from hicache.errors import InvalidIndicesError
from hicache.memory import as_int64
from hicache.tree.fastpath import min_token

INT32_MAX = 2**31 - 1
_INT32 = np.dtype(np.int32)  # numpy caches builtin dtypes: an identity test is enough

TokenIds = Sequence[int] | np.ndarray | torch.Tensor


def as_tokens(token_ids: TokenIds) -> np.ndarray:
    """Token ids as a contiguous 1-D int32 array (zero-copy for int32 arrays).

    Raises ValueError for floats, bools, nested or ragged input, negative ids and ids that do
    not fit int32.
    """
    if type(token_ids) is np.ndarray and token_ids.dtype is _INT32 and token_ids.ndim == 1:
        if token_ids.flags.c_contiguous:  # the wire format: validate and use as it is
            lowest = min_token(token_ids)
            if lowest < 0:
                raise ValueError(f"token_ids: negative id {lowest}")
            return token_ids
        arr = token_ids
    elif isinstance(token_ids, np.ndarray) and token_ids.dtype == np.int32:
        arr = token_ids
    elif isinstance(token_ids, torch.Tensor):
        if token_ids.dtype.is_floating_point or token_ids.dtype in (torch.bool, torch.complex64):
            raise ValueError(f"token_ids: expected integers, got {token_ids.dtype}")
        arr = token_ids.detach().to("cpu").numpy()
    else:
        try:
            arr = np.asarray(token_ids)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"token_ids: not an array of integers ({exc})") from None
    if arr.ndim != 1:
        raise ValueError(f"token_ids: expected a 1-D sequence, got {arr.ndim} dimensions")
    if arr.size == 0:
        return np.empty(0, dtype=np.int32)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"token_ids: expected integers, got {arr.dtype}")
    if arr.dtype != np.int32:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi > INT32_MAX:
            raise ValueError(f"token_ids: id {lo if lo < 0 else hi} outside [0, {INT32_MAX}]")
        arr = arr.astype(np.int32)
    elif int(arr.min()) < 0:
        raise ValueError(f"token_ids: negative id {int(arr.min())}")
    return np.ascontiguousarray(arr)


def check_token_bytes(key: bytes | memoryview) -> None:
    """Raise ValueError unless ``key`` is whole int32 ids, none negative (the wire form)."""
    if len(key) % 4:
        raise ValueError(f"token_ids: {len(key)} bytes are not whole int32 ids")
    lowest = min_token(key)
    if lowest < 0:
        raise ValueError(f"token_ids: negative id {lowest}")


def as_slots(indices: object, name: str = "device_indices") -> np.ndarray:
    """Slot indices as a 1-D int64 array; raises InvalidIndicesError for anything else."""
    if indices is None:
        raise InvalidIndicesError(f"{name}: missing")
    return as_int64(indices, name)  # type: ignore[arg-type]  # anything: it raises for the rest
