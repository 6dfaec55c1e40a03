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

One connection's fault never touches another: handlers share only the DeliveredSet and the
queue. An unexpected exception in a handler ends that connection and asyncio logs it.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass

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
from deltarl.transport.link_config import StreamLinkConfig
from deltarl.transport.stream_wire import (
    MSG_ACK,
    MSG_CHUNK,
    MSG_HELD,
    MSG_MANIFEST,
    MSG_MANIFEST_ACK,
    TO_RECEIVER,
    Header,
    WireError,
    decompress,
    pack_header,
    pack_ids,
    read_message,
)

logger = logging.getLogger(__name__)

_THREAD_BYTES = 1 << 20  # decompress larger payloads off the event loop
_CLOSE_GRACE_S = 1.0


@dataclass
class ReceiverStats:
    """Counters of one receiver, for logs, metrics and tests."""

    connections: int = 0  # accepted
    dropped_connections: int = 0  # closed for a protocol error
    delivered: int = 0  # chunks and manifests queued for the consumer
    duplicates: int = 0  # chunks and manifests acknowledged but not queued again


class StreamReceiver(ChunkReceiver):
    """Listens on ``config.host:config.port`` and yields what the connections deliver."""

    def __init__(self, config: StreamLinkConfig) -> None:
        self.config = config
        self._delivered = DeliveredSet(config.keep_versions)
        self._queue = DeliveryQueue(config.queue_size)
        self._server: asyncio.Server | None = None
        self._handlers: dict[asyncio.Task[None], asyncio.StreamWriter] = {}
        self._closed = False
        self.stats = ReceiverStats()

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
            self._serve, self.config.host, self.config.port, reuse_address=True
        )

    async def __anext__(self) -> Received:
        await self.start()
        return await self._queue.next()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._server is not None:
            self._server.close()
        await self._end_handlers()
        if self._server is not None:
            await self._server.wait_closed()
        self._queue.end()  # items the consumer has not taken are dropped: it is closing

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._handlers[task] = writer
        self.stats.connections += 1
        peer = writer.get_extra_info("peername")
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
            writer.close()

    async def _read(
        self, reader: asyncio.StreamReader, peer: object
    ) -> tuple[Header, bytes] | None:
        message = await read_message(reader, TO_RECEIVER, self.config.max_frame_bytes)
        if message is None:
            logger.debug("stream link: %s closed its connection", peer)
            return None
        header, payload = message
        if header.compressed:
            what = f"{TO_RECEIVER[header.kind]} of version {header.version}"
            max_bytes = self.config.max_frame_bytes
            if len(payload) > _THREAD_BYTES:
                payload = await asyncio.to_thread(decompress, payload, max_bytes, what)
            else:
                payload = decompress(payload, max_bytes, what)
        return header, payload

    async def _handle(self, header: Header, payload: bytes, writer: asyncio.StreamWriter) -> None:
        version, chunk_id = header.version, header.chunk_id
        if header.kind == MSG_CHUNK:
            # Marked before the (possibly waiting) put, so that a copy arriving meanwhile on
            # another connection is acknowledged without being queued a second time.
            if self._delivered.add_chunk(version, chunk_id, fingerprint(payload)):
                await self._deliver(ReceivedChunk(version, chunk_id, payload))
            else:
                self.stats.duplicates += 1
            reply = pack_header(MSG_ACK, version, chunk_id)
        elif header.kind == MSG_MANIFEST:
            if self._delivered.add_manifest(version, manifest_mark(payload)):
                await self._deliver(ReceivedManifest(version, payload))
            else:
                self.stats.duplicates += 1
            reply = pack_header(MSG_MANIFEST_ACK, version)
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
        await self._queue.put(item)
        self.stats.delivered += 1
