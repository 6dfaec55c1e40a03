"""The shared-memory weight store: two copies of one weight set and a pointer to the good one.

The apply agent writes each new version into the inactive buffer and then flips the version
pointer; the rollout daemon leases the active buffer and reads whole versions from it. The
previous version stays in the other buffer, so a rollback is one more flip. The segment's file
format is in segment.py, the pointer words in version_pointer.py, the byte-range locks and
the reader's Snapshot in leases.py, the writer's transaction in write_txn.py.

Protocol (the contract between the writer and the readers):

    reader, WeightStore.lease()             writer, WeightStore.begin_write() / WriteTxn
    1. read the pointer: (generation, idx)  1. EXCLUSIVE on the writer byte (one writer)
       generation 0: nothing to read        2. target = the buffer the pointer does not name;
    2. SHARED on buffer idx's byte             EXCLUSIVE on its byte, waiting (with a timeout)
    3. re-read the pointer; if it changed,     until readers of an older version let it go;
       release and start again                 or, with ``revoke``, revoke their leases (I4)
    4. buffer idx and its metadata are      3. mark target WRITING before the first writable
       frozen until the lease is released,     view is handed out (a crash leaves WRITING)
       unless it is revoked: check          4. commit: version, READY, flip the pointer with
       ``Snapshot.revoked`` after reading      one aligned 8-byte store; release the locks

Invariants (each is kept where its comment says "I1".."I3"):
- I1: the pointer names a READY buffer or nothing. Commit marks READY before the flip; rollback
  flips only to a READY buffer; a writer writes only the buffer the pointer does not name.
- I2: a buffer's bytes and its metadata words change only under the EXCLUSIVE lock on that
  buffer's byte, held by the holder of the writer lock; readers hold SHARED while they read.
  So a leased buffer is frozen, and so is its version.
- I3: the pointer changes only under the writer lock, and its generation grows at every change,
  so a reader that sees the same word twice knows no flip happened in between (no ABA).
- I4: a writer that will not wait longer for a buffer's readers (``begin_write(revoke=True)``:
  its lease bound has passed) first increases that buffer's revocation count, then writes it
  without the EXCLUSIVE lock. A reader compares the count with the one it leased under
  (``Snapshot.revoked``) after its last read and discards the read if it changed. So the
  writer never waits on the slowest reader past its bound, a reader that fell behind is told,
  and nobody uses torn bytes. I2 holds for every buffer whose leases were not revoked.

Memory ordering: the pointer and metadata are single aligned 8-byte loads and stores through a
numpy uint64 view (numpy's aligned scalar get/set compiles to one mov), atomic on x86-64 and
aarch64. Correctness does not rest on the order in which plain stores become visible: a reader
touches buffer bytes and metadata only after its lock is granted, and the writer releases its
lock only after its last store; lock grant and release are system calls that order memory like
a mutex. Unlocked reads of the pointer (``active_version``, ``status``) are hints.
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import time
import weakref
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import numpy as np

from deltarl.engine import leases
from deltarl.engine.layout import Layout
from deltarl.engine.leases import (
    LOCK_ATTACH,
    LOCK_BUFFER,
    LOCK_WRITER,
    LeaseRevoked,
    LeaseTimeout,
    NoVersionError,
    Snapshot,
    take_lease,
)
from deltarl.engine.segment import (
    FORMAT_VERSION,
    HEADER_NBYTES,
    SegmentFormatError,
    SegmentHeader,
    allocate,
    cleanup_stale,
    process_alive,
    publish,
    read_segment,
    segment_path,
)
from deltarl.engine.version_pointer import BufferState, VersionPointer
from deltarl.engine.write_txn import WriteTxn
from deltarl.ownership import GROUP_OTHER_WRITE, UnsafePathError, check_file, check_trusted_dirs

__all__ = [
    "BufferState",
    "LeaseRevoked",
    "LeaseTimeout",
    "NoVersionError",
    "RollbackError",
    "SegmentFormatError",
    "Snapshot",
    "UnsafePathError",
    "WeightStore",
    "WriteTxn",
    "WriterBusy",
    "cleanup_stale",
]

logger = logging.getLogger(__name__)

_OPEN_ATTEMPTS = 3


class WriterBusy(LeaseTimeout):
    """Another writer kept the write lock (a transaction or a rollback) for the whole wait."""


class RollbackError(RuntimeError):
    """There is no older complete version to roll back to."""


class WeightStore:
    """One weight set in shared memory: a double buffer, a version pointer, reader leases.

    Build it with ``create`` (the apply agent) or ``open`` (everyone else). Each open store
    holds a SHARED lock on the attach byte for its lifetime, so a segment nobody holds can be
    recognised as stale once its creator is gone.
    """

    def __init__(
        self,
        name: str,
        path: Path,
        fd: int,
        header: SegmentHeader,
        layout: Layout,
        *,
        readonly: bool,
    ) -> None:
        self.name = name
        self.path = path
        self.header = header
        self.layout = layout
        self.readonly = readonly
        self._fd = fd
        st = os.fstat(fd)
        self._file_id = (st.st_dev, st.st_ino)
        self._closed = False
        self._close_fd = weakref.finalize(self, os.close, fd)
        prot = mmap.PROT_READ if readonly else mmap.PROT_READ | mmap.PROT_WRITE
        self._mm = mmap.mmap(fd, header.file_nbytes, flags=mmap.MAP_SHARED, prot=prot)
        # Native-endian words: they never leave this host, and a native aligned view is what
        # makes each get and set a single load or store.
        words = np.frombuffer(self._mm, dtype=np.uint64, count=HEADER_NBYTES // 8)
        self._pointer = VersionPointer(words)
        self._bufs = tuple(
            np.frombuffer(self._mm, dtype=np.uint8, count=header.buffer_nbytes, offset=off)
            for off in header.buffer_offsets
        )
        # Each buffer's tensor digest table (segment.py); None in a segment without them.
        self._tables: tuple[np.ndarray, np.ndarray] | None = None
        if header.digests_stride:
            t0, t1 = (
                np.frombuffer(
                    self._mm,
                    dtype=np.uint8,
                    count=header.digests_stride,
                    offset=header.digests_offset + i * header.digests_stride,
                )
                for i in (0, 1)
            )
            self._tables = (t0, t1)

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def create(
        cls, name: str, layout: Layout, *, mode: int = 0o600, root: Path | None = None
    ) -> WeightStore:
        """Create the segment ``name`` for ``layout``, with both buffers EMPTY.

        The file is built in full under a temporary name and then linked to its public name,
        so no process ever opens a half-written header. An existing segment whose creator is
        dead and that nobody holds is removed first (and logged); any other existing file
        makes this raise FileExistsError.
        """
        if mode & GROUP_OTHER_WRITE:
            raise ValueError(
                f"weight store {name!r}: mode {mode:04o} lets group or others write it; "
                f"grant them read at most (0o640, 0o644): opening refuses any other"
            )
        path = segment_path(name, root)
        check_trusted_dirs(path.parent, f"weight store {name!r}")
        table = layout.to_json()
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, mode)
        try:
            leases.try_lock(fd, LOCK_ATTACH, exclusive=False)  # nobody else knows the file yet
            os.fchmod(fd, mode)  # os.open's mode went through the umask; the caller's is explicit
            header = SegmentHeader.plan(table, layout.nbytes, len(layout))
            allocate(fd, header.file_nbytes, name)  # zeros: pointer "none", buffers EMPTY
            os.pwrite(fd, header.pack(), 0)
            os.pwrite(fd, table, header.layout_offset)
            publish(tmp, path, name)
        except BaseException:
            os.close(fd)
            raise
        finally:
            tmp.unlink(missing_ok=True)
        logger.info("created weight store %s (%d bytes per buffer)", path, layout.nbytes)
        return cls(name, path, fd, header, layout, readonly=False)

    @classmethod
    def open(
        cls,
        name: str,
        *,
        root: Path | None = None,
        readonly: bool = False,
        layout: Layout | None = None,
        owner: int | None = None,
    ) -> WeightStore:
        """Attach to the existing segment ``name``; a clear error if it is not a valid one.

        ``readonly`` maps it without write permission (a reader cannot corrupt a buffer by
        mistake, nor write or roll back). ``layout``, if given, must equal the stored one.
        The segment must belong to ``owner`` (default: this process's effective uid) and be
        writable by nobody else, and its directory must be trusted; else UnsafePathError
        (``deltarl.ownership``): whoever else could write it could rewrite the active buffer.
        """
        path = segment_path(name, root)
        check_trusted_dirs(path.parent, f"weight store {name!r}")
        flags = (os.O_RDONLY if readonly else os.O_RDWR) | os.O_CLOEXEC | os.O_NOFOLLOW
        for _ in range(_OPEN_ATTEMPTS):
            try:
                fd = os.open(path, flags)
            except FileNotFoundError:
                raise FileNotFoundError(
                    f"no weight store {name!r}: {path} does not exist"
                ) from None
            try:
                check_file(fd, path, "weight store", owner=owner)
                found = read_segment(fd, path, layout)
            except BaseException:
                os.close(fd)
                raise
            if found is not None:
                return cls(name, path, fd, *found, readonly=readonly)
            os.close(fd)  # replaced by a cleaner while we opened it: open the new one
        raise FileNotFoundError(f"weight store {name!r} at {path} kept being replaced meanwhile")

    def close(self) -> None:
        """Detach: drop the mapping (once no view of it is left) and the attach lock.

        Leases and transactions taken from this store keep their own locks and views, and stay
        valid until they end.
        """
        if self._closed:
            return
        self._closed = True
        del self._pointer, self._bufs, self._tables
        try:
            self._mm.close()
        except BufferError:
            # Views handed out (leases, arrays, tensors) still point into the mapping; it is
            # unmapped when the last of them is collected.
            logger.debug("weight store %s closed while views of it are alive", self.path)
        self._close_fd()

    def unlink(self) -> None:
        """Remove the segment's name (the memory goes when the last process detaches).

        Only the file this store was opened on is removed, never a newer one of the same name.
        """
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return
        if (st.st_dev, st.st_ino) == self._file_id:
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ---- helpers ------------------------------------------------------------------------

    def _reopen(self, flags: int) -> int:
        """A new open file description of this segment: each lease or writer locks via its own."""
        if self._closed:
            raise RuntimeError(f"weight store {self.name!r} is closed")
        if flags != os.O_RDONLY and self.readonly:
            raise PermissionError(f"weight store {self.name!r} was opened read-only")
        # /proc/self/fd reaches the very file we hold, even if the name now points elsewhere.
        return os.open(f"/proc/self/fd/{self._fd}", flags | os.O_CLOEXEC)

    def _readonly_view(self, index: int) -> np.ndarray:
        view = self._bufs[index].view()
        view.flags.writeable = False
        return view

    # ---- readers ------------------------------------------------------------------------

    @property
    def active_version(self) -> int | None:
        """The active version, or None before the first commit (a hint: it may change now)."""
        if self._closed:
            raise RuntimeError(f"weight store {self.name!r} is closed")
        return self._pointer.active_version()

    @property
    def generation(self) -> int:
        """How many commits and rollbacks made a version active so far (a hint, unlocked):
        a version committed again under the same number comes with a new generation."""
        if self._closed:
            raise RuntimeError(f"weight store {self.name!r} is closed")
        return self._pointer.load() >> 1

    def lease(self, timeout: float | None = 5.0) -> Snapshot:
        """Lease the active version: it stays whole and unchanged until the lease is released.

        Use as ``with store.lease() as snap:``. Raises NoVersionError if nothing was ever
        committed, LeaseTimeout if no version could be pinned within ``timeout`` seconds.
        """
        fd = self._reopen(os.O_RDONLY)
        views = (self._readonly_view(0), self._readonly_view(1))
        try:
            return take_lease(
                fd,
                self._pointer,
                views,
                self.layout,
                timeout=timeout,
                name=self.name,
                digest_tables=self._tables,
            )
        except BaseException:
            os.close(fd)
            raise

    # ---- the writer ---------------------------------------------------------------------

    def begin_write(self, timeout: float | None = 10.0, *, revoke: bool = False) -> WriteTxn:
        """Start writing the inactive buffer: the one transaction of this segment until it ends.

        Waits at most ``timeout`` seconds in all: for another writer (WriterBusy), then for
        readers still leasing the inactive buffer's older version (LeaseTimeout; with
        ``revoke``, their leases are revoked instead (I4) and ``WriteTxn.revoked`` says so).
        """
        fd = self._reopen(os.O_RDWR)
        try:
            return self._begin_through(fd, timeout, revoke)
        except BaseException:
            os.close(fd)  # drops whatever locks were taken
            raise

    def _begin_through(self, fd: int, timeout: float | None, revoke: bool) -> WriteTxn:
        deadline = None if timeout is None else time.monotonic() + timeout
        self._take_writer_lock(fd, timeout, "begin a write")
        pointer = self._pointer
        active = VersionPointer.active_index(pointer.load())
        target = 0 if active is None else 1 - active  # I1: never the active buffer
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        revoked = False
        if not leases.wait_lock(fd, LOCK_BUFFER[target], exclusive=True, timeout=left):
            if not revoke:
                raise LeaseTimeout(
                    f"weight store {self.name!r}: buffer {target} (version "
                    f"{pointer.ready_version(target)}) is still leased by a reader after "
                    f"{timeout:.2f} s; the writer never overwrites a leased buffer, so readers "
                    f"must release their leases on old versions"
                )
            # I4: the count first; the lock calls of this transaction order it before the
            # first write, and a reader checks it after its last read.
            count = pointer.revoke(target)
            leases.holder(fd, LOCK_BUFFER[target])  # a system call: the fence
            logger.warning(
                "weight store %s: buffer %d (version %s) was still leased after %.2f s: its "
                "leases are revoked (revocation %d); their readers discard what they read "
                "and load the newest version",
                self.name,
                target,
                pointer.ready_version(target),
                timeout,
                count,
            )
            revoked = True
        if pointer.state(target) is BufferState.WRITING:
            logger.warning(
                "weight store %s: a writer died while writing buffer %d; its contents are "
                "discarded and the active version is untouched",
                self.path,
                target,
            )
            pointer.mark(target, BufferState.EMPTY)  # I2 (or I4: its leases are revoked)
        return WriteTxn(
            name=self.name,
            layout=self.layout,
            pointer=pointer,
            target=self._bufs[target],
            active=None if active is None else self._readonly_view(active),
            index=target,
            active_index=active,
            base_version=pointer.ready_version(target),
            fd=fd,
            revoked=revoked,
            digest_table=None if self._tables is None else self._tables[target],
        )

    def _take_writer_lock(self, fd: int, timeout: float | None, what: str) -> None:
        if not leases.wait_lock(fd, LOCK_WRITER, exclusive=True, timeout=timeout):
            raise WriterBusy(
                f"weight store {self.name!r}: cannot {what}, another writer kept the write "
                f"lock for the whole {timeout:.2f} s wait (one transaction or rollback at a time)"
            )

    def rollback(self, timeout: float | None = 10.0, to: int | None = None) -> int:
        """Make the previous version active again with one flip; returns that version.
        ``to``: the version asked for; RollbackError (nothing flipped) unless it is the one
        kept (only one older version is).

        Needs only the writer lock: the flip writes no buffer bytes, so readers of either
        buffer keep their leases (the next writer waits for those on the rolled-back one).
        """
        fd = self._reopen(os.O_RDWR)
        try:
            self._take_writer_lock(fd, timeout, "roll back")
            current, previous, other = self._rollback_target()
            if to is not None and to != previous:
                raise RollbackError(
                    f"weight store {self.name!r}: version {to} is not kept; the only older "
                    f"version is {previous} (active {current})"
                )
            self._pointer.flip(other)  # I1: checked READY. I3: under the writer lock
        finally:
            os.close(fd)
        logger.warning(
            "weight store %s rolled back from version %d to %d", self.path, current, previous
        )
        return previous

    def _rollback_target(self) -> tuple[int, int, int]:
        """(active version, older version, its buffer); RollbackError if there is none."""
        pointer = self._pointer
        active = VersionPointer.active_index(pointer.load())
        if active is None:
            raise RollbackError(
                f"weight store {self.name!r}: nothing to roll back to, no version was ever "
                f"committed"
            )
        other = 1 - active
        current, previous = pointer.version(active), pointer.ready_version(other)
        if previous is None:
            raise RollbackError(
                f"weight store {self.name!r}: nothing to roll back to, the other buffer "
                f"({other}) is {pointer.state(other).name} and holds no complete version"
            )
        if previous >= current:
            raise RollbackError(
                f"weight store {self.name!r}: nothing to roll back to, the other buffer holds "
                f"version {previous}, which is not older than the active version {current}"
            )
        return current, previous, other

    # ---- inspection ---------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """A plain description of the segment for ``deltarl ctl status`` (unlocked: a hint)."""
        if self._closed:
            raise RuntimeError(f"weight store {self.name!r} is closed")
        pointer = self._pointer
        word = pointer.load()
        active = VersionPointer.active_index(word)
        buffers = [
            {
                "index": i,
                "state": pointer.state(i).name,
                "version": pointer.ready_version(i),
                "active": i == active,
                # Only whether it is held: OFD locks carry no pid, and the kernel names one.
                "lock": leases.holder(self._fd, LOCK_BUFFER[i]),
                # Whether the writer committed its tensor digests with the version (a hint).
                "tensor_digests": pointer.ready_version(i) is not None
                and self._tables is not None
                and pointer.has_tensor_digests(i),
            }
            for i in (0, 1)
        ]
        return {
            "name": self.name,
            "path": str(self.path),
            "format_version": FORMAT_VERSION,
            "creator_pid": self.header.creator_pid,
            "creator_alive": process_alive(self.header.creator_pid, self.header.creator_start),
            "creation_id": self.header.creation_id.hex(),
            "tensors": len(self.layout),
            "buffer_nbytes": self.layout.nbytes,
            "generation": word >> 1,
            "active_index": active,
            "active_version": None if active is None else pointer.version(active),
            "buffers": buffers,
            "writer_busy": leases.holder(self._fd, LOCK_WRITER) != "none",
            "attached_elsewhere": leases.holder(self._fd, LOCK_ATTACH) != "none",
        }
