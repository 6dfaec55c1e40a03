"""``deltarl ctl status [--json] [--prometheus URL]``: the whole pipeline on one screen.

Every daemon in the configuration's ``[daemons.*]`` tables is asked for its status at once
(a daemon that does not answer within ``--timeout`` is shown ``down``, never waited for in
turn), and the answers are read into what an operator asks first: which daemon is in which
state, the trainer's version, the version in flight and the one active on each rollout host,
the lag between them, the last refit's time and bytes, the bubbles of the last step, and,
with ``--prometheus URL``, the alerts firing there.

Exit status: 0 when every daemon answered, 1 when one did not (the screen still shows the
rest), 2 for a configuration that names no daemons.
"""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson

from deltarl.config import CONFIG_ENV, ConfigError, load_config
from deltarl.rl.protocol import REPLIES as RL_REPLIES
from deltarl.rl.protocol import GetHistory, History
from deltarl.transport.control import ControlClient, ControlProtocolError, ControlTimeoutError
from deltarl.transport.messages import Command, GetStatus, Reply, Status


async def _ask(endpoint: str, command: Command, wait_s: float) -> Reply | str:
    try:
        async with ControlClient(endpoint, replies=RL_REPLIES) as client:
            return await client.request(command, wait_s)
    except ControlTimeoutError:
        return "down (no reply)"
    except (ControlProtocolError, OSError, ValueError) as e:
        return f"down ({e})"


async def ask_statuses(daemons: Mapping[str, str], wait_s: float) -> dict[str, Reply | str]:
    """Every daemon's status at once: its reply, or why there is none ("down (...)")."""
    names = sorted(daemons)
    asks = [_ask(daemons[n], GetStatus(), wait_s) for n in names]
    return dict(zip(names, await asyncio.gather(*asks), strict=True))


def _alerts(url: str) -> list[dict[str, Any]] | str:
    if not url.startswith(("http://", "https://")):
        return f"not read: {url!r} is not an http(s) URL"
    try:
        alerts = f"{url.rstrip('/')}/api/v1/alerts"
        with urllib.request.urlopen(alerts, timeout=5) as r:  # noqa: S310 - http(s), checked
            body = orjson.loads(r.read())
    except (urllib.error.URLError, OSError, orjson.JSONDecodeError) as e:
        return f"not read from {url}: {e}"
    return [
        {
            "alert": a["labels"].get("alertname"),
            "severity": a["labels"].get("severity"),
            "summary": a.get("annotations", {}).get("summary"),
        }
        for a in body.get("data", {}).get("alerts", [])
        if a.get("state") == "firing"
    ]


def daemon_tables(config: Path | None) -> dict[str, Any]:
    """The ``[daemons.*]`` tables of ``config`` (``ctl status``, ``doctor`` and ``drill`` read
    the same); ConfigError when there is no config or it names no daemon."""
    if config is None:
        raise ConfigError(f"no config: use --config FILE or set {CONFIG_ENV}")
    tables = load_config(config).get("daemons", {})
    if not isinstance(tables, dict) or not tables:
        raise ConfigError(f"config {config}: no [daemons.*] tables")
    return tables


def control_endpoints(tables: Mapping[str, Any]) -> dict[str, str]:
    """Each daemon's ``control`` endpoint (tables without one are left out)."""
    return {
        name: t["control"]
        for name, t in tables.items()
        if isinstance(t, dict) and isinstance(t.get("control"), str)
    }


def gather(
    config: Path | None, timeout: float = 2.0, prometheus: str | None = None
) -> dict[str, Any]:
    """The pipeline's state as one JSON-ready object (``--json`` prints it)."""
    endpoints = control_endpoints(daemon_tables(config))
    answers = asyncio.run(ask_statuses(endpoints, timeout))
    daemons: dict[str, dict[str, Any]] = {}
    for name, reply in answers.items():
        if isinstance(reply, Status):
            daemons[name] = {"daemon": reply.daemon, "state": reply.state, "fields": reply.fields}
        else:
            daemons[name] = {"daemon": None, "state": str(reply), "fields": {}}
    out = _summary(daemons)
    scheduler = next((n for n, d in daemons.items() if d["daemon"] == "scheduler"), None)
    if scheduler is not None:
        history = asyncio.run(_ask(endpoints[scheduler], GetHistory(last=1), timeout))
        if isinstance(history, History) and history.steps:
            out["last_step"] = _step(history.steps[-1])
    if prometheus is not None:
        out["alerts"] = _alerts(prometheus)
    out["daemons"] = {
        name: {"daemon": d["daemon"], "state": d["state"]} for name, d in daemons.items()
    }
    out["all_answered"] = all(d["daemon"] is not None for d in daemons.values())
    return out


def _of(daemons: dict[str, dict[str, Any]], kind: str) -> list[tuple[str, dict[str, Any]]]:
    return [(n, d["fields"]) for n, d in sorted(daemons.items()) if d["daemon"] == kind]


def _summary(daemons: dict[str, dict[str, Any]]) -> dict[str, Any]:
    trainer = next((f for _, f in _of(daemons, "trainer")), {})
    export = next((f for _, f in _of(daemons, "export")), {})
    trainer_version = trainer.get("version")
    if trainer_version is None:
        trainer_version = export.get("published_version")
    rollouts = {n: f.get("weight_version") for n, f in _of(daemons, "rollout")}
    applies = {n: f.get("active_version") for n, f in _of(daemons, "apply")}
    held = [v for v in rollouts.values() if v is not None]
    last = export.get("last") or {}
    return {
        "trainer_version": trainer_version,
        "trainer_step": trainer.get("step"),
        "in_flight": None if last.get("outcome") == "active" else last.get("version"),
        "deltas_enabled": export.get("deltas_enabled"),
        "active_per_apply_agent": applies,
        "active_per_rollout": rollouts,
        "lag": None if trainer_version is None or not held else trainer_version - min(held),
        "last_refit": None
        if not last
        else {
            "version": last.get("version"),
            "kind": last.get("kind"),
            "outcome": last.get("outcome"),
            "wire_bytes": last.get("wire_bytes"),
            "seconds": last.get("seconds"),
        },
    }


def _step(row: Mapping[str, Any]) -> dict[str, Any]:
    figures = row.get("metrics") or {}
    return {
        "step": row.get("step"),
        "reward_mean": row.get("reward_mean"),
        "lag_max": row.get("lag_max"),
        "padding_ratio": figures.get("padding_ratio"),
        "sorting_wait": row.get("sorting_wait"),
        "wasted_ratio": row.get("wasted_ratio"),
    }


def _v(value: Any) -> str:  # noqa: ANN401 - a JSON value
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def render(s: Mapping[str, Any]) -> str:
    """The screen: daemons, versions and lag, the last refit, the last step, alerts."""
    width = max((len(n) for n in s["daemons"]), default=6) + 2
    lines = ["daemons"]
    lines += [f"  {n:<{width}}{d['state']}" for n, d in s["daemons"].items()]
    deltas = {True: "on", False: "OFF (full versions only)", None: "-"}[s["deltas_enabled"]]
    lines += [
        "versions",
        f"  trainer        {_v(s['trainer_version'])} (step {_v(s['trainer_step'])})",
        f"  in flight      {_v(s['in_flight'])}",
        *(f"  apply {n:<9}{_v(v)}" for n, v in s["active_per_apply_agent"].items()),
        *(f"  {n:<15}{_v(v)}" for n, v in s["active_per_rollout"].items()),
        f"  lag            {_v(s['lag'])} (trainer minus the oldest rollout version)",
        f"  deltas         {deltas}",
    ]
    refit = s.get("last_refit")
    if refit:
        mb = (refit["wire_bytes"] or 0) / 1e6
        lines.append(
            f"last refit       version {_v(refit['version'])} ({_v(refit['kind'])}, "
            f"{mb:.3f} MB, {_v(refit['seconds'])} s, {_v(refit['outcome'])})"
        )
    step = s.get("last_step")
    if step:
        lines.append(
            f"last step        {_v(step['step'])}: reward {_v(step['reward_mean'])}, lag "
            f"{_v(step['lag_max'])}, padding {_v(step['padding_ratio'])}, sorting wait "
            f"{_v(step['sorting_wait'])}, wasted {_v(step['wasted_ratio'])}"
        )
    alerts = s.get("alerts")
    if isinstance(alerts, str):
        lines.append(f"alerts           {alerts}")
    elif alerts is not None:
        lines.append(f"alerts           {len(alerts)} firing")
        lines += [f"  [{a['severity']}] {a['alert']}: {a['summary']}" for a in alerts]
    return "\n".join(lines)
