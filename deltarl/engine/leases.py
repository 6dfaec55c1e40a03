"""Leases on a weight-store segment: Linux open-file-description (OFD) byte-range locks.

Why OFD locks and not classic POSIX (``lockf``) or ``flock`` locks:
- they belong to an open file description, not to a process, so two leases taken by one
  process through two ``open()`` calls conflict exactly as they would in two processes, and
  closing some unrelated fd of the same file does not silently drop them (POSIX locks do);
- they cover byte ranges, so one file carries several independent locks (``flock`` has one);
- the kernel drops them when the description's last fd is closed, which includes the death of
  the process: a reader or writer killed by SIGKILL never leaves a lease behind.

The locked bytes stand for roles, not for data (the locks are advisory; they never stop a
load or a store). The map, shared by every process that touches a segment:

    byte 0, 1   buffer 0, buffer 1: readers hold SHARED while they read that buffer;
                the writer holds EXCLUSIVE while it writes it (so it never writes a leased one)
    byte 2      the writer: EXCLUSIVE for the whole of a write transaction or a rollback
    byte 3      attachment: every open WeightStore holds SHARED for its lifetime, so a segment
                whose bytes 0-3 are all unlocked has nobody attached and may be removed

A reader's lease on one version is a ``Snapshot``: an fd of its own holding SHARED on the
buffer's byte, and read-only views of that buffer.

Caveat: a forked child inherits the parent's fds and with them the same open file
descriptions, so a lease held across ``fork()`` lasts until both processes have closed it.
Leases are opened with O_CLOEXEC, so ``exec`` does not carry them.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import time
import warnings
import weakref
from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Literal, Self

import numpy as np

from deltarl.engine.layout import Layout
from deltarl.engine.tensor_digest_table import read_table
from deltarl.engine.version_pointer import VersionPointer

if TYPE_CHECKING:
    import torch

LOCK_BUFFER: tuple[int, int] = (0, 1)
LOCK_WRITER = 2
LOCK_ATTACH = 3
LOCK_SPAN = 4  # bytes [0, LOCK_SPAN) carry every lock of a segment

if not hasattr(fcntl, "F_OFD_SETLK"):  # pragma: no cover - Linux >= 3.15 has them
    raise ImportError(
        "deltarl's weight store needs Linux open-file-description locks (fcntl.F_OFD_SETLK); "
        "classic POSIX locks would be dropped whenever any fd of the segment is closed"
    )

# struct flock on LP64 Linux (x86-64 and aarch64): short l_type, short l_whence, off_t l_start,
# off_t l_len, pid_t l_pid, then 4 bytes of tail padding (the kernel copies all 32 bytes).
_FLOCK = struct.Struct("hhqqi4x")

# Backoff while polling a contended lock: short first (most waits are a reader racing a
# pointer flip, a few microseconds), capped so a long wait costs little CPU.
_FIRST_SLEEP_S = 50e-6
_MAX_SLEEP_S = 5e-3

Holder = Literal["none", "shared", "exclusive"]


class LeaseRevoked(RuntimeError):  # noqa: N818 - reads as what happened
    """The writer revoked a lease its reader held past the writer's bound (I4 in
    weight_store.py): what the reader read from it may be torn and must be discarded."""


class LeaseTimeout(TimeoutError):  # noqa: N818 - the name is part of the store's API
    """A lock on a weight-store segment was not granted within the caller's timeout."""


def _fcntl_lock(fd: int, cmd: int, ltype: int, start: int, length: int) -> bytes:
    # l_pid must be 0 for OFD commands; the kernel rejects anything else with EINVAL.
    arg = _FLOCK.pack(ltype, os.SEEK_SET, start, length, 0)
    return fcntl.fcntl(fd, cmd, arg)  # type: ignore[no-any-return]


def try_lock(fd: int, byte: int, *, exclusive: bool, length: int = 1) -> bool:
    """Take a lock on ``[byte, byte+length)`` through ``fd`` if it is free now; False if not.

    Re-locking a range this description already holds converts it (shared <-> exclusive).
    """
    ltype = fcntl.F_WRLCK if exclusive else fcntl.F_RDLCK
    try:
        _fcntl_lock(fd, fcntl.F_OFD_SETLK, ltype, byte, length)
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):  # held by another description
            return False
        raise
    return True


def wait_lock(
    fd: int, byte: int, *, exclusive: bool, timeout: float | None, length: int = 1
) -> bool:
    """Take a lock on ``[byte, byte+length)``, waiting at most ``timeout`` seconds.

    Returns False on timeout; the caller raises an error that says what it was waiting for.
    ``timeout=None`` blocks in the kernel (F_OFD_SETLKW) until the lock is granted.
    """
    if timeout is None:
        ltype = fcntl.F_WRLCK if exclusive else fcntl.F_RDLCK
        _fcntl_lock(fd, fcntl.F_OFD_SETLKW, ltype, byte, length)
        return True
    # A blocking SETLKW cannot be given a timeout without signals (which belong to the
    # daemon's event loop, not to us), so a bounded wait polls with a growing sleep.
    deadline = time.monotonic() + timeout
    sleep = _FIRST_SLEEP_S
    while not try_lock(fd, byte, exclusive=exclusive, length=length):
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(sleep, left))
        sleep = min(sleep * 2, _MAX_SLEEP_S)
    return True


def unlock(fd: int, byte: int, length: int = 1) -> None:
    """Release this description's lock on ``[byte, byte+length)`` (a no-op if it holds none)."""
    _fcntl_lock(fd, fcntl.F_OFD_SETLK, fcntl.F_UNLCK, byte, length)


def holder(fd: int, byte: int, length: int = 1) -> Holder:
    """Who holds ``[byte, byte+length)``, as seen from ``fd``: nobody, readers or a writer.

    Locks held through ``fd``'s own description do not count (they never conflict with it).
    The kernel reports one conflicting lock only, and OFD locks carry no pid, so this says
    whether a range is held, never by whom or how many times.
    """
    out = _fcntl_lock(fd, fcntl.F_OFD_GETLK, fcntl.F_WRLCK, byte, length)
    ltype = _FLOCK.unpack(out)[0]
    if ltype == fcntl.F_UNLCK:
        return "none"
    return "shared" if ltype == fcntl.F_RDLCK else "exclusive"


class NoVersionError(LookupError):
    """A lease was asked for before any version was committed."""


def take_lease(
    fd: int,
    pointer: VersionPointer,
    buffers: Sequence[np.ndarray],
    layout: Layout,
    *,
    timeout: float | None,
    name: str,
    digest_tables: Sequence[np.ndarray] | None = None,
) -> Snapshot:
    """The reader's side of the protocol (weight_store.py): pin the active version via ``fd``.

    ``fd`` must be a description of its own; on success the Snapshot owns it, on error the
    caller closes it. ``buffers`` are read-only views of the two buffers.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    sleep = _FIRST_SLEEP_S
    while True:
        word = pointer.load()
        index = VersionPointer.active_index(word)
        if index is None:
            raise NoVersionError(f"weight store {name!r} has no version yet")
        if try_lock(fd, LOCK_BUFFER[index], exclusive=False):
            # I2: from here buffer ``index`` is frozen. I3: an unchanged word means no flip
            # since we read it, so ``index`` is still the active buffer, and READY (I1).
            if pointer.load() == word:
                version = pointer.ready_version(index)
                if version is None:
                    raise RuntimeError(
                        f"weight store {name!r}: the active buffer {index} is "
                        f"{pointer.state(index).name}, not READY; the segment is corrupt"
                    )
                return Snapshot(
                    fd,
                    buffers[index],
                    layout,
                    index=index,
                    generation=word >> 1,
                    version=version,
                    digest=pointer.digest(index),
                    pointer=pointer,
                    digest_table=(
                        digest_tables[index]
                        if digest_tables is not None and pointer.has_tensor_digests(index)
                        else None
                    ),
                )
            unlock(fd, LOCK_BUFFER[index])
            continue  # a flip raced us: retry at once
        # The writer holds a buffer past its flip only until its unlock: microseconds.
        if deadline is not None and time.monotonic() >= deadline:
            raise LeaseTimeout(
                f"weight store {name!r}: could not lease the active version within "
                f"{timeout:.2f} s (buffer {index} stayed locked by the writer)"
            )
        time.sleep(sleep)
        sleep = min(sleep * 2, _MAX_SLEEP_S)


class Snapshot:
    """A reader's lease on one whole version: the buffer cannot change until it is released.

    Views (``buffer``, ``array``, ``tensor``) are read-only windows on shared memory, not
    copies, valid while the lease is held. A view kept past ``release()`` still points at the
    buffer, which a writer may then overwrite: copy what must outlive the lease.
    """

    def __init__(
        self,
        fd: int,
        buffer: np.ndarray,
        layout: Layout,
        *,
        index: int,
        generation: int,
        version: int,
        digest: str | None = None,
        pointer: VersionPointer | None = None,
        digest_table: np.ndarray | None = None,
    ) -> None:
        self.version = version
        self.digest = digest
        """The model digest committed with this version (its manifest's), or None."""
        # Read on demand, under the lease: the table is frozen with the buffer (I2).
        self._digest_table = digest_table
        self.index = index  # which of the two buffers
        self.generation = generation  # of the pointer word when the lease was taken
        self.layout = layout
        self._buffer = buffer
        self._fd = fd
        self._pointer = pointer
        # Taken under the lease: a writer that revokes it (I4) increases the count first.
        self._revocations = None if pointer is None else pointer.revocations(index)
        # Closing the fd drops the SHARED lock; the finalizer also ends a forgotten lease.
        self._finalizer = weakref.finalize(self, os.close, fd)

    @property
    def revoked(self) -> bool:
        """Whether the writer revoked this lease (I4): the reader fell behind the writer's
        lease bound, and the buffer may have been overwritten while it read. Ask after the
        last read, before trusting it; a revoked read is discarded, never used.

        The count is read after a system call on the lease's fd (a lock probe), which orders
        this read after the buffer reads before it, as the writer's revocation is ordered
        before its first write by the lock calls between them."""
        if self._pointer is None or self._revocations is None:
            return False
        if self.released:
            raise RuntimeError(f"the lease on version {self.version} was released")
        holder(self._fd, LOCK_BUFFER[self.index])  # the fence: a system call
        return self._pointer.revocations(self.index) != self._revocations

    def check_not_revoked(self) -> None:
        """LeaseRevoked if the writer revoked this lease."""
        if self.revoked:
            raise LeaseRevoked(
                f"the lease on version {self.version} (buffer {self.index}) was revoked: this "
                f"reader held it past the writer's lease bound, so what it read is discarded"
            )

    @property
    def released(self) -> bool:
        return not self._finalizer.alive

    @property
    def buffer(self) -> np.ndarray:
        """The whole leased buffer as read-only uint8."""
        if self.released:
            raise RuntimeError(f"the lease on version {self.version} was released")
        return self._buffer

    @property
    def tensor_digests(self) -> list[str] | None:
        """The writer's xxh3-128 of each tensor of this version, in layout order, committed
        with it (``WriteTxn.commit``); None where it committed none or the segment keeps
        none. Read under the lease; check ``revoked`` after, as for the bytes."""
        if self._digest_table is None:
            return None
        self.buffer  # noqa: B018 - raises once the lease is released
        return read_table(self._digest_table, len(self.layout))

    def array(self, name_or_id: str | int) -> np.ndarray:
        """One tensor's read-only bit view (unsigned ints of its element size)."""
        return self.layout.view(self.buffer, name_or_id)

    def tensor(self, name_or_id: str | int) -> torch.Tensor:
        """One tensor as a torch tensor of its dtype and shape (bfloat16 included), zero-copy.

        torch has no read-only tensors: never write into it.
        """
        import torch  # noqa: PLC0415 - heavy, and most users of a store never need it

        buf = self.buffer
        layout = self.layout
        spec = (
            layout.tensors[name_or_id] if isinstance(name_or_id, int) else layout.spec(name_or_id)
        )
        dtype = getattr(torch, spec.dtype)
        if spec.nbytes == 0:
            return torch.empty(spec.shape, dtype=dtype)
        raw = buf[spec.offset : spec.offset + spec.nbytes]
        with warnings.catch_warnings():
            # torch warns that it cannot mark the tensor read-only; the docstring says so.
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            bits = torch.frombuffer(raw, dtype=torch.uint8)
        return bits.view(dtype).reshape(spec.shape)

    def release(self) -> None:
        """Give the version back (idempotent); a waiting writer may then overwrite it."""
        self._finalizer()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()
