"""Memory backings: where a pool's one contiguous buffer comes from.

A pool asks its backing for ``nbytes`` and gets a uint8 tensor it then views per layer. The
backing decides whether that memory can be shared with other processes:

- ``PlainBacking``: ordinary process memory (pinned on a CUDA machine when asked).
- ``SharedMemoryBacking``: a POSIX shared-memory file under /dev/shm, created O_EXCL with mode
  0600, preallocated with posix_fallocate (so a full tmpfs fails here, not with SIGBUS later),
  and mapped. Engines map the same file by name. Not Python's SharedMemory class: on 3.11 its
  resource tracker unlinks segments that other processes still use.
- ``CudaBacking``: one cudaMalloc'd allocation on a GPU (shared later through CUDA IPC).

Every backing checks the size against available memory first and raises
InsufficientMemoryError with the numbers, instead of letting the OOM killer answer.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import stat
from abc import ABC, abstractmethod
from collections.abc import Collection

import psutil
import torch

from hicache.endpoints import SHM_DIR
from hicache.errors import InsufficientMemoryError

# Keep this much RAM free for everything else on the machine when sizing pools in memory.
RAM_HEADROOM_FRACTION = 0.10


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def check_ram(nbytes: int, what: str) -> None:
    """Raise InsufficientMemoryError if ``nbytes`` would eat into the machine's RAM headroom."""
    vm = psutil.virtual_memory()
    usable = vm.available - int(vm.total * RAM_HEADROOM_FRACTION)
    if nbytes > usable:
        raise InsufficientMemoryError(
            f"{what} needs {_gib(nbytes)} but only {_gib(max(usable, 0))} of RAM is available "
            f"(available {_gib(vm.available)} minus {RAM_HEADROOM_FRACTION:.0%} headroom); "
            "lower --host-bytes / --host-tokens / --host-ratio or --device-tokens (with "
            "--device-tier engine, --host-bytes sizes the pool the engines share)"
        )


class Backing(ABC):
    """Source of one pool buffer. ``allocate`` is called once; ``close`` releases it."""

    shareable: bool = False  # whether another process can map the buffer

    @abstractmethod
    def allocate(self, nbytes: int, what: str) -> torch.Tensor:
        """A uint8 tensor of ``nbytes``. Raises InsufficientMemoryError when it cannot fit."""

    def close(self) -> None:
        """Release the memory. Views of the buffer must not be used afterwards."""

    def describe(self) -> dict:
        """What another process needs to map this buffer (empty when not shareable)."""
        return {}


class PlainBacking(Backing):
    def __init__(self, device: str = "cpu", pin: bool = False):
        self.device = torch.device(device)
        self.pin = pin and self.device.type == "cpu" and torch.cuda.is_available()

    def allocate(self, nbytes: int, what: str) -> torch.Tensor:
        if self.device.type == "cpu":
            check_ram(nbytes, what)
        else:
            free, _ = torch.cuda.mem_get_info(self.device)
            if nbytes > free:
                raise InsufficientMemoryError(
                    f"{what} needs {_gib(nbytes)} but {self.device} has {_gib(free)} free"
                )
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device, pin_memory=self.pin)


class CudaBacking(PlainBacking):
    """GPU memory from torch's allocator; the daemon exports it through CUDA IPC.

    ``describe`` returns the eight fields of ``UntypedStorage._share_cuda_()`` (plain bytes and
    ints, so msgpack carries them); an engine on the same machine and the same torch version
    maps the allocation with AttachedCudaIPC. Untested on this project's CPU-only CI.
    """

    shareable = True

    def __init__(self, device: str = "cuda"):
        super().__init__(device)
        self.buffer: torch.Tensor | None = None

    def allocate(self, nbytes: int, what: str) -> torch.Tensor:
        self.buffer = super().allocate(nbytes, what)
        return self.buffer

    def describe(self) -> dict:
        buffer = self.buffer
        assert buffer is not None  # (described once allocated)
        fields = buffer.untyped_storage()._share_cuda_()
        names = (
            "device",
            "handle",
            "size_bytes",
            "offset_bytes",
            "ref_counter_handle",
            "ref_counter_offset",
            "event_handle",
            "event_sync_required",
        )
        return {
            "kind": "cuda_ipc",
            "torch": torch.__version__,
            "nbytes": buffer.numel(),
            **dict(zip(names, fields, strict=True)),
        }


class AttachedCudaIPC(Backing):
    """The daemon's CUDA pool opened through its IPC handle (the engine side)."""

    def __init__(self, description: dict):
        if description.get("torch") != torch.__version__:
            raise RuntimeError(
                f"CUDA IPC needs the daemon's torch ({description.get('torch')}) here too, "
                f"found {torch.__version__}"
            )
        self.description = description

    def allocate(self, nbytes: int, what: str) -> torch.Tensor:
        d = self.description
        storage = torch.UntypedStorage._new_shared_cuda(
            d["device"],
            d["handle"],
            d["size_bytes"],
            d["offset_bytes"],
            d["ref_counter_handle"],
            d["ref_counter_offset"],
            d["event_handle"],
            d["event_sync_required"],
        )
        buf = torch.empty(0, dtype=torch.uint8, device=f"cuda:{d['device']}")
        return buf.set_(storage, 0, (nbytes,), (1,))


class SharedMemoryBacking(Backing):
    """A named POSIX shared-memory file, removed by close() (the creator's job)."""

    shareable = True

    def __init__(self, name: str, directory: str = SHM_DIR, adopt: str | None = None):
        """``adopt``: the path of an existing segment of the right size to take over (renamed
        to ``name``; its bytes kept) instead of creating one."""
        if "/" in name or not name:
            raise ValueError(f"shared memory name {name!r} must be a plain file name")
        self.name = name
        self.path = os.path.join(directory, name)
        self.adopt = adopt
        self.keep = False  # close() leaves the file for a successor (keep_host)
        self._mm: mmap.mmap | None = None
        self._pinned: int | None = None  # base address registered with CUDA, if any
        self.nbytes = 0

    def allocate(self, nbytes: int, what: str) -> torch.Tensor:
        if self.adopt is not None:
            if os.lstat(self.adopt).st_size != max(nbytes, 1):
                raise ValueError(f"{what}: {self.adopt} is not {nbytes} bytes: not adopted")
            os.rename(self.adopt, self.path)
            fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
        else:
            check_ram(nbytes, what)
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            try:
                if self.adopt is None:
                    os.posix_fallocate(fd, 0, max(nbytes, 1))
            except OSError as exc:
                os.unlink(self.path)
                raise InsufficientMemoryError(
                    f"{what}: cannot reserve {_gib(nbytes)} in {os.path.dirname(self.path)} "
                    f"({exc.strerror}); enlarge the tmpfs or shrink the pool"
                ) from None
            self._mm = mmap.mmap(fd, max(nbytes, 1), flags=MAP_FLAGS)
        finally:
            os.close(fd)
        self.nbytes = nbytes
        # through a memoryview: closing the mmap then fails while tensors still view it, instead
        # of leaving them pointing at unmapped memory
        buf = torch.frombuffer(memoryview(self._mm), dtype=torch.uint8, count=nbytes)
        self._pinned = register_pinned(buf)
        return buf

    def describe(self) -> dict:
        return {"kind": "shm", "name": self.name, "path": self.path, "nbytes": self.nbytes}

    def huge_page_bytes(self) -> int:
        """Bytes of the mapping the kernel backs with huge pages (huge_pages.py); reads
        /proc/self/smaps: call once, not per request."""
        if self._mm is None or not self.nbytes:
            return 0
        from hicache.memory.huge_pages import huge_page_bytes

        address = torch.frombuffer(memoryview(self._mm), dtype=torch.uint8, count=1).data_ptr()
        return huge_page_bytes(address, self.nbytes)

    def close(self) -> None:
        _unmap(self)
        if self.keep:
            return
        with contextlib.suppress(FileNotFoundError):  # already removed (close called twice)
            os.unlink(self.path)


class AttachedSharedMemory(Backing):
    """An existing shared-memory file mapped read-write (the engine side). close() unmaps and
    never unlinks: the daemon that created the file owns it. ``owners``: the uids it may
    belong to (the daemon's user); anything else, a link or a FIFO is refused unopened."""

    def __init__(self, path: str, owners: Collection[int] = ()):
        self.path = path
        self.owners = frozenset(owners) or frozenset({os.getuid()})
        self._mm: mmap.mmap | None = None
        self._pinned: int | None = None

    def allocate(self, nbytes: int, what: str) -> torch.Tensor:
        self._mm, buf = attach_shared_memory(self.path, nbytes, self.owners, what)
        self._pinned = register_pinned(buf)
        return buf

    def close(self) -> None:
        _unmap(self)


def _unmap(backing: SharedMemoryBacking | AttachedSharedMemory) -> None:
    """Unregister a mapping from CUDA, then unmap it (the order cleanup must follow)."""
    if backing._pinned is not None:
        torch.cuda.cudart().cudaHostUnregister(backing._pinned)
        backing._pinned = None
    if backing._mm is not None:
        try:
            backing._mm.close()
        except BufferError:
            pass  # views still exist; the mapping goes when they do
        backing._mm = None


HOST_REGISTER_FLAGS = 0x01 | 0x02  # cudaHostRegisterPortable | cudaHostRegisterMapped


def pinned_span(buf: torch.Tensor) -> tuple[int, int]:
    """(address, bytes) of a contiguous CPU buffer: what registering it must cover. Bytes, not
    elements: a float32 buffer registered by its element count left three quarters of it
    unmapped for the GPU, and a kernel writing there faulted (seen on an H200)."""
    if not buf.is_contiguous():
        raise ValueError("only a contiguous buffer can be registered as pinned memory")
    return buf.data_ptr(), buf.numel() * buf.element_size()


def register_pinned(buf: torch.Tensor) -> int | None:
    """Page-lock a CPU buffer with CUDA when a GPU is present; returns the registered address."""
    if not torch.cuda.is_available() or buf.numel() == 0:
        return None
    address, nbytes = pinned_span(buf)
    # portable (every device) and mapped: the Triton copy kernel reads and writes it in place
    err = torch.cuda.cudart().cudaHostRegister(address, nbytes, HOST_REGISTER_FLAGS)
    return address if int(err) == 0 else None


# Shared pools are mapped with their page tables filled at once (MAP_POPULATE): a first write
# to each 4 KiB page of a fresh mapping costs a fault, and copies into a pool nobody touched
# yet ran at a tenth of their speed (1.1 against 10.4 GB/s, measured here).
MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


def attach_shared_memory(
    path: str, nbytes: int, owners: Collection[int], what: str = "pool"
) -> tuple[mmap.mmap, torch.Tensor]:
    """Map an existing shared-memory file read-write (the engine side). Keep the mmap alive.
    Opened without following a link and without blocking (a FIFO), then checked on the open
    file: a regular file of one of ``owners``, private to its owner, of at least ``nbytes``.
    PermissionError or ValueError otherwise, with nothing mapped or written."""
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise PermissionError(f"{what}: {path} is not a regular file: not mapped")
        if st.st_uid not in owners or stat.S_IMODE(st.st_mode) & 0o077:
            raise PermissionError(
                f"{what}: {path} belongs to uid {st.st_uid} with mode "
                f"{oct(stat.S_IMODE(st.st_mode))}, not privately to the daemon's user: not mapped"
            )
        if st.st_size < nbytes:
            raise ValueError(f"{what}: {path} holds {st.st_size} bytes, expected {nbytes}")
        mm = mmap.mmap(fd, nbytes, flags=MAP_FLAGS)
    finally:
        os.close(fd)
    return mm, torch.frombuffer(memoryview(mm), dtype=torch.uint8, count=nbytes)
