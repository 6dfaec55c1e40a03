"""The one way a deltarl daemon runs: a socket-free core, two actors and a supervisor.

Every daemon is a *core* (its logic, a ``DaemonCore``: no sockets, unit-testable without a
process) plus a short process module that builds the core from its configuration and calls
``serve``. The runtime around the core is written once, here:

    Supervisor(name)                 signals, sd_notify (READY, STATUS, WATCHDOG, STOPPING),
      |                              staged shutdown, restart policy (Escalate: a failure of
      |                              either actor takes the process down, systemd restarts it)
      +- ControlActor  (added first) binds the ZeroMQ control socket (and the event socket);
      |                              answers the standard commands itself: status, pause,
      |                              resume, drain, shutdown; passes the core's own commands
      |                              to the CoreActor's mailbox (or, for the few a core marks
      |                              concurrent, straight to the core)
      +- CoreActor     (added last)  owns the core: starts it, runs its work loop as a task,
                                     serialises the core's commands through its bounded
                                     mailbox, drains and closes it on the way down

Actors stop in reverse order, so the core drains while the control socket still answers
``status`` (an operator sees "draining"), and the socket closes last.

How a daemon stops:

    shutdown command, SIGINT     stop: the work loop is cancelled and the core closed (a core
                                 whose close must finish something, the trainer's step in
                                 flight, does so in ``close``)
    drain command, SIGTERM       drain, then stop: the core stops taking new work and
    (``systemctl stop``)         finishes or hands back what is in flight, for at most
                                 ``drain_timeout_s`` (keep it below the unit's TimeoutStopSec)
    the work loop raises         the failure escalates: the process exits non-zero (78,
                                 EX_CONFIG, for a ConfigError, which systemd does not restart)
    the work loop returns        the work is done: stop

Status: every daemon's ``status`` reply carries its core's fields plus ``runtime`` (pid,
uptime, event-loop lag, each actor's mailbox statistics, whether it is draining), so an
operator can see a stalled loop or a backed-up mailbox on any daemon the same way.

Signal handlers only set state (a flag and the supervisor's shutdown event): a signal may
arrive between any two steps of the loop, and stopping needs awaits that a handler cannot do.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from deltarl.engine.actor import Actor, ActorStopped, AskTimeout
from deltarl.engine.loop import LoopLagMonitor
from deltarl.engine.notify import Notifier
from deltarl.engine.reload import reload_core
from deltarl.engine.supervisor import Escalate, Supervisor
from deltarl.ops.exposition import MetricsServer
from deltarl.ops.metrics import deltarl_version, installed_versions, register_runtime
from deltarl.transport.control import ControlServer, Handler
from deltarl.transport.events import EventPublisher
from deltarl.transport.messages import (
    Command,
    Drain,
    Error,
    ErrorCode,
    Event,
    GetStatus,
    Ok,
    Pause,
    Reply,
    Resume,
    Shutdown,
    Status,
)

logger = logging.getLogger(__name__)

from deltarl.config.base import DEFAULT_DRAIN_TIMEOUT_S  # noqa: E402
from deltarl.config.errors import ConfigError  # noqa: E402

COMMAND_TIMEOUT_S = 30.0  # a core command waiting in the mailbox and running, at most


class PauseGate:
    """``pause``/``resume`` for a core's work loop: the loop asks ``paused`` or waits for
    ``resumed``; the runtime's standard handlers flip it. A core without one answers
    ``pause`` with ``unsupported``."""

    def __init__(self) -> None:
        self._resumed = asyncio.Event()
        self._resumed.set()

    @property
    def paused(self) -> bool:
        return not self._resumed.is_set()

    def pause(self) -> bool:
        """Pause; whether it was paused already."""
        was = self.paused
        self._resumed.clear()
        return was

    def resume(self) -> bool:
        """Resume; whether it was paused."""
        was = self.paused
        self._resumed.set()
        return was

    async def resumed(self) -> None:
        await self._resumed.wait()


class DaemonCore:
    """What a daemon's logic gives the runtime. Override what applies; the defaults do nothing.

    ``run`` is the work loop (it may wait for its inputs: the control socket already answers
    ``status`` meanwhile). ``drain`` is called while ``run`` still runs: it must make the loop
    stop taking new work and return once the work in flight is finished or handed back; the
    runtime then cancels ``run`` and calls ``close``, which releases everything (also after
    a failure, and after a drain that ran out of time).
    """

    daemon: ClassVar[str] = "daemon"
    pause_text: ClassVar[str] = "paused"
    """What ``pause`` answers (say what still runs, e.g. "after the step in flight")."""

    gate: PauseGate | None = None
    """Set it to support ``pause``/``resume``."""

    reloadable: ClassVar[frozenset[str]] = frozenset()
    """Keys of the core's ``config`` that ``systemctl reload`` (SIGHUP) may change while it
    runs (deltarl/engine/reload.py); only keys read from ``self.config`` where they are used."""

    async def run(self) -> None:
        await asyncio.Event().wait()

    async def drain(self) -> None:
        """Stop taking new work and finish (or hand back) what is in flight."""

    async def close(self) -> None:
        """Release everything; runs once, whatever happened before."""

    def state(self) -> str:
        return "paused" if self.gate is not None and self.gate.paused else "running"

    def status_fields(self) -> dict[str, Any]:
        return {}

    def handlers(self) -> Mapping[type[Command], Handler]:
        """The core's own commands, run one at a time through the core's mailbox."""
        return {}

    def concurrent_handlers(self) -> Mapping[type[Command], Handler]:
        """Commands served concurrently, bypassing the mailbox: for a server whose clients
        must not wait behind each other (the scheduler's RL protocol, whose handlers await
        reward scoring and keep their state consistent in store transactions)."""
        return {}


@dataclass(frozen=True, slots=True)
class RuntimeStats:
    """The runtime's part of every status reply."""

    pid: int
    uptime_s: float
    draining: bool
    stop_reason: str | None
    loop_lag: dict[str, float | int]
    mailboxes: dict[str, dict[str, int | bool]]
    versions: dict[str, str | None] = dataclasses.field(default_factory=installed_versions)
    """deltarl, torch, vLLM and Python as installed where this daemon runs."""


@dataclass
class DaemonContext:
    """What a process module hands its core: the ways out of the core that are not sockets."""

    name: str
    events: EventPublisher | None = None
    notifier: Notifier = dataclasses.field(default_factory=lambda: Notifier(None))
    closers: list[Callable[[], Awaitable[None]]] = dataclasses.field(default_factory=list)
    """Run after the core's ``close``, last added first: the clients the process module made."""

    async def publish(self, event: Event) -> None:
        """Publish ``event`` if this daemon has an event socket (events are notices)."""
        if self.events is not None:
            await self.events.publish(event)

    def on_close(self, closer: Callable[[], Awaitable[None]]) -> None:
        self.closers.append(closer)


class _WorkEnded:
    """A message the work loop's task leaves in the core's mailbox when it ends."""

    def __init__(self, error: BaseException | None) -> None:
        self.error = error


class CoreActor(Actor[Command | _WorkEnded, Reply]):
    """Owns the core: its work loop, its serialised commands, its drain and close."""

    def __init__(
        self, name: str, core: DaemonCore, supervisor: Supervisor, context: DaemonContext
    ) -> None:
        super().__init__(f"{name}:core", capacity=64)
        self.core = core
        self.context = context
        self.supervisor = supervisor
        self.draining = False
        self.drain_timeout_s = DEFAULT_DRAIN_TIMEOUT_S
        self._handlers = dict(core.handlers())
        self._work: asyncio.Task[None] | None = None
        self._reporter: asyncio.Future[None] | None = None
        self._closed = False

    async def on_start(self) -> None:
        self._work = asyncio.create_task(self.core.run(), name=f"{self.name}:work")
        self._work.add_done_callback(self._work_done)

    def _work_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or self.mailbox.closed:
            return  # cancelled by our own stop, or ended while stopping: nothing to report
        # Through the mailbox, so that a failure is the actor's failure (the supervisor's
        # policy sees it) and a clean end is a stop request, in order with the commands.
        self._reporter = asyncio.ensure_future(self._report(_WorkEnded(task.exception())))

    async def _report(self, ended: _WorkEnded) -> None:
        with contextlib.suppress(ActorStopped):  # stopping already: nothing left to tell
            await self.tell(ended)

    async def handle(self, msg: Command | _WorkEnded) -> Reply:
        if isinstance(msg, _WorkEnded):
            if msg.error is not None:
                raise msg.error
            self.supervisor.request_shutdown("work finished")
            return Ok()
        handler = self._handlers.get(type(msg))
        if handler is None:  # the control actor only passes commands listed here
            return Error(ErrorCode.UNSUPPORTED, f"no handler for {msg.TAG!r}")
        return await handler(msg)

    async def on_stop(self) -> None:
        # The mailbox is drained; now the work: drain it if asked to, then cancel and close.
        if self.draining and self._work is not None and not self._work.done():
            logger.info("%s: draining (at most %.0f s)", self.name, self.drain_timeout_s)
            try:
                async with asyncio.timeout(self.drain_timeout_s):
                    await self.core.drain()
            except TimeoutError:
                logger.warning(
                    "%s: drain did not finish within %.0f s; stopping anyway",
                    self.name,
                    self.drain_timeout_s,
                )
        await self._stop_work()
        await self.close()

    async def on_failure(self, exc: Exception) -> None:
        await self._stop_work()
        await self.close()

    async def _stop_work(self) -> None:
        work = self._work
        if work is not None and not work.done():
            work.cancel()
        if work is not None:
            # asyncio.wait: never re-raises the work's own error or cancellation here.
            await asyncio.wait({work})

    async def close(self) -> None:
        """Close the core and then what the process module made for it; once."""
        if self._closed:
            return
        self._closed = True
        try:
            await self.core.close()
        finally:
            for closer in reversed(self.context.closers):
                await closer()


class ControlActor(Actor[None, None]):
    """The intake: binds the control (and event) sockets and answers the standard commands.

    ``status``, ``pause``, ``resume``, ``drain`` and ``shutdown`` are answered here, never
    queued behind the core's commands, so they work while the core is busy or draining. The
    core's own commands are asked of the CoreActor (bounded mailbox, one at a time) or, for
    its concurrent handlers, run straight away.
    """

    def __init__(
        self, name: str, control: str, core: CoreActor, context: DaemonContext, started: float
    ) -> None:
        super().__init__(f"{name}:control", capacity=1)
        self.daemon_name = name
        self.control = control
        self.core_actor = core
        self.context = context
        self.started_at = started
        self.lag = LoopLagMonitor(interval_s=0.25)
        self.server: ControlServer | None = None
        self._serving: asyncio.Task[None] | None = None

    def _table(self) -> dict[type[Command], Handler]:
        core = self.core_actor.core
        table: dict[type[Command], Handler] = {
            GetStatus: self.on_status,
            Drain: self.on_drain,
            Shutdown: self.on_shutdown,
        }
        if core.gate is not None:
            table[Pause] = self.on_pause
            table[Resume] = self.on_resume
        for cls in core.handlers():
            table[cls] = self._ask_core
        table.update(core.concurrent_handlers())
        return table

    async def on_start(self) -> None:
        if self.context.events is not None:
            self.context.events.bind()
        self.server = ControlServer(self.control, self._table(), name=self.daemon_name)
        endpoint = self.server.bind()
        self._serving = asyncio.create_task(self.server.serve(), name=f"{self.name}:serve")
        self.lag.start()
        logger.info("%s: control on %s", self.daemon_name, endpoint)

    async def on_stop(self) -> None:
        await self.lag.stop()
        if self.server is not None:
            self.server.stop()
        if self._serving is not None:
            await asyncio.wait({self._serving})
        if self.context.events is not None:
            self.context.events.close()

    async def on_failure(self, exc: Exception) -> None:
        await self.on_stop()

    # -- the standard commands ---------------------------------------------------------------

    def runtime(self) -> RuntimeStats:
        supervisor = self.core_actor.supervisor
        return RuntimeStats(
            pid=os.getpid(),
            uptime_s=round(time.monotonic() - self.started_at, 3),
            draining=self.core_actor.draining,
            stop_reason=supervisor.stop_reason,
            loop_lag=dataclasses.asdict(self.lag.stats()),
            mailboxes={n: dataclasses.asdict(s) for n, s in supervisor.stats().items()},
        )

    async def on_status(self, _: GetStatus) -> Status:
        core = self.core_actor.core
        state = "draining" if self.core_actor.draining else core.state()
        fields = {**core.status_fields(), "runtime": dataclasses.asdict(self.runtime())}
        return Status(core.daemon, state, fields)

    async def on_pause(self, _: Pause) -> Ok:
        core = self.core_actor.core
        assert core.gate is not None  # registered only with a gate
        return Ok("already paused" if core.gate.pause() else core.pause_text)

    async def on_resume(self, _: Resume) -> Ok:
        core = self.core_actor.core
        assert core.gate is not None  # registered only with a gate
        return Ok("resumed" if core.gate.resume() else "was not paused")

    async def on_drain(self, _: Drain) -> Ok:
        self.core_actor.draining = True
        self.core_actor.supervisor.request_shutdown("drain command")
        return Ok(f"draining (at most {self.core_actor.drain_timeout_s:g} s), then stopping")

    async def on_shutdown(self, _: Shutdown) -> Ok:
        self.core_actor.supervisor.request_shutdown("shutdown command")
        return Ok("stopping")

    async def _ask_core(self, command: Command) -> Reply:
        try:
            return await self.core_actor.ask(command, timeout=COMMAND_TIMEOUT_S)
        except ActorStopped:
            return Error(ErrorCode.STOPPING, f"{self.daemon_name} is stopping")
        except AskTimeout as e:
            return Error(ErrorCode.TIMEOUT, str(e))


async def serve(
    name: str,
    control: str,
    build: Callable[[DaemonContext], Awaitable[DaemonCore]],
    *,
    events: str | None = None,
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
    metrics: str | None = None,
    reload: Callable[[], Any] | None = None,
) -> None:
    """Run one daemon until it stops; raises EscalationError if its core failed.

    ``build`` makes the core (it may raise ConfigError: nothing has been bound yet then).
    ``metrics`` (``HOST:PORT`` or ``unix:PATH``) serves the ``deltarl_*`` metrics there
    (deltarl/ops/exposition.py); an address that cannot be bound is a ConfigError.
    ``reload`` reads the daemon's table again: with it, SIGHUP reloads what may change live
    (deltarl/engine/reload.py).
    """
    started = time.monotonic()
    notifier = Notifier.from_environ()
    context = DaemonContext(
        name, None if events is None else EventPublisher(events), notifier=notifier
    )
    core = await build(context)
    # Our own signal handlers: SIGTERM (systemctl stop) drains, SIGINT stops.
    supervisor = Supervisor(name, notifier=notifier, handle_signals=False)
    core_actor = CoreActor(name, core, supervisor, context)
    core_actor.drain_timeout_s = drain_timeout_s
    control_actor = ControlActor(name, control, core_actor, context, started)
    supervisor.add(control_actor, Escalate())
    supervisor.add(core_actor, Escalate())
    exporter = None if metrics is None else MetricsServer(metrics)
    unregister = register_runtime(control_actor, deltarl_version())
    if exporter is not None:
        try:
            logger.info("%s: metrics on %s", name, await exporter.start())
        except OSError as e:
            unregister()
            await core.close()
            for closer in reversed(context.closers):
                await closer()
            raise ConfigError(f"{name}: metrics {metrics}: {e}") from None

    def on_signal(signum: int) -> None:
        # Only state, as the module docstring says; run() does the stopping.
        if signum == signal.SIGTERM:
            core_actor.draining = True
        supervisor.request_shutdown(signal.Signals(signum).name)

    def on_hangup() -> None:
        # Run by the loop as a callback, not in signal context: reading the table (a small
        # file) and swapping the core's config happen between two steps of the loop.
        assert reload is not None  # registered only with it
        reload_core(core, core.daemon, name, reload)

    loop = asyncio.get_running_loop()
    signals = [signal.SIGTERM, signal.SIGINT]
    for sig in signals:
        loop.add_signal_handler(sig, on_signal, sig)
    if reload is not None:
        loop.add_signal_handler(signal.SIGHUP, on_hangup)
        signals.append(signal.SIGHUP)
    try:
        await supervisor.run()
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
        if core_actor.incarnations == 0:  # never started (a shutdown during start-up)
            await core_actor.stop(0)
            await core_actor.close()
        if exporter is not None:
            await exporter.stop()
        unregister()
        notifier.close()
