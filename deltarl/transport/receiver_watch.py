"""Keeps a ``StateFeed`` current with what a receiver (an apply agent) says about itself.

The receiver pushes its ``ReceiverState`` on its event socket on every change and every
heartbeat; the watch subscribes to it. A subscriber misses what was published before it
connected, and events can be dropped (PUB never blocks), so the watch also asks the receiver's
control socket (``GetReceiverState``) at once, and again whenever nothing was heard for
``quiet_s``. Without an event endpoint it asks every ``poll_s``: the fallback for a
configuration that names none, slower by up to ``poll_s`` per acknowledgement.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from deltarl.refit.receiver_state import RECEIVER_STATE, GetReceiverState, ReceiverState, StateFeed
from deltarl.transport.control import ControlClient, ControlProtocolError, ControlTimeoutError
from deltarl.transport.events import EventSubscriber
from deltarl.transport.messages import REPLIES

logger = logging.getLogger(__name__)

ASK_TIMEOUT_S = 2.0


class ReceiverWatch:
    def __init__(
        self,
        feed: StateFeed,
        control: str,
        events: str | None,
        *,
        poll_s: float = 0.05,
        quiet_s: float = 1.5,
        on_update: Callable[[], None] | None = None,
    ) -> None:
        self.feed = feed
        self.control = control
        self.events = events
        self.poll_s = poll_s
        self.quiet_s = quiet_s
        self.on_update = on_update or (lambda: None)
        self.asked = 0
        self._client = ControlClient(control, replies={**REPLIES, **RECEIVER_STATE})
        self._tasks: list[asyncio.Task[None]] = []
        self._unreachable = False

    def start(self) -> None:
        if self.events is not None:
            self._tasks.append(asyncio.create_task(self._listen(self.events), name="watch:events"))
        self._tasks.append(asyncio.create_task(self._ask_when_quiet(), name="watch:ask"))

    def _heard(self, state: ReceiverState) -> None:
        self.feed.update(state)
        self.on_update()

    async def _listen(self, endpoint: str) -> None:
        sub = EventSubscriber(endpoint, (ReceiverState.TAG,), events=RECEIVER_STATE)
        try:
            while True:
                event = await sub.receive()
                if isinstance(event, ReceiverState):
                    self._heard(event)
        finally:
            sub.close()

    async def _ask_when_quiet(self) -> None:
        quiet = self.poll_s if self.events is None else self.quiet_s
        while True:
            if self.feed.age_s >= quiet:
                await self._ask()
            await asyncio.sleep(self.poll_s if self.events is None else min(self.quiet_s, 0.25))

    async def _ask(self) -> None:
        self.asked += 1
        try:
            reply = await self._client.request(GetReceiverState(), ASK_TIMEOUT_S)
        except (ControlTimeoutError, ControlProtocolError) as e:
            # Tolerated: the apply agent restarts under systemd; the feed goes stale meanwhile.
            if not self._unreachable:
                logger.info("apply agent at %s not answering: %s", self.control, e)
            self._unreachable = True
            return
        if not isinstance(reply, ReceiverState):
            logger.warning("apply agent at %s answered %r", self.control, reply)
            return
        if self._unreachable:
            logger.info("apply agent at %s answers again", self.control)
        self._unreachable = False
        self._heard(reply)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._client.close()
