"""The stream receiver's memory under attack: connection limits and one shared byte budget.

Forty connections each sending a small zstd frame that decompresses to the frame limit once
took an apply agent from 175 MB to 10 GB: every connection decompressed its frame and held
it. Now connections are limited, and every payload is paid for from one budget before it is
read or decompressed.
"""

from __future__ import annotations

import asyncio
import logging
import tracemalloc
from typing import Any

import pytest
import zstandard

from deltarl.transport.base import ReceivedChunk, make_sender
from deltarl.transport.budget import BudgetClosedError, BudgetError, ByteBudget
from deltarl.transport.link_config import StreamLinkConfig
from deltarl.transport.stream import StreamReceiver
from deltarl.transport.stream_wire import HEADER, MSG_ACK, MSG_CHUNK, MSG_QUERY, pack_header
from tests.transport.linkdata import run
from tests.transport.test_stream import HOST, collect, frame, stream_config, until

Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


def bomb(nbytes: int) -> bytes:
    """A zstd frame of a few hundred bytes that decompresses to ``nbytes`` zeros."""
    return zstandard.ZstdCompressor(write_content_size=True).compress(bytes(nbytes))


def test_forty_connections_of_zstd_bombs_hold_at_most_the_budget() -> None:
    frame_max = 4 << 20
    config = stream_config(0, max_frame_bytes=frame_max, queue_size=64, max_connections_per_peer=64)
    budget = config.budget_bytes
    assert budget == 2 * frame_max
    payload = bomb(frame_max)
    assert len(payload) < 1000
    n = 40

    async def main() -> None:
        async with StreamReceiver(config) as receiver:
            port = receiver.address[1]
            tracemalloc.start()
            try:
                base = tracemalloc.get_traced_memory()[0]
                conns: list[Connection] = []
                for i in range(n):
                    conns.append(await asyncio.open_connection(HOST, port))
                    conns[-1][1].write(frame(MSG_CHUNK, 1, i, payload, zstd=True))
                await until(lambda: receiver.stats.connections == n)
                await asyncio.sleep(0.5)  # whatever can be decompressed now is
                grown = tracemalloc.get_traced_memory()[0] - base
            finally:
                tracemalloc.stop()
            # Unbounded, this is n * frame_max = 160 MiB of decompressed bombs.
            assert grown < budget + (2 << 20), f"{grown} bytes held by {n} connections"
            assert 0 < receiver.held_bytes <= budget
            assert receiver.peak_held_bytes <= budget
            assert receiver.budget_waits > 0

            # Backpressure, not refusal: as the consumer releases chunks, every one arrives.
            seen = set()
            while len(seen) < n:
                item = await anext(receiver)
                assert isinstance(item, ReceivedChunk)
                assert len(item.data) == frame_max
                assert receiver.held_bytes <= budget
                seen.add(item.chunk_id)
                item.release()
            for i, (reader, writer) in enumerate(conns):
                code, version, chunk_id, length = HEADER.unpack(
                    await reader.readexactly(HEADER.size)
                )
                assert (code, version, chunk_id, length) == (MSG_ACK, 1, i, 0)
                writer.close()
            assert seen == set(range(n))
            assert receiver.peak_held_bytes <= budget
            assert receiver.stats.delivered == n
            await until(lambda: receiver.held_bytes == 0)

    run(main())


async def alive(conn: Connection) -> bool:
    """Whether the receiver serves this connection: it answers a query."""
    reader, writer = conn
    try:
        writer.write(pack_header(MSG_QUERY, 1))
        async with asyncio.timeout(5):
            await reader.readexactly(HEADER.size)
    except (ConnectionError, asyncio.IncompleteReadError):
        return False
    return True


def test_connections_over_the_limits_are_refused_and_the_link_still_works(caplog: Any) -> None:
    caplog.set_level(logging.WARNING, logger="deltarl.transport.stream_receiver")
    config = stream_config(0, max_connections=6, max_connections_per_peer=4, connections=2)

    async def main() -> None:
        async with StreamReceiver(config) as receiver:
            port = receiver.address[1]

            async def connect(source: str) -> Connection:
                return await asyncio.open_connection(HOST, port, local_addr=(source, 0))

            conns, served = [], []
            for source in ["127.0.0.1"] * 5 + ["127.0.0.2"] * 3:
                conns.append(await connect(source))
                served.append(await alive(conns[-1]))
            # four from one address, then six in all
            assert served == [True] * 4 + [False] + [True, True, False]
            assert receiver.stats.refused_connections == 2
            assert receiver.stats.connections == 6

            conns[0][1].close()  # room again
            await until(lambda: len(receiver._handlers) == 5)
            conns.append(await connect("127.0.0.3"))
            assert await alive(conns[-1])

            for _, writer in conns:
                writer.close()
            await until(lambda: not receiver._handlers)
            reading = asyncio.create_task(collect(receiver, {1: 3}, 1))
            async with make_sender(stream_config(port, connections=2)) as sender:
                for i in range(3):
                    await sender.send_chunk(1, i, bytes([i]) * 1000)
                await sender.send_manifest(1, b"{}")
            got, _ = await reading
            assert got == {(1, i): bytes([i]) * 1000 for i in range(3)}
            assert receiver.held_bytes == 0

    run(main())
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "refused a connection from 127.0.0.1: max_connections_per_peer=4" in logged


def test_a_closing_receiver_frees_what_it_held_and_ends_waiting_handlers() -> None:
    frame_max = 1 << 20
    config = stream_config(0, max_frame_bytes=frame_max, queue_size=4)

    async def main() -> None:
        receiver = StreamReceiver(config)
        await receiver.start()
        port = receiver.address[1]
        conns = [await asyncio.open_connection(HOST, port) for _ in range(3)]
        for i, (_, writer) in enumerate(conns):
            writer.write(frame(MSG_CHUNK, 1, i, bomb(frame_max), zstd=True))
        await until(lambda: receiver.held_bytes > 0 and receiver.budget_waits > 0)
        await receiver.close()
        assert receiver.held_bytes == 0  # queued items dropped, waiting handlers ended
        for _, writer in conns:
            writer.close()

    run(main())


def test_a_payload_that_can_never_fit_drops_its_connection(caplog: Any) -> None:
    # The config keeps the budget at 2 * max_frame_bytes, so any frame the header check lets
    # through fits; a smaller budget (set here by hand) shows the refusal behind that.
    caplog.set_level(logging.ERROR, logger="deltarl.transport.stream_receiver")

    async def main() -> None:
        async with StreamReceiver(stream_config(0)) as receiver:
            receiver._budget = ByteBudget(1000)
            reader, writer = await asyncio.open_connection(HOST, receiver.address[1])
            writer.write(frame(MSG_CHUNK, 1, 0, bomb(5000), zstd=True))
            assert await reader.read() == b""  # dropped, no ack
            writer.close()
            assert receiver.stats.dropped_connections == 1
            assert receiver.held_bytes == 0

    run(main())
    assert "can never fit the 1000-byte budget" in caplog.text


def test_the_byte_budget_is_fifo_refuses_the_impossible_and_survives_cancels() -> None:
    async def main() -> None:
        budget = ByteBudget(10)
        with pytest.raises(BudgetError, match="11 bytes can never fit the 10-byte budget"):
            await budget.acquire(11)
        await budget.acquire(6)
        order: list[str] = []

        async def take(name: str, n: int) -> None:
            await budget.acquire(n)
            order.append(name)

        big = asyncio.create_task(take("big", 8))
        await asyncio.sleep(0)
        small = asyncio.create_task(take("small", 2))  # would fit now, but waits its turn
        doomed = asyncio.create_task(take("doomed", 1))
        await asyncio.sleep(0.01)
        assert order == []
        assert budget.waits == 3
        doomed.cancel()
        await asyncio.gather(doomed, return_exceptions=True)
        budget.release(6)
        await asyncio.gather(big, small)
        assert order == ["big", "small"]
        assert (budget.held, budget.peak) == (10, 10)
        budget.release(10)

        await budget.acquire(10)
        granted = asyncio.create_task(budget.acquire(3))
        await asyncio.sleep(0)
        budget.release(10)  # grants 3 to the waiter ...
        granted.cancel()  # ... which is cancelled before it runs: the 3 come back
        await asyncio.gather(granted, return_exceptions=True)
        assert budget.held == 0

        await budget.acquire(9)
        waiting = asyncio.create_task(budget.acquire(5))
        await asyncio.sleep(0)
        budget.close()
        with pytest.raises(BudgetClosedError):
            await waiting
        with pytest.raises(BudgetClosedError):
            await budget.acquire(1)
        with pytest.raises(RuntimeError, match="only 9 are held"):
            budget.release(10)

    run(main())


def test_the_connection_and_memory_keys_are_checked() -> None:
    config = StreamLinkConfig()
    assert (config.max_connections, config.max_connections_per_peer) == (64, 16)
    assert config.budget_bytes == 2 * config.max_frame_bytes
    assert StreamLinkConfig(memory_budget_bytes=1 << 30).budget_bytes == 1 << 30
    with pytest.raises(ValueError, match="memory_budget_bytes must be at least 2 \\* max_frame"):
        StreamLinkConfig(max_frame_bytes=100, memory_budget_bytes=150)
    with pytest.raises(ValueError, match="max_connections must be positive"):
        StreamLinkConfig(max_connections=0)
    with pytest.raises(ValueError, match="must not exceed max_connections"):
        StreamLinkConfig(max_connections=8, max_connections_per_peer=9)
    with pytest.raises(ValueError, match="connections \\(5\\) must not exceed"):
        StreamLinkConfig(connections=5, max_connections_per_peer=4)
