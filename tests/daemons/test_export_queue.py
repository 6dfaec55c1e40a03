"""The export agent's chunk queue: when the link's send task dies while the encoder waits for
room in a full queue, the encoder stops instead of waiting forever."""

from __future__ import annotations

import asyncio

from deltarl.daemons.export import _put_unless_done


def test_put_returns_false_when_the_consumer_dies_on_a_full_queue() -> None:
    async def scenario() -> tuple[bool, bool]:
        queue: asyncio.Queue[object] = asyncio.Queue(1)
        queue.put_nowait(object())  # full

        async def consumer() -> None:
            await asyncio.sleep(0.05)
            raise ConnectionError("the link failed")

        task = asyncio.create_task(consumer())
        ok = await asyncio.wait_for(_put_unless_done(queue, None, task), 5)  # type: ignore[arg-type]
        assert task.done()
        with_room = asyncio.Queue(1)  # type: ignore[var-annotated]
        live = asyncio.create_task(asyncio.sleep(10))
        ok2 = await _put_unless_done(with_room, None, live)
        live.cancel()
        return ok, ok2

    ok, ok2 = asyncio.run(scenario())
    assert ok is False
    assert ok2 is True
