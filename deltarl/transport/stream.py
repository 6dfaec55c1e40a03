"""The cross-region link: chunks over N parallel TCP connections, acknowledged, resumable.

The frames are in stream_wire.py and the receiver in stream_receiver.py; this is the sender.

``send_chunk`` assigns each chunk to a connection round-robin and returns once it is queued
there; ``send_manifest`` returns once the receiver has acknowledged every chunk of the version
and the manifest. Every connection runs one task, a loop of these states:

    IDLE        nothing assigned to it: no connection is held open
      v  work arrives
    CONNECTING  up to max_attempts tries in a row, capped exponential backoff with jitter;
      |         exhausted: the whole sender fails, every waiting call raises LinkError
      v
    RESUMING    for each version with chunks written before on an earlier connection but not
      |         acknowledged: QUERY it, and drop the chunks the receiver says it holds
      |         (their acks were lost in the cut). The rest is queued again in order, so
      v         sending restarts at the first chunk the receiver is missing
    SENDING     write queued frames; acks arrive on a reader task. The connection is lost when
      |         reading or writing fails, on a protocol error, or when frames stay
      |         unacknowledged (or a write stays blocked) for ack_timeout_s
      '--> IDLE or CONNECTING. A lost connection counts as a failed try unless it got an
           acknowledgement or had nothing unacknowledged on it

Security: with the cluster's keys (``DELTARL_CURVE_KEYS``; ``config.security``), each
connection is TLS 1.3, mutually authenticated by the cluster's CA (data_keys.py); a refused
handshake is a failed connection attempt like any other.

Backpressure and memory: the sender keeps every frame until it is acknowledged (it may have
to resend it), and at most ``window_bytes`` of them; ``send_chunk`` waits for room. Acked
frames are forgotten, so a receiver that restarts and loses what it held is not refilled
from here: it gets a full version through the control plane (docs/architecture.md, contract 4).
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from deltarl.transport.base import ChunkSender, LinkError, check_ids
from deltarl.transport.data_keys import link_keys
from deltarl.transport.link_config import StreamLinkConfig
from deltarl.transport.stream_receiver import ReceiverStats, StreamReceiver
from deltarl.transport.stream_wire import (
    MSG_ACK,
    MSG_CHUNK,
    MSG_HELD,
    MSG_MANIFEST,
    MSG_QUERY,
    TO_SENDER,
    WireError,
    compress,
    pack_header,
    read_message,
    unpack_ids,
)

__all__ = ["ReceiverStats", "SenderStats", "StreamReceiver", "StreamSender"]

logger = logging.getLogger(__name__)

_THREAD_BYTES = 1 << 20  # compress larger payloads off the event loop
_WATCH_S = 1.0  # how often an idle SENDING loop checks for overdue acknowledgements

Key = tuple[int, int, int]  # (message type, version, chunk id): what an ack names


@dataclass
class SenderStats:
    """Counters of one sender, for logs, metrics and tests."""

    frames_sent: int = 0  # chunk and manifest frames written, resends included
    payload_bytes_sent: int = 0
    resent: int = 0  # frames written again on a new connection
    acked: int = 0
    held_on_resume: int = 0  # unacknowledged frames the receiver said it already held
    reconnects: int = 0


@dataclass(eq=False)
class _Frame:
    key: Key
    header: bytes
    payload: bytes | memoryview
    link: _Link
    sends: int = 0
    written: bool = False  # on the link's current connection


class _Link:
    """One connection slot: its queue of keys to write and the state of its connection."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.outbox: deque[Key] = deque()
        self.wake = asyncio.Event()
        self.writer: asyncio.StreamWriter | None = None
        self.lost: BaseException | None = None  # why the current connection ended
        self.progressed = False  # an ack arrived on the current connection
        self.last_heard = 0.0  # monotonic time of the last ack or completed write
        self.held_waiters: dict[int, asyncio.Future[set[int]]] = {}

    def lose(self, reason: BaseException) -> None:
        if self.lost is None:
            self.lost = reason
        self.wake.set()
        if self.writer is not None:
            self.writer.transport.abort()  # unblocks a write waiting in drain()


class StreamSender(ChunkSender):
    """Sends to one StreamReceiver over ``config.connections`` connections."""

    def __init__(self, config: StreamLinkConfig) -> None:
        self.config = config
        self.stats = SenderStats()
        self._peer = f"{config.host}:{config.port}"
        keys = link_keys("stream link sender", config.host, config.security)
        self._tls = None if keys is None else keys.client_context()
        self._links = [_Link(i) for i in range(config.connections)]
        self._tasks: list[asyncio.Task[None]] = []
        self._pending: dict[Key, _Frame] = {}
        self._unacked_bytes = 0
        self._next_link = 0
        self._error: LinkError | None = None
        self._changed = asyncio.Event()  # replaced at every change: a broadcast to waiters

    # -- public ----------------------------------------------------------------------------

    async def start(self) -> None:
        self._check()
        if not self._tasks:
            self._tasks = [
                asyncio.create_task(self._run_link(link), name=f"stream-link-{link.index}")
                for link in self._links
            ]

    async def send_chunk(self, version: int, chunk_id: int, data: bytes | memoryview) -> None:
        check_ids(version, chunk_id)
        self._check_size(data, f"chunk {chunk_id} of version {version}")
        await self.start()
        key = (MSG_CHUNK, version, chunk_id)
        if key in self._pending:
            return  # already on its way; the receiver would drop the copy anyway
        compressed, payload = await self._encode(data)
        window = self.config.window_bytes
        await self._wait(
            lambda: not self._unacked_bytes or self._unacked_bytes + len(payload) <= window
        )
        if key not in self._pending:  # a concurrent call may have queued it while we waited
            self._enqueue(key, compressed, payload)

    async def send_manifest(self, version: int, manifest_json: bytes) -> None:
        """Send the manifest; return once it and every chunk of ``version`` are acknowledged."""
        check_ids(version)
        self._check_size(manifest_json, f"manifest {version}")
        await self.start()
        key = (MSG_MANIFEST, version, 0)
        if key not in self._pending:
            compressed, payload = await self._encode(manifest_json)
            self._enqueue(key, compressed, payload)
        await self._wait(lambda: all(k[1] != version for k in self._pending))

    async def close(self) -> None:
        if self._error is None:
            self._fail(LinkError(f"stream link to {self._peer}: the sender is closed"))
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._pending:
            logger.warning(
                "stream link to %s closed with %d frames unacknowledged",
                self._peer,
                len(self._pending),
            )

    # -- queueing --------------------------------------------------------------------------

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    async def _wait(self, ready: Callable[[], bool]) -> None:
        while True:
            self._check()
            if ready():
                return
            await self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _fail(self, error: LinkError) -> None:
        if self._error is None:
            self._error = error
            self._notify()
            for link in self._links:
                link.lose(error)  # every connection task ends

    def _check_size(self, data: bytes | memoryview, what: str) -> None:
        # The receiver refuses a payload over its limit before or after decompression.
        limit = self.config.max_frame_bytes
        if len(data) > limit:
            raise ValueError(f"{what} is {len(data)} bytes, over max_frame_bytes={limit}")

    async def _encode(self, data: bytes | memoryview) -> tuple[bool, bytes | memoryview]:
        if not self.config.compress:
            return False, data
        level = self.config.compression_level
        if len(data) > _THREAD_BYTES:
            return await asyncio.to_thread(compress, data, level)
        return compress(data, level)

    def _enqueue(self, key: Key, compressed: bool, payload: bytes | memoryview) -> None:
        link = self._links[self._next_link % len(self._links)]
        self._next_link += 1
        header = pack_header(*key, len(payload), compressed=compressed)
        self._pending[key] = _Frame(key, header, payload, link)
        self._unacked_bytes += len(payload)
        link.outbox.append(key)
        link.wake.set()

    def _acked(self, key: Key, *, on_resume: bool = False) -> None:
        frame = self._pending.pop(key, None)
        if frame is None:
            return  # a late ack for a frame acknowledged already (a resend's twin)
        self._unacked_bytes -= len(frame.payload)
        if on_resume:
            self.stats.held_on_resume += 1
        else:
            self.stats.acked += 1
        self._notify()

    def _frames_of(self, link: _Link) -> list[_Frame]:
        return [f for f in self._pending.values() if f.link is link]

    # -- one connection --------------------------------------------------------------------

    async def _run_link(self, link: _Link) -> None:
        failures = 0
        while self._error is None:
            while not self._frames_of(link) and self._error is None:  # IDLE
                link.wake.clear()
                await link.wake.wait()
            if self._error is not None:
                return
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(
                        self.config.host,
                        self.config.port,
                        ssl=self._tls,
                        server_hostname=self.config.host if self._tls else None,
                    ),
                    self.config.connect_timeout_s,
                )
            except OSError as exc:  # refused, unreachable, TimeoutError, or a TLS refusal
                reason: BaseException = exc
            else:
                reason = await self._serve(link, reader, writer)
                if link.progressed:
                    failures = 0
            if self._error is not None:
                return  # the sender failed or was closed meanwhile
            failures += 1
            if failures >= self.config.max_attempts:
                self._fail(
                    LinkError(
                        f"stream link to {self._peer}: connection {link.index} gave up after "
                        f"{failures} attempts without an acknowledgement; last error: {reason!r}"
                    )
                )
                logger.error("%s", self._error)
                return
            delay = min(self.config.backoff_max_s, self.config.backoff_s * 2 ** (failures - 1))
            delay *= random.uniform(0.5, 1.0)  # noqa: S311 - jitter, not a secret
            logger.warning(
                "stream link to %s: connection %d: %r; retrying in %.2f s (attempt %d of %d)",
                self._peer,
                link.index,
                reason,
                delay,
                failures + 1,
                self.config.max_attempts,
            )
            self.stats.reconnects += 1
            await asyncio.sleep(delay)

    async def _serve(
        self, link: _Link, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> BaseException:
        """RESUMING then SENDING on one connection; returns why the connection ended."""
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        link.writer, link.lost, link.progressed = writer, None, False
        link.last_heard = time.monotonic()
        for frame in self._frames_of(link):
            frame.written = False
        acks = asyncio.create_task(self._read_acks(link, reader))
        try:
            await self._resume(link, writer)
            while link.lost is None:
                while link.outbox and link.lost is None:
                    frame = self._pending.get(link.outbox.popleft())
                    if frame is not None and frame.link is link:  # else: acked meanwhile
                        await self._write(link, writer, frame)
                link.wake.clear()
                if link.outbox or link.lost is not None:
                    continue
                try:
                    async with asyncio.timeout(min(_WATCH_S, self.config.ack_timeout_s / 2)):
                        await link.wake.wait()
                except TimeoutError:
                    self._check_overdue(link)
        except OSError as exc:  # reset, drain or query timeout (TimeoutError is an OSError)
            link.lose(exc)
        finally:
            if link.lost is None:
                link.lose(ConnectionError("connection closed"))  # cancelled: close()
            acks.cancel()
            await asyncio.gather(acks, return_exceptions=True)
            writer.transport.abort()
            link.writer = None
            for waiter in link.held_waiters.values():
                if not waiter.done():
                    waiter.set_exception(ConnectionError("connection lost during resume"))
            link.held_waiters.clear()
        if not any(f.written for f in self._frames_of(link)):
            link.progressed = True  # nothing was at stake on it: not a failed attempt
        return link.lost or ConnectionError("connection closed")

    async def _resume(self, link: _Link, writer: asyncio.StreamWriter) -> None:
        sent_before = {f.key[1] for f in self._frames_of(link) if f.key[0] == MSG_CHUNK and f.sends}
        for version in sorted(sent_before):
            waiter = asyncio.get_running_loop().create_future()
            link.held_waiters[version] = waiter
            writer.write(pack_header(MSG_QUERY, version))
            async with asyncio.timeout(self.config.ack_timeout_s):
                await writer.drain()
                held = await waiter
            for frame in self._frames_of(link):
                if frame.key[0] == MSG_CHUNK and frame.key[1] == version and frame.key[2] in held:
                    self._acked(frame.key, on_resume=True)
        order = sorted((f.key for f in self._frames_of(link)), key=lambda k: (k[1], k[0], k[2]))
        link.outbox = deque(order)

    async def _write(self, link: _Link, writer: asyncio.StreamWriter, frame: _Frame) -> None:
        if frame.sends:
            self.stats.resent += 1
        frame.sends += 1
        frame.written = True
        writer.write(frame.header)
        writer.write(frame.payload)
        # A write blocked this long means the receiver stopped reading: treat it as a cut.
        async with asyncio.timeout(self.config.ack_timeout_s):
            await writer.drain()
        link.last_heard = time.monotonic()
        self.stats.frames_sent += 1
        self.stats.payload_bytes_sent += len(frame.payload)

    def _check_overdue(self, link: _Link) -> None:
        silent = time.monotonic() - link.last_heard
        if silent > self.config.ack_timeout_s and any(f.written for f in self._frames_of(link)):
            link.lose(TimeoutError(f"no acknowledgement for {silent:.1f} s"))

    async def _read_acks(self, link: _Link, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                message = await read_message(reader, TO_SENDER, self.config.max_frame_bytes)
                if message is None:
                    raise ConnectionError("the receiver closed the connection")
                header, payload = message
                link.last_heard = time.monotonic()
                if header.kind == MSG_HELD:
                    waiter = link.held_waiters.pop(header.version, None)
                    if waiter is not None and not waiter.done():
                        waiter.set_result(unpack_ids(payload))
                    continue
                link.progressed = True
                kind = MSG_CHUNK if header.kind == MSG_ACK else MSG_MANIFEST
                self._acked((kind, header.version, header.chunk_id))
        except WireError as exc:
            # The peer's fault, not ours: the message says it all, a traceback would not help.
            logger.error("stream link to %s: bad reply, dropped: %s", self._peer, exc)  # noqa: TRY400
            link.lose(exc)
        except (OSError, EOFError) as exc:  # EOFError: IncompleteReadError, cut mid-message
            link.lose(exc)
