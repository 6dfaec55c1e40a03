"""The receiving end of the stream link: a TCP server with one handler per connection.

Each connection, as the handler sees it (frames in stream_wire.py):

    READING   header, then payload
      | clean end of stream between messages --------------> CLOSED (the sender left)
      | cut mid-message, reset -----------------------------> CLOSED, logged
      | unknown type, bad length, bad zstd -----------------> CLOSED, logged as an error
      v
    CHUNK / MANIFEST  first time: queue the item for the consumer (waits while the queue is
                      full, which stops reading, which slows the sender through TCP); then ACK
    QUERY             answer HELD with the chunk ids of that version delivered so far
    PROBE             throw the bytes away (they were paid for like any payload), PROBE_ACK

Security: with the cluster's keys (``DELTARL_CURVE_KEYS``; ``config.security``), every
connection is TLS 1.3 and the sender must present a certificate of the cluster's CA; a peer
that cannot is cut during the handshake, before it is served at all.

One connection's fault never touches another: handlers share only the DeliveredSet, the
queue and the memory budget. An unexpected exception in a handler ends that connection and
asyncio logs it.

Memory: connections are limited (``max_connections`` in all, ``max_connections_per_peer``
from one address; more are closed at once), and every payload is paid for from one
ByteBudget shared by all connections (``config.budget_bytes``) before it is read: its wire
length, plus, for a zstd payload, the size its frame header declares (read from the
payload's first bytes). The compressed bytes are given back once decompressed; the rest is
held until the consumer releases the chunk, or takes the manifest, or the item is dropped
(a duplicate, a close). A payload waiting for room stops that connection's reading, and TCP
slows its sender; so many connections sending zstd bombs at once hold at most the budget.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import time
from collections import Counter
from dataclasses import dataclass

from deltarl.codecs.compression import ZSTD_FRAME_HEADER_MAX
from deltarl.transport.base import (
    ChunkReceiver,
    DeliveredSet,
    DeliveryQueue,
    Received,
    ReceivedChunk,
    ReceivedManifest,
    fingerprint,
    manifest_mark,
)
from deltarl.transport.budget import BudgetError, ByteBudget
from deltarl.transport.data_keys import link_keys
from deltarl.transport.link_config import StreamLinkConfig
from deltarl.transport.stream_wire import (
    MSG_ACK,
    MSG_CHUNK,
    MSG_HELD,
    MSG_MANIFEST,
    MSG_MANIFEST_ACK,
    MSG_PROBE,
    MSG_PROBE_ACK,
    TO_RECEIVER,
    Header,
    WireError,
    claimed_size,
    decompress,
    pack_header,
    pack_ids,
    read_header,
)

logger = logging.getLogger(__name__)

_THREAD_BYTES = 1 << 20  # decompress larger payloads off the event loop
_CLOSE_GRACE_S = 1.0
_REFUSAL_LOG_S = 10.0  # refused connections are logged at most once per this many seconds


@dataclass
class ReceiverStats:
    """Counters of one receiver, for logs, metrics and tests."""

    connections: int = 0  # accepted
    dropped_connections: int = 0  # closed for a protocol error
    delivered: int = 0  # chunks and manifests queued for the consumer
    duplicates: int = 0  # chunks and manifests acknowledged but not queued again
    refused_connections: int = 0  # closed at once: over max_connections(_per_peer)
    probe_bytes: int = 0  # thrown away for a link measurement (deltarl/transport/link_probe.py)


class StreamReceiver(ChunkReceiver):
    """Listens on ``config.host:config.port`` and yields what the connections deliver."""

    def __init__(self, config: StreamLinkConfig) -> None:
        self.config = config
        # TLS 1.3, both ends authenticated by the cluster's CA (data_keys.py); raises a
        # ConfigError for a non-loopback address without keys (security = "auto").
        keys = link_keys("stream link receiver", config.host, config.security)
        self._tls = None if keys is None else keys.server_context()
        self._delivered = DeliveredSet(config.keep_versions)
        self._budget = ByteBudget(config.budget_bytes)
        self._queue = DeliveryQueue(config.queue_size, on_drop=self._dropped)
        self._server: asyncio.Server | None = None
        self._handlers: dict[asyncio.Task[None], asyncio.StreamWriter] = {}
        self._per_peer: Counter[str] = Counter()
        self._closed = False
        self._refusal_logged = float("-inf")
        self.stats = ReceiverStats()

    @property
    def held_bytes(self) -> int:
        """Payload bytes held now, over all connections and items not yet released."""
        return self._budget.held

    @property
    def peak_held_bytes(self) -> int:
        """The most payload bytes held at once since the receiver was made."""
        return self._budget.peak

    @property
    def budget_waits(self) -> int:
        """Payloads that had to wait for room in the budget."""
        return self._budget.waits

    @property
    def address(self) -> tuple[str, int]:
        """Where it listens (the real port when the config said 0)."""
        if self._server is None:
            raise RuntimeError("the receiver is not started")
        host, port = self._server.sockets[0].getsockname()[:2]
        return host, port

    async def start(self) -> None:
        if self._server is not None or self._closed:
            return
        self._server = await asyncio.start_server(
            self._serve,
            self.config.host,
            self.config.port,
            reuse_address=True,
            ssl=self._tls,
            ssl_handshake_timeout=self.config.connect_timeout_s if self._tls else None,
        )

    async def __anext__(self) -> Received:
        await self.start()
        item = await self._queue.next()
        if isinstance(item, ReceivedManifest):
            self._budget.release(len(item.data))  # a manifest has no release(): taken is done
        return item

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._server is not None:
            self._server.close()
        self._budget.close()  # a handler waiting for room ends
        await self._end_handlers()
        if self._server is not None:
            await self._server.wait_closed()
        self._queue.end()  # items the consumer has not taken are dropped: it is closing

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        address = str(peer[0]) if isinstance(peer, tuple) else str(peer)
        if self._refuse(address):
            writer.transport.abort()
            return
        task = asyncio.current_task()
        if task is not None:
            self._handlers[task] = writer
        self._per_peer[address] += 1
        self.stats.connections += 1
        sock = writer.get_extra_info("socket")
        if sock is not None:
            # A peer that vanishes without a FIN (a cut cable) is found by keepalive.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        try:
            while (message := await self._read(reader, peer)) is not None:
                await self._handle(*message, writer)
        except (ConnectionError, asyncio.IncompleteReadError) as exc:
            # The sender reconnects and resumes; nothing to do here but note it.
            logger.info("stream link: connection from %s lost: %r", peer, exc)
        except WireError as exc:
            self.stats.dropped_connections += 1
            logger.error("stream link: dropped the connection from %s: %s", peer, exc)  # noqa: TRY400 - a peer's fault, the message says it all
        finally:
            if task is not None:
                self._handlers.pop(task, None)
            self._per_peer[address] -= 1
            if not self._per_peer[address]:
                del self._per_peer[address]
            writer.close()

    def _refuse(self, address: str) -> bool:
        """Whether a new connection from ``address`` is over a connection limit (then logged,
        at most once per _REFUSAL_LOG_S: a flood of connections must not flood the log)."""
        if len(self._handlers) >= self.config.max_connections:
            why = f"max_connections={self.config.max_connections} are open"
        elif self._per_peer[address] >= self.config.max_connections_per_peer:
            why = f"max_connections_per_peer={self.config.max_connections_per_peer} are open"
        else:
            return False
        self.stats.refused_connections += 1
        now = time.monotonic()
        if now - self._refusal_logged >= _REFUSAL_LOG_S:
            self._refusal_logged = now
            logger.warning(
                "stream link: refused a connection from %s: %s (%d refused so far)",
                address,
                why,
                self.stats.refused_connections,
            )
        return True

    async def _read(
        self, reader: asyncio.StreamReader, peer: object
    ) -> tuple[Header, bytes] | None:
        """The next message, its payload's bytes held in the budget (the caller hands them on
        or releases them); None at a clean end of stream."""
        max_bytes = self.config.max_frame_bytes
        header = await read_header(reader, TO_RECEIVER, max_bytes)
        if header is None:
            logger.debug("stream link: %s closed its connection", peer)
            return None
        if not header.length and not header.compressed:
            return header, b""
        what = f"{TO_RECEIVER[header.kind]} of version {header.version}"
        prefix, size = b"", 0
        if header.compressed:  # what it will decompress to, before anything is reserved
            prefix = await reader.readexactly(min(header.length, ZSTD_FRAME_HEADER_MAX))
            size = claimed_size(prefix, max_bytes, what)
        try:
            await self._budget.acquire(header.length + size)
        except BudgetError as exc:
            raise WireError(f"{what}: {exc}") from exc
        try:
            payload = prefix + await reader.readexactly(header.length - len(prefix))
            if header.compressed:
                if len(payload) > _THREAD_BYTES:
                    payload = await asyncio.to_thread(decompress, payload, max_bytes, what)
                else:
                    payload = decompress(payload, max_bytes, what)
        except BaseException:
            self._budget.release(header.length + size)
            raise
        self._budget.release(header.length + size - len(payload))  # the compressed copy
        return header, payload

    async def _handle(self, header: Header, payload: bytes, writer: asyncio.StreamWriter) -> None:
        version, chunk_id = header.version, header.chunk_id
        if header.kind == MSG_CHUNK:
            # Marked before the (possibly waiting) put, so that a copy arriving meanwhile on
            # another connection is acknowledged without being queued a second time.
            if self._delivered.add_chunk(version, chunk_id, fingerprint(payload)):
                free = functools.partial(self._budget.release, len(payload))
                await self._deliver(ReceivedChunk(version, chunk_id, payload, free))
            else:
                self._budget.release(len(payload))
                self.stats.duplicates += 1
            reply = pack_header(MSG_ACK, version, chunk_id)
        elif header.kind == MSG_MANIFEST:
            if self._delivered.add_manifest(version, manifest_mark(payload)):
                await self._deliver(ReceivedManifest(version, payload))
            else:
                self._budget.release(len(payload))
                self.stats.duplicates += 1
            reply = pack_header(MSG_MANIFEST_ACK, version)
        elif header.kind == MSG_PROBE:  # nothing is delivered: the bytes were the point
            self._budget.release(len(payload))
            self.stats.probe_bytes += len(payload)
            reply = pack_header(MSG_PROBE_ACK, version, chunk_id)
        else:  # MSG_QUERY: parse_header admits nothing else
            held = pack_ids(self._delivered.chunks(version))
            reply = pack_header(MSG_HELD, version, 0, len(held)) + held
        writer.write(reply)
        await writer.drain()

    async def _end_handlers(self) -> None:
        """End every connection's handler by cutting its connection rather than cancelling it:
        a handler that returns normally is not logged by asyncio as an error."""
        for writer in self._handlers.values():
            writer.transport.abort()
        deadline = asyncio.get_running_loop().time() + _CLOSE_GRACE_S
        while self._handlers and asyncio.get_running_loop().time() < deadline:
            self._queue.drop_pending()  # a handler may wait to queue an item
            await asyncio.wait(list(self._handlers), timeout=0.01)
        for task in list(self._handlers):  # stuck (a long decompression): cancel, as a last resort
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)

    async def _deliver(self, item: Received) -> None:
        """Queue ``item``; if that fails (the receiver is closing), free its bytes."""
        try:
            await self._queue.put(item)
        except BaseException:
            self._dropped(item)
            raise
        self.stats.delivered += 1

    def _dropped(self, item: Received) -> None:
        """An item the consumer will never take: give its bytes back to the budget."""
        if isinstance(item, ReceivedChunk):
            item.release()
        else:
            self._budget.release(len(item.data))
