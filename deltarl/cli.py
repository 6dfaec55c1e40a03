"""The `deltarl` command: one entry point for the daemons, control and benchmarks.

Subcommands parse their own arguments (each module's ``main(argv)``), so ``deltarl X --help``
shows X's options; this module only dispatches and keeps heavy imports out of the others.
"""

from __future__ import annotations

import argparse
import sys

BENCHES = ("codec", "refit", "samples", "schedule", "export-cost")
DAEMONS = {
    "trainer": "run the trainer daemon (--synthetic: a simulated policy)",
    "export": "run the export agent: diff, encode and send each published version",
    "apply": "run the apply agent: receive, verify and activate versions",
    "scheduler": "run the scheduler: prompts, dispatch, rewards, sample pool, lag bound",
    "rollout": "run a rollout daemon: vLLM generation, refit between engine steps",
    "reward": "run the reward service: scores samples for the scheduler (rule or judge)",
}


def main(argv: list[str] | None = None) -> int:  # noqa: PLR0911 - one return per command
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
    if args.command == "bench" and args.name == "codec":
        from deltarl.bench import codec  # noqa: PLC0415 - heavy imports only when used

        return codec.main(rest)
    if args.command == "bench" and args.name == "refit":
        from deltarl.bench import refit  # noqa: PLC0415 - heavy imports only when used

        return refit.main(rest)
    if args.command == "bench" and args.name == "schedule":
        from deltarl.bench import schedule  # noqa: PLC0415 - heavy imports only when used

        return schedule.main(rest)
    if args.command == "bench" and args.name == "export-cost":
        from deltarl.bench import export_cost  # noqa: PLC0415 - heavy imports only when used

        return export_cost.main(rest)
    if args.command == "bench" and args.name == "samples":
        from deltarl.bench import samples  # noqa: PLC0415 - heavy imports only when used

        return samples.main(rest)
    if args.command == "ctl":
        from deltarl import ctl  # noqa: PLC0415 - heavy imports only when used

        return ctl.main(rest)
    if args.command == "trainer" and "--synthetic" in rest:
        from deltarl.daemons import trainer_synthetic  # noqa: PLC0415 - heavy imports

        return trainer_synthetic.main(rest)
    if args.command == "keys":
        from deltarl.transport import curve  # noqa: PLC0415 - only when used

        return curve.main(rest)
    if args.command == "model":
        from deltarl import host_setup  # noqa: PLC0415 - only when used

        return host_setup.model_main(rest)
    if args.command == "plan":
        from deltarl.scheduler import plan_cli  # noqa: PLC0415 - only when used

        return plan_cli.main(rest)
    if args.command == "trainer-restore":
        from deltarl import drills  # noqa: PLC0415 - only when used

        return drills.trainer_restore_main(rest)
    if args.command == "drill":
        from deltarl import drills  # noqa: PLC0415 - only when used

        return drills.main(rest)
    if args.command == "doctor":
        from deltarl import doctor  # noqa: PLC0415 - only when used

        return doctor.main(rest)
    if args.command == "export-dry-run":
        from deltarl.refit import dry_run  # noqa: PLC0415 - heavy imports only when used

        return dry_run.main(rest)
    if args.command == "layout":
        from deltarl import host_setup  # noqa: PLC0415 - only when used

        return host_setup.layout_main(rest)
    if args.command == "up":
        from deltarl import up  # noqa: PLC0415 - heavy imports only when used

        return up.main(rest)
    if args.command == "chaos":
        from deltarl import chaos  # noqa: PLC0415 - heavy imports only when used

        return chaos.main(rest)
    if args.command in ("trainer", "scheduler", "rollout", "reward"):
        import importlib  # noqa: PLC0415

        daemon = importlib.import_module(f"deltarl.daemons.{args.command}")
        code: int = daemon.main(rest)
        return code
    if args.command == "export":
        from deltarl.daemons import export  # noqa: PLC0415 - heavy imports only when used

        return export.main(rest)
    if args.command == "apply":
        from deltarl.daemons import apply  # noqa: PLC0415 - heavy imports only when used

        return apply.main(rest)
    ap.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
