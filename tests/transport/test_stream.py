"""The stream link over loopback TCP: delivery, dedup, cuts and resume, retries, bad frames.

Also the parts of base.py every backend shares (configs, factory, DeliveredSet).
"""

from __future__ import annotations

import asyncio
import logging
import struct
import types
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import zstandard

from deltarl.codecs.frame import HEADER_SIZE
from deltarl.codecs.manifest import RefitManifest
from deltarl.transport.base import (
    DeliveredSet,
    LinkError,
    ReceivedChunk,
    ReceivedManifest,
    make_receiver,
    make_sender,
)
from deltarl.transport.link_config import ShmLinkConfig, StreamLinkConfig
from deltarl.transport.ports import free_port
from deltarl.transport.shm_link import ShmReceiver, ShmSender
from deltarl.transport.stream import StreamReceiver, StreamSender
from deltarl.transport.stream_wire import (
    FLAG_ZSTD,
    HEADER,
    MSG_ACK,
    MSG_CHUNK,
    MSG_HELD,
    MSG_MANIFEST,
    MSG_MANIFEST_ACK,
    MSG_QUERY,
    TO_RECEIVER,
    TO_SENDER,
    WireError,
    compress,
    decompress,
    pack_header,
    pack_ids,
    parse_header,
    unpack_ids,
)
from tests.transport.linkdata import encoded_versions, run

HOST = "127.0.0.1"


async def collect(
    receiver: Any, chunks: dict[int, int], manifests: int
) -> tuple[dict[tuple[int, int], bytes], dict[int, bytes]]:
    """Read until ``chunks[v]`` chunks of each version v and ``manifests`` manifests arrived;
    fail on a chunk or manifest delivered twice."""
    got: dict[tuple[int, int], bytes] = {}
    got_manifests: dict[int, bytes] = {}
    async for item in receiver:
        if isinstance(item, ReceivedChunk):
            key = (item.version, item.chunk_id)
            assert key not in got, f"chunk {key} delivered twice"
            got[key] = bytes(item.data)
            item.release()
        else:
            assert isinstance(item, ReceivedManifest)
            assert item.version not in got_manifests, f"manifest {item.version} twice"
            got_manifests[item.version] = item.data
        counts = Counter(v for v, _ in got)
        if len(got_manifests) == manifests and all(counts[v] == n for v, n in chunks.items()):
            break
    return got, got_manifests


def stream_config(port: int, **kw: Any) -> StreamLinkConfig:
    return StreamLinkConfig(host=HOST, port=port, **kw)


# -- delivery -----------------------------------------------------------------------------


def test_two_versions_arrive_complete_and_byte_exact_over_four_connections() -> None:
    versions = encoded_versions(7)

    async def main() -> None:
        async with make_receiver(stream_config(0)) as receiver:
            assert isinstance(receiver, StreamReceiver)
            port = receiver.address[1]
            expect = {v: len(chunks) for v, (chunks, _) in enumerate(versions, start=1)}
            reading = asyncio.create_task(collect(receiver, expect, 2))
            async with make_sender(stream_config(port, connections=4)) as sender:
                assert isinstance(sender, StreamSender)
                for version, (chunks, manifest) in enumerate(versions, start=1):
                    for i in reversed(range(len(chunks))):  # any order will do
                        await sender.send_chunk(version, i, chunks[i])
                    await sender.send_manifest(version, manifest)
            got, manifests = await reading
            assert receiver.stats.connections == 4
        for version, (chunks, manifest) in enumerate(versions, start=1):
            for i, data in enumerate(chunks):
                assert got[version, i] == data
            assert manifests[version] == manifest
            assert RefitManifest.from_json(manifests[version]).version == version
        assert sender.stats.resent == 0
        assert sender.stats.acked == sum(len(c) + 1 for c, _ in versions)

    run(main())


def test_compression_is_used_only_when_it_saves_bytes() -> None:
    rng = np.random.default_rng(1)
    noise = rng.integers(0, 256, 50_000, dtype=np.uint8).tobytes()
    zeros = bytes(50_000)

    async def main() -> dict[tuple[int, int], bytes]:
        async with make_receiver(stream_config(0)) as receiver:
            reading = asyncio.create_task(collect(receiver, {1: 3}, 1))
            async with make_sender(stream_config(receiver.address[1])) as sender:
                for i, data in enumerate([noise, zeros, b""]):
                    await sender.send_chunk(1, i, data)
                await sender.send_manifest(1, b"{}")
                assert sender.stats.payload_bytes_sent < len(noise) + 1000  # zeros shrank
            got, _ = await reading
        return got

    got = run(main())
    assert got == {(1, 0): noise, (1, 1): zeros, (1, 2): b""}
    assert compress(noise, 3) == (False, noise)
    flag, packed = compress(zeros, 3)
    assert flag
    assert decompress(bytes(packed), 50_000, "x") == zeros


# -- idempotent receipt --------------------------------------------------------------------


async def raw_exchange(port: int, data: bytes, replies: int) -> list[tuple[int, int, int, bytes]]:
    """Write ``data`` on a fresh connection and read ``replies`` messages back."""
    reader, writer = await asyncio.open_connection(HOST, port)
    writer.write(data)
    out = []
    for _ in range(replies):
        code, version, chunk_id, length = HEADER.unpack(await reader.readexactly(HEADER.size))
        out.append((code, version, chunk_id, await reader.readexactly(length)))
    writer.close()
    return out


def frame(kind: int, version: int, chunk_id: int, payload: bytes, *, zstd: bool = False) -> bytes:
    return pack_header(kind, version, chunk_id, len(payload), compressed=zstd) + payload


def test_a_chunk_received_twice_is_acknowledged_twice_and_delivered_once() -> None:
    packed = zstandard.ZstdCompressor().compress(b"chunk zero" * 10)
    data = (
        frame(MSG_CHUNK, 5, 0, b"chunk zero" * 10)
        + frame(MSG_CHUNK, 5, 0, packed, zstd=True)  # the same chunk, compressed this time
        + frame(MSG_MANIFEST, 5, 0, b"{}")
        + frame(MSG_MANIFEST, 5, 0, b"{}")
        + frame(MSG_QUERY, 5, 0, b"")
    )

    async def main() -> None:
        async with make_receiver(stream_config(0)) as receiver:
            assert isinstance(receiver, StreamReceiver)
            replies = await raw_exchange(receiver.address[1], data, 5)
            assert [r[:3] for r in replies] == [
                (MSG_ACK, 5, 0),
                (MSG_ACK, 5, 0),
                (MSG_MANIFEST_ACK, 5, 0),
                (MSG_MANIFEST_ACK, 5, 0),
                (MSG_HELD, 5, 0),
            ]
            assert unpack_ids(replies[4][3]) == {0}
            got, manifests = await collect(receiver, {5: 1}, 1)
            assert got == {(5, 0): b"chunk zero" * 10}
            assert manifests == {5: b"{}"}
            assert receiver.stats.duplicates == 2
            # a chunk sent again through a sender, after its first copy was acknowledged
            async with make_sender(stream_config(receiver.address[1])) as sender:
                await sender.send_chunk(5, 0, b"chunk zero" * 10)
                await sender.send_manifest(5, b"{}")
            assert receiver.stats.duplicates == 4
            assert receiver.stats.delivered == 2
            assert receiver._queue.empty()

    run(main())


# -- cut connections and resume --------------------------------------------------------------


class Proxy:
    """A TCP relay between sender and receiver that parses the frames going through it.

    ``drop_up(chunk_id)`` / ``drop_ack(chunk_id)`` say which chunk frames and chunk acks it
    swallows instead of forwarding; ``cut()`` closes every connection on both sides.
    """

    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self.drop_up: Callable[[int], bool] = lambda _: False
        self.drop_ack: Callable[[int], bool] = lambda _: False
        self.chunks_up: list[tuple[int, int]] = []  # (connection, chunk id), dropped or not
        self.dropped_up: list[int] = []
        self.acks_down: list[int] = []  # forwarded
        self.dropped_acks: list[int] = []
        self.connections = 0
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._accept, HOST, 0)
        return self._server.sockets[0].getsockname()[1]

    def cut(self) -> None:
        for w in self._writers:
            w.transport.abort()
        self._writers.clear()

    async def close(self) -> None:
        self.cut()
        self._server.close()

    async def _accept(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        conn = self.connections
        self.connections += 1
        ur, uw = await asyncio.open_connection(HOST, self.upstream)
        self._writers += [w, uw]
        await asyncio.gather(self._pump(r, uw, conn, up=True), self._pump(ur, w, conn, up=False))

    async def _pump(
        self, r: asyncio.StreamReader, w: asyncio.StreamWriter, conn: int, *, up: bool
    ) -> None:
        try:
            while True:
                head = await r.readexactly(HEADER.size)
                code, _, chunk_id, length = HEADER.unpack(head)
                payload = await r.readexactly(length)
                kind = code & ~FLAG_ZSTD
                if up and kind == MSG_CHUNK:
                    self.chunks_up.append((conn, chunk_id))
                    if self.drop_up(chunk_id):
                        self.dropped_up.append(chunk_id)
                        continue
                if not up and kind == MSG_ACK:
                    if self.drop_ack(chunk_id):
                        self.dropped_acks.append(chunk_id)
                        continue
                    self.acks_down.append(chunk_id)
                w.write(head + payload)
                await w.drain()
        except (OSError, asyncio.IncompleteReadError):
            w.transport.abort()


async def until(condition: Callable[[], bool], limit: float = 5.0) -> None:
    async with asyncio.timeout(limit):
        while not condition():  # noqa: ASYNC110 - the state belongs to the proxy and receiver
            await asyncio.sleep(0.005)


def test_a_cut_connection_resumes_from_the_first_missing_chunk() -> None:
    """Chunks 0-7 are acknowledged; 8-13 arrive but their acks are lost; 14-19 are lost on
    the way; the window (12 chunks) stops the sender at 20. Then every connection is cut.
    After reconnecting, the sender must learn that 8-13 are held, resend only 14-19 (each
    connection from its first missing chunk, in order), then send 20-23."""
    size, n = 64 << 10, 24
    rng = np.random.default_rng(3)
    chunks = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(n)]

    async def main() -> None:
        async with make_receiver(stream_config(0)) as receiver:
            proxy = Proxy(receiver.address[1])
            port = await proxy.start()
            proxy.drop_ack = lambda c: c >= 8
            proxy.drop_up = lambda c: c >= 14
            got: dict[int, bytes] = {}

            async def consume() -> None:
                manifests = 0
                async for item in receiver:
                    if isinstance(item, ReceivedChunk):
                        assert item.chunk_id not in got
                        got[item.chunk_id] = bytes(item.data)
                    else:
                        manifests += 1
                    if len(got) == n and manifests == 1:
                        return

            consuming = asyncio.create_task(consume())
            config = stream_config(
                port, connections=4, compress=False, window_bytes=12 * size, backoff_s=0.01
            )
            async with StreamSender(config) as sender:

                async def produce() -> None:
                    for i, data in enumerate(chunks):
                        await sender.send_chunk(1, i, data)
                    await sender.send_manifest(1, b"{}")

                producing = asyncio.create_task(produce())
                await until(lambda: len(proxy.dropped_up) == 6 and len(got) == 14)
                await asyncio.sleep(0.1)  # the window holds the sender at chunk 20
                assert sorted(proxy.acks_down) == list(range(8))
                assert sorted(proxy.dropped_acks) == list(range(8, 14))
                assert len(proxy.chunks_up) == 20
                before = len(proxy.chunks_up)
                proxy.drop_ack = proxy.drop_up = lambda _: False
                proxy.cut()
                await producing
                await consuming
            await proxy.close()

            assert got == dict(enumerate(chunks))
            sends = Counter(c for _, c in proxy.chunks_up)
            assert all(sends[c] == 1 for c in range(14)), "acknowledged or held chunks resent"
            assert all(sends[c] == 2 for c in range(14, 20))
            assert all(sends[c] == 1 for c in range(20, 24))
            assert sender.stats.held_on_resume == 6
            assert sender.stats.resent == 6
            # Each new connection starts at its first missing chunk and goes up from there.
            after: dict[int, list[int]] = {}
            for conn, c in proxy.chunks_up[before:]:
                after.setdefault(conn, []).append(c)
            assert all(ids == sorted(ids) for ids in after.values())
            assert {ids[0] for ids in after.values()} == {14, 15, 16, 17}
            assert receiver.stats.duplicates == 0

    run(main())


def test_the_sender_waits_for_a_receiver_that_starts_late() -> None:
    port = free_port()

    async def main() -> None:
        config = stream_config(port, backoff_s=0.05, backoff_max_s=0.1, max_attempts=50)
        async with make_sender(config) as sender:
            await sender.send_chunk(1, 0, b"early")
            sending = asyncio.create_task(sender.send_manifest(1, b"{}"))
            await asyncio.sleep(0.3)
            assert not sending.done()
            async with make_receiver(stream_config(port)) as receiver:
                got, _ = await collect(receiver, {1: 1}, 1)
                await sending
        assert got == {(1, 0): b"early"}
        assert sender.stats.reconnects >= 1

    run(main())


def test_exhausted_retries_raise_a_clear_error() -> None:
    port = free_port()  # nobody listens there

    async def main() -> None:
        config = stream_config(
            port, connections=1, max_attempts=3, backoff_s=0.01, backoff_max_s=0.02
        )
        sender = StreamSender(config)
        await sender.send_chunk(1, 0, b"x")
        with pytest.raises(LinkError, match=r"gave up after 3 attempts .*ConnectionRefused"):
            await sender.send_manifest(1, b"{}")
        with pytest.raises(LinkError, match="gave up after 3 attempts"):
            await sender.send_chunk(1, 1, b"y")
        assert sender.stats.reconnects == 2
        await sender.close()

    run(main())


async def fake_receiver(reply: bytes | None) -> tuple[asyncio.Server, int]:
    """A server that reads everything and answers each connection with ``reply`` (or nothing)."""

    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        if reply is not None:
            w.write(reply)
        while await r.read(1 << 16):
            pass
        w.close()

    server = await asyncio.start_server(serve, HOST, 0)
    return server, server.sockets[0].getsockname()[1]


def test_a_receiver_that_answers_garbage_makes_the_sender_reconnect_then_fail() -> None:
    async def main() -> None:
        server, port = await fake_receiver(b"\x42" * HEADER.size)
        config = stream_config(port, max_attempts=2, backoff_s=0.01)
        sender = StreamSender(config)
        await sender.send_chunk(1, 0, b"x")
        with pytest.raises(LinkError, match=r"unknown message type 0x42"):
            await sender.send_manifest(1, b"{}")
        await sender.close()
        server.close()

    run(main())


def test_a_receiver_that_never_acknowledges_is_treated_as_cut() -> None:
    async def main() -> None:
        server, port = await fake_receiver(None)
        config = stream_config(port, max_attempts=2, backoff_s=0.01, ack_timeout_s=0.2)
        sender = StreamSender(config)
        await sender.send_chunk(1, 0, b"x")
        with pytest.raises(LinkError, match="no acknowledgement for"):
            await sender.send_manifest(1, b"{}")
        assert sender.stats.resent == 1  # the second attempt sent it again
        await sender.close()
        server.close()

    run(main())


# -- bad frames ---------------------------------------------------------------------------


def test_garbage_drops_that_connection_and_the_receiver_keeps_serving(caplog) -> None:
    caplog.set_level(logging.ERROR, logger="deltarl.transport.stream_receiver")
    versions = encoded_versions(7)
    chunks, manifest = versions[0]
    bad = {
        "unknown message type 0xff": b"\xff" * 64,
        "claims 1099511627776 bytes, over the": pack_header(MSG_CHUNK, 1, 0, 1 << 40),
        "a query message has no payload": pack_header(MSG_QUERY, 1, 0, 5) + b"12345",
        "not a zstd frame": frame(MSG_CHUNK, 1, 0, b"not zstd", zstd=True),
        "over 2**63 - 1": HEADER.pack(MSG_CHUNK, 1 << 63, 0, 0),
    }

    async def garbage(port: int, data: bytes) -> bytes:
        reader, writer = await asyncio.open_connection(HOST, port)
        writer.write(data)
        rest = await reader.read()  # the receiver closes: EOF, and no reply
        writer.close()
        return rest

    async def main() -> None:
        async with make_receiver(stream_config(0)) as receiver:
            assert isinstance(receiver, StreamReceiver)
            port = receiver.address[1]
            reading = asyncio.create_task(collect(receiver, {1: len(chunks)}, 1))
            async with make_sender(stream_config(port, connections=4)) as sender:
                for i, data in enumerate(chunks[: len(chunks) // 2]):
                    await sender.send_chunk(1, i, data)
                assert await asyncio.gather(*(garbage(port, b) for b in bad.values())) == [
                    b""
                ] * len(bad)
                for i in range(len(chunks) // 2, len(chunks)):
                    await sender.send_chunk(1, i, chunks[i])
                await sender.send_manifest(1, manifest)
            got, _ = await reading
            assert got == {(1, i): c for i, c in enumerate(chunks)}
            assert receiver.stats.dropped_connections == len(bad)
            assert sender.stats.resent == 0

    run(main())
    logged = "\n".join(r.getMessage() for r in caplog.records)
    for what in bad:
        assert what in logged


def test_parse_header_names_what_is_wrong() -> None:
    limit = 1000
    ok = parse_header(pack_header(MSG_CHUNK, 3, 9, 10, compressed=True), TO_RECEIVER, limit)
    assert (ok.kind, ok.compressed, ok.version, ok.chunk_id, ok.length) == (1, True, 3, 9, 10)
    cases = {
        pack_header(MSG_ACK, 1): "unknown message type 0x11",  # a sender's type, to a receiver
        pack_header(MSG_QUERY, 1, compressed=True): "cannot be compressed",
        pack_header(MSG_CHUNK, 1, 0, limit + 1): "over the 1000-byte limit",
        pack_header(MSG_MANIFEST, 1, 4, 2): "names chunk 4",
    }
    for raw, what in cases.items():
        with pytest.raises(WireError, match=what):
            parse_header(raw, TO_RECEIVER, limit)
    with pytest.raises(WireError, match="not whole u32 ids"):
        parse_header(pack_header(MSG_HELD, 1, 0, 6), TO_SENDER, limit)
    with pytest.raises(WireError, match="unknown message type 0x01"):
        parse_header(pack_header(MSG_CHUNK, 1), TO_SENDER, limit)
    assert unpack_ids(pack_ids([3, 1, 2**32 - 1])) == {1, 3, 2**32 - 1}
    assert HEADER.size == 21
    assert struct.calcsize("<BQIQ") == HEADER.size


def test_decompress_refuses_frames_over_the_limit_or_without_a_size() -> None:
    with pytest.raises(WireError, match="the limit is 10"):
        decompress(zstandard.ZstdCompressor().compress(bytes(100)), 10, "chunk")
    unsized = zstandard.ZstdCompressor(write_content_size=False).compressobj()
    packed = unsized.compress(bytes(100)) + unsized.flush()
    with pytest.raises(WireError, match="unknown"):
        decompress(packed, 1000, "chunk")


# -- the shared interface (base.py) -------------------------------------------------------------


def test_delivered_set_is_idempotent_and_bounded() -> None:
    held = DeliveredSet(keep_versions=2)
    assert held.add_chunk(1, 0)
    assert not held.add_chunk(1, 0)
    assert held.add_manifest(1)
    assert not held.add_manifest(1)
    assert held.add_chunk(2, 5)
    assert held.add_chunk(3, 0)  # forgets version 1
    assert held.chunks(1) == []
    assert held.add_chunk(1, 0)  # too old to remember: delivered again, not remembered
    assert held.chunks(1) == []
    assert held.chunks(2) == [5]
    assert held.chunks(3) == [0]


def test_configs_refuse_bad_values_and_the_factory_switches_on_type(tmp_path) -> None:
    with pytest.raises(ValueError, match="connections must be positive"):
        StreamLinkConfig(connections=0)
    with pytest.raises(ValueError, match="port must lie in"):
        StreamLinkConfig(port=70000)
    with pytest.raises(ValueError, match="compression_level must lie in"):
        StreamLinkConfig(compression_level=0)
    with pytest.raises(ValueError, match="max_pending_chunks must be positive"):
        ShmLinkConfig(max_pending_chunks=0)
    shm = ShmLinkConfig(name="f", root=tmp_path)
    assert isinstance(make_sender(shm), ShmSender)
    assert isinstance(make_receiver(shm), ShmReceiver)
    assert isinstance(make_sender(StreamLinkConfig(port=1)), StreamSender)
    assert isinstance(make_receiver(StreamLinkConfig()), StreamReceiver)
    rdma = types.SimpleNamespace(type="rdma")
    with pytest.raises(ValueError, match="unknown link type 'rdma'"):
        make_sender(rdma)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown link type 'rdma'"):
        make_receiver(rdma)  # type: ignore[arg-type]


def test_send_refuses_ids_outside_the_frame_fields() -> None:
    async def main() -> None:
        sender = StreamSender(stream_config(1))
        with pytest.raises(ValueError, match="chunk id"):
            await sender.send_chunk(1, 2**32, b"")
        with pytest.raises(ValueError, match="version"):
            await sender.send_chunk(-1, 0, b"")
        with pytest.raises(ValueError, match="over max_frame_bytes"):
            await StreamSender(stream_config(1, max_frame_bytes=4)).send_chunk(1, 0, b"12345")
        await sender.close()

    run(main())
    assert HEADER_SIZE == 64  # the chunk frame this link carries opaquely
