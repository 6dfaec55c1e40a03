"""`deltarl bench schedule`: one workload through each dispatch policy, side by side.

The model half of issue-12's benchmark: ``deltarl/sim/schedule_model.py`` replays a long-tailed
workload (log-normal output lengths with a heavy tail, groups of n samples per prompt), or a
trace (``--workload FILE``: a JSON list of ``{"prompt_tokens": int, "output_tokens": [int,
...]}``), through ``sync``, ``least_requests`` and ``deltarl`` on ``--instances`` continuous-
batching instances, and prints their figures and the speedups. ``--cost FILE`` replaces the
cost model's knobs (a JSON object of ``CostModel`` fields).

With ``--json``, exactly one JSON object on stdout:

    {"workload": str, "instances": int,
     "policies": {"sync": M, "least_requests": M, "deltarl": M},
     "speedup_vs_sync": float, "speedup_vs_least_requests": float, "real": null}

M = {"throughput_tok_s", "padding_ratio", "skewness", "sorting_wait"} (floats), and added to
the contract: ``wasted_tokens_ratio``, ``token_lag_mean`` and ``over_bound_token_ratio`` (the
trained tokens' mean age in versions, and the share of them more than the bound behind) in each
M, and at the top ``lag`` (the bound, ``--lag``) and ``lag_rule`` (``--lag-rule``: which token
of a group its lag is measured from; ``partial`` lets groups go on under new weights).
Also added to each M: ``step_skewness``, the median over steps of the skewness the scheduler
records per step (the busiest instance's busy time since the previous step over the mean), and
``tail_s``, the seconds after the last group was issued, and ``step_tokens_min`` /
``step_tokens_max``, the smallest and largest step's mean completion tokens per group over the
workload's mean (what dispatch by length does to each step's mix); at the top, ``lookahead``
(``--lookahead``: the ``deltarl`` policy's window, as the scheduler's ``lookahead``).
``skewness`` is over the whole run, so on a workload of a few steps it mostly measures that
tail: the drain of a finite dataset, when an idle instance has nothing left to take while the
last long groups finish. The default workload (``DEFAULT_PROMPTS``) is therefore 128 steps long,
a short RL run, not 16 steps: there the drain is a few percent of the run, not a third.
``real``: the same policies on the real rollout daemons (``--real``), the same M for each plus
``model_error``, and ``model_error_in_situ`` with ``in_situ`` (the cost model's error on
the engines' steps as the daemons ran them, and the model's error once that is corrected:
``bench/schedule_real.py``); null without ``--real``. With ``--calibrate``, ``calibration``:
the decode fit's R^2 and points, and ``placement`` (``cpus``, ``engines_sharing``): where the
engine was measured and how many engines the cost model takes to share those CPUs.
"""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import orjson
from deltarl.bench.schedule_real import REAL_TASKS, engine_cpus, run_real

from deltarl.atomic_file import write_atomic
from deltarl.config.rl import FORWARD_WEIGHTS, RLTrainerConfig
from deltarl.sim.schedule_model import (
    DEFAULT_LOOKAHEAD,
    LAG_RULES,
    POLICIES,
    CostModel,
    Workload,
    from_trace,
    long_tailed,
    run_policy,
)

DEFAULT_PROMPTS = 16384
"""The synthetic workload's prompts: 128 steps of 128 groups. With 16 steps (2048 prompts) the
last step waits for every group still running, and that drain is a third of the run's wall
time and most of its skewness (README, "run length")."""


def run(
    workload: Workload,
    cost: CostModel,
    instances: int,
    groups_per_step: int,
    train_s: float,
    refit_s: float,
    lag: int = 1,
    lag_rule: str = "oldest_token",
    max_token_lag: int | None = None,
    lookahead: int = DEFAULT_LOOKAHEAD,
) -> dict[str, Any]:
    figures = {
        p: run_policy(
            p,
            workload,
            cost,
            instances,
            groups_per_step,
            train_s,
            refit_s,
            lag=lag,
            lag_rule=lag_rule,
            token_cap=max_token_lag,
            lookahead=lookahead,
        )
        for p in POLICIES
    }
    policies = {
        p: {
            "throughput_tok_s": f.throughput_tok_s,
            "padding_ratio": f.padding_ratio,
            "skewness": f.skewness,
            "sorting_wait": f.sorting_wait,
            "wasted_tokens_ratio": f.wasted_tokens_ratio,
            "token_lag_mean": f.token_lag_mean,
            "over_bound_token_ratio": f.over_bound_token_ratio,
            "step_skewness": f.step_skewness,
            "tail_s": f.tail_s,
            "step_tokens_min": f.step_tokens_min,
            "step_tokens_max": f.step_tokens_max,
        }
        for p, f in figures.items()
    }
    ours = figures["deltarl"].throughput_tok_s
    return {
        "workload": workload.name,
        "instances": instances,
        "policies": policies,
        "speedup_vs_sync": ours / figures["sync"].throughput_tok_s,
        "speedup_vs_least_requests": ours / figures["least_requests"].throughput_tok_s,
        "real": None,
        "lag": lag,
        "lag_rule": lag_rule,
        "max_token_lag": max_token_lag,
        "lookahead": lookahead,
    }


def render(result: dict[str, Any]) -> str:
    lines = [
        f"workload {result['workload']} on {result['instances']} instances (model), "
        f"lag bound {result['lag']} ({result.get('lag_rule', 'oldest_token')}"
        + (
            f", oldest token at most {result['max_token_lag']} behind"
            if result.get("max_token_lag") is not None
            else ""
        )
        + ")"
    ]
    lines.append(
        f"  {'policy':<16}{'tokens/s':>12}{'padding':>10}{'skewness':>10}{'sorting wait':>14}"
        f"{'wasted':>9}{'token lag':>11}{'over bound':>12}{'step skew':>11}{'tail s':>8}"
    )
    for name, m in result["policies"].items():
        lines.append(
            f"  {name:<16}{m['throughput_tok_s']:>12.0f}{m['padding_ratio']:>10.3f}"
            f"{m['skewness']:>10.3f}{m['sorting_wait']:>14.3f}{m['wasted_tokens_ratio']:>9.3f}"
            f"{m['token_lag_mean']:>11.2f}{m['over_bound_token_ratio']:>12.3f}"
            f"{m['step_skewness']:>11.3f}{m['tail_s']:>8.0f}"
        )
    lines.append(
        f"  deltarl: {result['speedup_vs_sync']:.2f}x sync, "
        f"{result['speedup_vs_least_requests']:.3f}x least_requests"
    )
    real = result.get("real")
    if real:
        lines.append(f"real engines: {real['workload']} on {real['instances']} engines")
        for name, m in real["policies"].items():
            lines.append(
                f"  {name:<16}{m['throughput_tok_s']:>12.0f}{m['padding_ratio']:>10.3f}"
                f"{m['skewness']:>10.3f}{m['sorting_wait']:>14.3f}{m['wasted_tokens_ratio']:>9.3f}"
                f"   (model: {real['model_throughput_tok_s'][name]:.0f}, "
                f"in situ {real['in_situ']['model_throughput_tok_s'][name]:.0f})"
            )
        lines.append(
            f"  deltarl: {real['speedup_vs_sync']:.2f}x sync, "
            f"{real['speedup_vs_least_requests']:.3f}x least_requests; model error "
            f"{real['model_error']:.1%}, in situ {real['model_error_in_situ']:.1%} (the "
            f"daemons' stepping rounds took {_factors(real)} what the cost model prices "
            "their steps at)"
        )
    return "\n".join(lines)


def _factors(real: dict[str, Any]) -> str:
    factors = real["in_situ"]["factor"].values()
    return "/".join("-" if f is None else f"{f:.2f}x" for f in factors)


def _trace(path: Path) -> Workload:
    entries = orjson.loads(path.read_bytes())
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{path}: a workload file is a non-empty JSON list of prompt groups")
    return from_trace(entries, str(path))


def _convergence(args: argparse.Namespace) -> int:
    from deltarl.bench.schedule_convergence import run_convergence  # noqa: PLC0415

    root = args.real_dir or Path(tempfile.mkdtemp(prefix="deltarl-convergence-"))
    print(f"deltarl bench schedule: convergence runs in {root}", file=sys.stderr, flush=True)
    try:
        runs = run_convergence(
            args.convergence,
            model=args.convergence_model,
            steps=args.convergence_steps,
            root=root,
            seed=args.seed,
            eval_every=args.eval_every,
            lag_rule=args.lag_rule,
            objective=args.objective,
            forward_weights=args.forward_weights,
        )
    except RuntimeError as e:
        print(f"deltarl bench schedule: {e}", file=sys.stderr)
        return 1
    if args.json:
        sys.stdout.write(orjson.dumps({"convergence": runs, "png": str(args.convergence)}).decode())
        sys.stdout.write("\n")
        return 0
    for label, r in runs.items():
        rewards = [p["reward"] for p in r["reward_curve"] if p.get("reward") is not None]
        evals = ", ".join(f"{e['step']}: {e['accuracy']:.3f}" for e in r["eval"])
        clip = r.get("clip_frac_mean")
        print(
            f"{label:<36} {r['samples_trained']} samples in {r['wall_s']:.0f} s; reward "
            f"{rewards[0]:.3f} -> {r['reward_tail_mean']:.3f} (last quarter)"
            + (f"; clipped {clip:.1%} of tokens" if clip is not None else "")
            + (f"; held-out {evals}" if evals else "")
        )
    print(f"curves: {args.convergence}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="deltarl bench schedule", description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    ap.add_argument("--workload", type=Path, help="a trace: JSON list of prompt groups")
    ap.add_argument(
        "--prompts",
        type=int,
        default=DEFAULT_PROMPTS,
        help=f"synthetic prompts (default {DEFAULT_PROMPTS}: 128 steps at 128 groups a step)",
    )
    ap.add_argument("--n", type=int, default=8, help="samples per prompt (default 8)")
    ap.add_argument("--instances", type=int, default=32, help="instances (default 32)")
    ap.add_argument("--groups-per-step", type=int, default=128, help="default 128")
    ap.add_argument("--train-s", type=float, default=3.0, help="seconds per training step")
    ap.add_argument("--refit-s", type=float, default=1.0, help="seconds per refit (sync)")
    ap.add_argument("--cost", type=Path, help="JSON object of CostModel fields")
    ap.add_argument(
        "--calibrate",
        type=Path,
        metavar="FILE",
        help="measure the cost model on this machine's rollout engine first, write it to FILE "
        "(a --cost file) and use it; with --real, on the real runs' engines' CPUs, its costs "
        "multiplied by the engines that share them",
    )
    ap.add_argument("--model-dir", type=Path, help="the engine's model (default: the tiny one)")
    ap.add_argument(
        "--real",
        action="store_true",
        help="also run each policy on the real daemons (deltarl up, tiny model): minutes",
    )
    ap.add_argument("--real-steps", type=int, default=12, help="steps of each real run")
    ap.add_argument("--real-rollouts", type=int, default=2, help="engines of each real run")
    ap.add_argument("--real-dir", type=Path, help="where the real runs go (default: a new dir)")
    ap.add_argument(
        "--real-task",
        choices=sorted(REAL_TASKS),
        default=None,
        help="the real runs' task: long_tail (completion lengths forced to a long-tailed "
        "distribution, what length-aware dispatch is for) or default (the tiny model's own "
        "task: every completion runs to max_tokens); default long_tail",
    )
    ap.add_argument(
        "--real-cpus",
        action="append",
        default=[],
        metavar="DAEMON=LIST",
        help="pin the real runs' daemons, as `deltarl up --cpus` (default: its own placement, "
        "half the CPUs to the engines and half to the trainer; none: every daemon on every "
        "core); repeatable",
    )
    ap.add_argument(
        "--convergence",
        type=Path,
        metavar="PNG",
        help="instead: run the model's task under sync and deltarl at lag 1 and 3 (deltarl "
        "up, same samples) and draw their reward and held-out curves to PNG",
    )
    ap.add_argument("--convergence-model", default="tiny", help="tiny or smollm2-135m")
    ap.add_argument("--convergence-steps", type=int, default=20)
    ap.add_argument(
        "--objective",
        choices=("clipped", "decoupled"),
        default="decoupled",
        help="the trainer's policy loss in the convergence runs (deltarl up --objective; "
        "default decoupled)",
    )
    ap.add_argument(
        "--forward-weights",
        choices=FORWARD_WEIGHTS,
        default=RLTrainerConfig.forward_weights,
        help="the weights the trainer's passes run at in the convergence runs (deltarl up "
        "--forward-weights; default published, the bf16 the engines serve)",
    )
    ap.add_argument("--eval-every", type=int, help="held-out rounds every K steps (convergence)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lag", type=int, default=1, help="max_policy_lag_steps (default 1)")
    ap.add_argument(
        "--lag-rule",
        choices=LAG_RULES,
        default="oldest_token",
        help="which token of a group its lag is measured from (default oldest_token; partial: "
        "groups go on under new weights)",
    )
    ap.add_argument(
        "--lookahead",
        type=int,
        default=DEFAULT_LOOKAHEAD,
        metavar="N",
        help=f"the deltarl policy's window past what may be issued now, as the scheduler's "
        f"lookahead (default {DEFAULT_LOOKAHEAD})",
    )
    ap.add_argument(
        "--max-token-lag",
        type=int,
        default=None,
        metavar="K",
        help="under --lag-rule partial (the model only): a group whose oldest token is more "
        "than K versions behind is aborted or dropped, as max_token_lag_steps does",
    )
    args = ap.parse_args(argv)
    if min(args.prompts, args.n, args.instances, args.groups_per_step) < 1:
        ap.error("--prompts, --n, --instances and --groups-per-step must be at least 1")
    if args.lag < 0:
        ap.error("--lag must not be negative")
    if args.lookahead < 0:
        ap.error("--lookahead must not be negative")
    if args.real_cpus and not args.real:
        ap.error("--real-cpus pins the real runs' daemons: it needs --real")
    if args.real_task is not None and not args.real:
        ap.error("--real-task is the real runs' task: it needs --real")
    args.real_task = args.real_task or "long_tail"
    if args.convergence:
        return _convergence(args)
    calibration = None
    if args.calibrate:
        from deltarl.bench.schedule_calibrate import calibrate_placed  # noqa: PLC0415

        # Measured where the real runs' engines run, as many as share those CPUs; without
        # --real, one engine as this process may run it.
        try:
            cpus, engines = (
                engine_cpus(args.real_cpus, args.real_rollouts) if args.real else (None, 1)
            )
            cost, calibration = calibrate_placed(args.model_dir, cpus, engines)
        except (ValueError, RuntimeError, subprocess.TimeoutExpired) as e:
            print(f"deltarl bench schedule: {e}", file=sys.stderr)
            return 1
        write_atomic(args.calibrate, orjson.dumps(dataclasses.asdict(cost)))
        print(
            f"deltarl bench schedule: cost model measured on the engine (decode fit R^2 "
            f"{calibration['decode_r2']:.3f} over {calibration['decode_points']} steps; "
            f"CPUs {cpus or 'all'}, times {engines} engines sharing them), "
            f"written to {args.calibrate}",
            file=sys.stderr,
        )
        args.cost = args.calibrate
    try:
        cost = CostModel(**orjson.loads(args.cost.read_bytes())) if args.cost else CostModel()
        if args.workload:
            workload = _trace(args.workload)
        else:
            workload = long_tailed(prompts=args.prompts, n=args.n, seed=args.seed)
    except (OSError, ValueError, TypeError, orjson.JSONDecodeError) as e:
        print(f"deltarl bench schedule: {e}", file=sys.stderr)
        return 2
    if len(workload.groups) < args.groups_per_step:
        print(
            f"deltarl bench schedule: the workload has {len(workload.groups)} prompt groups, "
            f"fewer than one step (--groups-per-step {args.groups_per_step})",
            file=sys.stderr,
        )
        return 2
    result = run(
        workload,
        cost,
        args.instances,
        args.groups_per_step,
        args.train_s,
        args.refit_s,
        args.lag,
        args.lag_rule,
        args.max_token_lag,
        args.lookahead,
    )
    if args.real:
        root = args.real_dir or Path(tempfile.mkdtemp(prefix="deltarl-bench-schedule-"))
        print(f"deltarl bench schedule: real runs in {root}", file=sys.stderr, flush=True)
        try:
            result["real"] = run_real(
                root,
                cost,
                steps=args.real_steps,
                rollouts=args.real_rollouts,
                lag=args.lag,
                lag_rule=args.lag_rule,
                cpus=args.real_cpus,
                task=args.real_task,
            )
        except RuntimeError as e:
            print(f"deltarl bench schedule: {e}", file=sys.stderr)
            return 1
    result["cost_model"] = dataclasses.asdict(cost)
    result["calibrated"] = calibration is not None or args.cost is not None
    if calibration is not None:
        result["calibration"] = calibration
    if args.json:
        sys.stdout.write(orjson.dumps(result).decode() + "\n")
    else:
        print(render(result))
        print(
            f"  cost model ({'from ' + str(args.cost) if args.cost else 'defaults'}): "
            f"{dataclasses.asdict(cost)}"
        )
    return 0
