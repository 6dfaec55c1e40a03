"""The stream link with the cluster's keys: TLS 1.3, both ends proving the cluster's CA.

A peer without the keys (plain TCP, or TLS with another cluster's identity) gets nothing
delivered; the bytes on the wire are TLS records, not frames; and a link beyond loopback
without keys refuses to start (a configuration error) unless ``security = "off"``.
"""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import pytest

from deltarl.transport.base import LinkError
from deltarl.transport.curve import make_keys
from deltarl.transport.data_keys import KEYS_ENV, DataKeyError, DataKeys, link_keys
from deltarl.transport.link_config import StreamLinkConfig
from deltarl.transport.ports import free_port
from deltarl.transport.stream import StreamReceiver, StreamSender
from deltarl.transport.stream_wire import MSG_CHUNK, MSG_MANIFEST
from tests.transport.linkdata import encoded_versions, run
from tests.transport.test_stream import HOST, collect, frame, stream_config


@pytest.fixture
def keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> DataKeys:
    d = make_keys(tmp_path / "keys")
    monkeypatch.setenv(KEYS_ENV, str(d))
    return DataKeys.load(d)


def test_a_version_crosses_over_tls_with_both_ends_authenticated(keys: DataKeys) -> None:
    (chunks, manifest), _ = encoded_versions(3)

    async def main() -> None:
        async with StreamReceiver(stream_config(0)) as receiver:
            port = receiver.address[1]
            async with StreamSender(stream_config(port, connections=2)) as sender:
                for i, data in enumerate(chunks):
                    await sender.send_chunk(1, i, data)
                sending = asyncio.create_task(sender.send_manifest(1, manifest))
                got, manifests = await collect(receiver, {1: len(chunks)}, 1)
                await sending
        assert [got[(1, i)] for i in range(len(chunks))] == chunks
        assert manifests == {1: manifest}

    run(main())


def test_what_travels_is_tls_not_frames(keys: DataKeys) -> None:
    # A listener that records the first bytes a sender writes: a TLS 1.3 ClientHello (record
    # type 22, handshake), never a frame header, so nothing readable leaves the host.
    seen: list[bytes] = []

    async def main() -> None:
        async def record(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            seen.append(await reader.read(5))
            writer.close()

        server = await asyncio.start_server(record, HOST, 0)
        port = server.sockets[0].getsockname()[1]
        config = stream_config(port, connections=1, max_attempts=1, connect_timeout_s=2.0)
        sender = StreamSender(config)
        await sender.send_chunk(1, 0, b"secret weights")
        with pytest.raises(LinkError):
            await sender.send_manifest(1, b"{}")
        await sender.close()
        server.close()

    run(main())
    assert seen
    assert seen[0][:1] == b"\x16"  # a TLS handshake record
    assert b"secret" not in seen[0]


async def _answered(
    port: int, data: bytes, ctx: ssl.SSLContext | None = None
) -> bytes | BaseException:
    """Write ``data`` to the receiver on a fresh connection (plain TCP, or TLS with ``ctx``);
    what came back before it closed, or why it failed."""
    try:
        reader, writer = await asyncio.open_connection(
            HOST, port, ssl=ctx, server_hostname=HOST if ctx else None
        )
        writer.write(data)
        await writer.drain()
        got = await reader.read()
        writer.close()
    except (OSError, asyncio.IncompleteReadError) as e:  # ssl.SSLError is an OSError
        return e
    return got


def test_a_peer_without_the_keys_delivers_nothing(keys: DataKeys, tmp_path: Path) -> None:
    (chunks, manifest), _ = encoded_versions(5)
    forged = b"".join(frame(MSG_CHUNK, 9, i, c) for i, c in enumerate(chunks))
    forged += frame(MSG_MANIFEST, 9, 0, manifest)
    other = DataKeys.load(make_keys(tmp_path / "other-cluster"))

    async def main() -> None:
        async with StreamReceiver(stream_config(0)) as receiver:
            port = receiver.address[1]
            # plain TCP: a self-consistent version written as frames, no acknowledgement
            plain = await _answered(port, forged)
            # TLS with another cluster's identity: the handshake fails
            stranger = await _answered(port, forged, other.client_context())
            await asyncio.sleep(0.3)
            assert receiver.stats.delivered == 0
        assert isinstance(plain, BaseException) or plain == b""
        assert isinstance(stranger, BaseException) or stranger == b""

    run(main())


def test_a_sender_of_another_cluster_is_refused(keys: DataKeys, tmp_path: Path) -> None:
    async def main() -> None:
        async with StreamReceiver(stream_config(0)) as receiver:
            port = receiver.address[1]
            config = stream_config(
                port, connections=1, max_attempts=2, backoff_s=0.01, connect_timeout_s=2.0
            )
            sender = StreamSender(config)
            # The sender holds another cluster's identity (its keys replaced after start).
            sender._tls = DataKeys.load(make_keys(tmp_path / "other")).client_context()
            await sender.send_chunk(1, 0, b"x" * 100)
            with pytest.raises(LinkError, match="gave up after 2 attempts"):
                await sender.send_manifest(1, b"{}")
            await sender.close()
            assert receiver.stats.delivered == 0

    run(main())


def test_beyond_loopback_the_link_needs_keys_unless_told_otherwise(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(KEYS_ENV, raising=False)
    with pytest.raises(DataKeyError, match="not loopback"):
        StreamReceiver(StreamLinkConfig(host="0.0.0.0"))
    with pytest.raises(DataKeyError, match="not loopback"):
        StreamSender(StreamLinkConfig(host="10.1.2.3", port=free_port()))
    with pytest.raises(DataKeyError, match="security = 'on'"):
        StreamSender(stream_config(free_port(), security="on"))
    assert link_keys("x", "10.1.2.3", "off") is None
    assert link_keys("x", "127.0.0.1", "auto") is None
    assert link_keys("x", "localhost", "auto") is None
    with pytest.raises(ValueError, match="security"):
        stream_config(0, security="maybe")
    d = make_keys(tmp_path / "keys")
    monkeypatch.setenv(KEYS_ENV, str(d))
    got = link_keys("x", "10.1.2.3", "auto")
    assert got is not None
    assert got.directory == d
