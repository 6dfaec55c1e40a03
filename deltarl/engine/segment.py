"""The file format of a weight-store segment, and how to tell a live segment from a stale one.

A segment is one file under /dev/shm (tmpfs), mapped by every process that uses it. This module
knows the file: its format, how a new one is published and an existing one read, and when an
existing one is stale (its creator is gone and nobody holds it) and may be removed.

    offset 0      header page (4096 bytes): fixed fields, then the live words
    offset 4096   layout table: ``Layout.to_json()``, padded to a page
    buffer 0      ``layout.nbytes`` bytes, page aligned
    buffer 1      ``layout.nbytes`` bytes, page aligned
    digests 0     buffer 0's tensor digests: 16 bytes a tensor, in layout order, page aligned
    digests 1     buffer 1's

Header fixed fields (little-endian, written once before the file gets its public name):

    0   magic            8s   b"DRLWSTOR"
    8   format_version   u32
    12  header_nbytes    u32
    16  creator_pid      u64  who created it: the pid, and its start time in clock ticks
    24  creator_start    u64  since boot (so a reused pid is not mistaken for the creator)
    32  boot_id          16s  the boot it was created in (a non-tmpfs root outlives a reboot)
    48  creation_id      16s  random, tells two segments of the same name apart
    64  created_ns       u64
    72  layout_offset, layout_nbytes, buffer0_offset, buffer1_offset, buffer_nbytes,
        file_nbytes      6 x u64
    120 digests_offset, digests_stride   2 x u64: where buffer 0's tensor digest table lies
        and how far buffer 1's lies after it; both zero in a segment without tables

Invariant: bytes 0-71 keep this meaning in every format version, so any deltarl can recognise
a segment, name its format version in an error, and judge whether its creator is alive.

The live words (native-endian uint64, each on its own cache line; see version_pointer.py):

    192  version pointer: generation << 1 | active buffer index; generation 0 = none active
    256  buffer 0: state, version, model digest (high, low), digest set
    320  buffer 1: state, version, model digest (high, low), digest set

The digest words were zero and unread before they were used, so a segment of an older deltarl
reads as "no digest" and the format version did not change. So were bytes 120-135 and the
file past buffer 1: a segment of an older deltarl has no tensor digest tables (its writers
commit none, its readers hash the bytes), and an older deltarl maps a newer segment's
buffers as before and never looks past them.

A tensor digest table holds the xxh3-128 of each tensor of its buffer's version as the writer
committed it (big-endian, as ``tensor_digest``'s hex reads): the trainer's own digests of the
bytes it wrote, so the export agent need not hash the model again, and a change to the
published bytes after the commit is caught by every receiver. Whether a buffer's table holds
its version's digests is one of its live words (version_pointer.py).
"""

from __future__ import annotations

import errno
import logging
import os
import re
import struct
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from deltarl.engine import leases
from deltarl.engine.layout import Layout
from deltarl.engine.tensor_digest_table import DIGEST_BYTES

logger = logging.getLogger(__name__)

MAGIC = b"DRLWSTOR"
FORMAT_VERSION = 1
PAGE = 4096
HEADER_NBYTES = PAGE
DEFAULT_ROOT = Path("/dev/shm")  # noqa: S108 - tmpfs shared memory, not a temp file
PREFIX = "deltarl-"
NAME_RE = re.compile(r"[A-Za-z0-9_.-]+")
MAX_NAME = 200

_IDENTITY = struct.Struct("<8sIIQQ16s16sQ")  # bytes 0-71, stable across format versions
_GEOMETRY = struct.Struct("<6Q")  # bytes 72-119
_DIGEST_TABLES = struct.Struct("<2Q")  # bytes 120-135
GONE = "no longer exists"
_CREATE_ATTEMPTS = 3
_ATTACH_WAIT_S = 1.0  # a cleaner holds the attach byte for microseconds
_TMP_RE = re.compile(r"\.deltarl-.+\.(\d+)\.[0-9a-f]+\.tmp")


class SegmentFormatError(ValueError):
    """A file is not a deltarl weight-store segment, or one this version cannot read."""


@dataclass(frozen=True)
class SegmentHeader:
    """The fixed header of a segment: who made it, and where its parts lie."""

    creator_pid: int
    creator_start: int
    boot_id: bytes
    creation_id: bytes
    created_ns: int
    layout_offset: int
    layout_nbytes: int
    buffer_offsets: tuple[int, int]
    buffer_nbytes: int
    file_nbytes: int
    digests_offset: int = 0
    """Buffer 0's tensor digest table; 0 in a segment of an older deltarl, which has none."""
    digests_stride: int = 0
    """From buffer 0's table to buffer 1's (page aligned)."""

    @classmethod
    def plan(cls, layout_json: bytes, buffer_nbytes: int, tensors: int) -> SegmentHeader:
        """A fresh header for this process, placing the layout table, both buffers and their
        tensor digest tables (``tensors`` digests each)."""
        layout_offset = HEADER_NBYTES
        buf0 = layout_offset + page_align(len(layout_json))
        buf1 = buf0 + page_align(buffer_nbytes)
        digests = buf1 + page_align(buffer_nbytes)
        stride = page_align(tensors * DIGEST_BYTES)
        pid = os.getpid()
        return cls(
            creator_pid=pid,
            creator_start=process_start_ticks(pid) or 0,
            boot_id=boot_id(),
            creation_id=uuid.uuid4().bytes,
            created_ns=time.time_ns(),
            layout_offset=layout_offset,
            layout_nbytes=len(layout_json),
            buffer_offsets=(buf0, buf1),
            buffer_nbytes=buffer_nbytes,
            file_nbytes=digests + 2 * stride,
            digests_offset=digests,
            digests_stride=stride,
        )

    def pack(self) -> bytes:
        identity = _IDENTITY.pack(
            MAGIC,
            FORMAT_VERSION,
            HEADER_NBYTES,
            self.creator_pid,
            self.creator_start,
            self.boot_id,
            self.creation_id,
            self.created_ns,
        )
        geometry = _GEOMETRY.pack(
            self.layout_offset,
            self.layout_nbytes,
            *self.buffer_offsets,
            self.buffer_nbytes,
            self.file_nbytes,
        )
        return identity + geometry + _DIGEST_TABLES.pack(self.digests_offset, self.digests_stride)

    @classmethod
    def unpack(cls, data: bytes, path: Path, *, check_version: bool = True) -> SegmentHeader:
        """Parse and check a header read from ``path``; errors name the file and the fault."""
        if len(data) < _IDENTITY.size + _GEOMETRY.size + _DIGEST_TABLES.size:
            raise SegmentFormatError(
                f"{path}: not a deltarl weight store (only {len(data)} bytes, "
                f"shorter than a segment header)"
            )
        magic, version, header_nbytes, pid, start, boot, creation, created = _IDENTITY.unpack_from(
            data
        )
        if magic != MAGIC:
            raise SegmentFormatError(
                f"{path}: not a deltarl weight store (magic {magic!r}, expected {MAGIC!r})"
            )
        if check_version and version != FORMAT_VERSION:
            raise SegmentFormatError(
                f"{path}: weight store format version {version}, "
                f"but this deltarl reads version {FORMAT_VERSION} only"
            )
        header = cls(pid, start, boot, creation, created, 0, 0, (0, 0), 0, 0)
        if not check_version:
            return header  # identity only: the geometry of another version is not ours to read
        lay_off, lay_n, buf0, buf1, buf_n, file_n = _GEOMETRY.unpack_from(data, _IDENTITY.size)
        dig_off, dig_stride = _DIGEST_TABLES.unpack_from(data, _IDENTITY.size + _GEOMETRY.size)
        header = cls(
            pid,
            start,
            boot,
            creation,
            created,
            lay_off,
            lay_n,
            (buf0, buf1),
            buf_n,
            file_n,
            dig_off,
            dig_stride,
        )
        tables_ok = (dig_off, dig_stride) == (0, 0) or (
            not dig_off % PAGE
            and not dig_stride % PAGE
            and dig_off >= buf1 + buf_n
            and file_n >= dig_off + 2 * dig_stride
        )
        if (
            not tables_ok
            or header_nbytes != HEADER_NBYTES
            or lay_off < HEADER_NBYTES
            or buf0 % PAGE
            or buf1 % PAGE
            or buf0 < lay_off + lay_n
            or buf1 < buf0 + buf_n
            or file_n < buf1 + buf_n
        ):
            raise SegmentFormatError(
                f"{path}: corrupt weight store header (header {header_nbytes} bytes, layout at "
                f"{lay_off}+{lay_n}, buffers at {buf0} and {buf1} of {buf_n} bytes, "
                f"tensor digests at {dig_off} every {dig_stride} bytes, file {file_n} bytes)"
            )
        return header

    def parse_layout(self, table: bytes, path: Path) -> Layout:
        try:
            layout = Layout.from_json(table)
        except ValueError as exc:
            raise SegmentFormatError(f"{path}: corrupt layout table: {exc}") from exc
        if layout.nbytes != self.buffer_nbytes:
            raise SegmentFormatError(
                f"{path}: layout table says {layout.nbytes} bytes per buffer, "
                f"header says {self.buffer_nbytes}"
            )
        if self.digests_stride and self.digests_stride < len(layout) * DIGEST_BYTES:
            raise SegmentFormatError(
                f"{path}: tensor digest tables of {self.digests_stride} bytes cannot hold "
                f"{len(layout)} tensors' digests"
            )
        return layout

    def creator_alive(self) -> bool:
        """Whether the process that created the segment is still running (not a reused pid)."""
        if self.boot_id != boot_id():
            return False
        return process_alive(self.creator_pid, self.creator_start)


def page_align(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


def segment_path(name: str, root: Path | None) -> Path:
    """Where the segment called ``name`` lives; a clear error for a name that is not safe."""
    if not isinstance(name, str) or not NAME_RE.fullmatch(name) or len(name) > MAX_NAME:
        raise ValueError(
            f"bad weight store name {name!r}: use 1-{MAX_NAME} characters from "
            f"[A-Za-z0-9_.-] (it becomes the file name {PREFIX}<name>)"
        )
    if name in (".", ".."):
        raise ValueError(f"bad weight store name {name!r}: '.' and '..' are not names")
    return (DEFAULT_ROOT if root is None else Path(root)) / f"{PREFIX}{name}"


def boot_id() -> bytes:
    """This boot's id (16 bytes); zeros where /proc does not say."""
    try:
        text = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return uuid.UUID(text).bytes
    except (OSError, ValueError):
        return bytes(16)


def process_start_ticks(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot); None if there is none.

    A zombie counts as gone: it has exited and only waits to be reaped.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces or parentheses itself,
    # so split after the last ')': the rest starts with field 3 (state); field 22 is starttime.
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def process_alive(pid: int, start_ticks: int) -> bool:
    if pid <= 0:
        return False
    if Path("/proc/self/stat").exists():
        started = process_start_ticks(pid)
        # A start time of 0 in the header means "unknown": trust the pid alone.
        return started is not None and start_ticks in (0, started)
    try:  # pragma: no cover - no procfs
        os.kill(pid, 0)
    except ProcessLookupError:  # pragma: no cover
        return False
    except PermissionError:  # pragma: no cover - alive, owned by another user
        return True
    return True  # pragma: no cover


def same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file open as ``fd`` (it may have been replaced)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return False
    fst = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)


def try_remove_stale(path: Path) -> str | None:
    """Remove the segment at ``path`` if it is stale; otherwise say why it was kept.

    Stale means: a deltarl segment whose creator is dead and on which no process holds any
    lock (no open WeightStore, no lease, no writer). Returns None when this call removed it,
    else why it was not removed, worded to follow "it ..." (``GONE`` if it no longer exists).
    """
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return GONE
    except OSError as exc:
        return f"cannot be opened to check it ({exc.strerror})"
    try:
        owner = os.fstat(fd).st_uid
        if owner != os.geteuid():  # root included: never remove another user's file
            reason: str | None = f"belongs to another user (uid {owner})"
        else:
            reason = _why_alive(fd, path)
        if reason is None:
            path.unlink()
    finally:
        os.close(fd)  # drops the lock _why_alive took
    if reason is None:
        logger.warning("removed stale weight store %s: its creator is gone, nobody holds it", path)
    return reason


def _why_alive(fd: int, path: Path) -> str | None:
    """Why the segment open as ``fd`` is not stale; None if it is (and then we hold it)."""
    tmp = _TMP_RE.fullmatch(path.name)
    if tmp is not None:  # an unfinished create(): its header may be incomplete
        if process_alive(int(tmp.group(1)), 0):
            return f"is being created by live process {tmp.group(1)}"
    else:
        try:
            header = SegmentHeader.unpack(os.pread(fd, PAGE, 0), path, check_version=False)
        except SegmentFormatError:
            return "is not a deltarl weight store"
        if header.creator_alive():
            return f"belongs to live process {header.creator_pid}"
    # The exclusive lock over every lock byte is both the test "nobody is attached" and the
    # guard that keeps another cleaner (or an opener, see read_segment) off the file while we
    # unlink it.
    if not leases.try_lock(fd, 0, exclusive=True, length=leases.LOCK_SPAN):
        return "is still in use (an open store, a lease or a writer holds it)"
    if not same_file(fd, path):
        return GONE  # replaced meanwhile by someone else's cleanup: not ours to remove
    return None


def allocate(fd: int, nbytes: int, name: str) -> None:
    """Reserve the segment's memory now, so a full tmpfs is a clear error at create time.

    A sparse file would let the first write into an unbacked page kill the writer with
    SIGBUS in the middle of a refit instead.
    """
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise OSError(
                errno.ENOSPC,
                f"no room for weight store {name!r}: it needs {nbytes} bytes (two buffers and "
                f"a header) and the file system holding it is full",
            ) from exc
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.ftruncate(fd, nbytes)  # a file system without fallocate: sparse, as a last resort


def publish(tmp: Path, path: Path, name: str) -> None:
    """Give the finished segment at ``tmp`` the name ``path``, replacing only a stale one.

    ``link`` is atomic and fails if the name is taken, so no process ever sees a segment
    before its header is complete, and two creators never both win.
    """
    for _ in range(_CREATE_ATTEMPTS):
        try:
            os.link(tmp, path)
        except FileExistsError:
            reason = try_remove_stale(path)
            if reason is not None and reason != GONE:
                raise FileExistsError(
                    f"weight store {name!r} already exists at {path} and it {reason}; "
                    f"open it with WeightStore.open(), or unlink it first"
                ) from None
        else:
            return
    raise FileExistsError(f"weight store {name!r} at {path} kept being recreated meanwhile")


def read_segment(
    fd: int, path: Path, expected: Layout | None
) -> tuple[SegmentHeader, Layout] | None:
    """Attach to and check the segment open as ``fd``; None if ``path`` no longer names it.

    Takes the SHARED attach lock on ``fd``, which the caller keeps while it uses the segment.
    """
    # A cleaner removing a stale segment holds EXCLUSIVE over every lock byte while it unlinks;
    # taking our SHARED attach lock and then checking that the path still names this file keeps
    # us off a segment that is on its way out.
    if not leases.wait_lock(fd, leases.LOCK_ATTACH, exclusive=False, timeout=_ATTACH_WAIT_S):
        raise leases.LeaseTimeout(f"{path}: stayed locked by a cleaner for {_ATTACH_WAIT_S} s")
    if not same_file(fd, path):
        return None
    header = SegmentHeader.unpack(os.pread(fd, PAGE, 0), path)
    size = os.fstat(fd).st_size
    if size < header.file_nbytes:
        raise SegmentFormatError(
            f"{path}: truncated weight store ({size} bytes, its header says {header.file_nbytes})"
        )
    layout = header.parse_layout(os.pread(fd, header.layout_nbytes, header.layout_offset), path)
    if expected is not None and expected != layout:
        raise SegmentFormatError(
            f"{path}: holds a different layout ({len(layout)} tensors, {layout.nbytes} bytes) "
            f"than expected ({len(expected)} tensors, {expected.nbytes} bytes)"
        )
    return header, layout


def cleanup_stale(root: Path | None = None) -> list[str]:
    """Remove every stale deltarl segment (and abandoned half-created one) under ``root``.

    Returns the file names removed. Segments in use or whose creator lives are left alone.
    """
    base = DEFAULT_ROOT if root is None else Path(root)
    candidates = sorted([*base.glob(f"{PREFIX}*"), *base.glob(f".{PREFIX}*.tmp")])
    return [p.name for p in candidates if p.is_file() and try_remove_stale(p) is None]
