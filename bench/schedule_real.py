"""The real-engine half of ``deltarl bench schedule`` (``--real``): the same policies on the real
daemons, and how far the model's prediction was.

Each policy runs as one ``deltarl up`` of the embedded tiny model (``--rollouts`` vLLM engines
fed by the scheduler with that ``--policy``, the trainer, export and apply agents), in a run
directory of its own. From each run:

- ``throughput_tok_s``: completion tokens trained per second in the steady state: the steps
  after the first (whose wall time holds the engines' start) over the time from the first
  step's end to the last's (the scheduler's ``step_tokens`` and step records);
- ``padding_ratio``, ``skewness``, ``sorting_wait``: the run summary's (the trainer's padding,
  the engines' busy-time skew, the median per-step sorting wait);
- the trace: every pooled group's prompt and output lengths (the store's ``length_history``),
  replayed through the model with the run's measured training step and refit times on as many
  instances, for the same policy. ``model_error`` is the mean over the policies of |predicted
  - real| / real throughput.
- the engines' steps as the daemons ran them (``StepTally`` in each engine's status): the
  seconds of the rounds that stepped, against what the cost model prices those same steps at.
  Their ratio (``in_situ.factor``) is what the cost model misses: the round trips to the
  scheduler, the daemon's own work, and whatever else shares the engines' CPUs.
  ``model_error_in_situ`` is the model's error when each run is replayed with the cost model
  scaled by the ratio measured on the *other* policies' runs (so no run predicts itself): how
  far the model's dynamics are, once the cost of a step is right.

The default task, ``long_tail``, forces each sample's completion length to a long-tailed
draw (``deltarl.rl.long_tail``): the tiny model's own completions nearly all run to its
``max_tokens``, and there would be nothing for length-aware dispatch to use
(``--real-task default``). With ``--calibrate`` the cost model is measured where the real
runs' engines run (``engine_cpus``, ``schedule_calibrate.calibrate_placed``).
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from deltarl.ops.placement import parse_cpu_list
from deltarl.scheduler.store import SchedulerStore
from deltarl.sim.schedule_model import POLICIES, CostModel, PromptGroup, Workload, run_policy
from deltarl.up import CHECKPOINT_DIR, cpu_placement, rollout_names

GROUPS_PER_STEP = 8  # the tiny profile's (deltarl/up_models.py)
REAL_TASKS: dict[str, tuple[str, ...]] = {
    # Completion lengths forced per sample to a long-tailed distribution (deltarl.rl.long_tail),
    # up to the task's cap, which `deltarl up` makes its max_tokens: the workload
    # length-aware dispatch is for.
    "long_tail": ("--task", "long_tail"),
    # The tiny model's own task: its completions nearly all run to max_tokens.
    "default": (),
}


def engine_cpus(cpus: Sequence[str], rollouts: int) -> tuple[str | None, int]:
    """Where the real runs' first engine runs (a cpu list; None: unpinned, on every CPU) and
    how many of their engines run on CPUs it runs on, by ``deltarl up``'s own reading of the
    ``--cpus`` items (``up.cpu_placement``; ValueError for a bad one)."""
    names = rollout_names(rollouts)
    placed = cpu_placement(cpus, rollouts)
    every = frozenset(os.sched_getaffinity(0))

    def on(name: str) -> frozenset[int]:
        return parse_cpu_list(placed[name]) if name in placed else every

    first = on(names[0])
    return placed.get(names[0]), sum(1 for n in names if on(n) & first)


def up_summary(label: str, workdir: Path, *args: str) -> dict[str, Any]:
    """``deltarl up --json --workdir WORKDIR ARGS`` in a process of its own; its summary
    (RuntimeError with the end of its log if it fails).

    A run that finished leaves its logs, stores and curves in ``workdir`` but not its
    checkpoints: a bench reads the stores, never restarts a run, and a SmolLM2 run's
    checkpoints are 5.5 GB (three convergence runs filled a disk). A failed run keeps them."""
    cmd = [sys.executable, "-m", "deltarl.cli", "up", "--json", "--workdir", str(workdir), *args]
    proc = subprocess.run(  # noqa: S603 - our own entry point
        cmd, capture_output=True, text=True, timeout=7200, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"deltarl up ({label}) failed:\n{proc.stderr[-4000:]}")
    summary: dict[str, Any] = orjson.loads(proc.stdout.strip().splitlines()[-1])
    shutil.rmtree(workdir / CHECKPOINT_DIR, ignore_errors=True)
    return summary


def step_seconds(summary: dict[str, Any], cost: CostModel) -> tuple[float, float]:
    """The run's engines' stepping rounds: their seconds, and what ``cost`` prices their
    steps at (summed over the engines; ``StepTally``)."""
    rounds = priced = 0.0
    for engine in summary.get("engines") or []:
        steps = engine.get("steps") or {}
        rounds += float(steps.get("round_s") or 0.0)
        priced += cost.steps_s(
            int(steps.get("count") or 0),
            int(steps.get("seqs") or 0),
            int(steps.get("context_tokens") or 0),
        )
    return rounds, priced


def _store(workdir: Path) -> tuple[float, Workload]:
    """Steady-state trained tokens per second, and the run's trace, from its scheduler store."""
    with SchedulerStore(workdir / "scheduler.sqlite", readonly=True) as store:
        rows = [
            r
            for r in store.history()
            if r.get("done_at") is not None and r.get("trained_tokens") is not None
        ]
        trace = store.length_records()
    if len(rows) < 2:
        raise RuntimeError(f"{workdir}: fewer than two steps done")
    span = float(rows[-1]["done_at"]) - float(rows[0]["done_at"])
    throughput = sum(int(r["trained_tokens"]) for r in rows[1:]) / span if span > 0 else 0.0
    groups = tuple(PromptGroup(p, tuple(o)) for _, _, _, p, o in trace)
    workload = Workload(f"trace of {workdir.name}", groups, tuple(float(g.tokens) for g in groups))
    return throughput, workload


def run_real(
    root: Path,
    cost: CostModel,
    *,
    steps: int,
    rollouts: int,
    lag: int,
    lag_rule: str = "oldest_token",
    cpus: Sequence[str] = (),
    task: str = "long_tail",
) -> dict[str, Any]:
    """``R`` of the bench's JSON: the policies on the real daemons, with the model's error.
    ``cpus``: ``deltarl up --cpus`` items (``trainer=1``), the same for every run."""
    pinning = [a for item in cpus for a in ("--cpus", item)]
    policies: dict[str, dict[str, float]] = {}
    runs: dict[str, tuple[dict[str, Any], Workload]] = {}
    for policy in POLICIES:
        workdir = root / policy
        summary = up_summary(
            f"--policy {policy}", workdir,
            "--model", "tiny", "--steps", str(steps), "--rollouts", str(rollouts),
            "--policy", policy, "--max-policy-lag", str(lag),
            "--lag-rule", lag_rule, *pinning, *REAL_TASKS[task],
        )  # fmt: skip
        real, trace = _store(workdir)
        runs[policy] = (summary, trace)
        policies[policy] = {
            "throughput_tok_s": real,
            "padding_ratio": float(summary.get("padding_ratio_median") or 0.0),
            "skewness": float(summary.get("skewness") or 1.0),
            "sorting_wait": float(summary.get("sorting_wait_median") or 0.0),
            "wasted_tokens_ratio": float(summary.get("wasted_tokens_ratio") or 0.0),
            "token_lag_mean": float(summary.get("token_lag_mean") or 0.0),
            "over_bound_token_ratio": float(summary.get("over_bound_token_ratio") or 0.0),
        }

    def predict(policy: str, cost: CostModel) -> float:
        summary, trace = runs[policy]
        times = summary.get("step_time") or {}
        return run_policy(
            policy,
            trace,
            cost,
            rollouts,
            GROUPS_PER_STEP,
            float(times.get("train_s") or 0.0) + float(times.get("publish_s") or 0.0),
            float(summary.get("refit_median_s") or 0.0),
            lag=lag,
            lag_rule=lag_rule,
        ).throughput_tok_s

    seconds = {p: step_seconds(runs[p][0], cost) for p in POLICIES}

    def others(policy: str) -> float:
        """The stepping rounds' seconds over the cost model's, on the other policies' runs."""
        rest = [seconds[q] for q in POLICIES if q != policy]
        priced = sum(s for _, s in rest)
        return sum(r for r, _ in rest) / priced if priced > 0 else 1.0

    predicted = {p: predict(p, cost) for p in POLICIES}
    in_situ = {p: predict(p, cost.scaled(others(p))) for p in POLICIES}

    def error(model: dict[str, float]) -> float:
        return statistics.fmean(
            abs(model[p] - policies[p]["throughput_tok_s"]) / policies[p]["throughput_tok_s"]
            for p in POLICIES
        )

    ours = policies["deltarl"]["throughput_tok_s"]
    return {
        "workload": f"deltarl up --model tiny {' '.join(REAL_TASKS[task])} ({steps} steps each)",
        "instances": rollouts,
        "policies": policies,
        "speedup_vs_sync": ours / policies["sync"]["throughput_tok_s"],
        "speedup_vs_least_requests": ours / policies["least_requests"]["throughput_tok_s"],
        "model_error": error(predicted),
        "model_throughput_tok_s": predicted,
        "model_error_in_situ": error(in_situ),
        "in_situ": {
            # each run's own stepping rounds over what the cost model prices their steps at
            "factor": {p: r / s if s > 0 else None for p, (r, s) in seconds.items()},
            "model_throughput_tok_s": in_situ,
        },
        "runs": str(root),
        "cpus": list(cpus),
        "task": task,
    }
