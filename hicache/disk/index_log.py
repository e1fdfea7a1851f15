"""IndexLog: a disk store's index on the drive, as a checkpoint and the journal after it, in the
store's first folder: what a start after any stop, a crash included, reads instead of every
slot's header (``recovery.py`` reads them; this writes them).

- ``checkpoint(entries)`` writes the whole index under a new token (naming the one it
  replaces) and starts an empty journal after it: at every open, clean close and clear, and
  when the journal would outgrow it.
- ``add(record)`` keeps a change of the call running (``journal.Record``: a write, a let-go, a
  use); ``flush(entries)`` appends the call's changes in one write as it ends, or, where they
  would take the journal to ``journal.bound`` (``journal.MAX_BYTES`` and twice the last
  checkpoint), writes a new checkpoint instead, which holds them.
- A checkpoint or an append that fails (logged) leaves no journal that misses changes: it is
  removed, so that a start after a crash scans; where it cannot be, the checkpoint it follows
  goes instead. Nothing is journaled then until ``retry_due`` says a retry may run (once a
  ``CHECKPOINT_RETRY_S``; the store's ``tick`` runs it).

Mutates only the folder's ``index`` and ``journal`` files and its own fields; one thread calls
it (the store's).
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Iterable
from typing import Any

from hicache.disk import checkpoint, journal

log = logging.getLogger(__name__)

CHECKPOINT_RETRY_S = 60.0  # a checkpoint or journal that failed is tried again this often
Entry = tuple[int, int, str, "str | None"]  # (slot, sequence, key, parent): one held value


class IndexLog:
    """The checkpoint and journal of the index of a store whose first folder is ``folder``
    and whose files are described by ``geometry`` (a checkpoint of another geometry is not
    read back)."""

    def __init__(self, folder: str, geometry: dict[str, Any]):
        self.folder, self.geometry = folder, geometry
        self._journal: journal.Journal | None = None  # (None: not journaling; the next open
        # then scans, or replays a stale journal: reads verify)
        self.checkpoint_bytes = 0  # the last checkpoint's size
        # the checkpoint the journal on the drive follows, holding every change since it (""
        # none such: a journal that failed, or none)
        self.token = journal.follows(folder) or ""
        self.failed_at = 0.0  # (monotonic) when writing a checkpoint or journal last failed

    @property
    def on(self) -> bool:
        """Whether changes are journaled (else a start after a crash scans)."""
        return self._journal is not None

    def add(self, record: journal.Record) -> None:
        """Keep ``record`` for the next ``flush`` (nothing while not journaling)."""
        if self._journal is not None:
            self._journal.add(record)

    def checkpoint(self, entries: Iterable[Entry]) -> None:
        """Write ``entries`` (the whole index, least recent first) as a checkpoint under a new
        token, then an empty journal after it. Failing (logged): see the module's docstring."""
        replaces = self.token  # (what the new checkpoint holds all of)
        if self._journal is not None:
            self._journal.close()
            self._journal = None
        token = secrets.token_hex(8)
        try:
            self.checkpoint_bytes = checkpoint.write(
                self.folder, self.geometry, entries, token, replaces
            )
            self._journal, self.token = journal.Journal(self.folder, token), token
        except OSError as exc:
            log.warning("disk: the index's checkpoint or journal was not written (%s): a "
                        "start after a crash scans the slots", exc)  # fmt: skip
            self.failed_at = time.monotonic()
            self._disown()

    def flush(self, entries: Iterable[Entry]) -> None:
        """Append the changes kept since the last flush, or write a checkpoint of ``entries``
        (the index as it is now, which holds them) where they would take the journal to its
        bound (the next open's replay stays short, the checkpoint's cost is amortized, and a
        journal is never longer than a reader takes). ``entries`` is read only then."""
        if self._journal is None:
            return
        data = self._journal.take()
        if not data:
            return
        if self._journal.bytes + len(data) >= journal.bound(self.checkpoint_bytes):
            self.checkpoint(entries)
            return
        try:
            self._journal.append(data)
        except OSError as exc:
            log.warning("disk: the journal could not be written (%s): a start after a crash "
                        "scans the slots", exc)  # fmt: skip
            self._journal.close()
            self._journal = None
            self.failed_at = time.monotonic()
            self._disown()

    def retry_due(self) -> bool:
        """Not journaling, and the last failure was a ``CHECKPOINT_RETRY_S`` ago or more."""
        return self._journal is None and time.monotonic() - self.failed_at >= CHECKPOINT_RETRY_S

    def sync(self) -> None:
        """fdatasync the journal (OSError)."""
        if self._journal is not None:
            self._journal.sync()

    def close(self) -> None:
        if self._journal is not None:
            self._journal.close()
            self._journal = None

    def _disown(self) -> None:
        """The journal on the drive no longer holds every change: remove it (the next open
        after a crash scans); where it cannot be, remove the checkpoint it follows instead,
        and the one that replaced it, so that neither is trusted with it."""
        self.token = ""
        try:
            os.unlink(os.path.join(self.folder, journal.NAME))
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            log.error("disk: the journal could not be removed (%s): the checkpoint goes", exc)
        try:
            os.unlink(os.path.join(self.folder, checkpoint.NAME))
        except FileNotFoundError:
            return  # (none to trust)
        except OSError as exc:
            log.error("disk: the checkpoint could not be removed either (%s): a start after a "
                      "crash may find pages written since as free (reads verify)", exc)  # fmt: skip
