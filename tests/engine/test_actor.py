"""Actors and mailboxes: round trips, order, backpressure, timeouts, stop, hooks."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import uvloop

from deltarl.engine.actor import (
    Actor,
    ActorState,
    ActorStopped,
    AskTimeout,
    Mailbox,
    MailboxFull,
)

Runner = Callable[[Coroutine[Any, Any, Any]], Any]


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request) -> Runner:
    """Each async test body runs on both loop implementations."""
    return asyncio.run if request.param == "asyncio" else uvloop.run


class Recorder(Actor[Any, Any]):
    """Records what it is told; answers "get" with the record; can be held on a gate."""

    def __init__(self, name: str = "recorder", capacity: int = 64) -> None:
        super().__init__(name, capacity=capacity)
        self.seen: list[Any] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.events: list[str] = []

    async def on_start(self) -> None:
        self.events.append("start")

    async def on_stop(self) -> None:
        self.events.append("stop")

    async def on_failure(self, exc: Exception) -> None:
        self.events.append(f"failure:{exc}")

    async def handle(self, msg: Any) -> Any:
        await self.gate.wait()
        if msg == "get":
            return list(self.seen)
        if msg == "boom":
            raise ValueError("boom")
        if msg == "hang":
            await asyncio.Event().wait()
        self.seen.append(msg)
        return ("ok", msg)


def test_tell_and_ask_round_trip_in_fifo_order(run) -> None:
    async def main() -> None:
        actor = Recorder()
        actor.start()
        for i in range(100):
            await actor.tell(i)
        actor.tell_nowait(100)
        assert await actor.ask("x", timeout=1.0) == ("ok", "x")
        assert await actor.ask("get") == [*range(101), "x"]
        stats = actor.stats()
        assert stats.total_received == 103
        assert stats.used == 0
        await actor.stop()
        assert actor.state is ActorState.STOPPED

    run(main())


def test_full_mailbox_makes_senders_wait_and_counts_them(run) -> None:
    async def main() -> None:
        actor = Recorder(capacity=2)
        actor.gate.clear()
        actor.start()
        await actor.tell("in-flight")
        await asyncio.sleep(0)  # the actor takes it and waits on the gate
        await actor.tell("a")
        await actor.tell("b")
        senders = [asyncio.create_task(actor.tell(c)) for c in "cd"]
        await asyncio.sleep(0.01)
        assert not any(s.done() for s in senders)  # backpressure: they wait for space
        stats = actor.stats()
        assert (stats.used, stats.capacity, stats.peak, stats.waiting_senders) == (2, 2, 2, 2)
        with pytest.raises(MailboxFull, match="mailbox of actor recorder is full"):
            actor.tell_nowait("e")
        actor.gate.set()
        await asyncio.gather(*senders)
        assert await actor.ask("get") == ["in-flight", "a", "b", "c", "d"]
        stats = actor.stats()
        assert stats.waiting_senders == 0
        assert stats.peak == 2
        assert stats.total_received == 6
        await actor.stop()

    run(main())


def test_cancelled_sender_does_not_keep_the_space_from_the_next(run) -> None:
    async def main() -> None:
        box: Mailbox[int] = Mailbox(1, "m")
        box.put_nowait(0)
        first = asyncio.create_task(box.put(1))
        second = asyncio.create_task(box.put(2))
        await asyncio.sleep(0)
        assert box.stats().waiting_senders == 2
        assert await box.get() == 0  # wakes `first` ...
        first.cancel()  # ... which is cancelled before it runs: the wake-up passes on
        await asyncio.sleep(0)
        await asyncio.wait_for(second, 1.0)
        assert await box.get() == 2
        assert first.cancelled()

    run(main())


def test_mailbox_rejects_a_capacity_below_one() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        Mailbox(0, "m")


def test_ask_times_out_with_a_clear_error(run) -> None:
    async def main() -> None:
        actor = Recorder()
        actor.gate.clear()
        actor.start()
        with pytest.raises(AskTimeout, match=r"ask to actor recorder got no reply within 0\.05 s"):
            await actor.ask("slow", timeout=0.05)
        actor.gate.set()  # the message is still handled; only its reply was dropped
        assert await actor.ask("get", timeout=1.0) == ["slow"]
        await actor.stop()

    run(main())


def test_a_handlers_own_errors_reach_the_asker(run) -> None:
    class Raiser(Actor[str, None]):
        async def handle(self, msg: str) -> None:
            raise TimeoutError(msg)  # not an AskTimeout: the handler's own error

    async def main() -> None:
        actor = Raiser()
        actor.start()
        with pytest.raises(TimeoutError, match="upstream") as info:
            await actor.ask("upstream", timeout=1.0)
        assert not isinstance(info.value, AskTimeout)

    run(main())


def test_stop_fails_queued_and_in_flight_asks_and_later_sends(run) -> None:
    async def main() -> None:
        actor = Recorder(capacity=1)
        actor.start()
        in_flight = asyncio.create_task(actor.ask("hang"))
        await asyncio.sleep(0.01)
        queued = asyncio.create_task(actor.ask("queued"))
        waiting = asyncio.create_task(actor.ask("waiting"))  # mailbox full: a waiting sender
        await asyncio.sleep(0.01)
        assert actor.stats().waiting_senders == 1
        await actor.stop(drain_timeout_s=0.05)  # "hang" never finishes: cancelled
        for pending in (in_flight, queued, waiting):
            with pytest.raises(ActorStopped, match=r"^actor recorder stopped$"):
                await asyncio.wait_for(pending, 1.0)
        with pytest.raises(ActorStopped):
            await actor.tell("late")
        with pytest.raises(ActorStopped):
            actor.tell_nowait("late")
        with pytest.raises(ActorStopped):
            await actor.ask("late", timeout=1.0)
        assert actor.events == ["start", "stop"]
        await actor.stop()  # idempotent: on_stop ran once
        assert actor.events == ["start", "stop"]

    run(main())


def test_stop_drains_what_is_queued_within_the_timeout(run) -> None:
    async def main() -> None:
        actor = Recorder()
        actor.gate.clear()
        actor.start()
        asks = [asyncio.create_task(actor.ask(i)) for i in range(5)]
        await asyncio.sleep(0.01)
        stopping = asyncio.create_task(actor.stop(drain_timeout_s=5.0))
        await asyncio.sleep(0.01)
        assert actor.state is ActorState.STOPPING
        with pytest.raises(ActorStopped):
            await actor.tell("refused while draining")
        actor.gate.set()
        await stopping
        assert [await a for a in asks] == [("ok", i) for i in range(5)]
        assert actor.seen == list(range(5))

    run(main())


def test_hooks_run_in_order_across_a_restart(run) -> None:
    async def main() -> None:
        actor = Recorder()
        actor.start(crash_policy=lambda _actor, _exc: 0.0)  # always restart at once
        with pytest.raises(ValueError, match="boom"):
            await actor.ask("boom", timeout=1.0)
        assert await actor.ask("after", timeout=1.0) == ("ok", "after")
        await actor.stop()
        assert actor.events == ["start", "failure:boom", "start", "stop"]
        assert actor.incarnations == 2

    run(main())


def test_an_unsupervised_failure_stops_the_actor_and_fails_what_was_queued(run) -> None:
    async def main() -> None:
        actor = Recorder()
        actor.gate.clear()
        actor.start()
        failing = asyncio.create_task(actor.ask("boom"))
        queued = asyncio.create_task(actor.ask("queued"))
        await asyncio.sleep(0.01)
        actor.gate.set()
        with pytest.raises(ValueError, match="boom"):
            await failing
        with pytest.raises(ActorStopped):
            await queued
        assert actor.state is ActorState.FAILED
        assert isinstance(actor.failure, ValueError)
        with pytest.raises(ActorStopped):
            await actor.tell("late")
        await actor.stop()
        assert actor.events == ["start", "failure:boom"]  # on_failure instead of on_stop

    run(main())


def test_stop_before_start_fails_queued_asks_without_hooks(run) -> None:
    async def main() -> None:
        actor = Recorder()
        pending = asyncio.create_task(actor.ask("never"))
        await asyncio.sleep(0)
        await actor.stop()
        with pytest.raises(ActorStopped):
            await pending
        assert actor.events == []

    run(main())


def test_an_actor_cannot_await_its_own_stop(run) -> None:
    class SelfStopper(Actor[str, None]):
        async def handle(self, msg: str) -> None:
            await self.stop()

    async def main() -> None:
        actor = SelfStopper()
        actor.start()
        with pytest.raises(RuntimeError, match="cannot await its own stop"):
            await actor.ask("stop", timeout=1.0)

    run(main())
