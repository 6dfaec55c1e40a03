"""The intra-region link: chunks over UCX (RDMA where the region has it), acknowledged.

ucxx (the maintained successor of ucx-py) moves the bytes: over InfiniBand or RoCE where the
hosts have it, else over UCX's tcp and shared-memory transports (``UCX_TLS`` chooses; the
tests run on loopback). ucxx is imported when a sender or receiver is made, never by
importing this module, so the config costs nothing where the ``ucx`` extra is not installed.

All messages are UCX tag messages on one endpoint. UCX matches the messages of one tag in the
order they were sent, which is what pairs a header with its payload:

    sender -> receiver   HEADER (32 bytes, ``_HEADER``) naming kind, version, chunk id and
                         length; then, if the length is not 0, the PAYLOAD as one message,
                         sent from the caller's buffer without a copy
    receiver -> sender   a HEADER of kind CHUNK_ACK or MANIFEST_ACK (length 0), once the item
                         is queued for the consumer, or found to be a duplicate

The sender, as a state machine (``_connect`` and ``_send`` keep it, under ``_lock``):

    DISCONNECTED  first send, or the connection was lost
      v
    CONNECTING    up to max_attempts tries in a row, connect_timeout_s each, doubling backoff;
      |           exhausted: the sender fails, and every call raises LinkError
      v
    CONNECTED     first resend every unacknowledged item (the receiver acknowledges and drops
                  the ones it holds), then send new items in order; a task reads the acks.
                  A failed send or ack read, or a send blocked for ack_timeout_s, loses the
                  connection: back to CONNECTING

Security: UCX carries the bytes in the clear. What proves a version's origin is the
manifest's seal (a MAC under the cluster's data key) and the BLAKE2b-256 it lists per chunk,
checked by the apply agent as for every link; a sender to a host that is not loopback
refuses to start without the keys unless ``security = "off"`` (data_keys.py).

Backpressure: ``send_chunk`` returns once UCX has taken the payload; above UCX's rendezvous
threshold that is once the receiver has pulled it, and the receiver pulls only while its queue
has room. The sender holds a reference to every unacknowledged payload (never a copy), which
is why ``data`` must not change until ``send_manifest`` returns. ``send_manifest`` returns once
the manifest and every chunk of its version are acknowledged; a version that hears no
acknowledgement for ack_timeout_s fails the sender with LinkError.
"""

from __future__ import annotations

import asyncio
import logging
import os
import struct
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

from deltarl.transport.base import (
    ChunkReceiver,
    ChunkSender,
    DeliveredSet,
    DeliveryQueue,
    LinkError,
    Received,
    ReceivedChunk,
    ReceivedManifest,
    check_ids,
    fingerprint,
    manifest_mark,
)
from deltarl.transport.data_keys import KEYS_ENV, DataKeys, link_keys
from deltarl.transport.link_config import UcxLinkConfig
from deltarl.transport.stream_wire import WireError

if TYPE_CHECKING:  # ucxx itself is imported on first use (see _ucxx)
    from ucxx._lib_async import Endpoint, Listener

logger = logging.getLogger(__name__)

_MAGIC = b"DRLU"
_WIRE_VERSION = 1
_END = b"ULRD"  # the last bytes: a short header message (zero-filled after it) lacks them
# magic, wire version, kind, reserved u16, version i64, chunk id u32, length u64, end marker
_HEADER = struct.Struct("<4sBBHqIQ4s")
CHUNK, MANIFEST, CHUNK_ACK, MANIFEST_ACK = 1, 2, 3, 4
TO_RECEIVER = {CHUNK: "chunk", MANIFEST: "manifest"}
TO_SENDER = {CHUNK_ACK: "chunk ack", MANIFEST_ACK: "manifest ack"}
_CLOSE_GRACE_S = 1.0

Key = tuple[int, int, int]  # (kind, version, chunk id): what an ack names


# -- wire -------------------------------------------------------------------------------------


def pack_header(kind: int, version: int, chunk_id: int = 0, length: int = 0) -> bytes:
    return _HEADER.pack(_MAGIC, _WIRE_VERSION, kind, 0, version, chunk_id, length, _END)


def unpack_header(
    data: bytes | bytearray, kinds: dict[int, str], max_bytes: int
) -> tuple[int, int, int, int]:
    """(kind, version, chunk id, length); WireError naming what is wrong."""
    magic, wire_version, kind, reserved, version, chunk_id, length, end = _HEADER.unpack(data)
    if magic != _MAGIC:
        raise WireError(f"bad magic {magic!r}, expected {_MAGIC!r}")
    if end != _END:
        raise WireError(f"header ends in {end!r}, not {_END!r}: a short or corrupt header")
    if reserved:
        raise WireError(f"the reserved header field is {reserved}, not 0")
    if wire_version != _WIRE_VERSION:
        raise WireError(f"wire version {wire_version}, expected {_WIRE_VERSION}")
    if kind not in kinds:
        raise WireError(f"message kind {kind} is not one of {sorted(kinds)} here")
    if version < 0:
        raise WireError(f"negative version {version}")
    if length > max_bytes:
        raise WireError(f"{kinds[kind]} of {length} bytes is over max_frame_bytes={max_bytes}")
    return kind, version, chunk_id, length


def _ucxx() -> ModuleType:
    """ucxx, imported on first use: a large native dependency, the ``ucx`` extra."""
    # UCX reads its options when ucxx makes its context, on first use. Without REUSEADDR a
    # restarted receiver cannot listen on its port while an old connection is in TIME_WAIT
    # (a minute on Linux). An operator's own setting wins.
    os.environ.setdefault("UCX_TCP_CM_REUSEADDR", "y")
    try:
        import ucxx  # noqa: PLC0415
    except ImportError as exc:
        raise LinkError("the ucx link needs ucxx: pip install 'deltarl[ucx]'") from exc
    return ucxx


def _link_faults() -> tuple[type[BaseException], ...]:
    """What a lost connection raises: any UCX error, a timeout, an OS error."""
    return (_ucxx().exceptions.UCXError, TimeoutError, OSError)


async def _send_message(ep: Endpoint, buffer: bytes | memoryview) -> None:
    _check_open(ep)
    await ep.send(buffer)


async def _receive_message(ep: Endpoint, buffer: bytearray) -> None:
    """Receive one message into ``buffer``. A longer message is an error (UCX's truncation);
    a shorter one is not, and ucxx does not say how long it was. So every receive gets a
    fresh, zeroed buffer: a short header then fails ``unpack_header``, and a short payload
    fails the apply agent's checksum of the chunk (the receiver checks no content, base.py)."""
    _check_open(ep)
    await ep.recv(buffer)


def _check_open(ep: Endpoint) -> None:
    # ucxx's Endpoint, once aborted (by close, or by the task that saw the connection fail),
    # raises AttributeError on its next use; make that the connection error it is.
    if ep.closed:
        raise ConnectionError("the UCX endpoint is closed")


# -- sender -----------------------------------------------------------------------------------


class UcxSender(ChunkSender):
    """Sends to one UcxReceiver over one UCX endpoint."""

    def __init__(self, config: UcxLinkConfig) -> None:
        self.config = config
        # UCX has no TLS: the manifest's seal authenticates (checked by the apply agent).
        # Without keys it may run on loopback only, unless security = "off".
        link_keys("ucx link sender", config.host, config.security)
        self._ucxx = _ucxx()
        self._faults = _link_faults()
        self._peer = f"ucx link to {config.host}:{config.port}"
        self._ep: Endpoint | None = None  # while CONNECTED
        self._reader: asyncio.Task[None] | None = None
        # Unacknowledged items and their payloads, in send order (a resend keeps it).
        self._pending: dict[Key, bytes | memoryview] = {}
        self._lock = asyncio.Lock()  # one header+payload pair at a time; one connect at a time
        self._error: LinkError | None = None
        self._changed = asyncio.Event()  # replaced at every ack: a broadcast to waiters
        self.reconnects = 0

    async def start(self) -> None:
        self._check()
        async with self._lock:
            if self._ep is None:
                await self._connect()

    async def send_chunk(self, version: int, chunk_id: int, data: bytes | memoryview) -> None:
        check_ids(version, chunk_id)
        await self._send((CHUNK, version, chunk_id), data)

    async def send_manifest(self, version: int, manifest_json: bytes) -> None:
        """Send the manifest; return once it and every chunk of ``version`` are acknowledged."""
        check_ids(version)
        await self._send((MANIFEST, version, 0), manifest_json)
        while any(key[1] == version for key in self._pending):
            self._check()
            if self._ep is None:  # lost while waiting: reconnecting resends what is missing
                async with self._lock:
                    if self._ep is None:
                        await self._connect()
                continue
            changed = self._changed
            try:
                await asyncio.wait_for(changed.wait(), self.config.ack_timeout_s)
            except TimeoutError:
                raise self._fail(
                    LinkError(
                        f"{self._peer}: no acknowledgement for {self.config.ack_timeout_s} s "
                        f"while waiting for version {version}"
                    )
                ) from None
        self._check()

    async def close(self) -> None:
        # Not under _lock: a send blocked in UCX holds it; aborting the endpoint ends that send.
        self._fail(LinkError(f"{self._peer}: the sender is closed"))
        await self._drop_connection()
        if self._pending:
            logger.warning("%s closed with %d items unacknowledged", self._peer, len(self._pending))

    # -- internals -----------------------------------------------------------------------

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _fail(self, error: LinkError) -> LinkError:
        """Fail the sender (the first error sticks); returns the error every call raises."""
        if self._error is None:
            self._error = error
            self._notify()
        return self._error

    async def _send(self, key: Key, payload: bytes | memoryview) -> None:
        limit = self.config.max_frame_bytes
        if len(payload) > limit:
            raise ValueError(f"{key} is {len(payload)} bytes, over max_frame_bytes={limit}")
        self._check()
        if key in self._pending:
            return  # already on its way; the receiver would drop the copy anyway
        self._pending[key] = payload
        async with self._lock:
            self._check()
            if self._ep is None:
                await self._connect()  # sends every pending item, this one included
                return
            try:
                await self._write(self._ep, key, payload)
            except self._faults as exc:
                logger.warning("%s: send failed, reconnecting: %r", self._peer, exc)
                await self._drop_connection()
                await self._connect()

    async def _write(self, ep: Endpoint, key: Key, payload: bytes | memoryview) -> None:
        # A send blocked this long means the receiver stopped pulling: treat it as a cut.
        async with asyncio.timeout(self.config.ack_timeout_s):
            await _send_message(ep, pack_header(*key, len(payload)))
            if len(payload):
                await _send_message(ep, payload)  # zero-copy: UCX reads the caller's buffer

    async def _connect(self) -> None:
        """CONNECTING then the resend of CONNECTED; the caller holds ``_lock``."""
        failures = 0
        while True:
            self._check()
            ep = None
            try:
                async with asyncio.timeout(self.config.connect_timeout_s):
                    ep = await self._ucxx.create_endpoint(
                        self.config.host,
                        self.config.port,
                        connect_timeout=self.config.connect_timeout_s,
                    )
                self._ep = ep
                self._reader = asyncio.create_task(self._read_acks(ep), name="ucx-acks")
                for key, payload in list(self._pending.items()):
                    if key in self._pending:  # else: acknowledged meanwhile
                        await self._write(ep, key, payload)
            except self._faults as exc:
                await self._drop_connection(ep)
                failures += 1
                if failures >= self.config.max_attempts:
                    raise self._fail(
                        LinkError(
                            f"{self._peer}: no connection after {failures} attempts; "
                            f"last error: {exc!r}"
                        )
                    ) from exc
                delay = min(self.config.backoff_max_s, self.config.backoff_s * 2 ** (failures - 1))
                logger.warning(
                    "%s: %r; retrying in %.2f s (attempt %d of %d)",
                    self._peer,
                    exc,
                    delay,
                    failures + 1,
                    self.config.max_attempts,
                )
                self.reconnects += 1
                await asyncio.sleep(delay)
            else:
                return

    async def _drop_connection(self, ep: Endpoint | None = None) -> None:
        ep = ep if ep is not None else self._ep
        if ep is self._ep:
            self._ep = None
            reader, self._reader = self._reader, None
            if reader is not None and reader is not asyncio.current_task():
                reader.cancel()
                await asyncio.gather(reader, return_exceptions=True)
        if ep is not None:
            ep.abort()
        self._notify()

    async def _read_acks(self, ep: Endpoint) -> None:
        try:
            while True:
                header = bytearray(_HEADER.size)
                await _receive_message(ep, header)
                kind, version, chunk_id, _ = unpack_header(header, TO_SENDER, 0)
                acked = CHUNK if kind == CHUNK_ACK else MANIFEST
                if self._pending.pop((acked, version, chunk_id), None) is not None:
                    self._notify()
        except WireError as exc:
            # The peer's fault, not ours: the message says it all, a traceback would not help.
            logger.error("%s: bad reply, connection dropped: %s", self._peer, exc)  # noqa: TRY400
        except self._faults as exc:
            logger.info("%s: connection lost: %r", self._peer, exc)
        if self._ep is ep:  # lost, not closed by us: the next send or wait reconnects
            self._reader = None
            await self._drop_connection(ep)


# -- receiver ---------------------------------------------------------------------------------


@dataclass
class ReceiverStats:
    """Counters of one receiver, for logs, metrics and tests."""

    connections: int = 0
    dropped_connections: int = 0  # closed for a protocol error
    delivered: int = 0
    duplicates: int = 0  # acknowledged but not queued again


class UcxReceiver(ChunkReceiver):
    """Listens on ``config.port`` (every interface) and yields what senders deliver."""

    def __init__(self, config: UcxLinkConfig) -> None:
        self.config = config
        if config.security != "off" and DataKeys.from_env() is None:
            # It listens on every interface; only a sealed manifest tells a forgery apart.
            logger.warning(
                "ucx link receiver on port %d: versions are not authenticated (set %s)",
                config.port,
                KEYS_ENV,
            )
        self._ucxx = _ucxx()
        self._faults = _link_faults()
        self._delivered = DeliveredSet(config.keep_versions)
        self._queue = DeliveryQueue(config.queue_size)
        self._listener: Listener | None = None
        self._handlers: dict[asyncio.Task[Any], Endpoint] = {}  # handler task -> its endpoint
        self._closed = False
        self.stats = ReceiverStats()

    @property
    def address(self) -> tuple[str, int]:
        """Where a sender connects (the real port when the config said 0)."""
        if self._listener is None:
            raise RuntimeError("the receiver is not started")
        return self.config.host, self._listener.port

    async def start(self) -> None:
        if self._listener is not None or self._closed:
            return
        # UCX closes a listener's socket on its progress thread, a moment after close(): a
        # receiver restarted on the same port may find it busy (UCXBusyError) for that moment.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.connect_timeout_s
        while True:
            try:
                self._listener = self._ucxx.create_listener(
                    self._serve, self.config.port, connect_timeout=self.config.connect_timeout_s
                )
            except self._ucxx.exceptions.UCXError as exc:
                busy = isinstance(exc, self._ucxx.exceptions.UCXBusyError)
                if not busy or loop.time() >= deadline:
                    raise LinkError(
                        f"ucx link: cannot listen on port {self.config.port}: {exc}"
                    ) from exc
                await asyncio.sleep(0.05)
            else:
                return

    async def __anext__(self) -> Received:
        await self.start()
        return await self._queue.next()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._listener is not None:
            self._listener.close()
        for ep in self._handlers.values():
            ep.abort()  # a handler waiting in recv() sees a UCX error and returns
        deadline = asyncio.get_running_loop().time() + _CLOSE_GRACE_S
        while self._handlers and asyncio.get_running_loop().time() < deadline:
            self._queue.drop_pending()  # a handler may wait to queue an item
            await asyncio.wait(list(self._handlers), timeout=0.01)
        for task in list(self._handlers):  # stuck: cancel, as a last resort
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        self._queue.end()  # items the consumer has not taken are dropped: it is closing

    async def _serve(self, ep: Endpoint) -> None:
        """One sender's endpoint: READ header, READ payload, QUEUE (first time), ACK; repeat."""
        task = asyncio.current_task()
        if self._closed or task is None:
            ep.abort()
            return
        self._handlers[task] = ep
        self.stats.connections += 1
        try:
            while not self._closed:
                header = bytearray(_HEADER.size)
                await _receive_message(ep, header)
                kind, version, chunk_id, length = unpack_header(
                    header, TO_RECEIVER, self.config.max_frame_bytes
                )
                payload = bytearray(length)
                if length:
                    await _receive_message(ep, payload)
                await self._handle(kind, version, chunk_id, payload)
                reply = CHUNK_ACK if kind == CHUNK else MANIFEST_ACK
                await _send_message(ep, pack_header(reply, version, chunk_id))
        except WireError as exc:
            self.stats.dropped_connections += 1
            logger.error("ucx link: dropped a sender's connection: %s", exc)  # noqa: TRY400 - a peer's fault, the message says it all
        except self._faults as exc:
            # The sender reconnects and resends; nothing to do here but note it.
            logger.info("ucx link: a sender's connection ended: %r", exc)
        finally:
            self._handlers.pop(task, None)
            ep.abort()

    async def _handle(self, kind: int, version: int, chunk_id: int, payload: bytearray) -> None:
        # Marked before the (possibly waiting) put, so that a resent copy arriving meanwhile
        # on a new connection is acknowledged without being queued a second time.
        if kind == CHUNK:
            first = self._delivered.add_chunk(version, chunk_id, fingerprint(payload))
            item: Received = ReceivedChunk(version, chunk_id, memoryview(payload))
        else:
            first = self._delivered.add_manifest(version, manifest_mark(payload))
            item = ReceivedManifest(version, bytes(payload))
        if not first:
            self.stats.duplicates += 1
            return
        await self._queue.put(item)
        self.stats.delivered += 1
