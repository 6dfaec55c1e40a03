"""The same-host link: one file per chunk in shared memory, a ZeroMQ notice per file.

    sender                                             receiver
    1. wait for room and for a connected receiver      (binds PULL after cleaning)
    2. write .v<V>-c<C>.<pid>-<seq>.tmp, rename it
       to v<V>-c<C>.<pid>-<seq>.bin
    3. PUSH [KIND_CHUNK, NOTICE, file name] ---------> 4. open, check size and xxh3-64, mmap,
                                                          yield a zero-copy view
                                                       5. release(): unmap, unlink the file
    PUSH [KIND_MANIFEST, version u64, json] -------> yield the manifest (no file: it is small)

NOTICE is ``<QIQQ``: version u64, chunk_id u32, size u64, xxh3-64 of the file's bytes. The
notice names a file, never a path: the receiver accepts only a chunk file name and joins it
to its own directory, so a notice cannot make it open or delete anything else.

Invariants:
- A chunk file exists under its public name only complete: it is written under a temporary
  name and renamed, which is atomic, and the notice is sent only after the rename.
- A sender writes a file only while a receiver is connected (ZMQ_IMMEDIATE and a POLLOUT
  wait), and a receiver removes every chunk file it finds before it binds. So every file
  present at a receiver's start belongs to no live notice (its notice was queued to a dead
  receiver, or died with its sender) and is stale. Temporary files are removed only when
  their writer (the pid in the name) is dead: a live one may be writing it right now.

Withdrawal: a sender that gave up on a version (the export agent heard no acknowledgement in
time, or the link failed) removes its files of that version the receiver has not taken
(``withdraw``). The receiver skips a notice whose file is gone (or refuses a bad one), and
drops the manifest of a version whose chunks were lost so until a chunk of it arrives again (a
later send of it): that send cannot complete, so it must not open a version
(``ShmReceiver._lost``).

Backpressure: the directory is the queue. A sender counts its own files there (released
files are unlinked) and waits while there are ``max_pending_chunks``, up to
``pending_timeout_s``, then raises LinkError. Nothing is dropped silently.

Ownership (``deltarl.ownership``): the link directory must be this user's and 0700 (it is
made so), and the directories above it trusted; chunk files are written 0600 and a file that
is not this user's, or that others may write, is refused; the notice socket is 0600. Else
another user could swap a chunk under the receiver, or answer its notices.

What this link does not promise: acknowledgements. On one host the only loss is a receiver
crash, and a receiver that restarts gets a full version (docs/architecture.md, contract 4).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import mmap
import os
import re
import secrets
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import xxhash
import zmq
import zmq.asyncio

from deltarl.engine.segment import process_alive
from deltarl.ownership import check_file, check_private_dir, check_trusted_dirs
from deltarl.transport.base import (
    ChunkReceiver,
    ChunkSender,
    DeliveredSet,
    LinkError,
    Received,
    ReceivedChunk,
    ReceivedManifest,
    check_ids,
    fingerprint,
    manifest_mark,
)
from deltarl.transport.link_config import ShmLinkConfig
from deltarl.transport.router import bind_endpoint

logger = logging.getLogger(__name__)

KIND_CHUNK = b"\x01"
KIND_MANIFEST = b"\x02"
NOTICE = struct.Struct("<QIQQ")
VERSION = struct.Struct("<Q")

CHUNK_FILE = re.compile(r"v(\d+)-c(\d+)\.(\d+)-(\d+)\.bin")
TMP_FILE = re.compile(r"\.v\d+-c\d+\.(\d+)-\d+\.[0-9a-f]+\.tmp")
MAX_IPC_PATH = 107  # sun_path holds 108 bytes with the terminating NUL
_POLL_S = (0.001, 0.05)  # the room wait polls the directory, from 1 ms backing off to 50 ms


def endpoint_of(config: ShmLinkConfig) -> str:
    if config.endpoint is not None:
        return config.endpoint
    path = str(config.directory / "notify.sock")
    if len(path.encode()) > MAX_IPC_PATH:
        raise ValueError(
            f"shm link {config.name!r}: the notice socket path {path} is over {MAX_IPC_PATH} "
            f"bytes; choose a shorter root or name, or set endpoint"
        )
    return f"ipc://{path}"


def remove_stale(directory: Path, *, chunk_files: bool) -> list[str]:
    """Remove temporary files of dead writers and, if ``chunk_files``, every chunk file.

    Returns the names removed. Other files (the notice socket) are left alone.
    """
    removed = []
    for entry in os.scandir(directory):
        tmp = TMP_FILE.fullmatch(entry.name)
        dead_tmp = tmp is not None and not process_alive(int(tmp.group(1)), 0)
        if dead_tmp or (chunk_files and CHUNK_FILE.fullmatch(entry.name)):
            Path(entry.path).unlink(missing_ok=True)
            removed.append(entry.name)
    if removed:
        logger.warning("removed %d stale chunk files from %s", len(removed), directory)
    return removed


def _make_directory(config: ShmLinkConfig) -> Path:
    """The link directory, made 0700 if missing; UnsafePathError (a ConfigError) if it is not
    this user's own private directory, or a directory above it is not trusted: another user
    could swap chunk files in it (``deltarl.ownership``)."""
    directory = config.directory
    what = f"shm link {config.name!r}"
    check_trusted_dirs(directory.parent, what)
    with contextlib.suppress(FileExistsError):  # checked below, whoever made it
        directory.mkdir(mode=0o700)
    check_private_dir(directory, what)
    return directory


class ShmSender(ChunkSender):
    """Writes chunk files and notifies the receiver. ``send_manifest`` returns once the
    manifest's notice is queued to a connected receiver: this link has no acknowledgements."""

    def __init__(
        self, config: ShmLinkConfig, *, context: zmq.asyncio.Context | None = None
    ) -> None:
        self.config = config
        self._endpoint = endpoint_of(config)
        self._context = context or zmq.asyncio.Context.instance()
        self._sock: zmq.asyncio.Socket | None = None
        self._pid = os.getpid()
        self._seq = itertools.count()
        self._closed = False

    async def start(self) -> None:
        if self._closed:
            raise LinkError(f"shm link {self.config.name!r}: the sender is closed")
        if self._sock is not None:
            return
        directory = _make_directory(self.config)
        remove_stale(directory, chunk_files=False)
        sock = self._context.socket(zmq.PUSH)
        # IMMEDIATE: queue notices only to a receiver that is connected, so POLLOUT means
        # "a receiver is there" (see the invariants above).
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.LINGER, 1000)  # on close, notices already queued may still leave
        sock.connect(self._endpoint)
        self._sock = sock

    async def send_chunk(self, version: int, chunk_id: int, data: bytes | memoryview) -> None:
        check_ids(version, chunk_id)
        sock = await self._ready()
        await self._wait_for_room()
        await self._wait_for_receiver(sock)
        name = f"v{version}-c{chunk_id}.{self._pid}-{next(self._seq)}.bin"
        # Writing tens of megabytes into tmpfs and hashing them would stall the event loop.
        try:
            size, checksum = await asyncio.to_thread(self._write, name, data)
        except OSError as e:
            # Resource exhaustion (ENOSPC, EDQUOT: a full /dev/shm; EMFILE) is a failure of
            # this send, not of the agent: the export agent fails the version and sends it
            # again after a back-off, which succeeds once space is freed.
            raise LinkError(
                f"shm link {self.config.name!r}: cannot write chunk {chunk_id} of version "
                f"{version} into {self.config.directory}: {e.strerror or e}"
            ) from e
        await sock.send_multipart(
            [KIND_CHUNK, NOTICE.pack(version, chunk_id, size, checksum), name.encode()]
        )

    async def send_manifest(self, version: int, manifest_json: bytes) -> None:
        check_ids(version)
        if len(manifest_json) > self.config.max_manifest_bytes:
            raise ValueError(
                f"manifest of version {version} is {len(manifest_json)} bytes, over "
                f"max_manifest_bytes={self.config.max_manifest_bytes}"
            )
        sock = await self._ready()
        await self._wait_for_receiver(sock)
        await sock.send_multipart([KIND_MANIFEST, VERSION.pack(version), manifest_json])

    async def close(self) -> None:
        self._closed = True
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    async def withdraw(self, version: int) -> int:
        """Remove this process's chunk files of ``version`` that the receiver has not taken.

        Left, they would hold shared memory until a receiver stalled for long (a compile, a
        paused process) reads them, and then make it apply a version the sender gave up on
        and has sent again or passed since (its rollout engines reloading weights for
        nothing). Every sender of this process counts (a link error spends one, and the
        files it wrote stay), and only this process's files: the pid is in the name. A file
        the receiver has mapped already stays readable (unlinking keeps its pages); a notice
        naming a removed file is skipped, and the manifest after it too (``ShmReceiver``).
        Returns the files removed, a mapped one included."""
        return await asyncio.to_thread(self._remove_own, version)

    async def _ready(self) -> zmq.asyncio.Socket:
        await self.start()
        if self._sock is None:
            raise LinkError(f"shm link {self.config.name!r}: the sender is closed")
        return self._sock

    def _write(self, name: str, data: bytes | memoryview) -> tuple[int, int]:
        directory = self.config.directory
        tmp = directory / f".{name.removesuffix('.bin')}.{secrets.token_hex(4)}.tmp"
        view = memoryview(data).cast("B")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
        fd = os.open(tmp, flags, 0o600)
        try:
            written = 0
            while written < len(view):  # os.write may write less than asked
                written += os.write(fd, view[written:])
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        os.rename(tmp, directory / name)
        return len(view), xxhash.xxh3_64_intdigest(view)

    def _own_files(self) -> Iterator[tuple[int, str]]:
        """(version, path) of each chunk file this process wrote that is still there."""
        own = str(self._pid)
        try:
            entries = list(os.scandir(self.config.directory))
        except FileNotFoundError:  # never started: nothing written
            return
        for entry in entries:
            if (m := CHUNK_FILE.fullmatch(entry.name)) and m.group(3) == own:
                yield int(m.group(1)), entry.path

    def _pending_files(self) -> int:
        return sum(1 for _ in self._own_files())

    def _remove_own(self, version: int) -> int:
        removed = 0
        for found, path in self._own_files():
            if found == version:
                try:
                    os.unlink(path)
                except FileNotFoundError:  # taken and released meanwhile
                    continue
                removed += 1
        return removed

    async def _wait_for_room(self) -> None:
        limit, deadline = self.config.max_pending_chunks, self.config.pending_timeout_s
        start, delay = time.monotonic(), _POLL_S[0]
        while (pending := self._pending_files()) >= limit:
            if time.monotonic() - start > deadline:
                raise LinkError(
                    f"shm link {self.config.name!r}: the receiver has not released {pending} "
                    f"chunk files in {deadline:g} s (max_pending_chunks={limit}); "
                    f"is it consuming and releasing them?"
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, _POLL_S[1])

    async def _wait_for_receiver(self, sock: zmq.asyncio.Socket) -> None:
        timeout = self.config.connect_timeout_s
        ms = None if timeout is None else int(timeout * 1000)
        if not await sock.poll(ms, zmq.POLLOUT):
            raise LinkError(
                f"shm link {self.config.name!r}: no receiver on {self._endpoint} "
                f"within {timeout:g} s"
            )


class ShmReceiver(ChunkReceiver):
    """Maps each notified chunk file and yields a zero-copy view of it; ``release()`` unmaps
    and unlinks it. Bad notices are logged and skipped."""

    def __init__(
        self, config: ShmLinkConfig, *, context: zmq.asyncio.Context | None = None
    ) -> None:
        self.config = config
        self._endpoint = endpoint_of(config)
        self._context = context or zmq.asyncio.Context.instance()
        self._sock: zmq.asyncio.Socket | None = None
        self._delivered = DeliveredSet(config.keep_versions)
        self._held: dict[str, ReceivedChunk] = {}  # by file name: yielded, not yet released
        self._closed = False
        self._receiving: asyncio.Future[list[bytes]] | None = None  # the pending recv
        # Versions whose last chunk notice named a file that was gone (withdrawn by its
        # sender, or removed as stale) or bad: their manifest cannot complete them, so it is
        # dropped, until a chunk of the version arrives again (a send of it after that).
        self._lost: set[int] = set()

    @property
    def held(self) -> int:
        """Chunks yielded and not yet released."""
        return len(self._held)

    async def start(self) -> None:
        if self._sock is not None or self._closed:
            return
        directory = _make_directory(self.config)
        remove_stale(directory, chunk_files=True)  # before binding: see the invariants
        sock = self._context.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            bind_endpoint(sock, self._endpoint)  # an ipc socket file: 0600, directory checked
        except OSError as exc:
            sock.close()
            raise OSError(f"shm link {self.config.name!r}: {exc}") from exc
        except BaseException:
            sock.close()
            raise
        self._sock = sock

    async def __anext__(self) -> Received:
        await self.start()
        while True:
            frames = await self._receive()
            if frames is None:
                raise StopAsyncIteration
            if self._closed:  # it arrived as close() ran
                self._discard(frames)
                raise StopAsyncIteration
            item = await self._decode(frames)
            if item is not None:
                return item

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        sock, self._sock = self._sock, None
        if self._receiving is not None and not self._receiving.done():
            self._receiving.cancel()  # a waiting __anext__ ends; no notice is taken by it
        if sock is not None:
            # Notices already here name files nobody will read: remove those files now.
            while True:
                try:
                    self._discard(await sock.recv_multipart(flags=zmq.NOBLOCK))
                except zmq.Again:
                    break
            sock.close()
        for chunk in list(self._held.values()):
            chunk.release()

    async def _receive(self) -> list[bytes] | None:
        """The next notice's frames, or None once closed."""
        if self._sock is None:
            return None
        receiving = self._sock.recv_multipart()
        self._receiving = receiving
        try:
            await asyncio.wait({receiving})  # never raises for the future's own outcome
        finally:
            self._receiving = None
            if not receiving.done():  # this task was cancelled: leave no recv behind
                receiving.cancel()
        if receiving.cancelled():  # by close()
            return None
        return receiving.result()

    def _discard(self, frames: list[bytes]) -> None:
        """Remove the file a notice names: nobody will read it (the receiver is closing)."""
        if frames[0] == KIND_CHUNK and len(frames) == 3:
            name = frames[2].decode(errors="replace")
            if CHUNK_FILE.fullmatch(name):
                (self.config.directory / name).unlink(missing_ok=True)

    async def _decode(self, frames: list[bytes]) -> Received | None:
        kind = frames[0]
        if kind == KIND_MANIFEST and len(frames) == 3 and len(frames[1]) == VERSION.size:
            (version,) = VERSION.unpack(frames[1])
            if len(frames[2]) > self.config.max_manifest_bytes:
                logger.error("shm link: refused a %d-byte manifest", len(frames[2]))
                return None
            if version in self._lost:
                logger.warning(
                    "shm link: dropped the manifest of version %d: chunks of it were lost "
                    "(withdrawn by a sender that gave up on it, or refused)",
                    version,
                )
                return None
            if not self._delivered.add_manifest(version, manifest_mark(frames[2])):
                return None
            return ReceivedManifest(version, frames[2])
        if kind == KIND_CHUNK and len(frames) == 3 and len(frames[1]) == NOTICE.size:
            return await self._map_chunk(*NOTICE.unpack(frames[1]), frames[2])
        logger.error("shm link: dropped a bad notice (%d frames, kind %r)", len(frames), kind[:1])
        return None

    async def _map_chunk(
        self, version: int, chunk_id: int, size: int, checksum: int, raw_name: bytes
    ) -> ReceivedChunk | None:
        name = raw_name.decode(errors="replace")
        m = CHUNK_FILE.fullmatch(name)
        if m is None or (int(m.group(1)), int(m.group(2))) != (version, chunk_id):
            logger.error(
                "shm link: notice for version %d chunk %d names %r, not its chunk file",
                version,
                chunk_id,
                name,
            )
            return None
        path = self.config.directory / name
        try:
            mm, view = await asyncio.to_thread(self._map, path, size, checksum)
        except FileNotFoundError:
            # Withdrawn by its sender (it gave up on the version) or removed as stale by a
            # receiver's start: either way this send of the version cannot complete.
            logger.info("shm link: version %d chunk %d is gone (%s)", version, chunk_id, name)
            self._lose(version)
            return None
        except ValueError as exc:
            logger.error("shm link: refused version %d chunk %d: %s", version, chunk_id, exc)  # noqa: TRY400 - a bad file, not a bug here
            path.unlink(missing_ok=True)
            self._lose(version)
            return None
        self._lost.discard(version)  # a send of it after the one withdrawn
        chunk = ReceivedChunk(version, chunk_id, view, lambda: self._free(name, path, mm, view))
        if self._closed or not self._delivered.add_chunk(version, chunk_id, fingerprint(view)):
            chunk.release()  # closed while mapping, or a duplicate: delivered once already
            return None
        self._held[name] = chunk
        return chunk

    def _lose(self, version: int) -> None:
        """A chunk of ``version`` will not be delivered: this send of it cannot complete."""
        self._lost.add(version)
        while len(self._lost) > self.config.keep_versions:
            self._lost.discard(min(self._lost))

    def _map(
        self, path: Path, size: int, checksum: int
    ) -> tuple[mmap.mmap | None, bytes | memoryview]:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            # Ours and writable by nobody else, or another user could change it under the
            # mapping (the 0700 directory keeps others out anyway; this checks the file too).
            found = check_file(fd, path, "chunk file").st_size
            if found != size:
                raise ValueError(f"{path} holds {found} bytes, its notice says {size}")
            # mmap cannot map an empty file; an empty chunk needs no mapping.
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ) if size else None
        finally:
            os.close(fd)  # the mapping keeps the pages
        view: bytes | memoryview = memoryview(mm) if mm is not None else b""
        if self.config.verify_checksum and xxhash.xxh3_64_intdigest(view) != checksum:
            _unmap(mm, view)
            raise ValueError(f"{path} does not match its notice's xxh3-64 {checksum:#018x}")
        return mm, view

    def _free(self, name: str, path: Path, mm: mmap.mmap | None, view: bytes | memoryview) -> None:
        self._held.pop(name, None)
        _unmap(mm, view)
        path.unlink(missing_ok=True)


def _unmap(mm: mmap.mmap | None, view: bytes | memoryview) -> None:
    try:
        if isinstance(view, memoryview):
            view.release()
        if mm is not None:
            mm.close()
    except BufferError:
        # The consumer still holds a view into the chunk (a numpy array, say). The file is
        # unlinked anyway; the pages go back once that last view is dropped.
        logger.debug("chunk mapping still exported by the consumer; freed when it is dropped")
