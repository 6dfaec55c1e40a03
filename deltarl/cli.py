"""The `deltarl` command: one entry point for the daemons, control and benchmarks.

Subcommands parse their own arguments (each module's ``main(argv)``), so ``deltarl X --help``
shows X's options; this module only dispatches and keeps heavy imports out of the others.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable

BENCHES = ("codec", "refit", "samples", "schedule", "export-cost", "gpu-apply")
DAEMONS = {
    "trainer": "run the trainer daemon (--synthetic: a simulated policy)",
    "export": "run the export agent: diff, encode and send each published version",
    "apply": "run the apply agent: receive, verify and activate versions",
    "scheduler": "run the scheduler: prompts, dispatch, rewards, sample pool, lag bound",
    "rollout": "run a rollout daemon: vLLM generation, refit between engine steps",
    "reward": "run the reward service: scores samples for the scheduler (rule or judge)",
}


ENTRY_POINTS: dict[str, tuple[str, str]] = {
    **{f"bench {b}": (f"deltarl.bench.{b.replace('-', '_')}", "main") for b in BENCHES},
    **{d: (f"deltarl.daemons.{d}", "main") for d in DAEMONS},
    "trainer --synthetic": ("deltarl.daemons.trainer_synthetic", "main"),
    "ctl": ("deltarl.ctl", "main"),
    "keys": ("deltarl.transport.curve", "main"),
    "model": ("deltarl.host_setup", "model_main"),
    "layout": ("deltarl.host_setup", "layout_main"),
    "plan": ("deltarl.scheduler.plan_cli", "main"),
    "doctor": ("deltarl.doctor", "main"),
    "drill": ("deltarl.drills", "main"),
    "trainer-restore": ("deltarl.drills", "trainer_restore_main"),
    "export-dry-run": ("deltarl.refit.dry_run", "main"),
    "up": ("deltarl.up", "main"),
    "chaos": ("deltarl.chaos", "main"),
}
"""Each command's module and function (``main(argv) -> exit status``)."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(
        prog="deltarl", description="asynchronous RL with weight-delta refit"
    )
    sub = ap.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="run a benchmark", add_help=False)
    bench.add_argument("name", choices=BENCHES)
    sub.add_parser("ctl", help="send a control command to a running daemon", add_help=False)
    sub.add_parser(
        "up", help="run the whole RL loop on this machine, then summarise", add_help=False
    )
    sub.add_parser(
        "chaos", help="run the loop while SIGKILLing random daemons; check it", add_help=False
    )
    sub.add_parser("keys", help="make the CURVE keys for tcp:// control sockets", add_help=False)
    sub.add_parser("model", help="build a model directory deltarl ships, once", add_help=False)
    sub.add_parser(
        "plan", help="plan a task's prompts: lengths, batches, schedule groups", add_help=False
    )
    sub.add_parser("doctor", help="pre-flight checks of a configured pipeline", add_help=False)
    sub.add_parser("drill", help="run an operator drill (rollback) for real", add_help=False)
    sub.add_parser(
        "trainer-restore",
        help="make an older checkpoint the one the stopped trainer resumes from",
        add_help=False,
    )
    sub.add_parser(
        "export-dry-run",
        help="encode the trainer's next versions as deltas, check they apply, send nothing",
        add_help=False,
    )
    sub.add_parser(
        "layout",
        help="write a model's published layout (an apply agent's layout_file)",
        add_help=False,
    )
    for name, what in DAEMONS.items():
        sub.add_parser(name, help=what, add_help=False)
    args, rest = ap.parse_known_args(argv)
    command = args.command
    if command == "bench":
        command = f"bench {args.name}"
    elif command == "trainer" and "--synthetic" in rest:
        command = "trainer --synthetic"
    module, function = ENTRY_POINTS[command]
    # Imported only when used: the heavy ones (torch, vLLM, numba) stay out of the others.
    entry: Callable[[list[str]], int] = getattr(importlib.import_module(module), function)
    return entry(rest)


if __name__ == "__main__":
    sys.exit(main())
