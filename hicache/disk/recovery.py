"""recover: what a disk tier's slots hold when it opens, and in which order of use.

From the checkpoint (``checkpoint.py``: the index as it was, in its order of use) and the
journal of every change after it (``journal.py``), or else, where either is missing or does
not fit, from a scan of the slots' headers until ``scan_s`` is spent (the slots not read in
time are free). Either way a slot written at or below the folders' ``floor`` (a flush) is
free, and a key claimed by two slots keeps the newer. A scan has no order of use: a key counts
as recent as the newest write under it (its own or a descendant's), so that every parent comes
after its children, as ``SlotStore`` keeps them.

Reads the files; changes nothing. The caller (``SlotStore``) builds its index from the result,
replays the journal's records over it, drops what is held without its prefix, and writes a
new checkpoint and journal before its first change.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from hicache.disk import checkpoint, journal
from hicache.disk.folder import MAX_SEQ, Folder, read_floor
from hicache.disk.slots import SlotFiles

log = logging.getLogger("hicache.disk")


@dataclass
class Recovered:
    held: list[tuple[str, int, str | None]] = field(default_factory=list)  # (key, slot,
    # parent), least recently used first
    free: list[int] = field(default_factory=list)  # slots holding nothing to keep
    seq: int = 0  # the newest write sequence seen (the next write comes after it)
    scanned: int = 0  # slots whose headers were read (0: from the checkpoint)
    read_errors: int = 0  # headers the drive failed to read (their slots: free)
    from_checkpoint: bool = False  # (and its journal)
    records: list[journal.Record] = field(default_factory=list)  # the journal's, to replay
    # over ``held`` (writes at or below the floor left out)


def recover(
    files: SlotFiles, folders: list[Folder], geometry: dict[str, Any], scan_s: float
) -> Recovered:
    """What ``files`` hold (see the module's docstring)."""
    started = time.monotonic()
    floor = max(read_floor(f.path) for f in folders)  # (slots at or below: flushed)
    out = Recovered(seq=floor)
    found_checkpoint = checkpoint.read(folders[0].path, geometry, files.count)
    records = None
    if found_checkpoint is not None:
        _, token, replaces, size = found_checkpoint
        records = journal.read(folders[0].path, token, files.count, size)
        if records is None and replaces and journal.follows(folders[0].path) == replaces:
            records = []  # (stopped between the two: the checkpoint holds all of it)
        if records is None:
            log.warning("disk: the checkpoint has no journal after it (none, or one after "
                        "another checkpoint): the slots are scanned")  # fmt: skip
    if found_checkpoint is not None and records is not None:
        entries = found_checkpoint[0]
        out.from_checkpoint = True
        for record in records:
            if record[0] == "w":
                out.seq = max(out.seq, record[2])
                if record[2] <= floor:
                    continue  # (flushed since)
            out.records.append(record)
        taken = set()
        for slot, seq, key, parent in entries:  # (least recent first, as closed)
            out.seq = max(out.seq, seq)
            if seq > floor:
                out.held.append((key, slot, parent))
                taken.add(slot)
        out.free = [s for s in range(files.count) if s not in taken]
        return out
    found: dict[str, tuple[int, int, str | None]] = {}  # key -> (seq, slot, parent)
    slot = 0
    while slot < files.count and time.monotonic() - started < scan_s:
        try:
            header = files.read_header(slot)
        except OSError as exc:
            out.read_errors += 1
            log.warning("disk: slot %d unreadable at start (%s): free", slot, str(exc))
            header = None
        if header is not None and header.seq > MAX_SEQ:
            header = None  # (no write of the store's: not taken, it would stop every write)
        if header is not None:
            out.seq = max(out.seq, header.seq)  # (new writes come after every one)
        if header is not None and header.value_len <= files.value_bytes and header.seq > floor:
            held = found.get(header.key)
            if held is None or held[0] < header.seq:
                if held is not None:
                    out.free.append(held[1])
                found[header.key] = (header.seq, slot, header.parent)
            else:
                out.free.append(slot)
        else:
            out.free.append(slot)
        slot += 1
    out.scanned = slot
    out.free.extend(range(slot, files.count))
    for key in recency_order({k: (seq, parent) for k, (seq, _, parent) in found.items()}):
        _, where, parent = found[key]
        out.held.append((key, where, parent))
    if slot < files.count:
        log.warning(
            "disk: %d of %d slots scanned in %.1f s; the rest are taken as free",
            slot, files.count, time.monotonic() - started,
        )  # fmt: skip
    return out


def recency_order(found: dict[str, tuple[int, str | None]]) -> list[str]:
    """Keys found at start (key -> (seq, parent)), least recent first, each parent after its
    children: a key is as recent as the newest write under it (its own or a descendant's)."""
    depth: dict[str, int] = {}
    for key in found:
        path: list[str] = []
        at: str | None = key
        while at is not None and at in found and at not in depth and at not in path:
            path.append(at)
            at = found[at][1]
        base = depth.get(at, -1) if at is not None else -1  # (a cycle: from its start)
        for n, k in enumerate(reversed(path)):
            depth[k] = base + 1 + n
    newest = {key: seq for key, (seq, _) in found.items()}
    for key in sorted(found, key=depth.__getitem__, reverse=True):
        parent = found[key][1]
        if parent is not None and parent in newest and depth[parent] < depth[key]:
            newest[parent] = max(newest[parent], newest[key])
    return sorted(found, key=lambda k: (newest[k], -depth[k]))
