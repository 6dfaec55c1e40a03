"""A daemon's process: ``deltarl <daemon> --config FILE [--name NAME]`` to an exit status.

Every daemon's ``main`` is one call: load its ``[daemons.NAME]`` table, build its core, run it
on the daemon runtime (deltarl/engine/daemon.py) on the preferred event loop. Exit statuses,
which the units rely on:

    0   stopped cleanly (shutdown, drain, a signal, or its work finished)
    1   the core failed (logged with its traceback); systemd restarts the daemon
    78  EX_CONFIG: the configuration cannot work (a bad table, an unusable key directory, a
        model directory without a config, ...); the units list it in
        ``RestartPreventExitStatus=``, since restarting cannot fix a file
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from deltarl.config import EX_CONFIG, ConfigError, load
from deltarl.config.base import DaemonTable
from deltarl.engine import loop
from deltarl.engine.daemon import DaemonContext, DaemonCore, serve
from deltarl.engine.supervisor import EscalationError
from deltarl.ops import logs, placement
from deltarl.ops.parent_death import end_with_harness
from deltarl.transport.curve import CurveKeyError

T = TypeVar("T")

CONFIG_ERRORS = (ConfigError, CurveKeyError)


def daemon_main(
    daemon: str,
    cls: type[T],
    argv: list[str],
    build: Callable[[T, DaemonContext], Awaitable[DaemonCore]],
    doc: str,
) -> int:
    """``deltarl <daemon>``: parse the arguments, load the config, serve; the exit status."""
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
        cfg = load(cls, args.name, args.config)
        try:
            logs.configure(daemon, args.name, cfg.log_format, cfg.audit_log)
            if cfg.cpus is not None:  # before the core starts threads or processes
                pinned = placement.pin_at_start(cfg.cpus)
                logging.getLogger(__name__).info(
                    "%s: pinned to CPUs %s", args.name, placement.format_cpu_list(pinned)
                )
        except (ValueError, OSError) as e:
            raise ConfigError(f"[daemons.{args.name}]: {e}") from None
        return run(args.name, cfg, build, reload=lambda: load(cls, args.name, args.config))
    except CONFIG_ERRORS as e:
        print(f"deltarl {daemon}: {e}", file=sys.stderr)
        return EX_CONFIG


def run(
    name: str,
    cfg: DaemonTable,
    build: Callable[[Any, DaemonContext], Awaitable[DaemonCore]],
    reload: Callable[[], DaemonTable] | None = None,
) -> int:
    """Serve one daemon whose config is loaded; the exit status (ConfigError propagates)."""
    end_with_harness()  # started by deltarl up, a bench or a test: not to outlive it

    async def make(context: DaemonContext) -> DaemonCore:
        return await build(cfg, context)

    main = serve(
        name,
        cfg.control,
        make,
        events=getattr(cfg, "events", None),  # only the daemons that publish have one
        drain_timeout_s=cfg.drain_timeout_s,
        metrics=cfg.metrics,
        reload=reload,
    )
    try:
        loop.run(main)
    except EscalationError as e:
        if isinstance(e.__cause__, CONFIG_ERRORS):
            raise e.__cause__ from None
        return 1
    return 0
