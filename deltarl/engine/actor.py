"""Actors: one asyncio task reading one bounded mailbox.

An actor serialises everything that touches its state: ``handle()`` runs for one message at a
time, in mailbox (FIFO) order, in the actor's own task. Senders either ``tell`` (fire and
forget) or ``ask`` (the message travels in an ``Envelope`` with a reply future).

Backpressure: the mailbox is bounded. ``tell``/``ask`` wait for space, so a slow actor slows
its senders down instead of growing a queue without limit; ``tell_nowait`` refuses with
``MailboxFull`` instead of waiting (for callers that must not block, e.g. a socket reader that
would rather drop and count). Nothing is ever dropped silently.

An actor's lifetime (one incarnation is one run of on_start + the message loop):

    NEW --start()--> RUNNING --handler or on_start raises--> on_failure()
                        |                                       |
                        |        restart (supervisor's policy) <-+-> FAILED (no restart:
                        |        after a backoff; same mailbox        queued asks fail)
                        |
                     stop(): mailbox closed (no new messages), queued ones drained
                        |    (bounded by the caller's timeout), then the task cancelled
                        v
                     STOPPED (on_stop() ran; every pending ask failed with ActorStopped)

A restart keeps the mailbox: messages queued behind the failing one are served by the next
incarnation. ``on_stop`` runs once, after a clean or cancelled drain; an actor that ended by
failure had ``on_failure`` instead (as in pykka).
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

logger = logging.getLogger(__name__)

MsgT = TypeVar("MsgT")
ReplyT = TypeVar("ReplyT")
ItemT = TypeVar("ItemT")


class ActorStopped(RuntimeError):  # noqa: N818 - named by the project's API
    """The actor has stopped (or is stopping): it takes no message and will answer no ask."""

    def __init__(self, actor: str) -> None:
        super().__init__(f"actor {actor} stopped")
        self.actor = actor


class MailboxFull(RuntimeError):  # noqa: N818 - named by the project's API
    """``tell_nowait`` found the actor's mailbox at capacity."""

    def __init__(self, actor: str, capacity: int) -> None:
        super().__init__(f"mailbox of actor {actor} is full ({capacity} messages)")
        self.actor = actor
        self.capacity = capacity


class AskTimeout(TimeoutError):  # noqa: N818 - reads as what happened, like TimeoutError
    """An ask got no reply in time (waiting for mailbox space counts against the timeout).

    The message may still be handled later; only its reply is dropped. As with any timeout,
    the asker cannot know whether the handler ran.
    """

    def __init__(self, actor: str, timeout_s: float) -> None:
        super().__init__(f"ask to actor {actor} got no reply within {timeout_s:g} s")
        self.actor = actor
        self.timeout_s = timeout_s


@dataclass(frozen=True, slots=True)
class MailboxStats:
    """A snapshot of one mailbox, for status commands and metrics."""

    used: int  # messages queued now (not counting the one being handled)
    capacity: int
    peak: int  # the most messages ever queued at once
    waiting_senders: int  # senders blocked in tell/ask for want of space
    total_received: int  # messages ever accepted into the mailbox
    closed: bool


@dataclass(slots=True)
class Envelope(Generic[MsgT, ReplyT]):
    """A message and, for an ask, the future its reply goes to (None for a tell)."""

    msg: MsgT
    reply: asyncio.Future[ReplyT] | None = None

    def resolve(self, value: ReplyT) -> None:
        # A done future is an asker that timed out or was cancelled: nobody is listening.
        if self.reply is not None and not self.reply.done():
            self.reply.set_result(value)

    def fail(self, exc: BaseException) -> None:
        if self.reply is not None and not self.reply.done():
            self.reply.set_exception(exc)


class Mailbox(Generic[ItemT]):
    """A bounded FIFO with one receiver, many senders, and statistics.

    Invariants (kept by ``put``/``get``/``close``):
    - ``len(_items) <= capacity``;
    - ``_senders`` holds the futures of senders waiting for space, oldest first; a sender is
      only woken when there is space (or the mailbox closed);
    - once closed, nothing is added; ``get`` returns what is left, then None.
    """

    def __init__(self, capacity: int, owner: str) -> None:
        if capacity < 1:
            raise ValueError(f"mailbox capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self.owner = owner
        self._items: deque[ItemT] = deque()
        self._senders: deque[asyncio.Future[None]] = deque()
        self._receiver: asyncio.Future[None] | None = None
        self._closed = False
        self._peak = 0
        self._total_received = 0

    @property
    def closed(self) -> bool:
        return self._closed

    def stats(self) -> MailboxStats:
        waiting = sum(1 for f in self._senders if not f.done())
        return MailboxStats(
            used=len(self._items),
            capacity=self.capacity,
            peak=self._peak,
            waiting_senders=waiting,
            total_received=self._total_received,
            closed=self._closed,
        )

    async def put(self, item: ItemT) -> None:
        """Queue ``item``, waiting while the mailbox is full. Raises ActorStopped once closed."""
        while not self._closed and len(self._items) >= self.capacity:
            waiter = asyncio.get_running_loop().create_future()
            self._senders.append(waiter)
            try:
                await waiter
            except BaseException:
                # Cancelled (or timed out) while waiting. If a wake-up had already been handed
                # to us, pass it on so the space does not go unused by the next sender.
                if waiter in self._senders:
                    self._senders.remove(waiter)
                elif not waiter.cancelled():
                    self._wake_next_sender()
                raise
        if self._closed:
            raise ActorStopped(self.owner)
        self.put_nowait(item)

    def put_nowait(self, item: ItemT) -> None:
        if self._closed:
            raise ActorStopped(self.owner)
        if len(self._items) >= self.capacity:
            raise MailboxFull(self.owner, self.capacity)
        self._items.append(item)
        self._total_received += 1
        self._peak = max(self._peak, len(self._items))
        if self._receiver is not None and not self._receiver.done():
            self._receiver.set_result(None)

    async def get(self) -> ItemT | None:
        """The oldest item; None when the mailbox is closed and empty (drained)."""
        while not self._items:
            if self._closed:
                return None
            if self._receiver is not None:
                raise RuntimeError(f"mailbox of actor {self.owner} has a second receiver")
            self._receiver = asyncio.get_running_loop().create_future()
            try:
                await self._receiver
            finally:
                self._receiver = None
        item = self._items.popleft()
        self._wake_next_sender()
        return item

    def close(self) -> None:
        """Stop accepting: later puts and every waiting sender get ActorStopped.

        What is queued stays, for the receiver to drain or for ``take_all``.
        """
        self._closed = True
        while self._senders:
            waiter = self._senders.popleft()
            if not waiter.done():
                waiter.set_result(None)  # it wakes, sees the mailbox closed, raises ActorStopped
        if self._receiver is not None and not self._receiver.done():
            self._receiver.set_result(None)

    def take_all(self) -> list[ItemT]:
        """Empty the mailbox and return what was in it (to fail the asks among them)."""
        items = list(self._items)
        self._items.clear()
        self._wake_next_sender()
        return items

    def _wake_next_sender(self) -> None:
        while self._senders and len(self._items) < self.capacity:
            waiter = self._senders.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return


class ActorState(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    RESTARTING = "restarting"  # an incarnation failed; waiting out the backoff
    STOPPING = "stopping"  # mailbox closed, draining
    STOPPED = "stopped"
    FAILED = "failed"  # ended by a failure that was not restarted


# Called by the actor's task after on_failure: the delay before the next incarnation, or None
# to stay down. The supervisor installs one; an unsupervised actor stays down.
CrashPolicy = Callable[["Actor[Any, Any]", Exception], float | None]


def _stay_down(actor: Actor[Any, Any], exc: Exception) -> float | None:
    return None


class Actor(Generic[MsgT, ReplyT]):
    """Subclass and define ``handle``; override the hooks as needed."""

    def __init__(self, name: str | None = None, *, capacity: int = 64) -> None:
        self.name = name or type(self).__name__
        self.mailbox: Mailbox[Envelope[MsgT, ReplyT]] = Mailbox(capacity, self.name)
        self.state = ActorState.NEW
        self.failure: Exception | None = None  # set when the actor ended by failure
        self.incarnations = 0
        # Set once the first incarnation's on_start has returned (and stays set).
        self.started = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._crash_policy: CrashPolicy = _stay_down
        self._stop_done = False  # stop() finished its work once (it is idempotent)

    # -- hooks --------------------------------------------------------------------------------

    async def on_start(self) -> None:
        """Runs in the actor's task before each incarnation's first message."""

    async def handle(self, msg: MsgT) -> ReplyT:
        """Handle one message; the return value answers an ask (ignored for a tell)."""
        raise NotImplementedError(f"{type(self).__name__} must define handle()")

    async def on_stop(self) -> None:
        """Runs once, after the mailbox was drained (or the drain was cut short)."""

    async def on_failure(self, exc: Exception) -> None:
        """Runs in the actor's task when on_start or handle raised; before any restart."""

    # -- senders ------------------------------------------------------------------------------

    async def tell(self, msg: MsgT) -> None:
        """Queue a message, waiting for space. Raises ActorStopped if the actor stopped."""
        await self.mailbox.put(Envelope(msg))

    def tell_nowait(self, msg: MsgT) -> None:
        """Queue a message or raise MailboxFull (or ActorStopped) at once."""
        self.mailbox.put_nowait(Envelope(msg))

    # ASYNC109: the timeout is part of the ask (it names the actor in AskTimeout and tells a
    # dead actor from a slow one), not a general cancel scope a caller could wrap around it.
    async def ask(self, msg: MsgT, timeout: float | None = None) -> ReplyT:  # noqa: ASYNC109
        """Send a message and wait for the handler's reply (or its exception).

        Raises AskTimeout after ``timeout`` seconds (queueing included), ActorStopped if the
        actor stops before answering, or whatever the handler raised.
        """
        reply: asyncio.Future[ReplyT] = asyncio.get_running_loop().create_future()
        deadline = asyncio.timeout(timeout)
        try:
            async with deadline:
                await self.mailbox.put(Envelope(msg, reply))
                return await reply
        except TimeoutError:
            if deadline.expired():
                raise AskTimeout(self.name, timeout or 0.0) from None
            raise  # the handler's own TimeoutError

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self, crash_policy: CrashPolicy | None = None) -> asyncio.Task[None]:
        if self._task is not None:
            raise RuntimeError(f"actor {self.name} was already started")
        if crash_policy is not None:
            self._crash_policy = crash_policy
        self._task = asyncio.get_running_loop().create_task(
            self._lifecycle(), name=f"actor:{self.name}"
        )
        return self._task

    @property
    def task(self) -> asyncio.Task[None] | None:
        return self._task

    @property
    def done(self) -> bool:
        return self._task is not None and self._task.done()

    def stats(self) -> MailboxStats:
        return self.mailbox.stats()

    async def stop(self, drain_timeout_s: float | None = 5.0) -> None:
        """Stop accepting, drain what is queued for up to ``drain_timeout_s``, then cancel.

        Every ask still pending afterwards (queued or in flight) fails with ActorStopped.
        Idempotent; ``on_stop`` runs once, and not at all for an actor that ended by failure.
        """
        task = self._task
        if task is not None and task is asyncio.current_task():
            raise RuntimeError(f"actor {self.name} cannot await its own stop() from handle()")
        self.mailbox.close()
        if task is not None and not task.done():
            self.state = ActorState.STOPPING
            try:
                await asyncio.wait({task}, timeout=drain_timeout_s)
            finally:
                if not task.done():
                    logger.warning(
                        "actor %s did not drain within %.3g s; cancelling it",
                        self.name,
                        drain_timeout_s,
                    )
                    task.cancel()
            await asyncio.wait({task})
        for env in self.mailbox.take_all():  # only an actor that never started has any left
            env.fail(ActorStopped(self.name))
        if self._stop_done:
            return
        self._stop_done = True
        if self.state is not ActorState.FAILED:
            self.state = ActorState.STOPPED
            if self.incarnations > 0:
                await self.on_stop()

    async def _lifecycle(self) -> None:
        try:
            while True:
                try:
                    await self._incarnation()
                except Exception as exc:  # noqa: BLE001 - tolerated here only to run on_failure
                    # and ask the policy; cancellation is a BaseException and passes through.
                    delay = await self._after_failure(exc)
                    if delay is None:
                        return
                    await asyncio.sleep(delay)
                else:
                    return  # mailbox closed and drained
        finally:
            # Invariant: once the task has ended (drained, failed for good, or cancelled), the
            # mailbox is closed and empty and every ask it held has been answered.
            self.mailbox.close()
            for env in self.mailbox.take_all():
                env.fail(ActorStopped(self.name))

    async def _after_failure(self, exc: Exception) -> float | None:
        logger.error("actor %s failed", self.name, exc_info=exc)
        await self.on_failure(exc)
        delay = self._crash_policy(self, exc)  # the policy hears of every failure ...
        if self.mailbox.closed:
            delay = None  # ... but one while stopping is not restarted: the stop is under way
        if delay is not None:
            self.state = ActorState.RESTARTING
            return delay
        self.state = ActorState.FAILED
        self.failure = exc
        return None

    async def _incarnation(self) -> None:
        self.incarnations += 1
        await self.on_start()
        self.started.set()
        if self.state is not ActorState.STOPPING:
            self.state = ActorState.RUNNING
        while (env := await self.mailbox.get()) is not None:
            try:
                reply = await self.handle(env.msg)
            except Exception as exc:
                env.fail(exc)  # the asker gets the handler's own error; the policy gets it too
                raise
            else:
                env.resolve(reply)
            finally:
                # Invariant: an envelope that left the mailbox is answered before the next is
                # taken. Only a cancelled handler reaches here unanswered: its asker must
                # learn that the actor stopped rather than wait forever.
                env.fail(ActorStopped(self.name))
