"""``deltarl doctor [--config FILE] [--json] [--exercise]``: pre-flight checks before a run.

What an operator checks before going live, automated where it can be, each answered pass,
fail (with a hint) or skip (with the reason):

    config       every ``[daemons.NAME]`` table loads as its daemon would load it
    reachable    every daemon answers ``status`` on its control socket (authenticated: a
                 tcp:// socket speaks CURVE with the keys of $DELTARL_CURVE_KEYS)
    versions     deltarl, torch, vLLM and Python are the same on every daemon's host (each
                 daemon reports what is installed where it runs)
    refit        the weight hot-update path holds: what the export agent last sent is active
                 on every apply agent, and every rollout engine has loaded and verified it;
                 with ``--exercise``, a full version is sent now (``resync``) and followed
                 until every engine has loaded and verified it
    reward       P99 of the reward daemon's scoring at its own max_concurrency, against
                 ``--reward-p99`` seconds (``--reward-requests`` calls)
    lengths      the completion-length histogram of the task, from the scheduler's store
                 (what ``deltarl plan`` builds its buckets from)
    link         each export agent's stream link: bandwidth on one connection, RTT and the
                 share of segments TCP retransmitted, measured with the link's own PROBE
                 messages against the running receiver (fails above 1% retransmitted)

A daemon kind is told by its table's name: ``scheduler``, ``trainer``, ``export``,
``apply``, ``rollout`` and ``reward``, alone or with a suffix (``apply-b``, ``rollout-2``).

Exit status: 0 nothing failed; 1 a check failed; 2 the configuration cannot be read.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson

from deltarl.config import CONFIG_ENV, ConfigError, config_path, load
from deltarl.config.base import DaemonTable
from deltarl.config.refit import ApplyConfig, ExportConfig, TrainerConfig
from deltarl.config.reward import RewardConfig
from deltarl.config.rl import RLTrainerConfig, RolloutConfig, SchedulerConfig
from deltarl.ctl_status import ask_statuses, daemon_tables
from deltarl.drills import engines_loaded, verified_loads
from deltarl.reward.protocol import REPLIES as REWARD_REPLIES
from deltarl.reward.protocol import ScoreGroup, Scores
from deltarl.rl.task import make_task
from deltarl.transport import link_probe
from deltarl.transport.control import ControlClient, ControlTimeoutError, request_sync
from deltarl.transport.curve import KEYS_ENV
from deltarl.transport.link_config import StreamLinkConfig
from deltarl.transport.messages import Resync, Status

KINDS: dict[str, tuple[type[DaemonTable], ...]] = {
    "scheduler": (SchedulerConfig,),
    "trainer": (RLTrainerConfig, TrainerConfig),  # the RL trainer, or the synthetic one
    "export": (ExportConfig,),
    "apply": (ApplyConfig,),
    "rollout": (RolloutConfig,),
    "reward": (RewardConfig,),
}


NO_LINK_CHECK = "no stream link in the config (an shm link stays on one host)"
MAX_RETRANS_RATIO = 0.01


@dataclass
class Check:
    check: str
    status: str  # "pass" | "fail" | "skip"
    detail: str
    hint: str | None = None


def kind_of(name: str) -> str | None:
    kind = name.split("-", 1)[0]
    return kind if kind in KINDS else None


def check_config(path: Path, tables: Mapping[str, Any]) -> tuple[Check, dict[str, DaemonTable]]:
    loaded: dict[str, DaemonTable] = {}
    problems, unknown = [], []
    for name in sorted(tables):
        kind = kind_of(name)
        if kind is None:
            unknown.append(name)
            continue
        errors = []
        for cls in KINDS[kind]:
            try:
                loaded[name] = load(cls, name, str(path))
                break
            except ConfigError as e:
                errors.append(str(e))
        else:
            problems.append(errors[0])
    detail = f"{len(loaded)} tables load"
    if unknown:
        detail += f"; not a daemon kind doctor knows: {', '.join(unknown)}"
    if problems:
        return Check("config", "fail", "; ".join(problems), "fix the key the message names"), loaded
    return Check("config", "pass", detail), loaded


def check_reachable(statuses: Mapping[str, Any]) -> Check:
    if not statuses:
        return Check("reachable", "skip", "no daemon table loaded")
    down = {n: s for n, s in statuses.items() if not isinstance(s, Status)}
    if not down:
        return Check("reachable", "pass", f"all {len(statuses)} daemons answered status")
    return Check(
        "reachable",
        "fail",
        "; ".join(f"{n}: {s}" for n, s in sorted(down.items())),
        "start it (systemctl start deltarl-NAME, or deltarl NAME --config FILE) and check its "
        f"control endpoint; a tcp:// socket needs ${KEYS_ENV} on both sides",
    )


def check_versions(statuses: Mapping[str, Any]) -> Check:
    seen: dict[str, dict[str, list[str]]] = {}
    for name, status in statuses.items():
        if not isinstance(status, Status):
            continue
        versions = (status.fields.get("runtime") or {}).get("versions") or {}
        for package, version in versions.items():
            seen.setdefault(package, {}).setdefault(str(version), []).append(name)
    if not seen:
        return Check("versions", "skip", "no daemon answered with its versions")
    differ = {p: v for p, v in seen.items() if len(v) > 1}
    if not differ:
        same = ", ".join(f"{p} {next(iter(v))}" for p, v in sorted(seen.items()))
        return Check("versions", "pass", f"the same everywhere: {same}")
    detail = "; ".join(
        f"{p}: "
        + ", ".join(f"{v} on {', '.join(sorted(names))}" for v, names in sorted(vs.items()))
        for p, vs in sorted(differ.items())
    )
    return Check("versions", "fail", detail, "install the same release on every host")


def _fields(statuses: Mapping[str, Any], kind: str) -> dict[str, dict[str, Any]]:
    return {
        n: s.fields
        for n, s in sorted(statuses.items())
        if isinstance(s, Status) and s.daemon == kind
    }


def check_refit(statuses: Mapping[str, Any]) -> Check:
    exports, applies = _fields(statuses, "export"), _fields(statuses, "apply")
    rollouts = _fields(statuses, "rollout")
    if not exports or not applies:
        return Check("refit", "skip", "needs an export agent and an apply agent answering")
    last = next(iter(exports.values())).get("last") or {}
    if last.get("outcome") != "active":
        return Check(
            "refit",
            "fail",
            f"the export agent's last version: {last or 'none sent yet'}",
            "is the trainer publishing? see deltarl ctl export status and its log",
        )
    version = last["version"]
    # At or past it: with the pipeline running, an agent may hold a newer version whose
    # acknowledgement the export agent had not recorded when it answered (run_checks asks
    # the export agents first, so an agent behind it is one that did not apply it).
    problems = [
        f"{n} holds {f.get('active_version')}"
        for n, f in applies.items()
        if not isinstance(f.get("active_version"), int) or f["active_version"] < version
    ]
    for n, f in rollouts.items():
        if f.get("mismatches"):
            problems.append(f"{n}: {f['mismatches']} loads did not match their manifest")
        elif not f.get("verified"):
            problems.append(f"{n} has verified no load yet")
    if problems:
        return Check(
            "refit",
            "fail",
            f"version {version} was sent; " + "; ".join(problems),
            "see deltarl ctl apply status and the rollout daemons' logs; deltarl ctl export "
            "resync sends a full version",
        )
    return Check(
        "refit",
        "pass",
        f"version {version} ({last.get('kind')}) active on {len(applies)} apply agent(s), "
        f"loaded and verified by {len(rollouts)} engine(s)",
    )


def exercise_refit(
    endpoints: Mapping[str, str], statuses: Mapping[str, Any], timeout_s: float
) -> Check:
    """Send a full version now and follow it until every engine has verified it."""
    exports = list(_fields(statuses, "export"))
    applies = list(_fields(statuses, "apply"))
    rollouts = list(_fields(statuses, "rollout"))
    if not exports or not applies:
        return Check("refit (exercised)", "skip", "needs an export agent and an apply agent")
    before = {n: int(statuses[n].fields.get("applied") or 0) for n in applies}
    verified = verified_loads(_fields(statuses, "rollout"))
    started = time.monotonic()
    request_sync(endpoints[exports[0]], Resync(), 5.0)
    deadline = started + timeout_s
    waiting = "the apply agents"
    while time.monotonic() < deadline:
        now = asyncio.run(ask_statuses({n: endpoints[n] for n in applies + rollouts}, 2.0))
        fields = {n: s.fields for n, s in now.items() if isinstance(s, Status)}
        if len(fields) == len(now):
            applied = all(int(fields[n].get("applied") or 0) > before[n] for n in applies)
            active = {fields[n].get("active_version") for n in applies}
            loaded = engines_loaded({n: fields[n] for n in rollouts}, active, verified)
            if applied and loaded:
                took = time.monotonic() - started
                return Check(
                    "refit (exercised)",
                    "pass",
                    f"a full version applied and verified end to end in {took:.1f} s",
                )
            waiting = "the rollout engines" if applied else "the apply agents"
        time.sleep(0.2)
    return Check(
        "refit (exercised)",
        "fail",
        f"sent a full version (resync); {waiting} did not take it within {timeout_s:g} s",
        "see deltarl ctl export status (detail) and the apply and rollout logs",
    )


async def _score_many(endpoint: str, commands: list[ScoreGroup], concurrency: int) -> list[Any]:
    gate = asyncio.Semaphore(concurrency)

    async def one(client: ControlClient, cmd: ScoreGroup) -> float | str:
        async with gate:
            t = time.monotonic()
            try:
                reply = await client.request(cmd, 30.0)
            except ControlTimeoutError:
                return "no reply in 30 s"
            return time.monotonic() - t if isinstance(reply, Scores) else str(reply)

    async with ControlClient(endpoint, replies=REWARD_REPLIES) as client:
        return list(await asyncio.gather(*(one(client, c) for c in commands)))


def check_reward(
    endpoints: Mapping[str, str],
    configs: Mapping[str, DaemonTable],
    requests: int,
    target_s: float,
) -> Check:
    rewards = [(n, c) for n, c in configs.items() if isinstance(c, RewardConfig)]
    if not rewards:
        return Check("reward", "skip", "no reward daemon in the config (scoring in-process)")
    name, cfg = rewards[0]
    task = make_task(cfg.task, seed=cfg.seed)
    commands = [
        ScoreGroup(task.prompt(i), ["0"] * 8, task=cfg.task, group_id=f"doctor.{i}")
        for i in range(requests)
    ]
    results = asyncio.run(_score_many(endpoints[name], commands, cfg.max_concurrency))
    failed = [r for r in results if isinstance(r, str)]
    times = sorted(r for r in results if isinstance(r, float))
    if failed:
        return Check(
            "reward", "fail", f"{len(failed)} of {requests} calls failed: {failed[0]}",
            f"see deltarl ctl {name} status and its log",
        )  # fmt: skip
    p99 = times[min(len(times) - 1, int(0.99 * len(times)))]
    detail = (
        f"{name}: P99 {p99:.3f} s, median {statistics.median(times):.3f} s over {requests} "
        f"calls at concurrency {cfg.max_concurrency} (target {target_s:g} s)"
    )
    if p99 > target_s:
        return Check("reward", "fail", detail, "raise rule_workers/max_concurrency, or scale out")
    return Check("reward", "pass", detail)


def check_lengths(configs: Mapping[str, DaemonTable]) -> Check:
    from deltarl.scheduler.store import SchedulerStore  # noqa: PLC0415 - only when used

    schedulers = [c for c in configs.values() if isinstance(c, SchedulerConfig)]
    if not schedulers:
        return Check("lengths", "skip", "no scheduler in the config")
    db = Path(schedulers[0].db)
    if not db.exists():
        return Check("lengths", "skip", f"no run history yet ({db} does not exist)")
    with SchedulerStore(db, readonly=True) as store:
        lengths = sorted(n for *_, outs in store.length_records() for n in outs)
    if not lengths:
        return Check("lengths", "skip", "the store holds no completed groups yet")

    def q(p: float) -> int:
        return lengths[min(len(lengths) - 1, int(p * len(lengths)))]

    return Check(
        "lengths",
        "pass",
        f"{len(lengths)} completions: p50 {q(0.5)}, p90 {q(0.9)}, p99 {q(0.99)}, max "
        f"{lengths[-1]} tokens (deltarl plan derives its buckets from these)",
    )


def check_links(configs: Mapping[str, DaemonTable], seconds: float) -> Check:
    """Each export agent's stream link, measured with the link's own PROBE messages."""
    links = [
        (n, c.link)
        for n, c in sorted(configs.items())
        if isinstance(c, ExportConfig) and isinstance(c.link, StreamLinkConfig)
    ]
    if not links:
        return Check("link", "skip", NO_LINK_CHECK)
    found, failed = [], []
    for name, link in links:
        try:
            f = asyncio.run(link_probe.probe(link, seconds))
        except (OSError, TimeoutError, ConnectionError, ValueError) as e:
            failed.append(f"{name} -> {link.host}:{link.port}: {type(e).__name__}: {e}")
            continue
        lossy = f.retrans_ratio is not None and f.retrans_ratio > MAX_RETRANS_RATIO
        text = (
            f"{name} -> {f.peer}: {f.mbit_s:.1f} Mbit/s on one connection, RTT "
            f"{'-' if f.rtt_ms is None else f'{f.rtt_ms:.2f} ms'}, "
            f"{'-' if f.retrans_ratio is None else f'{f.retrans_ratio:.3%}'} of segments "
            "retransmitted"
        )
        (failed if lossy else found).append(text)
    if failed:
        return Check(
            "link",
            "fail",
            "; ".join(failed + found),
            "is the apply agent running and listening there? a link that loses more than "
            f"{MAX_RETRANS_RATIO:.0%} of its segments slows every refit: check the network",
        )
    return Check("link", "pass", "; ".join(found))


def run_checks(
    path: Path | None,
    *,
    timeout_s: float,
    exercise: bool,
    reward_requests: int,
    reward_p99_s: float,
    link_seconds: float = 3.0,
) -> list[Check]:
    tables = daemon_tables(path)
    assert path is not None  # daemon_tables refused None
    config, configs = check_config(path, tables)
    # Only the tables that load: a bad one has failed "config", its endpoint is unusable.
    endpoints = {n: c.control for n, c in configs.items()}
    # The export agents first: a version one reports active was acknowledged, so committed
    # by its apply agent before it answered, and every answer asked after is at least as new
    # (asked all at once, an apply agent could answer just before a commit that the export
    # agent's answer, just after the acknowledgement, already counts: check_refit).
    exports = {n: e for n, e in endpoints.items() if isinstance(configs[n], ExportConfig)}
    statuses = asyncio.run(ask_statuses(exports, timeout_s))
    rest = {n: e for n, e in endpoints.items() if n not in exports}
    statuses.update(asyncio.run(ask_statuses(rest, timeout_s)))
    checks = [config, check_reachable(statuses), check_versions(statuses)]
    steps: list[tuple[str, Callable[[], Check]]] = [("refit", lambda: check_refit(statuses))]
    if exercise:
        steps.append(("refit (exercised)", lambda: exercise_refit(endpoints, statuses, 120.0)))
    steps += [
        ("reward", lambda: check_reward(endpoints, configs, reward_requests, reward_p99_s)),
        ("lengths", lambda: check_lengths(configs)),
        ("link", lambda: check_links(configs, link_seconds)),
    ]
    for name, step in steps:
        try:
            checks.append(step())
        except (OSError, ValueError, RuntimeError) as e:  # a check's own failure is a fail
            checks.append(Check(name, "fail", f"{type(e).__name__}: {e}"))
    return checks


def render(checks: list[Check]) -> str:
    mark = {"pass": "PASS", "fail": "FAIL", "skip": "skip"}
    lines = []
    for c in checks:
        lines.append(f"{mark[c.status]:<5} {c.check:<18} {c.detail}")
        if c.hint and c.status == "fail":
            lines.append(f"{'':<24} hint: {c.hint}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="deltarl doctor", description="pre-flight checks")
    ap.add_argument("--config", metavar="FILE", help=f"TOML or JSON config (or ${CONFIG_ENV})")
    ap.add_argument("--json", action="store_true", help="print exactly one JSON object")
    ap.add_argument("--timeout", type=float, default=3.0, help="seconds per status (default 3)")
    ap.add_argument("--exercise", action="store_true", help="send a full version and follow it")
    ap.add_argument("--reward-requests", type=int, default=64, help="scoring calls (default 64)")
    ap.add_argument("--reward-p99", type=float, default=1.0, help="target seconds (default 1)")
    ap.add_argument("--link-seconds", type=float, default=3.0, help="per link (default 3)")
    args = ap.parse_args(argv)
    try:
        checks = run_checks(
            config_path(args.config),
            timeout_s=args.timeout,
            exercise=args.exercise,
            reward_requests=args.reward_requests,
            reward_p99_s=args.reward_p99,
            link_seconds=args.link_seconds,
        )
    except ConfigError as e:
        if args.json:
            print(orjson.dumps({"ok": False, "error": str(e)}).decode())
        else:
            print(f"deltarl doctor: {e}", file=sys.stderr)
        return 2
    ok = not any(c.status == "fail" for c in checks)
    if args.json:
        print(orjson.dumps({"ok": ok, "checks": [asdict(c) for c in checks]}).decode())
    else:
        print(render(checks))
    return 0 if ok else 1
