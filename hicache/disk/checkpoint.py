"""The slot index's checkpoint: what the store holds (per value: its slot, write sequence, key
and chain parent, least recently used first) in the first folder's ``index``, under a token
that its journal (``journal.py``) names. The store writes one at every open, clean close and
flush, and when its journal grew past its bound; the next open reads it and replays the
journal after it instead of scanning every slot's header. A checkpoint for another geometry
(slots, slot size, folders), one that does not parse, or one whose journal is missing or
follows another checkpoint, is ignored (the slots are scanned), never trusted in part. Values
read through a checkpointed index are still checked against their slot's header on every
read.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from typing import Any

from hicache.disk.folder import MAX_SEQ, read_file, replace_file

log = logging.getLogger("hicache.disk")

NAME = "index"
MAGIC = "hicache-disk-index/2"  # (/1: removed at open, no journal)
ENTRY_MAX = 2 * 6 * 1024 + 64  # bytes of one entry's line at most (two keys of MAX_KEY bytes,
# each escaped by JSON to at most 6 bytes a byte, and numbers)

Entry = tuple[int, int, str, str | None]  # (slot, seq, key, parent)


def write(
    folder: str, geometry: dict[str, Any], entries: Iterable[Entry], token: str, replaces: str
) -> int:
    """Write the checkpoint under ``token`` (replaced atomically, synced), saying that it
    holds every change of the journal after ``replaces`` (the checkpoint before it; "": none);
    its bytes. OSError."""
    size = 0

    def fill(fd: int) -> None:
        nonlocal size
        with os.fdopen(fd, "w", encoding="utf-8", closefd=False) as fh:
            head = {"magic": MAGIC, "journal": token, "replaces": replaces, **geometry}
            size += fh.write(json.dumps(head) + "\n")
            for entry in entries:
                size += fh.write(json.dumps(entry) + "\n")

    replace_file(folder, NAME, fill)
    return size


def read(
    folder: str, geometry: dict[str, Any], slots: int
) -> tuple[list[Entry], str, str, int] | None:
    """The checkpoint's entries, token, the token it replaces ("": none) and its size in
    bytes; None where there is none, it cannot be read, or it does not describe ``geometry``
    exactly (logged)."""
    path = os.path.join(folder, NAME)
    data = read_file(path, ENTRY_MAX * (slots + 1))  # (None: logged; the slots are scanned)
    if data is None:
        return None
    size = len(data)
    try:
        lines = data.decode().splitlines()
    except UnicodeDecodeError as exc:
        log.warning("disk: %s unusable (%s): the slots are scanned", path, exc)
        return None
    try:
        head = json.loads(lines[0]) if lines else None
        token = head.pop("journal", None) if isinstance(head, dict) else None
        replaces = head.pop("replaces", None) if isinstance(head, dict) else None
        tokens_ok = isinstance(token, str) and isinstance(replaces, str)
        if head != {"magic": MAGIC, **geometry} or not tokens_ok:
            log.warning("disk: %s is for another geometry or version: the slots are scanned",
                        path)  # fmt: skip
            return None
        entries = [_entry(json.loads(line), slots) for line in lines[1:]]
    except (ValueError, TypeError, RecursionError) as exc:
        log.warning("disk: %s does not parse (%s): the slots are scanned", path, exc)
        return None
    if len({e[0] for e in entries}) != len(entries) or len({e[2] for e in entries}) != len(entries):
        log.warning("disk: %s names a slot or a key twice: the slots are scanned", path)
        return None
    at = {e[2]: n for n, e in enumerate(entries)}
    if any(e[3] is not None and at.get(e[3], n + 1) <= n for n, e in enumerate(entries)):
        log.warning("disk: %s lists a parent before its child: the slots are scanned", path)
        return None  # (so a cycle is refused too)
    assert isinstance(token, str) and isinstance(replaces, str)  # (checked above)
    return entries, token, replaces, size


def _entry(item: Any, slots: int) -> Entry:
    slot, seq, key, parent = item
    ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (slot, seq))
    if not (ints and 0 <= slot < slots and 0 < seq <= MAX_SEQ):
        raise ValueError(f"a bad entry {item!r}")
    if not isinstance(key, str) or not (parent is None or isinstance(parent, str)):
        raise ValueError(f"a bad entry {item!r}")
    return slot, seq, key, parent
