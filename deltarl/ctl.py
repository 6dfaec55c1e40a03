"""``deltarl ctl TARGET COMMAND``: send one control command to a running daemon.

TARGET is a daemon name, looked up in the ``[daemons.NAME] control = "..."`` table of the
configuration (TOML, or JSON if the file ends in ``.json``), or an endpoint (``ipc://...``,
``tcp://...``). The configuration is ``--config FILE``, else ``$DELTARL_CONFIG``, else
``/etc/deltarl/deltarl.toml`` if it exists.

Output is human-readable by default and exactly one JSON object on stdout with ``--json``
(also on failure: ``{"ok": false, "error": {"code", "message"}, ...}``).

``deltarl ctl scheduler history [--json]`` reads the scheduler's run metadata: a table of
its steps (weight version, reward, samples, lag, timings), or the ``History`` reply as JSON.

The export agent's operator commands (another daemon answers them ``unsupported``, exit 1):

- ``deltarl ctl export versions [--limit N] [--json]``: the versions its manifest store holds
  (the newest N, default all), one table row per version, newest last: version, base, kind,
  state, wire bytes, elements changed, recorded and last-changed times (local), error. With
  ``--json`` the object also has ``"versions"``: the ``Versions`` reply's rows (``version``,
  ``base_version``, ``kind``, ``state``, ``created``, ``updated``, ``wire_bytes``,
  ``changed``, ``error``; times in seconds since the epoch) and ``"omitted"``.
- ``deltarl ctl export deltas off|on``: turn deltas off (every version sent afterwards is full,
  until ``deltas on``) or back on; the export agent keeps the setting across restarts and
  reports it as ``deltas_enabled`` in its status.

Exit codes: 0 done; 1 the daemon answered with an error; 2 usage or configuration error
(including an unknown target name, and a bad argument such as ``deltas maybe``); 3 no reply
in time (daemon down or wrong endpoint).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import orjson

from deltarl import ctl_status
from deltarl.config import CONFIG_ENV, ConfigError, config_path, load_config
from deltarl.rl.protocol import REPLIES as RL_REPLIES
from deltarl.rl.protocol import GetHistory, History
from deltarl.transport.control import (
    DEFAULT_TIMEOUT,
    ControlClient,
    ControlProtocolError,
    ControlTimeoutError,
    check_endpoint,
)
from deltarl.transport.messages import (
    Command,
    Drain,
    Error,
    GetStatus,
    GetVersions,
    Ok,
    Pause,
    Reply,
    RestoreTo,
    Resume,
    Resync,
    Rollback,
    SetDeltas,
    Shutdown,
    Status,
    Versions,
)

EXIT_OK = 0
EXIT_ERROR_REPLY = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3

COMMAND_NAMES = (
    "status",
    "pause",
    "resume",
    "drain",
    "resync",
    "rollback",
    "shutdown",
    "history",
    "versions",
    "deltas",
    "restore",
)
DELTAS_ARGS = {"on": True, "off": False}


class TargetError(ValueError):
    """TARGET names no daemon, or the configuration that should name it is unusable.

    ``code`` is what ``--json`` reports: ``unknown_target``, ``config`` or ``usage``.
    """

    def __init__(self, message: str, code: str = "config") -> None:
        super().__init__(message)
        self.code = code


def resolve_target(target: str, path: Path | None) -> str:
    """The control endpoint of TARGET: the target itself if it is an endpoint, else its
    ``[daemons.TARGET] control`` entry."""
    if "://" in target:
        try:
            return check_endpoint(target)
        except ValueError as e:
            raise TargetError(str(e), "usage") from None
    if path is None:
        raise TargetError(
            f"unknown target {target!r}: no config to look it up in"
            f" (use --config FILE or set {CONFIG_ENV}, or give an ipc:// or tcp:// endpoint)",
            "unknown_target",
        )
    try:
        daemons = load_config(path).get("daemons", {})
    except ConfigError as e:
        raise TargetError(str(e)) from None
    if not isinstance(daemons, dict):
        raise TargetError(f"config {path}: 'daemons' must be a table")
    entry = daemons.get(target)
    if entry is None:
        known = ", ".join(sorted(daemons)) or "none"
        message = f"unknown target {target!r}: config {path} names daemons: {known}"
        raise TargetError(message, "unknown_target")
    endpoint = entry.get("control") if isinstance(entry, dict) else None
    if not isinstance(endpoint, str):
        raise TargetError(f"config {path}: [daemons.{target}] has no 'control' endpoint")
    try:
        return check_endpoint(endpoint)
    except ValueError as e:
        raise TargetError(f"config {path}: [daemons.{target}]: {e}") from None


def build_command(
    name: str, to_version: int | None, arg: str | None = None, limit: int | None = None
) -> Command:
    """The command for NAME; ``arg`` is the positional after it (only ``deltas`` takes one)."""
    if to_version is not None and name not in ("rollback", "restore"):
        raise TargetError("--to is only meaningful with rollback and restore", "usage")
    if name == "restore" and to_version is None:
        raise TargetError("restore needs --to STEP: the step of the trainer's checkpoint", "usage")
    if limit is not None and name != "versions":
        raise TargetError("--limit is only meaningful with versions", "usage")
    if limit is not None and limit < 1:
        raise TargetError(f"--limit must be at least 1, got {limit}", "usage")
    if name == "deltas":
        if arg not in DELTAS_ARGS:
            got = "nothing" if arg is None else repr(arg)
            raise TargetError(f"deltas takes on or off, got {got}", "usage")
        return SetDeltas(enabled=DELTAS_ARGS[arg])
    if arg is not None:
        raise TargetError(f"{name} takes no argument, got {arg!r}", "usage")
    commands: dict[str, Command] = {
        "status": GetStatus(),
        "pause": Pause(),
        "resume": Resume(),
        "drain": Drain(),
        "resync": Resync(),
        "rollback": Rollback(version=to_version),
        "shutdown": Shutdown(),
        "history": GetHistory(),
        "versions": GetVersions(limit=limit),
        "restore": RestoreTo(step=to_version or 0),
    }
    return commands[name]


def request(endpoint: str, command: Command, timeout: float = DEFAULT_TIMEOUT) -> Reply:
    """One request from the CLI; replies decode with the RL table too (``History``), which
    is a superset of the standard one."""

    async def once() -> Reply:
        async with ControlClient(endpoint, replies=RL_REPLIES) as client:
            return await client.request(command, timeout)

    return asyncio.run(once())


def _flatten(fields: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, str]]:
    """Nested status fields as dotted keys; strings as they are, other values as JSON."""
    for key, value in fields.items():
        if isinstance(value, dict) and value:
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            text = value if isinstance(value, str) else orjson.dumps(value).decode()
            yield f"{prefix}{key}", text


def format_status(status: Status) -> str:
    """``key: value`` lines with the values aligned: daemon, state, then the daemon's fields."""
    rows = [("daemon", status.daemon), ("state", status.state), *_flatten(status.fields)]
    width = max(len(key) for key, _ in rows) + 1
    return "\n".join(f"{key + ':':<{width}} {value}" for key, value in rows)


def _cell(value: Any, digits: int = 3) -> str:  # noqa: ANN401 - a JSON value
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def format_history(history: History) -> str:
    """One line per step: version, reward (the feedback signal), samples, lag, timings, the
    reward service's P99, the share of generated tokens wasted (dropped stale since the
    previous step), the trained tokens' mean age in versions and the share of them over the
    lag bound (``token_lag``), the sorting wait (pool wait over generation time), the length
    prediction error (with a plan) and the held-out accuracy; a line of the held-out rounds,
    if any."""
    header = (
        "step",
        "trainer v",
        "version",
        "reward",
        "std",
        "samples",
        "lag",
        "max lag",
        "gen s",
        "queue s",
        "step s",
        "reward p99 s",
        "wasted",
        "tok lag",
        "over bound",
        "sort wait",
        "skew",
        "len err",
        "eval acc",
        "ckpt",
    )
    rows = [header]
    for s in history.steps:
        metrics = s.get("metrics") or {}
        step_s = metrics.get("step_s", metrics.get("seconds"))
        rows.append(
            (
                _cell(s.get("step")),
                _cell(s.get("trainer_version")),
                _cell(s.get("version")),
                _cell(s.get("reward_mean")),
                _cell(s.get("reward_std")),
                _cell(s.get("samples")),
                _cell(s.get("lag_mean"), 2),
                _cell(s.get("lag_max")),
                _cell(s.get("gen_s_mean")),
                _cell(s.get("queue_s_mean")),
                _cell(step_s),
                _cell(s.get("reward_p99_s"), 4),
                _cell(s.get("wasted_ratio")),
                _cell(s.get("token_lag_mean"), 2),
                _cell(s.get("over_bound_token_ratio")),
                _cell(s.get("sorting_wait")),
                _cell(s.get("skewness")),
                _cell(s.get("length_error")),
                _cell(s.get("eval_accuracy")),
                "yes" if s.get("checkpointed") else "no",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    if not history.steps:
        lines.append("(no steps yet)")
    rounds = [e for e in history.evals if e.get("accuracy") is not None]
    if rounds:
        lines.append(
            "held-out eval: "
            + ", ".join(
                f"step {e['step']} {e['accuracy']:.3f} (v{e.get('version_min')}"
                + (f"-{e['version_max']}" if e.get("version_max") != e.get("version_min") else "")
                + (", partial" if e.get("partial") else "")
                + ("" if e.get("finished") else ", running")
                + ")"
                for e in rounds
            )
        )
    drops = {k: v for k, v in history.counters.items() if k.startswith("dropped_") and v}
    lines.append("drops: " + (", ".join(f"{k}={v}" for k, v in sorted(drops.items())) or "none"))
    return "\n".join(lines)


def _clock(seconds: Any) -> str:  # noqa: ANN401 - a JSON value
    if not isinstance(seconds, int | float) or isinstance(seconds, bool):
        return _cell(seconds)
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds))


def format_versions(versions: Versions) -> str:
    """One line per version, newest last: version, base, kind, state, wire bytes, elements
    changed, when recorded and last changed (local time), and the error of a failed one."""
    header = ("version", "base", "kind", "state", "wire bytes", "changed", "created", "updated")
    rows = [header]
    errors = []
    for v in versions.versions:
        base = v.get("base_version")
        rows.append(
            (
                _cell(v.get("version")),
                "-" if not isinstance(base, int) or base < 0 else str(base),
                _cell(v.get("kind")),
                _cell(v.get("state")),
                _cell(v.get("wire_bytes")),
                _cell(v.get("changed")),
                _clock(v.get("created")),
                _clock(v.get("updated")),
            )
        )
        errors.append(v.get("error") or "")
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = [
        "  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) + (f"  {e}" if e else "")
        for r, e in zip(rows, ["error", *errors], strict=True)
    ]
    if not versions.versions:
        lines.append("(no versions recorded)")
    if versions.omitted:
        lines.append(f"({versions.omitted} older versions left out: use --limit)")
    return "\n".join(lines)


def format_reply(target: str, command: Command, reply: Reply) -> str:
    """What a person reads for a reply that is not an error."""
    if isinstance(reply, Status):
        return format_status(reply)
    if isinstance(reply, History):
        return format_history(reply)
    if isinstance(reply, Versions):
        return format_versions(reply)
    if isinstance(reply, Ok):
        return f"{target}: {command.TAG}: ok" + (f" ({reply.detail})" if reply.detail else "")
    return f"{target}: {command.TAG}: {reply.TAG}: {orjson.dumps(reply).decode()}"


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="deltarl ctl",
        description="send a control command to a running deltarl daemon",
        epilog="`deltarl ctl status [--json]` with no TARGET shows every daemon of the config "
        "at once (deltarl/ctl_status.py). Exit codes: 0 done, 1 error reply, 2 usage or config "
        "error, 3 no reply in time",
    )
    ap.add_argument("target", help="daemon name from the config, or an ipc:// or tcp:// endpoint")
    ap.add_argument("command", choices=COMMAND_NAMES)
    ap.add_argument("arg", nargs="?", metavar="on|off", help="deltas: on or off")
    ap.add_argument("--json", action="store_true", help="print exactly one JSON object")
    ap.add_argument("--config", metavar="FILE", help=f"TOML or JSON config (or ${CONFIG_ENV})")
    ap.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT, metavar="S", help="seconds to wait"
    )
    ap.add_argument(
        "--to",
        type=int,
        metavar="VERSION",
        help="rollback: the version expected back (refused unless it is the one kept); "
        "restore: the step of the trainer's checkpoint to go back to",
    )
    ap.add_argument("--limit", type=int, metavar="N", help="versions: only the newest N")
    return ap


def pipeline_main(argv: list[str]) -> int:
    """``deltarl ctl status [--json] [--config FILE] [--timeout S] [--prometheus URL]``."""
    ap = argparse.ArgumentParser(
        prog="deltarl ctl status", description="every daemon of the config at a glance"
    )
    ap.add_argument("--json", action="store_true", help="print exactly one JSON object")
    ap.add_argument("--config", metavar="FILE", help=f"TOML or JSON config (or ${CONFIG_ENV})")
    ap.add_argument("--timeout", type=float, default=2.0, help="seconds per daemon (default 2)")
    ap.add_argument("--prometheus", metavar="URL", help="also list the alerts firing there")
    args = ap.parse_args(argv)
    path = config_path(args.config)
    try:
        state = ctl_status.gather(path, args.timeout, args.prometheus)
    except ConfigError as e:
        error = {"code": "config", "message": str(e)}
        if args.json:
            print(orjson.dumps({"ok": False, "error": error}).decode())
        else:
            print(f"deltarl ctl status: {e}", file=sys.stderr)
        return EXIT_USAGE
    ok = bool(state["all_answered"])
    if args.json:
        print(orjson.dumps({"ok": ok, **state}).decode())
    else:
        print(ctl_status.render(state))
    return EXIT_OK if ok else EXIT_ERROR_REPLY


def main(argv: list[str]) -> int:
    if argv[:1] == ["status"] and (len(argv) == 1 or argv[1].startswith("-")):
        # No TARGET: the whole pipeline. ``deltarl ctl NAME status`` still asks one daemon.
        return pipeline_main(argv[1:])
    return _one_daemon(argv)


def _one_daemon(argv: list[str]) -> int:
    args = _parser().parse_intermixed_args(argv)  # ``deltas --json off`` too
    report: dict[str, Any] = {"ok": False, "target": args.target, "command": args.command}

    def fail(code: str, message: str, exit_code: int) -> int:
        if args.json:
            print(orjson.dumps({**report, "error": {"code": code, "message": message}}).decode())
        else:
            print(f"deltarl ctl: {message}", file=sys.stderr)
        return exit_code

    if not args.timeout > 0:
        return fail("usage", f"--timeout must be positive, got {args.timeout:g}", EXIT_USAGE)
    try:
        command = build_command(args.command, args.to, args.arg, args.limit)
        endpoint = resolve_target(args.target, config_path(args.config))
    except TargetError as e:
        return fail(e.code, str(e), EXIT_USAGE)
    report["endpoint"] = endpoint
    try:
        reply = request(endpoint, command, args.timeout)
    except ControlTimeoutError as e:
        return fail("unreachable", str(e), EXIT_UNREACHABLE)
    except ControlProtocolError as e:
        return fail("protocol", str(e), EXIT_ERROR_REPLY)

    if isinstance(reply, Error):
        message = f"{args.target}: {command.TAG} failed: {reply.code}: {reply.message}"
        return fail(reply.code, message, EXIT_ERROR_REPLY)
    if args.json:
        report.update(ok=True, reply={"type": reply.TAG, "body": dataclasses.asdict(reply)})
        if isinstance(reply, Versions):  # the rows at the top too, as the docstring says
            report.update(versions=reply.versions, omitted=reply.omitted)
        print(orjson.dumps(report).decode())
    else:
        print(format_reply(args.target, command, reply))
    return EXIT_OK
