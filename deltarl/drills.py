"""``deltarl drill rollback [--config FILE] [--json]``: the rollback drill, run for real.

What an operator rehearses before going live (and after any change to the refit path): roll
every rollout host back to the version before the current one, see every engine load and
verify it, then roll forward to the newest version again, and time both. The drill:

    1. pauses the trainer (if it runs), so the newest version stays the newest, and waits
       until the export agent's last version is active on every apply agent;
    2. ``rollback`` on every apply agent (each flips to the one older version it keeps) and
       waits until every rollout engine reports that version, loaded and verified;
    3. ``resync`` on the export agent (the newest version again, in full: the receivers no
       longer hold the reference) and waits until every apply agent and engine is back on it;
    4. resumes the trainer if it paused it, whatever happened before.

Each stage is bounded by ``--timeout``; the first that does not finish fails the drill and
says where it stopped. Exit status: 0 the drill passed; 1 it failed; 2 configuration error.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any

import orjson

from deltarl.config import CONFIG_ENV, ConfigError, config_path, load
from deltarl.ctl_status import ask_statuses, control_endpoints, daemon_tables
from deltarl.transport.control import request_sync
from deltarl.transport.messages import Error, Pause, Resume, Resync, Rollback, Status


class DrillFailedError(RuntimeError):
    """A stage of the drill did not finish; the message says which and why."""


class Cluster:
    """The daemons of one config, by kind, asked for their status on demand."""

    def __init__(self, endpoints: Mapping[str, str]) -> None:
        self.endpoints = dict(endpoints)
        statuses = self.ask()
        self.kind = {n: s.daemon for n, s in statuses.items() if isinstance(s, Status)}

    def ask(self) -> dict[str, Any]:
        return asyncio.run(ask_statuses(self.endpoints, 3.0))

    def of(self, kind: str) -> list[str]:
        return sorted(n for n, k in self.kind.items() if k == kind)

    def fields(self, kind: str) -> dict[str, dict[str, Any]]:
        names = self.of(kind)
        now = asyncio.run(ask_statuses({n: self.endpoints[n] for n in names}, 3.0))
        down = [n for n, s in now.items() if not isinstance(s, Status)]
        if down:
            raise DrillFailedError(f"{', '.join(down)} stopped answering")
        return {n: s.fields for n, s in now.items()}

    def command(self, name: str, command: Any) -> None:  # noqa: ANN401 - a Command
        reply = request_sync(self.endpoints[name], command, 10.0)
        if isinstance(reply, Error):
            raise DrillFailedError(f"{name}: {command.TAG}: {reply.code}: {reply.message}")


def _wait(what: str, done: Callable[[], bool], timeout_s: float) -> float:
    started = time.monotonic()
    while not done():
        if time.monotonic() - started > timeout_s:
            raise DrillFailedError(f"{what}: not within {timeout_s:g} s")
        time.sleep(0.1)
    return time.monotonic() - started


def verified_loads(engines: Mapping[str, Mapping[str, Any]]) -> dict[str, int]:
    """Each rollout engine's count of loads verified against their manifests (its status)."""
    return {n: int(f.get("verified") or 0) for n, f in engines.items()}


def engines_loaded(
    engines: Mapping[str, Mapping[str, Any]],
    versions: Collection[int | None],
    before: Mapping[str, int],
) -> bool:
    """Whether every engine holds one of ``versions`` and has verified a load since its
    ``before`` count (``verified_loads``): a version loaded and proven, not just reported."""
    return all(
        f.get("weight_version") in versions and int(f.get("verified") or 0) > before[n]
        for n, f in engines.items()
    )


def _engines_on(cluster: Cluster, version: int, verified: Mapping[str, int]) -> bool:
    return engines_loaded(cluster.fields("rollout"), (version,), verified)


def _verified(cluster: Cluster) -> dict[str, int]:
    return verified_loads(cluster.fields("rollout"))


def rollback_drill(cluster: Cluster, timeout_s: float) -> dict[str, Any]:
    exports, applies = cluster.of("export"), cluster.of("apply")
    trainers = cluster.of("trainer")
    if not exports or not applies:
        raise DrillFailedError("the drill needs an export agent and an apply agent answering")
    export = exports[0]
    paused = False
    report: dict[str, Any] = {"apply_agents": applies, "engines": cluster.of("rollout")}
    try:
        trainer = cluster.ask().get(trainers[0]) if trainers else None
        if isinstance(trainer, Status) and trainer.state != "paused":
            cluster.command(trainers[0], Pause())
            paused = True

        def settled() -> bool:
            # The trainer's newest version sent, and active on every apply agent.
            fields = cluster.fields("export")[export]
            last = fields.get("last") or {}
            held = {f.get("active_version") for f in cluster.fields("apply").values()}
            return (
                last.get("outcome") == "active"
                and last.get("version") == fields.get("published_version")
                and held == {last.get("version")}
            )

        # Held for a second: a trainer pauses after its step in flight, which may publish.
        _wait("the newest version active everywhere before the drill", settled, timeout_s)
        time.sleep(1.0)
        _wait("the newest version active everywhere before the drill", settled, timeout_s)
        newest = int(cluster.fields("export")[export]["last"]["version"])
        report["newest"] = newest

        verified = _verified(cluster)
        started = time.monotonic()
        for name in applies:
            cluster.command(name, Rollback())
        previous = {f.get("active_version") for f in cluster.fields("apply").values()}
        if len(previous) != 1 or None in previous:
            raise DrillFailedError(
                f"the apply agents rolled back to different versions: {previous}"
            )
        back = int(previous.pop())
        _wait(
            f"every engine on version {back}",
            lambda: _engines_on(cluster, back, verified),
            timeout_s,
        )
        report.update(rolled_back_to=back, rollback_s=round(time.monotonic() - started, 3))

        verified = _verified(cluster)
        started = time.monotonic()
        cluster.command(export, Resync())

        def forward() -> bool:
            # The newest version: a trainer that was already paused may have been resumed.
            now = int(cluster.fields("export")[export].get("published_version") or newest)
            held = {f.get("active_version") for f in cluster.fields("apply").values()}
            return held == {now} and _engines_on(cluster, now, verified)

        _wait(f"every apply agent and engine back on version {newest}", forward, timeout_s)
        report["forward_s"] = round(time.monotonic() - started, 3)
    finally:
        if paused:
            cluster.command(trainers[0], Resume())
    return report


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="deltarl drill", description="run an operator drill")
    ap.add_argument("name", choices=("rollback",), help="the drill")
    ap.add_argument("--config", metavar="FILE", help=f"TOML or JSON config (or ${CONFIG_ENV})")
    ap.add_argument("--json", action="store_true", help="print exactly one JSON object")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per stage")
    args = ap.parse_args(argv)
    try:
        tables = daemon_tables(config_path(args.config))
        cluster = Cluster(control_endpoints(tables))
    except (ConfigError, ValueError) as e:
        print(f"deltarl drill: {e}", file=sys.stderr)
        return 2
    try:
        report = {"ok": True, **rollback_drill(cluster, args.timeout)}
    except DrillFailedError as e:
        report = {"ok": False, "error": str(e)}
    if args.json:
        print(orjson.dumps(report).decode())
    elif report["ok"]:
        print(
            f"rollback drill passed: {len(report['apply_agents'])} apply agent(s) and "
            f"{len(report['engines'])} engine(s) rolled back from {report['newest']} to "
            f"{report['rolled_back_to']} in {report['rollback_s']:.2f} s, and forward again "
            f"in {report['forward_s']:.2f} s"
        )
    else:
        print(f"rollback drill FAILED: {report['error']}")
    return 0 if report["ok"] else 1


def trainer_restore_main(argv: list[str]) -> int:
    """``deltarl trainer-restore --config FILE --step S``: with the trainer stopped, make its
    checkpoint of step S the one it resumes from, under a version above every one published
    (``Checkpointer.restore_to``). Run ``deltarl ctl scheduler restore --to S`` first, then
    start the trainer as usual."""
    from deltarl.config.rl import RLTrainerConfig  # noqa: PLC0415 - torch only when used
    from deltarl.engine.weight_store import WeightStore  # noqa: PLC0415
    from deltarl.trainer.checkpoint import Checkpointer, CheckpointError  # noqa: PLC0415

    ap = argparse.ArgumentParser(
        prog="deltarl trainer-restore", description=trainer_restore_main.__doc__
    )
    ap.add_argument("--config", metavar="FILE", help=f"TOML or JSON config (or ${CONFIG_ENV})")
    ap.add_argument("--name", default="trainer", help="read [daemons.NAME] instead")
    ap.add_argument("--step", type=int, required=True, help="the checkpoint's step")
    args = ap.parse_args(argv)
    try:
        cfg = load(RLTrainerConfig, args.name, args.config)
    except ConfigError as e:
        print(f"deltarl trainer-restore: {e}", file=sys.stderr)
        return 2
    published = -1
    try:
        with WeightStore.open(cfg.published_store, root=cfg.store_root, readonly=True) as store:
            published = store.active_version if store.active_version is not None else -1
    except FileNotFoundError:
        pass  # no store on this host now (a reboot emptied /dev/shm): the checkpoints decide
    try:
        version, moved = Checkpointer(cfg.checkpoint_dir, keep=cfg.keep_checkpoints).restore_to(
            args.step, published
        )
    except CheckpointError as e:
        print(f"deltarl trainer-restore: {e}", file=sys.stderr)
        return 1
    print(
        f"the trainer resumes from step {args.step} as version {version}"
        + (f"; {len(moved)} newer checkpoints moved to {moved[0].parent}" if moved else "")
    )
    return 0
