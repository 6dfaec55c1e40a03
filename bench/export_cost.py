"""`deltarl bench export-cost`: what the export agent costs the trainer beside it.

The export agent runs on the trainer's host and competes with it for the CPU (the diff and
encode kernels) and memory bandwidth (reading each version and its reference). This bench runs the
synthetic trainer (a real AdamW step on ``--params`` parameters per version, back to back)
three times in one run, for ``--seconds`` each after a warm-up, and counts its steps:

    alone        the trainer only
    with export  the trainer, the export agent and an apply agent (the receiver), at equal
                 priority
    niced        the same, the two agents at ``nice 5``, as the export unit runs them
                 (systemd/deltarl-export.service: Nice=5, CPUWeight=50, IOWeight=50; the
                 weights need systemd's cgroups, which this bench does not have)

and reports the trainer's mean step time in each, the slowdowns against ``alone``, and how
many versions the export agent sent. With ``--json``, exactly one JSON object on stdout:

    {"params": int, "seconds": float, "cores": int,
     "step_s": {"alone": float, "with_export": float, "niced": float},
     "slowdown": {"with_export": float, "niced": float},
     "versions_sent": {"with_export": int, "niced": int}}
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

from deltarl.config import write_toml
from deltarl.launch import DaemonGroup
from deltarl.transport.messages import Status

WARMUP_S = 8.0
_DAEMONS = ("trainer", "export", "apply")


def _tables(d: Path, params: int) -> dict[str, Any]:
    def ep(name: str, kind: str = "sock") -> str:
        return f"ipc://{d}/{name}.{kind}"

    link = {"type": "shm", "name": "cost", "root": str(d)}
    return {
        "daemons": {
            "trainer": {
                "control": ep("trainer"),
                "published_store": "pub",
                "store_root": str(d),
                "params": params,
                "interval_s": 0.001,  # back to back: the step time is the trainer's work
            },
            "export": {
                "control": ep("export"),
                "published_store": "pub",
                "store_root": str(d),
                "manifest_store": str(d / "versions.sqlite"),
                "apply_control": ep("apply"),
                "apply_events": ep("apply", "events"),
                "poll_s": 0.01,
                "link": link,
            },
            "apply": {
                "control": ep("apply"),
                "events": ep("apply", "events"),
                "rollout_store": "roll",
                "store_root": str(d),
                "layout_store": "pub",
                "link": link,
            },
        }
    }


def _fields(group: DaemonGroup, name: str) -> dict[str, Any]:
    status = group.status(name, 5.0)
    if status is None:
        raise RuntimeError(f"{name} does not answer; see {group.log(name)}")
    return status.fields


def measure(params: int, seconds: float, mode: str) -> tuple[float, int]:
    """(mean trainer step seconds, versions the export agent sent) in ``mode``."""
    with tempfile.TemporaryDirectory(prefix="deltarl-cost-", dir="/dev/shm") as tmp:
        d = Path(tmp)
        config = write_toml(d / "deltarl.toml", _tables(d, params))
        group = DaemonGroup(d, config, {n: f"ipc://{d}/{n}.sock" for n in _DAEMONS})
        try:
            group.start("trainer", args=["--synthetic"])
            if mode != "alone":
                prefix = ["nice", "-n", "5"] if mode == "niced" else []
                group.start("apply", prefix=prefix)
                group.start("export", prefix=prefix)
            group.wait("the trainer stepping", lambda: _version(group) >= 1, 300)
            time.sleep(WARMUP_S)
            v0, t0 = _version(group), time.monotonic()
            time.sleep(seconds)
            v1, t1 = _version(group), time.monotonic()
            sent = 0 if mode == "alone" else int(_fields(group, "export").get("sent") or 0)
        finally:
            group.stop(timeout_s=60)
    if v1 <= v0:
        raise RuntimeError(f"{mode}: the trainer made no step in {seconds:g} s")
    return (t1 - t0) / (v1 - v0), sent


def _version(group: DaemonGroup) -> int:
    status = group.status("trainer", 5.0)
    if not isinstance(status, Status):
        return -1
    return int(status.fields.get("version") or 0)


def run(params: int, seconds: float) -> dict[str, Any]:
    step = {}
    sent = {}
    for mode in ("alone", "with_export", "niced"):
        step[mode], sent[mode] = measure(params, seconds, mode)
    return {
        "params": params,
        "seconds": seconds,
        "cores": os.cpu_count() or 1,
        "step_s": {k: round(v, 5) for k, v in step.items()},
        "slowdown": {
            "with_export": round(step["with_export"] / step["alone"], 4),
            "niced": round(step["niced"] / step["alone"], 4),
        },
        "versions_sent": {"with_export": sent["with_export"], "niced": sent["niced"]},
    }


def render(r: dict[str, Any]) -> str:
    s = r["step_s"]
    return "\n".join(
        [
            f"export agent cost to the trainer: {r['params']:,} params, {r['seconds']:g} s per "
            f"mode, {r['cores']} cores",
            f"  trainer alone            {s['alone'] * 1e3:8.1f} ms a step",
            f"  with export + apply      {s['with_export'] * 1e3:8.1f} ms a step "
            f"({r['slowdown']['with_export']:.2f}x, {r['versions_sent']['with_export']} "
            "versions sent)",
            f"  agents at nice 5         {s['niced'] * 1e3:8.1f} ms a step "
            f"({r['slowdown']['niced']:.2f}x, {r['versions_sent']['niced']} versions sent)",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="deltarl bench export-cost", description=__doc__)
    ap.add_argument("--params", type=int, default=20_000_000, help="default 20M")
    ap.add_argument("--seconds", type=float, default=30.0, help="measured per mode (default 30)")
    ap.add_argument("--json", action="store_true", help="print exactly one JSON object")
    args = ap.parse_args(argv)
    result = run(args.params, args.seconds)
    if args.json:
        sys.stdout.write(orjson.dumps(result).decode() + "\n")
    else:
        print(render(result))
    return 0
