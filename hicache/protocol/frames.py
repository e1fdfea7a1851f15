"""Array frames: token ids (int32) and slots or page ids (int64), little-endian, never inside
msgpack; a batch's token frame cut into its sequences (shared heads expanded block by block)."""

from __future__ import annotations

import operator
from collections.abc import Iterator
from typing import Any

import numpy as np

from hicache.protocol.header import (
    MAX_BATCH,
    MAX_FRAME_BYTES,
    MAX_MATCH_TOKENS,
    ErrorCode,
    ProtocolError,
)

_TOKEN = np.dtype("<i4")
_SLOT = np.dtype("<i8")


def array_frame(values: Any, dtype: np.dtype) -> memoryview:
    """A contiguous little-endian buffer of ``values`` (zero-copy when already so)."""
    if hasattr(values, "numpy"):  # a CPU torch tensor: its own memory, not __array__
        values = values.detach().numpy()
    arr = np.ascontiguousarray(values, dtype=dtype)
    # (numpy's stubs give ndarray __buffer__ on Python 3.12+ only: it has one on 3.11 too)
    return memoryview(arr).cast("B")  # type: ignore[arg-type]


def tokens_frame(token_ids: Any) -> memoryview:
    return array_frame(token_ids, _TOKEN)


def slots_frame(slots: Any) -> memoryview:
    return array_frame(slots, _SLOT)


def _decode_array(frame: bytes | memoryview, dtype: np.dtype, what: str) -> np.ndarray:
    size = len(frame)
    if size > MAX_FRAME_BYTES:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"{what} frame of {size} bytes")
    if size % dtype.itemsize:
        raise ProtocolError(
            ErrorCode.BAD_FIELD, f"{what} frame of {size} bytes is not whole {dtype.name} values"
        )
    return np.frombuffer(frame, dtype=dtype)


def decode_tokens(frame: bytes | memoryview) -> np.ndarray:
    """Token ids (read-only int32 view of the frame; keep the frame alive while in use)."""
    return _decode_array(frame, _TOKEN, "token ids")


def split(values: np.ndarray, lengths: Any, what: str) -> list[np.ndarray]:
    """Cut a concatenated array into sequences of ``lengths`` (a msgpack list of ints)."""
    if (
        type(lengths) is list
        and len(lengths) == 1
        and type(lengths[0]) is int
        and lengths[0] == len(values)
    ):
        return [values]  # the common single sequence, without numpy's split machinery
    if (
        not isinstance(lengths, list)
        or len(lengths) > MAX_BATCH
        or not all(type(n) is int and n >= 0 for n in lengths)
        or sum(lengths) != len(values)
    ):
        raise ProtocolError(ErrorCode.BAD_FIELD, f"lengths: must be ints summing to the {what}")
    out, pos = [], 0
    for n in lengths:  # plain slices: np.split costs ~3 us per piece
        out.append(values[pos : pos + n])
        pos += n
    return out


def split_tokens(frame: bytes | memoryview, lengths: Any, shared: Any = None) -> list[bytes]:
    """Cut a token frame into per-sequence int32 LE byte strings (the tree's key form), with no
    numpy on the way: the match path keys the tree with these bytes directly.

    ``shared[i]`` (optional) tokens of sequence i are the first ones of sequence i - 1 and are
    not in the frame: a batch whose prompts share a system prompt sends it once.
    """
    return list(token_batch(frame, lengths, shared))


class TokenBatch:
    """The sequences of a checked token frame, expanded a block at a time as they are read
    (1024 prompts sharing a 16k-token prefix are 64 MiB of keys at once, 30 ms of copying
    before the first match). ``lengths``: each sequence's token count."""

    BLOCK_BYTES = 256 << 10  # keys expanded at once (a block holds at least one sequence)

    def __init__(self, frame: bytes | memoryview, lengths: list[int], shared: list[int]):
        self.frame = frame
        self.lengths = lengths
        self.shared = shared

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self) -> Iterator[bytes]:
        from hicache.tree import unpack_shared  # the schema alone imports no torch

        frame, lengths, shared = self.frame, self.lengths, self.shared
        i, n, pos, prev = 0, len(lengths), 0, b""
        while i < n:
            j, size = i + 1, 4 * lengths[i]
            while j < n and size < self.BLOCK_BYTES:
                size += 4 * lengths[j]
                j += 1
            take = 4 * (sum(lengths[i:j]) - sum(shared[i:j]))
            part = frame[pos : pos + take]
            # the block's first sequence brings what it shares with the previous one along
            head = prev[: 4 * shared[i]]
            keys = unpack_shared(head + part if head else part, lengths[i:j],
                                 [0, *shared[i + 1 : j]])  # fmt: skip
            pos, prev, i = pos + take, keys[-1], j
            yield from keys


def token_batch(frame: bytes | memoryview, lengths: Any, shared: Any = None) -> TokenBatch | list:
    """``split_tokens``, checked at once and expanded as it is read (a TokenBatch; a lone
    sequence that is the whole frame: a list of its key)."""
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"token ids frame of {len(frame)} bytes")
    if shared is None and type(lengths) is list and len(lengths) == 1:
        if type(lengths[0]) is int and lengths[0] * 4 == len(frame):  # the frame is its key
            return [frame if type(frame) is bytes else bytes(frame)]
    shared = _check_shared(lengths, shared)
    if sum(lengths) > MAX_MATCH_TOKENS:  # checked before anything is built
        raise ProtocolError(
            ErrorCode.TOO_LARGE,
            f"a match of {sum(lengths)} tokens (shared prefixes expanded); the limit is "
            f"{MAX_MATCH_TOKENS}",
        )
    if sum(lengths) - sum(shared) != len(frame) // 4 or len(frame) % 4:
        raise ProtocolError(ErrorCode.BAD_FIELD, "lengths: must be ints summing to the token ids")
    return TokenBatch(frame, lengths, shared)


_INTS = {int}  # (bool is not one)


def _check_shared(lengths: Any, shared: Any) -> list[int]:
    if (
        not isinstance(lengths, list)
        or len(lengths) > MAX_BATCH
        or not set(map(type, lengths)) <= _INTS  # (C loops: a batch has up to 1024 entries)
        or min(lengths, default=0) < 0
    ):
        raise ProtocolError(ErrorCode.BAD_FIELD, "lengths: must be a list of ints >= 0")
    if shared is None:
        return [0] * len(lengths)
    if not isinstance(shared, list) or len(shared) != len(lengths):
        raise ProtocolError(ErrorCode.BAD_FIELD, "shared: must be a list as long as lengths")
    # whole-list checks (a batch has up to MAX_BATCH entries): each at most what its sequence
    # and the previous one hold, none before the first sequence
    if (
        not set(map(type, shared)) <= _INTS
        or (shared and shared[0] != 0)
        or min(shared, default=0) < 0
        or any(map(operator.gt, shared, lengths))
        or any(map(operator.gt, shared[1:], lengths))
    ):
        raise ProtocolError(
            ErrorCode.BAD_FIELD, "shared: ints, 0 first, each at most its and the previous length"
        )
    return shared


def decode_pages(frame: bytes | memoryview) -> np.ndarray:
    """Page ids (read-only int64 view of the frame)."""
    return _decode_array(frame, _SLOT, "page ids")


def decode_slots(frame: bytes | memoryview) -> np.ndarray:
    """Slot indices (read-only int64 view of the frame)."""
    return _decode_array(frame, _SLOT, "slot indices")
