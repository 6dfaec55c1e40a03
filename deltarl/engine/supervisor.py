"""Supervision: start a daemon's actors, restart the ones that fail, shut down in stages.

The daemon's lifecycle, as run by ``Supervisor.run``:

    INIT --run()--> STARTING   actors start in the order they were added (what an actor sends
       |                       to is added before it), each on_start awaited before the next
       v
    RUNNING                    READY=1; WATCHDOG=1 pinged from this event loop
       |  SIGTERM / SIGINT / request_shutdown() / an escalation (also from STARTING)
       v
    STOPPING                   STOPPING=1; actors stop last-added first, so the intake stops
       |                       before what it feeds, each in three steps:
       |                         1) stop accepting: its mailbox closes (senders get ActorStopped)
       |                         2) drain: it finishes what is queued, until the shared deadline
       |                            (drain_timeout_s after STOPPING began)
       |                         3) cancel: if still busy; its pending asks fail with
       |                            ActorStopped; then on_stop
       v
    STOPPED                    run() returns, or raises EscalationError (main exits non-zero)

A failing actor (on_start or handle raised) is restarted after a backoff by ``Restart``, until
it fails more than ``max_restarts`` times within ``window_s``; then, or at once under
``Escalate``, the failure escalates: the daemon goes down loudly rather than limp along, and
systemd (``Restart=on-failure``) brings a fresh process.

Keep ``drain_timeout_s`` below the unit's ``TimeoutStopSec``: past that systemd sends SIGKILL.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import signal
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, TypeVar

from deltarl.engine import loop as event_loop
from deltarl.engine.actor import Actor, MailboxStats
from deltarl.engine.notify import Notifier

logger = logging.getLogger(__name__)

A = TypeVar("A", bound=Actor[Any, Any])

SHUTDOWN_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@dataclass(frozen=True, slots=True)
class Restart:
    """Restart a failed actor after a backoff, up to ``max_restarts`` within ``window_s``."""

    max_restarts: int = 3
    window_s: float = 60.0
    backoff_s: float = 0.1  # before the first restart in the window; doubles for each next
    max_backoff_s: float = 5.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0 or self.window_s <= 0 or self.backoff_s < 0:
            raise ValueError(f"invalid restart policy {self}")

    def delay_s(self, restart: int) -> float:
        """The backoff before the ``restart``-th restart within the window (1-based)."""
        return min(self.max_backoff_s, self.backoff_s * 2 ** (restart - 1))


@dataclass(frozen=True, slots=True)
class Escalate:
    """Any failure of this actor brings the daemon down."""


RestartPolicy = Restart | Escalate


class EscalationError(RuntimeError):
    """An actor's failure was not tolerated; ``__cause__`` is the actor's own exception."""

    def __init__(self, supervisor: str, actor: str, why: str) -> None:
        super().__init__(f"{supervisor}: actor {actor} failed and escalated ({why})")
        self.actor = actor


class SupervisorState(enum.Enum):
    INIT = "init"
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"


@dataclass(slots=True)
class _Child:
    actor: Actor[Any, Any]
    policy: RestartPolicy
    # Invariant: monotonic times of the restarts granted within the last window, oldest first.
    restarts: deque[float] = field(default_factory=deque)


class Supervisor:
    def __init__(
        self,
        name: str,
        *,
        drain_timeout_s: float = 10.0,
        notifier: Notifier | None = None,
        handle_signals: bool = True,
    ) -> None:
        self.name = name
        self.drain_timeout_s = drain_timeout_s
        self.notifier = notifier or Notifier(None)
        self.handle_signals = handle_signals
        self.state = SupervisorState.INIT
        self.stop_reason: str | None = None
        self._children: dict[str, _Child] = {}
        self._shutdown = asyncio.Event()
        self._escalation: EscalationError | None = None

    def add(self, actor: A, policy: RestartPolicy | None = None) -> A:
        if self.state is not SupervisorState.INIT:
            raise RuntimeError(f"supervisor {self.name}: actors are added before run()")
        if actor.name in self._children:
            raise ValueError(f"supervisor {self.name} already has an actor named {actor.name}")
        self._children[actor.name] = _Child(actor, policy or Restart())
        return actor

    def stats(self) -> dict[str, MailboxStats]:
        return {name: child.actor.stats() for name, child in self._children.items()}

    def request_shutdown(self, reason: str = "requested") -> None:
        """Begin the staged shutdown (idempotent; the first reason is kept)."""
        if self.stop_reason is None:
            self.stop_reason = reason
        self._shutdown.set()

    def _on_signal(self, signum: int) -> None:
        # Only state is set here, never a mailbox touched: stopping needs to await (drains with
        # a deadline) and a handler cannot; and should this run as a raw signal handler (no
        # loop.add_signal_handler), it would interrupt the loop between any two bytecodes,
        # halfway through a deque append. run() sees the flag and does the work in its task.
        # A second signal changes nothing: the drain is already bounded by drain_timeout_s.
        name = signal.Signals(signum).name
        if self._shutdown.is_set():
            logger.warning("%s: %s while stopping; the drain is bounded already", self.name, name)
        self.request_shutdown(name)

    def _on_crash(self, actor: Actor[Any, Any], exc: Exception) -> float | None:
        """The actors' crash policy (runs in the failed actor's task): a delay, or None."""
        child = self._children[actor.name]
        policy = child.policy
        if isinstance(policy, Escalate):  # also while stopping: the exit status must say so
            self._escalate(actor, exc, "its policy is to escalate")
            return None
        if self.state is SupervisorState.STOPPING:
            logger.warning("%s: not restarting actor %s while stopping", self.name, actor.name)
            return None
        now = time.monotonic()
        while child.restarts and now - child.restarts[0] > policy.window_s:
            child.restarts.popleft()
        if len(child.restarts) >= policy.max_restarts:
            why = f"more than {policy.max_restarts} restarts within {policy.window_s:g} s"
            self._escalate(actor, exc, why)
            return None
        child.restarts.append(now)
        delay = policy.delay_s(len(child.restarts))
        logger.warning(
            "%s: restarting actor %s in %.3f s (restart %d of %d within %g s)",
            self.name,
            actor.name,
            delay,
            len(child.restarts),
            policy.max_restarts,
            policy.window_s,
        )
        return delay

    def _escalate(self, actor: Actor[Any, Any], exc: Exception, why: str) -> None:
        escalation = EscalationError(self.name, actor.name, why)
        escalation.__cause__ = exc
        # The actor has logged the traceback already; this line says what it costs.
        logger.critical("%s: %r; bringing the daemon down", escalation, exc)
        if self._escalation is None:
            self._escalation = escalation
        self.request_shutdown(f"escalation from actor {actor.name}")

    async def run(self) -> None:
        """Run the daemon until shutdown; raises EscalationError if an actor's failure escalated."""
        loop = asyncio.get_running_loop()
        watchdog: asyncio.Task[None] | None = None
        if self.handle_signals:
            for sig in SHUTDOWN_SIGNALS:
                loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            self.state = SupervisorState.STARTING
            await self._start_children()
            if not self._shutdown.is_set():
                self.state = SupervisorState.RUNNING
                watchdog = loop.create_task(self.notifier.watchdog_loop(), name="sd-watchdog")
                self.notifier.ready(f"{self.name}: running {len(self._children)} actors")
                logger.info("%s: running", self.name)
                await self._shutdown.wait()
            self.state = SupervisorState.STOPPING
            self.notifier.stopping()
            self.notifier.status(f"{self.name}: stopping ({self.stop_reason})")
            logger.info("%s: stopping (%s)", self.name, self.stop_reason)
            await self._stop_children(loop.time() + self.drain_timeout_s)
            self.state = SupervisorState.STOPPED
            logger.info("%s: stopped", self.name)
        finally:
            if self.handle_signals:
                for sig in SHUTDOWN_SIGNALS:
                    loop.remove_signal_handler(sig)
            if watchdog is not None:
                watchdog.cancel()
            # Only reached with live actors if run() itself was cancelled: take them along.
            for child in self._children.values():
                if child.actor.task is not None:
                    child.actor.task.cancel()
        if self._escalation is not None:
            raise self._escalation

    async def _start_children(self) -> None:
        shutdown = asyncio.ensure_future(self._shutdown.wait())
        try:
            for child in self._children.values():
                if self._shutdown.is_set():
                    return
                task = child.actor.start(self._on_crash)
                started = asyncio.ensure_future(child.actor.started.wait())
                try:
                    # on_start may fail and be retried by policy; wait until it succeeds, or
                    # the actor is gone for good, or the shutdown began (an escalation).
                    await asyncio.wait(
                        {started, task, shutdown}, return_when=asyncio.FIRST_COMPLETED
                    )
                finally:
                    started.cancel()
                if not child.actor.started.is_set():
                    self.request_shutdown(f"actor {child.actor.name} did not start")
                    return
        finally:
            shutdown.cancel()

    async def _stop_children(self, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        for child in reversed(self._children.values()):
            await child.actor.stop(max(0.0, deadline - loop.time()))


def run_daemon(supervisor: Supervisor, *, prefer_uvloop: bool = True) -> int:
    """A daemon's main: run the supervisor on the chosen loop; the process exit status.

    0 after a clean (signalled or requested) shutdown, 1 after an escalation, which has been
    logged with its traceback.
    """
    try:
        event_loop.run(supervisor.run(), prefer_uvloop=prefer_uvloop)
    except EscalationError:
        return 1
    return 0
