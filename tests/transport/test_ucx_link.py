"""The UCX link over loopback (UCX's tcp and shared-memory transports): delivery, dedup,
connection failure, bad headers. Skipped where the ``ucx`` extra (ucxx) is not installed."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable

import pytest

from deltarl.transport.base import (
    LinkError,
    ReceivedChunk,
    make_receiver,
    make_sender,
)
from deltarl.transport.link_config import UcxLinkConfig
from deltarl.transport.ports import free_port
from deltarl.transport.stream_wire import WireError
from deltarl.transport.ucx_link import CHUNK, UcxReceiver, UcxSender, pack_header, unpack_header

ucxx = pytest.importorskip("ucxx", reason="the ucx extra (ucxx) is not installed")

HOST = "127.0.0.1"


def run(main: Callable[[], Awaitable[None]], timeout: float = 20.0) -> None:
    asyncio.run(asyncio.wait_for(main(), timeout))


Item = tuple[str, int, int, bytes]  # ("chunk" or "manifest", version, chunk id, data)


async def collect(receiver: UcxReceiver, last_version: int) -> list[Item]:
    """Every item until the manifest of ``last_version``, chunks copied out and released."""
    items: list[Item] = []
    async for item in receiver:
        if isinstance(item, ReceivedChunk):
            items.append(("chunk", item.version, item.chunk_id, bytes(item.data)))
            item.release()
        else:
            items.append(("manifest", item.version, 0, item.data))
            if item.version == last_version:
                break
    return items


def test_a_version_arrives_byte_exact() -> None:
    # Empty, eager (below UCX's rendezvous threshold) and rendezvous-sized payloads.
    sizes = [0, 1, 100, 8191, 8192, 70_000, 3 << 20]
    chunks = [os.urandom(n) for n in sizes]
    manifest = b'{"version": 7, "tensors": []}'

    async def main() -> None:
        async with make_receiver(UcxLinkConfig(host=HOST)) as receiver:
            assert isinstance(receiver, UcxReceiver)
            port = receiver.address[1]
            got = asyncio.create_task(collect(receiver, 7))
            async with make_sender(UcxLinkConfig(host=HOST, port=port)) as sender:
                assert isinstance(sender, UcxSender)
                for chunk_id, data in enumerate(chunks):
                    # bytes and a memoryview into a larger buffer: both sent without a copy
                    payload = memoryview(b"xx" + data)[2:] if chunk_id % 2 else data
                    await sender.send_chunk(7, chunk_id, payload)
                await sender.send_manifest(7, manifest)
            items = await got
        received = {chunk_id: data for kind, _, chunk_id, data in items if kind == "chunk"}
        assert received == dict(enumerate(chunks))
        assert items[-1] == ("manifest", 7, 0, manifest)
        assert len(items) == len(chunks) + 1
        assert receiver.stats.duplicates == 0

    run(main)


def test_a_duplicate_is_delivered_once() -> None:
    async def main() -> None:
        async with make_receiver(UcxLinkConfig(host=HOST)) as receiver:
            got = asyncio.create_task(collect(receiver, 2))
            config = UcxLinkConfig(host=HOST, port=receiver.address[1])
            async with make_sender(config) as sender:
                for _ in range(2):  # the whole version twice: the second copy is acked, dropped
                    await sender.send_chunk(1, 0, b"first")
                    await sender.send_manifest(1, b"{}")
            async with make_sender(config) as other:  # a new connection, same chunk again
                await other.send_chunk(1, 0, b"first")
                await other.send_chunk(2, 0, b"second")
                await other.send_manifest(2, b"{}")
            items = await got
        assert items == [
            ("chunk", 1, 0, b"first"),
            ("manifest", 1, 0, b"{}"),
            ("chunk", 2, 0, b"second"),
            ("manifest", 2, 0, b"{}"),
        ]
        assert receiver.stats.duplicates == 3
        assert receiver.stats.connections == 2

    run(main)


def test_no_listener_gives_a_link_error_within_the_timeout() -> None:
    config = UcxLinkConfig(
        host=HOST, port=free_port(), connect_timeout_s=0.5, max_attempts=2, backoff_s=0.05
    )

    async def main() -> None:
        sender = make_sender(config)
        start = time.monotonic()
        with pytest.raises(LinkError, match=r"no connection after 2 attempts"):
            await sender.send_chunk(0, 0, b"x")
        assert time.monotonic() - start < 2 * 0.5 + 2.0
        with pytest.raises(LinkError):  # the sender stays failed
            await sender.send_manifest(0, b"{}")
        await sender.close()

    run(main)


def test_a_restarted_receiver_gets_what_was_not_acknowledged() -> None:
    async def main() -> None:
        first = make_receiver(UcxLinkConfig(host=HOST, queue_size=1))
        await first.start()
        port = first.address[1]
        sender = make_sender(UcxLinkConfig(host=HOST, port=port, backoff_s=0.05))
        await sender.send_chunk(4, 0, b"zero")  # queued (the queue holds one): acknowledged
        await sender.send_chunk(4, 1, b"one")  # pulled, but waits for room: never acknowledged
        await first.close()  # drops both; the restart listens on the same port at once
        async with make_receiver(UcxLinkConfig(host=HOST, port=port)) as second:
            got = asyncio.create_task(collect(second, 4))
            await sender.send_manifest(4, b"{}")  # reconnects, resends chunk 1, then this
            items = await got
        # Chunk 0 comes again only if its ack was still on its way when the first one closed.
        assert items[-2:] == [("chunk", 4, 1, b"one"), ("manifest", 4, 0, b"{}")]
        assert items[:-2] in ([], [("chunk", 4, 0, b"zero")])
        assert second.stats.duplicates == 0
        await sender.close()

    run(main)


def test_a_bad_header_drops_that_connection_only(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        async with make_receiver(UcxLinkConfig(host=HOST)) as receiver:
            port = receiver.address[1]
            got = asyncio.create_task(collect(receiver, 3))
            rogue = await ucxx.create_endpoint(HOST, port)
            await rogue.send(b"NOPE" + bytes(28))
            for _ in range(200):  # the receiver notices and drops it
                if receiver.stats.dropped_connections:
                    break
                await asyncio.sleep(0.01)
            await rogue.close()
            async with make_sender(UcxLinkConfig(host=HOST, port=port)) as sender:
                await sender.send_chunk(3, 1, b"ok")
                await sender.send_manifest(3, b"{}")
            items = await got
        assert items == [("chunk", 3, 1, b"ok"), ("manifest", 3, 0, b"{}")]
        assert receiver.stats.dropped_connections == 1

    run(main)
    assert "bad magic" in caplog.text


def test_headers_round_trip_and_refuse_what_is_wrong() -> None:
    kinds = {CHUNK: "chunk"}
    assert unpack_header(pack_header(CHUNK, 5, 9, 100), kinds, 100) == (CHUNK, 5, 9, 100)
    with pytest.raises(WireError, match="over max_frame_bytes=99"):
        unpack_header(pack_header(CHUNK, 5, 9, 100), kinds, 99)
    with pytest.raises(WireError, match="message kind 2"):
        unpack_header(pack_header(2, 5), kinds, 100)
    with pytest.raises(WireError, match="bad magic"):
        unpack_header(b"XXXX" + pack_header(CHUNK, 5)[4:], kinds, 100)
    short = pack_header(CHUNK, 5, 9, 100)[:20] + bytes(12)  # a short message, zero-filled
    with pytest.raises(WireError, match="a short or corrupt header"):
        unpack_header(short, kinds, 100)
    with pytest.raises(WireError, match="reserved header field is 1"):
        unpack_header(pack_header(CHUNK, 5)[:6] + b"\x01" + pack_header(CHUNK, 5)[7:], kinds, 9)


def test_config_refuses_bad_values_and_importing_deltarl_does_not_load_ucxx() -> None:
    with pytest.raises(ValueError, match="port must lie in"):
        UcxLinkConfig(port=70000)
    with pytest.raises(ValueError, match="ack_timeout_s must be positive"):
        UcxLinkConfig(ack_timeout_s=0)
    code = (
        "import sys, deltarl.transport.base, deltarl.transport.ucx_link;"
        "assert 'ucxx' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
