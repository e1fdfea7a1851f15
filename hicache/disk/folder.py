"""A disk tier's folder: private to the daemon's user, used by one daemon at a time, and its
files opened for direct I/O where the file system allows it.

``open_folder`` makes the folder (0700) or checks the one there (a real folder, not a symlink,
owned by this user, no access for others), takes its lock (``lock``, flock: released by the
kernel when the process dies, so a crash never leaves it held) and returns it. ``open_data``
opens or makes a data file (0600, never through a symlink), preallocated to its size, with
O_DIRECT when the file system takes it (tmpfs refuses it: buffered I/O then, said once).
``read_note``/``write_note``: a folder's small files, replaced atomically and synced: the
``floor`` (the write sequence at or below which slots were flushed: a flush outlives a crash)
and the write budget's record (``budget.py``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import secrets
import stat
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("hicache.disk")

ALIGN = 4096  # direct I/O's alignment of offsets, lengths and buffers (a page: every drive's)
LOCK_NAME = "lock"
FLOOR_NAME = "floor"
NOTE_NAMES = ("floor", "budget", "index")  # the folder's small files (and the checkpoint)
TMP_SUFFIX = ".tmp"
MAX_FLOOR = 1 << 62  # write sequences stay far below 2**64 (a header's field)
MAX_SEQ = MAX_FLOOR + (1 << 40)  # no write the store makes has a higher sequence (more: not
# its own, never taken: it would stop every later write)
NOTE_MAX = 64 << 10  # bytes of a folder's small file (the floor, the write budget's record)


class FolderRefused(ValueError):
    """A folder the tier may not use (not private, not ours, a symlink, locked by another)."""


@dataclass
class Folder:
    path: str
    lock_fd: int  # held for the folder's life (flock)

    def close(self) -> None:
        if self.lock_fd >= 0:
            os.close(self.lock_fd)  # (the flock goes with it)
            self.lock_fd = -1


def check_folder(path: str) -> None:
    """What ``open_folder`` would refuse, said before a daemon starts (nothing is kept: a
    missing folder is made and removed again, to know it can be). FolderRefused."""
    path = os.path.abspath(path)
    if not os.path.lexists(path):
        if not os.path.isdir(os.path.dirname(path)):
            raise FolderRefused(f"disk: {os.path.dirname(path)} does not exist")
        try:
            os.mkdir(path, 0o700)
        except OSError as exc:
            raise FolderRefused(f"disk: cannot make {path}: {exc.strerror}") from None
        os.rmdir(path)
        return
    open_folder(path).close()
    read_floor(path)  # (one out of range is refused)


def open_folder(path: str) -> Folder:
    """The folder at ``path``, made private if missing, checked if present, and locked.
    Raises FolderRefused naming the problem (nothing is changed then)."""
    path = os.path.abspath(path)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:  # (checked below: ours, private, not a symlink)
        pass
    except OSError as exc:
        raise FolderRefused(f"disk: cannot make {path}: {exc.strerror}") from None
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise FolderRefused(f"disk: {path} is a symlink (not followed): name the folder itself")
    if not stat.S_ISDIR(st.st_mode):
        raise FolderRefused(f"disk: {path} is not a folder")
    if st.st_uid != os.getuid():
        raise FolderRefused(f"disk: {path} belongs to uid {st.st_uid}, not this user")
    if st.st_mode & 0o077:
        raise FolderRefused(
            f"disk: {path} is open to others (mode {stat.S_IMODE(st.st_mode):o}): chmod 700 {path}"
        )
    fd = os.open(os.path.join(path, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise FolderRefused(f"disk: {path} is used by another daemon (its lock is held)") from None
    return Folder(path, fd)


def open_data(path: str, size: int) -> tuple[int, bool]:
    """A data file of ``size`` bytes (made 0600 and preallocated if missing or shorter):
    ``(fd, direct)``. OSError from the file system (ENOSPC while preallocating included)."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(path, flags, 0o600)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            raise OSError(errno.EPERM, f"disk: {path} is not this user's regular file")
        if st.st_size < size:
            os.posix_fallocate(fd, 0, size)
    except BaseException:
        os.close(fd)
        raise
    direct = _direct(path)
    if direct >= 0:
        os.close(fd)
        return direct, True
    log.warning("disk: %s refuses O_DIRECT (tmpfs?): buffered I/O, through the page cache", path)
    return fd, False


def open_to_read(path: str) -> int:
    """A descriptor to read the regular file at ``path`` (not followed if a symlink; a FIFO
    or a device is refused, never waited on). FileNotFoundError, or OSError."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_file(path: str, most: int) -> bytes | None:
    """The bytes of the folder's file at ``path`` (``open_to_read``); None where there is
    none, it cannot be read, or it holds more than ``most`` bytes (logged: what the store
    writes is never that long; it is not read into memory)."""
    try:
        fd = open_to_read(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("disk: %s unreadable (%s)", path, str(exc))
        return None
    try:
        with os.fdopen(fd, "rb") as fh:
            if os.fstat(fh.fileno()).st_size > most:
                log.warning("disk: %s is longer than %d bytes: not ours, not read", path, most)
                return None
            return fh.read()
    except OSError as exc:
        log.warning("disk: %s unreadable (%s)", path, str(exc))
        return None


def read_note(folder: str, name: str) -> str | None:
    """The text of the folder's small file ``name`` (None: none, or unreadable: logged)."""
    path = os.path.join(folder, name)
    data = read_file(path, NOTE_MAX)
    if data is None:
        return None
    try:
        return data.decode()
    except UnicodeDecodeError:
        log.warning("disk: %s is not text: ignored", path)
        return None


def write_note(folder: str, name: str, text: str) -> None:
    """Replace the folder's small file ``name`` with ``text``, durably (OSError)."""
    data = text.encode()
    if len(data) > NOTE_MAX:
        raise ValueError(f"disk: {name}: {len(data)} bytes, more than {NOTE_MAX}")
    replace_file(folder, name, lambda fd: os.write(fd, data))


def replace_file(folder: str, name: str, fill: Callable[[int], object]) -> None:
    """Replace the folder's file ``name`` atomically and durably: ``fill`` writes the new
    contents to the open descriptor of a temporary beside it, which is synced and renamed
    over ``name``, and the folder is synced (OSError; the temporary never stays)."""
    path = os.path.join(folder, name)
    tmp = temporary(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            fill(fd)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    dfd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def temporary(path: str) -> str:
    """A new name beside ``path`` for a file written before it replaces ``path``."""
    return f"{path}.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}"


def remove_stale_temporaries(folder: str) -> None:
    """Remove what a crash left of files being replaced (only in a folder this process
    holds the lock of: nobody else writes there)."""
    for name in os.listdir(folder):
        if name.endswith(TMP_SUFFIX) and name.split(".", 1)[0] in NOTE_NAMES:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(folder, name))


def read_floor(folder: str) -> int:
    """The folder's floor (0: none, or not a number: logged)."""
    text = read_note(folder, FLOOR_NAME)
    if text is None:
        return 0
    try:
        floor = max(0, int(text.strip()))
    except ValueError:
        log.warning("disk: %s's floor is not a number: none", folder)
        return 0
    if floor > MAX_FLOOR:
        raise FolderRefused(
            f"disk: {folder}: its floor ({floor}) is beyond any write sequence this tier "
            f"makes; remove {os.path.join(folder, FLOOR_NAME)} and the slots to start it cold"
        )
    return floor


def write_floor(folder: str, seq: int) -> None:
    """Set the folder's floor to ``seq``, durably (OSError)."""
    write_note(folder, FLOOR_NAME, f"{seq}\n")


def _direct(path: str) -> int:
    """The file opened with O_DIRECT, or -1 where the file system refuses it."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_DIRECT)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return -1
        raise
    buf = aligned(ALIGN)
    try:  # (some file systems take the flag at open and refuse the first read)
        os.preadv(fd, [buf], 0)
    except OSError as exc:
        os.close(fd)
        if exc.errno == errno.EINVAL:
            return -1
        raise
    finally:
        buf.close()
    return fd


def aligned(size: int) -> mmap.mmap:
    """A zeroed buffer of ``size`` bytes at a page-aligned address (direct I/O's buffers)."""
    return mmap.mmap(-1, max(ALIGN, -(-size // ALIGN) * ALIGN))
