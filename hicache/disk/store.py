"""SlotStore: whole values under string keys in a disk tier's slots, kept across restarts.

Open: each folder is made private or checked and locked (``folder.py``), its data file
preallocated to its share of ``capacity_bytes``; then the index is read from its checkpoint
and the journal of every change after it (``index_log.py``, which writes them: a clean close,
a SIGKILL or any crash of the process alike), or else the slots' headers are scanned, within
``scan_s``, to find what the files hold (a slot not scanned in time, or whose header does not
verify, is free). A key claimed by two slots keeps the newer. A new checkpoint and an empty
journal are written before the first change. What follows:

- ``put``: a value goes to a free slot, or to the least recently used one's (a full tier
  evicts; it never refuses a write an eviction serves); a key already held is not written
  again; past the write budget (``budget.py``) a put is refused and counted; a drive error is
  a refused put (``ENOSPC``: space taken by others), counted, never raised.
- Prefixes: a value may name its chain parent (the page before it in its prompt). It is held
  only with its parent (held already, or written in the same batch before it): otherwise, or
  when the parent's write failed, it is refused and counted, so what the tier holds of a
  prompt is always its first pages. Recency keeps every parent more recent than its children
  (a use of a value is a use of its prefix), so the least recently used value, the one
  eviction takes, is always a leaf: a prefix never leaves before its tail. A value that goes
  otherwise (its slot read back torn or overwritten, ``remove``, or not found at a restart)
  takes everything held under it along.
- ``get``: the slot is read whole and its header must name the key (else a miss, and the
  slot is freed); the value is copied out with the header's trailer, which the caller
  verifies (a torn or flipped value never verifies). A drive error is a miss.
- Durability: a value is on the drive once ``put`` returns (direct I/O) and survives a crash
  of the process; against a power loss, once ``sync`` ran (``sync_s`` after the first unsynced
  write: at the next put or ``tick``, which the owner calls when idle, and at ``close``): what
  a power loss can lose is about the last ``sync_s`` of writes, seen as misses. Every call
  that changes the index appends its changes to the journal as it ends (a line the drive lost
  is at worst a miss: reads verify); a call whose changes would take the journal past
  ``journal.MAX_BYTES`` (and twice the checkpoint) writes a new checkpoint instead.
  Each sync also saves the write budget's record in the first folder, so a restart counts
  what the folder wrote in the last day (a crash forgets the writes since the last sync).

Not thread-safe: one thread calls it at a time (the third tier's IO thread); a batch
(``put_many``, ``get_many``) runs its I/Os on ``io_threads`` threads at once, each through
its own bounce buffer, and keeps the index on the caller's thread. ``figures`` reads plain
fields and may be called from another.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from hicache.disk import journal
from hicache.disk.budget import WriteBudget
from hicache.disk.folder import (
    ALIGN,
    MAX_FLOOR,
    Folder,
    open_data,
    open_folder,
    read_floor,
    read_note,
    remove_stale_temporaries,
    write_floor,
    write_note,
)
from hicache.disk.index_log import Entry, IndexLog
from hicache.disk.recovery import recover
from hicache.disk.slots import MAX_KEY, TRAILER_BYTES, Fault, Header, SlotFiles, as_bytes

log = logging.getLogger("hicache.disk")
T = TypeVar("T")
R = TypeVar("R")
DATA_NAME = "slots.dat"
BUDGET_NAME = "budget"  # the write budget's record, in the first folder
CLEAR_GAP = 1 << 32  # a clear's floor is this far above the last write's sequence


class SlotStore:
    def __init__(
        self,
        paths: Sequence[str],
        capacity_bytes: int,
        value_bytes: int,
        budget_bytes_per_day: int | None = None,
        scan_s: float = 30.0,
        sync_s: float = 5.0,
        fault: Fault | None = None,
        io_threads: int = 4,
    ):
        """``paths``: one folder per drive; ``capacity_bytes``: slots' bytes over all of
        them; ``value_bytes``: the largest value (a page and nothing else); the budget
        defaults to one drive-write of ``capacity_bytes`` a day. FolderRefused, ValueError or
        OSError (nothing is left open then)."""
        if not paths:
            raise ValueError("disk: no folder")
        if value_bytes <= 0:
            raise ValueError("disk: a value of at least one byte")
        slot_bytes = ALIGN + -(-value_bytes // ALIGN) * ALIGN
        per_file = capacity_bytes // len(paths) // slot_bytes
        if per_file < 1:
            raise ValueError(
                f"disk: {capacity_bytes} bytes hold no slot of {slot_bytes} bytes per folder"
            )
        self.folders: list[Folder] = []
        fds: list[int] = []
        try:
            for path in paths:
                folder = open_folder(path)
                self.folders.append(folder)
                fd, direct = open_data(os.path.join(folder.path, DATA_NAME), per_file * slot_bytes)
                fds.append(fd)
                self.direct = direct
            for folder in self.folders:  # (ours, locked: a crash's temporary files go)
                remove_stale_temporaries(folder.path)
            self._start(fds, per_file * len(paths), value_bytes, capacity_bytes,
                        budget_bytes_per_day, scan_s, sync_s, fault, io_threads)  # fmt: skip
        except BaseException:
            pool = getattr(self, "_pool", None)
            if pool is not None:
                pool.shutdown(wait=True)
            for fd in fds:
                os.close(fd)
            for folder in self.folders:
                folder.close()
            self.folders = []
            raise

    def _start(
        self,
        fds: list[int],
        count: int,
        value_bytes: int,
        capacity_bytes: int,
        budget_bytes_per_day: int | None,
        scan_s: float,
        sync_s: float,
        fault: Fault | None,
        io_threads: int,
    ) -> None:
        self.files = SlotFiles(fds, value_bytes, count, fault)
        self.budget = WriteBudget(
            capacity_bytes if budget_bytes_per_day is None else budget_bytes_per_day
        )
        record = read_note(self.folders[0].path, BUDGET_NAME)
        if record is not None:  # (what this folder wrote in the last day, before this process)
            try:
                self.budget.load(record)
            except ValueError as exc:
                log.warning("%s: ignored", exc)
        self.sync_s = sync_s
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="hicache-disk")
        self.io_threads = io_threads
        # key -> slot, least recent first; a held parent is always after its held children
        self._index: OrderedDict[str, int] = OrderedDict()
        self._parent: dict[str, str | None] = {}  # held key -> its chain parent's key
        self._kids: dict[str, set[str]] = {}  # held key -> its held children (if any)
        self._free: list[int] = []
        self._dropped: list[str] | None = None  # keys let go since take_dropped() (tracked)
        self._seq = 0
        self._dirty_since: float | None = None
        # figures (read by other threads)
        self.hits = self.misses = 0
        self.written = self.written_bytes = self.read_bytes = 0
        self.evicted = 0
        self.read_errors = self.write_errors = self.refused_space = 0
        self.bad_slots = 0  # slots read back that did not hold their key
        self.refused_no_prefix = 0  # puts refused: their chain parent is not held
        self.refused_no_room = 0  # puts refused: only the batch's own prefixes to evict
        self.cleared = 0  # values forgotten by clear (an operator's flush)
        self.scanned = self.recovered = 0
        self.replayed = 0  # journal records replayed over the checkpoint at the open
        self.scan_seconds = 0.0
        self.from_checkpoint = False  # the index came from the checkpoint and its journal
        self._geometry = {
            "slots": self.files.count,
            "slot_bytes": self.files.slot_bytes,
            "value_bytes": value_bytes,
            "folders": [os.path.realpath(f.path) for f in self.folders],
        }
        # the index's checkpoint and journal (not journaling until the first checkpoint)
        self._log = IndexLog(self.folders[0].path, self._geometry)
        self._recover(scan_s)

    # ---- what the drive holds ---------------------------------------------------------------
    def _recover(self, scan_s: float) -> None:
        """The index from what the slots hold (``recovery.py``: the checkpoint, or a scan)."""
        started = time.monotonic()
        found = recover(self.files, self.folders, self._geometry, scan_s)
        for key, slot, parent in found.held:
            self._index[key] = slot
            self._link(key, parent)
        self._free = found.free
        self._seq = found.seq
        self.scanned, self.from_checkpoint = found.scanned, found.from_checkpoint
        self.read_errors += found.read_errors
        self._replay(found.records)
        self._settle_recovered(started)
        # (the index now holds whatever the journal on the drive says, or what a scan found)
        self._log.checkpoint(self._entries())

    def _replay(self, records: list[journal.Record]) -> None:
        """The journal's changes over the checkpoint's index, as the store made them, up to
        one that does not fit it (a key held already, a slot still held by another, a parent
        not held): the rest is not used. A run of writes is also a use of its keys as the run
        ends (each parent after its children, whatever record comes next: a journal cut
        inside a batch leaves the order the rules want, and the batch's closing use gives the
        order the store had; once per run, as the store does once per batch, so a long chain
        costs its length, not its square).
        The free slots are those held by nothing after."""
        by_slot = {slot: key for key, slot in self._index.items()}  # (last written there)
        done = 0
        run: list[str] = []  # the keys of the writes since the last other record
        for record in records:
            if record[0] != "w" and run:
                self._touch(run)
                run = []
            if record[0] == "w":
                _, slot, seq, key, parent = record
                holder = by_slot.get(slot)
                if (
                    key in self._index
                    or (holder is not None and self._index.get(holder) == slot)
                    or (parent is not None and parent not in self._index)
                ):
                    log.warning("disk: the journal's record %d does not fit the index: the "
                                "rest is not used", done + 1)  # fmt: skip
                    break
                self._index[key] = slot
                by_slot[slot] = key
                self._link(key, parent)
                run.append(key)
                self._seq = max(self._seq, seq)
            elif record[0] == "d":
                self._drop(record[1])
            else:
                self._touch(record[1])
            done += 1
        self._touch(run)
        self.replayed = done
        if records:
            taken = set(self._index.values())
            self._free = [s for s in range(self.files.count) if s not in taken]

    def _settle_recovered(self, started: float) -> None:
        """What was found, held only with its prefix; the figures of the start."""
        lost = [k for k, p in self._parent.items() if p is not None and p not in self._index]
        before = len(self._index)
        for key in lost:  # (its parent's slot was torn or overwritten: never a tail alone)
            self._drop(key)
        if lost:
            log.warning("disk: %d pages whose prefix is gone are free", before - len(self._index))
        self.recovered = len(self._index)
        self.scan_seconds = time.monotonic() - started
        self._free.reverse()  # (pop() takes the lowest slots first)

    # ---- calls -------------------------------------------------------------------------------
    def exists(self, keys: Sequence[str]) -> list[bool]:
        return [key in self._index for key in keys]

    def held(self) -> list[str]:
        """The keys held, least recently used first."""
        return list(self._index)

    def parent(self, key: str) -> str | None:
        """The chain parent ``key`` was written after (None: a first page, or not held)."""
        return self._parent.get(key)

    def put(
        self,
        key: str,
        parts: list[memoryview] | list[bytes],
        trailer: bytes,
        parent: str | None = None,
    ) -> bool:
        """Store ``parts`` (the value) with ``trailer`` under ``key`` (after ``parent`` in its
        chain); True when it is held (already, or now)."""
        return self.put_many([(key, parts, trailer)], [parent])[0]

    def put_many(
        self,
        items: Sequence[tuple[str, Sequence[Any], bytes]],
        parents: Sequence[str | None] | None = None,
    ) -> list[bool]:
        """``put`` of each ``(key, parts, trailer)``, the writes at once, ``parents[i]`` the
        chain parent of item ``i`` (None, or no ``parents``: a prompt's first page).
        ValueError (nothing written) for a value larger than a slot, a bad trailer or a key
        too long."""
        parent_of = list(parents) if parents is not None else [None] * len(items)
        if len(parent_of) != len(items):
            raise ValueError("disk: one parent per item")
        items = [(key, [as_bytes(p) for p in parts], trailer) for key, parts, trailer in items]
        for (key, parts, trailer), parent in zip(items, parent_of, strict=True):
            if sum(len(p) for p in parts) > self.files.value_bytes or len(trailer) != TRAILER_BYTES:
                raise ValueError(f"disk: {key}: a value larger than a slot, or a bad trailer")
            if len(key.encode()) > MAX_KEY or len((parent or "").encode()) > MAX_KEY:
                raise ValueError(f"disk: a key longer than {MAX_KEY} bytes")
        out = [False] * len(items)
        # the batch's held prefixes become the most recent (and are never evicted for it)
        keep = self._touch([p for p in parent_of if p is not None] + [k for k, _, _ in items])
        jobs: list[tuple[int, int, Header]] = []  # (item, slot, header)
        taking: set[str] = set()
        for i, (key, parts, trailer) in enumerate(items):
            parent = parent_of[i]
            if key in self._index or key in taking:  # (twice in one batch: written once)
                out[i] = True
            elif parent is not None and parent not in self._index and parent not in taking:
                self.refused_no_prefix += 1
            elif self.budget.take(self.files.slot_bytes):
                slot = self._take_slot(keep)
                if slot is None:
                    self.budget.give_back(self.files.slot_bytes)
                    self.refused_no_room += 1
                    continue
                self._seq += 1
                size = sum(len(p) for p in parts)
                jobs.append((i, slot, Header(key, size, bytes(trailer), self._seq, parent)))
                taking.add(key)

        def write(job: tuple[int, int, Header]) -> OSError | None:
            i, slot, header = job
            try:
                self.files.write(slot, header, items[i][1])
            except OSError as exc:
                return exc
            return None

        written: list[str] = []
        for (i, slot, header), error in zip(jobs, self._map(write, jobs), strict=True):
            if error is None and (header.parent is None or header.parent in self._index):
                self._index[header.key] = slot
                self._link(header.key, header.parent)
                self._log.add(("w", slot, header.seq, header.key, header.parent))
                written.append(header.key)
                self.written += 1
                self.written_bytes += self.files.slot_bytes
                out[i] = True
                continue
            self._free.append(slot)  # (whatever it held before is gone: it was evicted)
            if error is None:  # written, but its parent's write failed: never held alone
                self.written_bytes += self.files.slot_bytes
                self.refused_no_prefix += 1
                continue
            self.budget.give_back(self.files.slot_bytes)
            if error.errno == errno.ENOSPC:
                self.refused_space += 1
            else:
                self.write_errors += 1
            log.warning("disk: a write failed (%s): skipped", str(error))
        self._touch(written)  # (each parent after its children again)
        for i, (key, _, _) in enumerate(items):  # (a duplicate is held if its first is)
            if key in taking and not out[i]:
                out[i] = key in self._index
        self._log.flush(self._entries())
        if jobs:
            self._maybe_sync()
        return out

    def get(self, key: str, into: list[memoryview]) -> bytes | None:
        """Copy ``key``'s value into ``into`` (views summing to its length) and return its
        trailer; None for a miss (``into`` is then left as it was or partly written)."""
        return self.get_many([(key, into)])[0]

    def get_many(self, items: Sequence[tuple[str, Sequence[memoryview]]]) -> list[bytes | None]:
        """``get`` of each ``(key, into)``, the reads at once (each ``into`` its own memory).
        ValueError where ``into`` is not contiguous memory, or not as long as the value held
        (which is kept)."""
        items = [(key, [as_bytes(v) for v in into]) for key, into in items]
        slots = [self._index.get(key) for key, _ in items]

        def read(i: int) -> bytes | OSError | None:
            key, into = items[i]
            slot = slots[i]
            assert slot is not None
            try:
                header = self.files.read_into(slot, key, into)
            except OSError as exc:
                return exc
            return None if header is None else header.trailer

        wanted = [i for i, slot in enumerate(slots) if slot is not None]
        out: list[bytes | None] = [None] * len(items)
        for i, got in zip(wanted, self._map(read, wanted), strict=True):
            key = items[i][0]
            if isinstance(got, OSError):
                self.read_errors += 1
                log.warning("disk: a read failed (%s): a miss", str(got))
            elif got is None:  # (overwritten or torn: the slot is free)
                self.bad_slots += 1
                self._drop(key)
            else:
                out[i] = got
                self.hits += 1
                self.read_bytes += self.files.slot_bytes
        self._touch([key for (key, _), got in zip(items, out, strict=True) if got is not None])
        self.misses += sum(1 for got in out if got is None)
        self._log.flush(self._entries())
        return out

    def remove(self, keys: Sequence[str]) -> None:
        """Forget ``keys`` and what is held under them (their slots are free; the bytes are
        overwritten when reused)."""
        for key in keys:
            self._drop(key)
        self._log.flush(self._entries())

    def evict(self, count: int) -> int:
        """Free the ``count`` least recently used values; how many were freed."""
        done = 0
        while done < count and self._index:
            key, slot = self._index.popitem(last=False)  # (a leaf: see _touch)
            self._unlink(key)
            if self._dropped is not None:
                self._dropped.append(key)
            self._log.add(("d", key))
            self._free.append(slot)
            done += 1
        self.evicted += done
        self._log.flush(self._entries())
        return done

    def track_drops(self) -> None:
        """Record every key let go from now on (evicted, or dropped with its prefix; not a
        clear), for ``take_dropped``, which the owner must then call after every call."""
        if self._dropped is None:
            self._dropped = []

    def take_dropped(self) -> list[str]:
        """The keys let go since the last call, in order (tracked: ``track_drops``)."""
        out, self._dropped = self._dropped or [], [] if self._dropped is not None else None
        return out

    def check(self) -> list[str]:
        """The index's invariants (messages of those broken): every slot held or free once,
        and every held parent more recent than its held children."""
        bad = []
        where = {key: at for at, key in enumerate(self._index)}
        for key, at in where.items():
            parent = self._parent.get(key, "?")
            if parent == "?":
                bad.append(f"disk: {key} has no parent entry")
            elif parent is not None and where.get(parent, at + 1) < at:
                bad.append(f"disk: {key}'s parent is less recent than it (evicted first)")
        slots = [*self._index.values(), *self._free]
        if sorted(slots) != list(range(self.files.count)):
            bad.append("disk: slots not each held or free exactly once")
        if set(self._parent) != set(self._index):
            bad.append("disk: parents kept for keys not held")
        kids: dict[str, set[str]] = {}
        for key, parent in self._parent.items():
            if parent is not None:
                kids.setdefault(parent, set()).add(key)
                if parent not in where:
                    bad.append(f"disk: {key} is held without its parent")
        if kids != self._kids:
            bad.append("disk: the children kept do not match the parents")
        return bad

    def clear(self) -> int:
        """Forget every value, now and after a restart (each folder's floor is raised to the
        last write's sequence, durably, before the index is emptied); how many were held.
        OSError (nothing forgotten) when a floor cannot be written: the floors raised before
        it are put back."""
        floor = self._seq + CLEAR_GAP  # (above any slot a scan cut short did not read)
        if floor > MAX_FLOOR:
            raise OSError(errno.ERANGE, "disk: the write sequence is spent; start it cold")
        raised: list[tuple[str, int]] = []  # (folder, its floor before)
        try:
            for folder in self.folders:
                before = read_floor(folder.path)
                write_floor(folder.path, floor)
                raised.append((folder.path, before))
        except OSError:
            for path, before in raised:
                try:
                    write_floor(path, before)
                except OSError as exc:  # (what it held is gone after a restart: new writes
                    self._seq = floor  # go above the floor, so that they are not)
                    log.error("disk: %s: its floor could not be put back (%s)", path, exc)
            raise
        self._seq = floor
        held = len(self._index)
        self._free.extend(self._index.values())
        self._index.clear()
        self._parent.clear()
        self._kids.clear()
        self.cleared += held
        self._log.checkpoint(self._entries())  # (empty: the journal described what is gone)
        return held

    def tick(self) -> None:
        """Housekeeping the owner calls when idle, at least every second or so (the third
        tier's IO thread does): a sync due ``sync_s`` after the first unsynced write; a journal
        that failed started again (``IndexLog.retry_due``)."""
        if self._dirty_since is not None and time.monotonic() - self._dirty_since >= self.sync_s:
            self.sync()
        if self._log.retry_due():
            self._log.checkpoint(self._entries())  # (the journal failed: tried again)

    def sync(self) -> None:
        """Make every write so far durable against a power loss (fdatasync), and save the
        write budget's record (what a later process counts)."""
        try:
            self.files.sync()
            self._log.sync()
            write_note(self.folders[0].path, BUDGET_NAME, self.budget.dump())
        except OSError as exc:
            log.warning("disk: fdatasync failed (%s)", str(exc))
        self._dirty_since = None

    def figures(self) -> dict[str, Any]:
        held = len(self._index)
        return {
            "disk_direct_io": self.direct,
            "disk_slots": self.files.count,
            "disk_slot_bytes": self.files.slot_bytes,
            "disk_held_values": held,
            "disk_held_bytes": held * self.files.slot_bytes,
            "disk_capacity_bytes": self.files.count * self.files.slot_bytes,
            "disk_hits": self.hits,
            "disk_misses": self.misses,
            "disk_written_values": self.written,
            "disk_written_bytes": self.written_bytes,
            "disk_read_bytes": self.read_bytes,
            "disk_evicted_values": self.evicted,
            "disk_cleared_values": self.cleared,
            "disk_budget_bytes_per_day": self.budget.bytes_per_day,
            "disk_budget_left_bytes": self.budget.left(),
            "disk_budget_refused_writes": self.budget.refused,
            "disk_read_errors": self.read_errors,
            "disk_write_errors": self.write_errors,
            "disk_space_refusals": self.refused_space,
            "disk_bad_slots": self.bad_slots,
            "disk_refused_no_prefix": self.refused_no_prefix,
            "disk_refused_no_room": self.refused_no_room,
            "disk_recovered_values": self.recovered,
            "disk_scan_seconds": round(self.scan_seconds, 3),
            "disk_from_checkpoint": self.from_checkpoint,
            "disk_replayed_records": self.replayed,
        }

    def close(self) -> None:
        """Sync, close the files and release the folders' locks; idempotent."""
        if not self.folders:
            return
        self.sync()
        self._pool.shutdown(wait=True)
        self._log.checkpoint(self._entries())  # (the next open replays nothing)
        self._log.close()
        for fd in self.files.fds:
            os.close(fd)
        self.files.close()
        for folder in self.folders:
            folder.close()
        self.folders = []

    # ---- helpers -----------------------------------------------------------------------------
    def _map(self, fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
        """``fn`` of each item, in order, on the I/O threads: one hand-off per thread, each
        taking the next item not taken yet until none is left (no thread waits on another's
        slow I/O while items remain)."""
        if len(items) <= 1:
            return [fn(item) for item in items]
        out: list[R | None] = [None] * len(items)
        taken = itertools.count()  # (next() is atomic: each index goes to one thread)

        def drain() -> None:
            while (i := next(taken)) < len(items):
                out[i] = fn(items[i])

        for done in [self._pool.submit(drain) for _ in range(min(self.io_threads, len(items)))]:
            done.result()
        return out  # type: ignore[return-value]  # (every index was filled)

    def _take_slot(self, keep: set[str]) -> int | None:
        """A free slot, evicting the least recently used value for it (a full tier makes
        room, never refuses), unless that is one of ``keep`` (a prefix of the batch): None."""
        if not self._free:
            if not self._index or next(iter(self._index)) in keep:
                return None
            self.evict(1)
        return self._free.pop()

    def _touch(self, keys: Sequence[str]) -> set[str]:
        """Make the held ``keys`` and their held prefixes the most recent, each parent after
        its children (the invariant that makes the least recent value a leaf); what moved."""
        moved: set[str] = set()
        index, parent_of = self._index, self._parent
        if keys:
            self._log.add(("t", list(keys)))
        for key in reversed(keys):
            if key in moved:
                continue  # (its prefixes moved after it already)
            walked: set[str] = set()
            at: str | None = key
            while at is not None and at in index and at not in walked:
                index.move_to_end(at)
                walked.add(at)
                at = parent_of[at]
            moved |= walked
        return moved

    def _link(self, key: str, parent: str | None) -> None:
        self._parent[key] = parent
        if parent is not None:
            self._kids.setdefault(parent, set()).add(key)

    def _unlink(self, key: str) -> None:
        parent = self._parent.pop(key)
        kids = self._kids.get(parent) if parent is not None else None
        if kids is not None:
            kids.discard(key)
            if not kids:
                del self._kids[parent]  # type: ignore[arg-type]  # (not None: kids found)

    def _drop(self, key: str) -> None:
        """Forget ``key`` and everything held under it (a tail is never held alone)."""
        stack = [key]
        while stack:
            at = stack.pop()
            slot = self._index.pop(at, None)
            if slot is None:
                continue
            stack.extend(self._kids.pop(at, ()))
            self._unlink(at)
            if self._dropped is not None:
                self._dropped.append(at)
            self._log.add(("d", at))
            self._free.append(slot)

    def _entries(self) -> Iterator[Entry]:
        """The index as a checkpoint holds it: (slot, sequence, key, parent), least recent
        first (read lazily: only when a checkpoint is written)."""
        parent = self._parent
        return ((slot, self._seq, key, parent[key]) for key, slot in self._index.items())

    def _maybe_sync(self) -> None:
        now = time.monotonic()
        if self._dirty_since is None:
            self._dirty_since = now
        elif now - self._dirty_since >= self.sync_s:
            self.sync()
