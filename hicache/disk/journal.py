"""The slot index's journal: every change to the index since its checkpoint, so that a store
whose process died (SIGKILL, the OOM killer, a crash) finds its index again without a scan.

The store writes a checkpoint of its index (``checkpoint.py``) at every open, at a clean
close, after a flush and when the journal outgrew it, each under a fresh token (and naming the
one it replaces: a crash before the new journal was started leaves the old one, whose changes
the new checkpoint holds already), and starts an empty journal naming that token in its first
line. One line per change follows:

- ``["w", slot, seq, key, parent]``: ``key`` is held in ``slot`` (its write returned), the
  most recently used;
- ``["d", key]``: ``key`` is let go (evicted, dropped with its prefix, read back bad,
  removed) with everything held under it;
- ``["t", [key, ...]]``: a use of the keys, each with its prefix (``SlotStore._touch``).

The lines of one store call reach the file in one ``write`` as the call ends, after the drive
writes they describe returned: a process that dies leaves every line of every call that
returned (the kernel's page cache holds them). A power loss can lose what came after the last
``sync`` (the store syncs it with the slots). A reader takes the lines up to the first that
does not parse, is cut short or names a slot the files lack, and nothing after it (the store's
replay likewise stops at a record that does not fit its index); what any prefix of the journal
replays to keeps the index's rules (``SlotStore._replay``). Every value read through it is
still checked against its slot's header, so a line the drive lost is a miss, never another
page's KV. A journal longer than the store ever lets one grow (``bound``), or anything but a
regular file, is not read.

Not thread-safe: its store's thread only.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from hicache.disk.folder import MAX_SEQ, open_to_read, read_file, replace_file

log = logging.getLogger("hicache.disk")

NAME = "journal"
MAGIC = "hicache-disk-journal/1"
MAX_BYTES = 16 << 20  # a journal this long is folded into a new checkpoint (or twice that's)

Record = tuple[Any, ...]  # ("w", slot, seq, key, parent) | ("d", key) | ("t", [key, ...])


def bound(checkpoint_bytes: int) -> int:
    """What a journal after a checkpoint of ``checkpoint_bytes`` stays under: a call whose
    changes would take it there folds them into a new checkpoint instead of appending them."""
    return max(MAX_BYTES, 2 * checkpoint_bytes)


class Journal:
    def __init__(self, folder: str, token: str):
        """Start an empty journal after the checkpoint ``token`` names (it replaces any other,
        durably). OSError."""
        head = (json.dumps({"magic": MAGIC, "checkpoint": token}) + "\n").encode()
        replace_file(folder, NAME, lambda fd: os.write(fd, head))
        self.path = os.path.join(folder, NAME)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
        self.bytes = len(head)  # the file's length
        self._lines: list[str] = []  # records not taken yet

    def add(self, record: Record) -> None:
        """Note one change (its line is the next ``take``'s)."""
        self._lines.append(json.dumps(record, separators=(",", ":")))

    def take(self) -> bytes:
        """The lines of the changes noted since the last ``take``, forgotten here."""
        if not self._lines:
            return b""
        data = ("\n".join(self._lines) + "\n").encode()
        self._lines.clear()
        return data

    def append(self, data: bytes) -> None:
        """Append ``data`` (``take``'s) in one write. OSError (the file then ends where the
        drive stopped: a reader stops at the cut line)."""
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view) :]
        self.bytes += len(data)

    def sync(self) -> None:
        """Make what was flushed durable against a power loss. OSError."""
        os.fdatasync(self._fd)

    def close(self) -> None:
        """Close the file (what was not flushed is not written); idempotent."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def follows(folder: str) -> str | None:
    """The token of the checkpoint the folder's journal follows (None: no journal, or none
    readable)."""
    try:
        fd = open_to_read(os.path.join(folder, NAME))
    except OSError:
        return None
    try:
        head = json.loads(os.read(fd, 256).split(b"\n", 1)[0])
    except (OSError, ValueError, RecursionError):
        return None
    finally:
        os.close(fd)
    ok = isinstance(head, dict) and head.get("magic") == MAGIC
    token = head.get("checkpoint") if ok else None
    return token if isinstance(token, str) else None


def read(folder: str, token: str, slots: int, checkpoint_bytes: int) -> list[Record] | None:
    """The records of the journal after the checkpoint ``token`` names, up to the first line
    that is not a whole record for ``slots`` slots (logged); None where there is no journal,
    it cannot be read, it follows another checkpoint, or it is longer than the store ever
    lets one grow after a checkpoint of ``checkpoint_bytes`` (``bound``)."""
    path = os.path.join(folder, NAME)
    data = read_file(path, bound(checkpoint_bytes) - 1)
    if data is None:
        return None
    lines = data.split(b"\n")
    try:
        head = json.loads(lines[0])
    except (ValueError, RecursionError):
        head = None
    if head != {"magic": MAGIC, "checkpoint": token}:
        return None  # (the caller says what it does instead)
    out: list[Record] = []
    whole = lines[1:-1]  # (the last piece has no newline: empty, or cut short)
    for n, line in enumerate(whole):
        try:
            out.append(_record(json.loads(line), slots))
        except (ValueError, TypeError, UnicodeDecodeError, RecursionError):
            log.warning("disk: %s: line %d of %d is not a record: the rest is not used", path,
                        n + 2, len(whole) + 1)  # fmt: skip
            break
    return out


def _record(item: Any, slots: int) -> Record:
    def key(value: Any) -> str:
        if not isinstance(value, str):
            raise ValueError(f"a bad key {value!r}")
        return value

    if not isinstance(item, list) or not item:
        raise ValueError(f"a bad record {item!r}")
    kind = item[0]
    if kind == "w" and len(item) == 5:
        _, slot, seq, k, parent = item
        ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (slot, seq))
        if not (ints and 0 <= slot < slots and 0 < seq <= MAX_SEQ):
            raise ValueError(f"a bad record {item!r}")
        return ("w", slot, seq, key(k), None if parent is None else key(parent))
    if kind == "d" and len(item) == 2:
        return ("d", key(item[1]))
    if kind == "t" and len(item) == 2 and isinstance(item[1], list):
        return ("t", [key(k) for k in item[1]])
    raise ValueError(f"a bad record {item!r}")
