"""The export agent's watch on a receiver: events first, the control socket when they are
missing or fall silent, and nothing heard means no receiver. Real sockets over ipc://."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

from deltarl.refit.receiver_state import GetReceiverState, ReceiverState, StateFeed
from deltarl.transport.control import ControlServer
from deltarl.transport.events import EventPublisher
from deltarl.transport.receiver_watch import ReceiverWatch

STATE = ReceiverState(session="s", active_version=1, needs_full=False)


class Receiver:
    """Plays an apply agent: answers refit.get_receiver and publishes states."""

    def __init__(self, tmp: Path) -> None:
        self.control = f"ipc://{tmp}/apply.sock"
        self.events = f"ipc://{tmp}/apply.events"
        self.state = STATE
        self.asked = 0
        self.server = ControlServer(self.control, {GetReceiverState: self.on_get})
        self.publisher = EventPublisher(self.events)

    async def on_get(self, _: GetReceiverState) -> ReceiverState:
        self.asked += 1
        return self.state


async def _heard(feed: StateFeed, version: int, timeout_s: float = 5.0) -> ReceiverState:
    async with asyncio.timeout(timeout_s):
        state = feed.latest()
        while state is None or state.active_version != version:
            state = await feed.next(timeout_s)
        return state


def test_events_carry_the_state_and_silence_makes_it_ask(tmp_path: Path) -> None:
    async def scenario() -> None:
        rx = Receiver(tmp_path)
        rx.publisher.bind()
        feed = StateFeed(stale_s=3.0)
        watch = ReceiverWatch(feed, rx.control, rx.events, quiet_s=1.5)
        async with rx.server:
            watch.start()
            try:
                await _heard(feed, 1)  # asked at once: a subscriber misses the past
                assert rx.asked == 1
                for version in (2, 3):  # then pushed: nobody asks while events flow
                    rx.state = dataclasses.replace(STATE, active_version=version)
                    for _ in range(20):  # PUB/SUB joins asynchronously: publish until heard
                        await rx.publisher.publish(rx.state)
                        if feed.state is not None and feed.state.active_version == version:
                            break
                        await asyncio.sleep(0.05)
                    await _heard(feed, version, 1.0)
                assert rx.asked == 1
                # silence (events lost, or the publisher gone): the watch asks the socket
                rx.state = dataclasses.replace(STATE, active_version=4)
                await _heard(feed, 4, 4.0)
                assert rx.asked >= 2
            finally:
                await watch.close()
                rx.publisher.close()

    asyncio.run(scenario())


def test_without_events_it_polls_and_a_dead_receiver_goes_stale(tmp_path: Path) -> None:
    async def scenario() -> None:
        rx = Receiver(tmp_path)
        feed = StateFeed(stale_s=0.5)
        watch = ReceiverWatch(feed, rx.control, None, poll_s=0.05)
        async with rx.server:
            watch.start()
            try:
                await _heard(feed, 1)
                rx.state = dataclasses.replace(STATE, active_version=2)
                await _heard(feed, 2, 1.0)  # within a few polls
                assert rx.asked >= 2
            except BaseException:
                await watch.close()
                raise
        # the receiver is gone: nothing is heard, and the feed says so
        await asyncio.sleep(1.0)
        assert feed.latest() is None
        await watch.close()

    asyncio.run(scenario())
