"""Typed configuration of the refit daemons (trainer, export, apply), and their shared shell.

Every daemon reads its own ``[daemons.NAME]`` table of the file ``deltarl ctl`` reads
(``ctl.load_config``: TOML, or JSON for ``.json``). A table that is missing, a key that is
unknown, or a value of the wrong type raises ``ConfigError`` naming the file, the table and the
key; ``main`` turns it into exit status 78 (EX_CONFIG), which the units list in
``RestartPreventExitStatus=`` because restarting cannot fix a bad file.

``DaemonShell`` is what every daemon does the same way: bind the control socket (and the event
socket), turn SIGTERM/SIGINT into a stop request, speak sd_notify (READY once the control socket
serves, WATCHDOG from the event loop, STOPPING at the end).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import signal
import sys
import types
import typing
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from deltarl.ctl import TargetError, config_path, load_config
from deltarl.daemons.relay import RelayTarget
from deltarl.engine import loop
from deltarl.engine.notify import Notifier
from deltarl.transport.base import LinkConfig, ShmLinkConfig, StreamLinkConfig
from deltarl.transport.control import ControlServer, Handler, check_endpoint
from deltarl.transport.curve import CurveKeyError
from deltarl.transport.events import EventPublisher
from deltarl.transport.messages import Command, Event

logger = logging.getLogger(__name__)

T = TypeVar("T")

EX_CONFIG = 78  # sysexits.h: configuration error; the units do not restart on it


class ConfigError(ValueError):
    """The configuration cannot run this daemon; the message names the file, table and key."""


@dataclass(frozen=True)
class TrainerConfig:
    control: str
    """The trainer's control endpoint (ROUTER)."""
    published_store: str
    """The weight store it creates and commits every version into (the version counter)."""
    store_root: Path | None = None
    """Directory of the weight stores; None: /dev/shm."""
    params: int = 200_000
    """Parameters of the synthetic model (RealisticDeltas)."""
    interval_s: float = 1.0
    """Seconds between optimizer steps (each one publishes a version)."""
    steps: int = 0
    """Stop stepping after this many steps (keep serving); 0: never stop."""
    seed: int = 0


@dataclass(frozen=True)
class ExportConfig:
    control: str
    published_store: str
    """The trainer's store: the export agent is its only reader."""
    manifest_store: Path
    """The sqlite record of every version (deltarl.refit.manifest_store)."""
    apply_control: str
    """The apply agent's control endpoint: its ``status`` is the acknowledgement channel."""
    link: LinkConfig
    events: str | None = None
    """Where VersionPublished / RefitFailed are published; None: not published."""
    store_root: Path | None = None
    full_resync_every: int = 50
    """A full version after this many deltas in a row, to bound every delta chain."""
    chunk_bytes: int = 16 << 20
    """Input bytes per encoded chunk. Measured on 98M params (bench refit, 1 Gbit): 4 MiB chunks
    spent more on per-chunk overhead than they gained in overlap (median delta 0.22-0.30 s),
    16 MiB 0.15-0.20 s, 32 MiB 0.14-0.16 s with less overlap (total 1.3-1.5x its slowest
    stage); 16 MiB is the compromise."""
    ack_timeout_s: float = 60.0
    """How long to wait for the apply agent to report a sent version active or failed."""
    poll_s: float = 0.05
    """How often the published store's version (and, while waiting, the ack) is polled."""


@dataclass(frozen=True)
class ApplyConfig:
    control: str
    rollout_store: str
    """The double-buffered store the apply agent writes (created if it does not exist)."""
    link: LinkConfig
    events: str | None = None
    store_root: Path | None = None
    layout_store: str | None = None
    """A store on this host whose layout the rollout store copies when it must be created."""
    layout_file: Path | None = None
    """Or a file holding ``Layout.to_json()``."""
    layout_wait_s: float = 120.0
    """How long to wait for ``layout_store`` to appear (the trainer creates it)."""
    relay: tuple[RelayTarget, ...] = ()
    """Further apply agents this one relays every chunk to (``[[daemons.apply.relay]]``
    tables: control, link, name, max_queued_bytes); see daemons/relay.py."""


_LINKS: dict[str, type[ShmLinkConfig] | type[StreamLinkConfig]] = {
    "shm": ShmLinkConfig,
    "stream": StreamLinkConfig,
}


def _convert(where: str, name: str, hint: Any, value: Any) -> Any:  # noqa: ANN401, PLR0911
    """``value`` checked against (and coerced to) a field's type hint, else ConfigError."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if value is None and len(inner) < len(args):
            return None
        if len(inner) == 1:
            return _convert(where, name, inner[0], value)
        return value  # LinkConfig is built separately
    if typing.get_origin(hint) is dict or hint is dict:
        if isinstance(value, dict):
            return dict(value)  # a free-form table, checked by whoever reads it
        raise ConfigError(f"{where}: {name} must be a table, got {value!r}")
    if typing.get_origin(hint) is typing.Literal:
        if value in args:
            return value
        raise ConfigError(f"{where}: {name} must be one of {list(args)}, got {value!r}")
    if hint is bool and isinstance(value, bool):
        return value
    if hint is Path and isinstance(value, str):
        return Path(value)
    if hint is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if hint is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if hint is str and isinstance(value, str):
        return value
    raise ConfigError(f"{where}: {name} must be {getattr(hint, '__name__', hint)}, got {value!r}")


def _hints(cls: type) -> dict[str, Any]:
    """Each field's type, evaluated in its module; ``link`` is left out (built by ``_link``:
    its union names a backend class that is imported only when used)."""
    namespace = vars(sys.modules[cls.__module__])
    return {
        f.name: eval(f.type, namespace) if isinstance(f.type, str) else f.type  # noqa: S307
        for f in dataclasses.fields(cls)
        if f.name not in ("link", "relay")
    }


def _build(cls: type[T], where: str, table: Mapping[str, Any]) -> T:
    hints = _hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(table) - names)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; known: {sorted(names)}")
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name not in table:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"{where}: missing key {f.name!r}")
            continue
        value = table[f.name]
        if f.name == "link":
            values["link"] = _link(f"{where}.link", value)
        elif f.name == "relay":
            values["relay"] = _relay(f"{where}.relay", value)
        else:
            values[f.name] = _convert(where, f.name, hints[f.name], value)
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from None


def _link(where: str, table: Any) -> LinkConfig:  # noqa: ANN401 - TOML value
    if not isinstance(table, dict):
        raise ConfigError(f"{where} must be a table with type = 'shm' or 'stream'")
    kind = table.get("type")
    if kind == "ucx":
        try:
            from deltarl.transport.ucx_link import UcxLinkConfig  # noqa: PLC0415 - optional
        except ImportError as e:
            raise ConfigError(f"{where}: type 'ucx' is not available here: {e}") from None
        return _build(UcxLinkConfig, where, table)
    if kind not in _LINKS:
        raise ConfigError(f"{where}: type must be one of {sorted(_LINKS)}, got {kind!r}")
    return _build(_LINKS[kind], where, table)


def _relay(where: str, value: Any) -> tuple[RelayTarget, ...]:  # noqa: ANN401 - TOML value
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise ConfigError(f"{where} must be an array of tables ([[...relay]])")
    targets = tuple(_build(RelayTarget, f"{where}[{i}]", t) for i, t in enumerate(value))
    for i, target in enumerate(targets):
        _check(f"{where}[{i}]", target)
    return targets


def _check(where: str, cfg: Any) -> None:  # noqa: ANN401 - any of the config classes
    for key in ("control", "events", "apply_control"):
        value = getattr(cfg, key, None)
        if value is not None:
            try:
                check_endpoint(value)
            except ValueError as e:
                raise ConfigError(f"{where}: {key}: {e}") from None
    for key in ("params", "full_resync_every", "chunk_bytes"):
        value = getattr(cfg, key, None)
        if value is not None and value <= 0:
            raise ConfigError(f"{where}: {key} must be positive, got {value}")
    for key in ("interval_s", "ack_timeout_s", "poll_s"):
        value = getattr(cfg, key, None)
        if value is not None and value <= 0:
            raise ConfigError(f"{where}: {key} must be positive, got {value}")


def daemon_main(
    daemon: str, cls: type[T], argv: list[str], amain: Callable[[T], Awaitable[None]], doc: str
) -> int:
    """``deltarl <daemon> --config FILE``: load the daemon's table, run it on the event loop.

    A ConfigError, at load or while starting (say, a layout that cannot be found), exits with
    EX_CONFIG, which the units do not restart on.
    """
    ap = argparse.ArgumentParser(prog=f"deltarl {daemon}", description=doc.splitlines()[0])
    ap.add_argument("--config", help=f"the deltarl TOML; reads [daemons.{daemon}]")
    ap.add_argument(
        "--name",
        default=daemon,
        help=f"read [daemons.NAME] instead (several {daemon} daemons on one host, or a relay "
        "tree: apply-b, apply-c ...)",
    )
    args = ap.parse_args(argv)
    fmt = f"%(asctime)s {args.name} %(levelname)s %(message)s"
    logging.basicConfig(level=logging.INFO, format=fmt)
    try:
        loop.run(amain(load(cls, args.name, args.config)))
    except (ConfigError, CurveKeyError) as e:
        print(f"deltarl {daemon}: {e}", file=sys.stderr)
        return EX_CONFIG
    return 0


def load(cls: type[T], daemon: str, path: str | None) -> T:
    """The ``[daemons.<daemon>]`` table of the config file as ``cls``; ConfigError if unusable."""
    found = config_path(path)
    if found is None:
        raise ConfigError("no config: use --config FILE or set DELTARL_CONFIG")
    try:
        raw = load_config(found)
    except TargetError as e:
        raise ConfigError(str(e)) from None
    table = raw.get("daemons", {}).get(daemon) if isinstance(raw.get("daemons"), dict) else None
    where = f"config {found}: [daemons.{daemon}]"
    if not isinstance(table, dict):
        raise ConfigError(f"config {found} has no [daemons.{daemon}] table")
    cfg = _build(cls, where, table)
    _check(where, cfg)
    return cfg


# -- the shell every daemon runs in -------------------------------------------------------


@dataclass
class DaemonShell:
    """Control socket, events, signals and sd_notify for one daemon.

    ``stop`` is the one stop request: set by SIGTERM/SIGINT (the handler only sets it: a
    signal may arrive anywhere, so it must not touch sockets or stores) and by ``shutdown``.
    """

    name: str
    control: str
    handlers: dict[type[Command], Handler]
    events: str | None = None
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    notifier: Notifier = field(default_factory=Notifier.from_environ)
    _publisher: EventPublisher | None = None

    async def publish(self, event: Event) -> None:
        if self._publisher is not None:
            await self._publisher.publish(event)

    async def run(self, work: typing.Coroutine[Any, Any, None]) -> None:
        """Serve control until ``stop`` (or ``work`` fails); then cancel ``work`` and close."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop.set)
        if self.events is not None:
            self._publisher = EventPublisher(self.events)
            self._publisher.bind()
        server = ControlServer(self.control, self.handlers, name=self.name)
        async with server:
            self.notifier.ready(f"{self.name}: serving {server.endpoint}")
            logger.info("%s: control on %s", self.name, server.endpoint)
            watchdog = asyncio.create_task(self.notifier.watchdog_loop())
            task = asyncio.create_task(work, name=f"{self.name}:work")
            stopped = asyncio.create_task(self.stop.wait())
            try:
                await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                self.notifier.stopping()
                for t in (task, stopped, watchdog):
                    t.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watchdog
                # The work's own failure (not its cancellation) is the daemon's failure.
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._publisher is not None:
            self._publisher.close()
        self.notifier.close()
