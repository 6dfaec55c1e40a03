"""Daemons as local processes: what ``deltarl up``, the refit benchmark and the tests share.

A ``DaemonGroup`` starts daemons through the entry point systemd uses (``deltarl <daemon>
--config FILE [--name NAME]``), one process each with its own log file, asks them for
``status`` over their control sockets, tells a dead one from a slow one, and stops them in
waves: a wave is signalled together and waited for before the next, so a daemon that feeds
another (the rollout daemon feeds the scheduler) stops first.

Nothing here is a process manager for production (systemd is): this is the one-machine
harness, with the same commands and configuration a cluster runs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

from deltarl.ops.parent_death import HARNESS_PID_ENV
from deltarl.transport.control import ControlProtocolError, ControlTimeoutError, request_sync
from deltarl.transport.messages import REPLIES, Command, GetStatus, Reply, Status


class DaemonDied(RuntimeError):  # noqa: N818 - reads as what happened
    """A daemon of the group exited while something was waited for."""


class WaitTimeout(TimeoutError):  # noqa: N818 - reads as what happened, like TimeoutError
    """What was waited for did not happen in time."""


class DaemonGroup:
    """Daemons of one configuration file, started as processes in ``directory``.

    ``endpoints`` maps each daemon name to its control endpoint (from the same configuration
    the daemons read). A daemon's log is ``directory/NAME.log``.
    """

    def __init__(self, directory: Path, config: Path, endpoints: dict[str, str]) -> None:
        self.directory = directory
        self.config = config
        self.endpoints = endpoints
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def log(self, name: str) -> Path:
        return self.directory / f"{name}.log"

    def start(
        self,
        name: str,
        *,
        daemon: str | None = None,
        table: str | None = None,
        config: Path | None = None,
        args: Sequence[str] = (),
        prefix: Sequence[str] = (),
        own_session: bool = False,
    ) -> subprocess.Popen[bytes]:
        """Start daemon ``name`` (``daemon``: the command, default ``name``) from its table
        ``[daemons.TABLE]`` (default ``name``; ``--name TABLE`` is passed when it is not the
        command) of ``config`` (default: the group's file, one for every daemon). ``prefix``
        runs it inside another command (``ip netns exec ...``); ``own_session``: a Ctrl-C at
        the terminal does not reach it, so the caller can stop the group in order.

        The daemon is told this process's pid (``parent_death.end_with_harness``): if this
        process dies without stopping it, the kernel sends it SIGTERM. Linux sends that
        when the *thread* that started the daemon exits, so start daemons from a thread that
        outlives them (every harness here starts them from its main thread)."""
        command, table = daemon or name, table or name
        argv = [
            sys.executable,
            "-m",
            "deltarl.cli",
            command,
            "--config",
            str(config or self.config),
        ]
        if command != table:
            argv += ["--name", table]
        with self.log(name).open("ab") as log:
            proc = subprocess.Popen(  # noqa: S603 - our own entry point
                [*prefix, *argv, *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=own_session,
                env={**os.environ, HARNESS_PID_ENV: str(os.getpid())},
            )
        self.procs[name] = proc
        return proc

    def request(
        self,
        name: str,
        command: Command,
        timeout_s: float = 2.0,
        replies: Mapping[str, type[Reply]] = REPLIES,
    ) -> Reply | None:
        """The daemon's reply, or None if it does not answer in time."""
        try:
            return request_sync(self.endpoints[name], command, timeout_s, replies=replies)
        except (ControlTimeoutError, ControlProtocolError):
            return None

    def status(self, name: str, timeout_s: float = 2.0) -> Status | None:
        reply = self.request(name, GetStatus(), timeout_s)
        return reply if isinstance(reply, Status) else None

    def dead(self) -> str | None:
        """Which daemon exited, and how; None while all run."""
        for name, p in self.procs.items():
            if p.poll() is not None:
                return f"{name} exited with status {p.returncode}"
        return None

    def wait(self, what: str, condition: Callable[[], bool], timeout_s: float) -> None:
        """Until ``condition()``; DaemonDied if a daemon exits first, WaitTimeout after
        ``timeout_s``. Polling: the state is in other processes, no event of ours tells."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            died = self.dead()
            if died is not None:
                raise DaemonDied(f"{died} while waiting for {what}")
            with contextlib.suppress(ControlTimeoutError, ControlProtocolError):
                if condition():
                    return
            time.sleep(0.01)
        raise WaitTimeout(f"timed out after {timeout_s:.0f} s waiting for {what}")

    def tail(self, name: str, lines: int = 25) -> str:
        try:
            text = self.log(name).read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def logs(self, lines: int = 25) -> str:
        """The tail of every daemon's log, for a failure message."""
        return "\n".join(f"--- {name}\n{self.tail(name, lines)}" for name in self.procs)

    def stop(
        self, waves: Iterable[Iterable[str]] | None = None, timeout_s: float = 60.0
    ) -> dict[str, int | None]:
        """SIGTERM (each daemon drains) wave by wave; then whatever the waves did not name.
        A daemon still running at the deadline is killed: its exit status is then None."""
        deadline = time.monotonic() + timeout_s
        named = [list(w) for w in waves] if waves is not None else []
        rest = [n for n in self.procs if not any(n in w for w in named)]
        codes: dict[str, int | None] = {}
        for wave in [*named, rest]:
            procs = {n: self.procs[n] for n in wave if n in self.procs}
            for p in procs.values():
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for name, p in procs.items():
                try:
                    codes[name] = p.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(10)
                    codes[name] = None
        return codes

    def kill(self, name: str) -> int:
        """SIGKILL daemon ``name`` (a fault test) and reap it; its exit status."""
        proc = self.procs[name]
        proc.kill()
        return proc.wait(10)
