"""`deltarl plan TASK --size N [--out PLAN]`: the offline plan of a task's prompts (``plan``).

Predicts every prompt's output length (from ``--history``: earlier runs' scheduler stores, or
run directories holding one), forms length-homogeneous batches under ``--max-batch-tokens``
within bucket boundaries (``--bucket-boundaries``, or ``--buckets`` quantiles of the
predictions), composes them into one schedule group per training step, balanced over
``--instances``, prints the statistics, and validates them: a plan whose predicted skew is over
``--max-skew`` is refused (exit 3) and not written. With ``--out`` the plan is written
atomically; the scheduler loads it with ``plan = PATH`` in its table. ``--json`` prints the
statistics as one JSON object.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import orjson

from deltarl.rl.task import make_task
from deltarl.scheduler.length_predictor import LengthPredictor, load_history
from deltarl.scheduler.plan import (
    DEFAULT_MAX_SKEW,
    PlanError,
    build_plan,
    plan_stats,
    validate,
    write_plan,
)
from deltarl.sim.schedule_model import CostModel

EXIT_REFUSED = 3


def _ints(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"want comma-separated integers, got {text!r}") from None
    if any(b <= 0 for b in out):
        raise argparse.ArgumentTypeError("bucket boundaries must be positive")
    return out


def render(stats: dict[str, object], out: Path | None) -> str:
    lines = [
        f"plan of {stats['prompts']} prompts: {stats['batches']} batches in "
        f"{stats['schedule_groups']} schedule groups",
        f"  predicted padding ratio {stats['predicted_padding_ratio']:.3f}, "
        f"predicted skew {stats['predicted_skew']:.3f} (mean {stats['predicted_skew_mean']:.3f})",
        f"  predicted tokens per sample, mean {stats['predicted_tokens_mean']:.1f}; "
        f"sources {stats['sources']}",
        f"  bucket boundaries {stats['bucket_boundaries']}",
    ]
    hist = stats["histogram"]
    assert isinstance(hist, dict)
    edges, counts = hist["edges"], hist["counts"]
    lines += [
        f"    {edges[k]:>8.1f} .. {edges[k + 1]:<8.1f} {counts[k]:>6} {'#' * min(counts[k], 60)}"
        for k in range(len(counts))
    ]
    lines.append(f"  written to {out}" if out else "  not written (no --out)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="deltarl plan", description=__doc__.split("\n")[0])
    ap.add_argument("task", help="the task (dataset) by name, as the scheduler's `task`")
    ap.add_argument("--size", type=int, required=True, help="prompts in the dataset")
    ap.add_argument("--seed", type=int, default=0, help="the scheduler's `seed` (default 0)")
    ap.add_argument("--out", type=Path, help="write the plan here")
    ap.add_argument("--history", type=Path, nargs="*", default=[], help="scheduler stores / runs")
    ap.add_argument("--group-size", type=int, default=8, help="samples per prompt (default 8)")
    ap.add_argument("--groups-per-step", type=int, default=8, help="default 8")
    ap.add_argument("--instances", type=int, default=1, help="rollout instances (default 1)")
    ap.add_argument("--max-batch-tokens", type=int, default=32768, help="default 32768")
    ap.add_argument("--buckets", type=int, default=4, help="quantile buckets (default 4)")
    ap.add_argument("--bucket-boundaries", type=_ints, help="e.g. 128,256,512 (tokens)")
    ap.add_argument("--max-skew", type=float, default=DEFAULT_MAX_SKEW, help="default 1.10")
    ap.add_argument(
        "--default-tokens", type=float, default=128.0, help="prediction with no history"
    )
    ap.add_argument("--cost", type=Path, help="JSON object of CostModel fields")
    ap.add_argument("--json", action="store_true", help="print the statistics as JSON")
    args = ap.parse_args(argv)
    try:
        task = make_task(args.task, seed=args.seed, size=args.size)
        cost = CostModel(**orjson.loads(args.cost.read_bytes())) if args.cost else CostModel()
        predictor = LengthPredictor(
            load_history(args.history), task.name, default_tokens=args.default_tokens
        )
        plan = build_plan(
            task=task.name,
            seed=args.seed,
            size=args.size,
            prompt=task.prompt,
            predictor=predictor,
            group_size=args.group_size,
            groups_per_step=args.groups_per_step,
            instances=args.instances,
            max_batch_tokens=args.max_batch_tokens,
            boundaries=args.bucket_boundaries,
            buckets=args.buckets,
            max_skew=args.max_skew,
            cost=cost,
        )
    except (OSError, ValueError, TypeError, orjson.JSONDecodeError) as e:
        print(f"deltarl plan: {e}", file=sys.stderr)
        return 2
    code = 0
    try:
        figures = validate(plan)
    except PlanError as e:
        print(f"deltarl plan: refused: {e}", file=sys.stderr)
        code = EXIT_REFUSED
        figures = plan_stats(plan)
    stats = {**figures, "bucket_boundaries": list(plan.bucket_boundaries)}
    if code == 0 and args.out:
        write_plan(plan, args.out)
    written = args.out if code == 0 else None
    if args.json:
        sys.stdout.write(
            orjson.dumps({**stats, "written": str(written) if written else None}).decode() + "\n"
        )
    else:
        print(render(stats, written))
    return code
