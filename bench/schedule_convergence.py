"""``deltarl bench schedule --convergence OUT.png``: does asynchrony cost learning?

Seed 000: throughput means nothing if convergence degrades. The same task, model, seed and
number of trained samples (``--convergence-steps`` steps of the model's groups) run three
times with ``deltarl up``: ``sync`` (the synchronous loop), and ``deltarl`` at lag bound 1 and
at lag bound 3. Their reward curves (and held-out accuracy, where the task has a split and
``--eval-every`` asks for it) are drawn side by side in one PNG, with each run's wall time:
the same samples, in how much time, to what reward. ``--lag-rule partial`` runs the two
``deltarl`` loops under that lag rule (groups go on under new weights; deltarl/scheduler/
token_lag.py), each run reporting its trained tokens' age beside its waste. ``--objective``
picks the trainer's loss for all three (deltarl/trainer/grpo.py; ``decoupled``, the default:
the clip around the step's own policy, staleness corrected by truncated importance weights;
``clipped``: PPO's clip against the behaviour policy); each run reports the share of tokens
the clip zeroed (``clip_frac_mean``), the share whose weight the cap truncated
(``cap_frac_mean``), its last step's KL to the sampling policy (``kl_behaviour_last``)
and its mean reward over the last quarter of its steps
(``reward_tail_mean``). ``--forward-weights master`` runs all three with the trainer's passes
at its float32 master weights instead of the bf16 ones the engines serve (the trainer's
``forward_weights``), to see what that mismatch costs.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from deltarl.bench.schedule_real import up_summary

from deltarl.scheduler.store import SchedulerStore

RUNS = (("sync", 0), ("deltarl", 1), ("deltarl", 3))


def _label(
    policy: str,
    lag: int,
    lag_rule: str = "oldest_token",
    objective: str = "decoupled",
    forward_weights: str = "published",
) -> str:
    label = "sync" if policy == "sync" else f"deltarl, lag {lag}"
    if policy != "sync" and lag_rule == "partial":
        label += ", partial"
    label += ", clipped" if objective == "clipped" else ""
    return label + (", master weights" if forward_weights == "master" else "")


def run_convergence(
    out: Path,
    *,
    model: str,
    steps: int,
    root: Path,
    seed: int,
    eval_every: int | None,
    lag_rule: str = "oldest_token",
    objective: str = "decoupled",
    forward_weights: str = "published",
) -> dict[str, Any]:
    """Run the three loops (module docstring), draw ``out``; the figures of each run."""
    runs: dict[str, Any] = {}
    for policy, lag in RUNS:
        label = _label(policy, lag, lag_rule, objective, forward_weights)
        workdir = root / label.replace(", ", "-").replace(" ", "")
        args = [
            "--model", model, "--steps", str(steps), "--policy", policy,
            "--max-policy-lag", str(lag), "--seed", str(seed),
            "--lag-rule", lag_rule, "--objective", objective,
            "--forward-weights", forward_weights,
        ]  # fmt: skip
        if eval_every:
            args += ["--eval-every", str(eval_every)]
        print(f"deltarl bench schedule: convergence run {label}", file=sys.stderr, flush=True)
        summary = up_summary(label, workdir, *args)
        curve = summary.get("reward_curve") or []
        rewards = [p["reward"] for p in curve if p.get("reward") is not None]
        tail = rewards[-max(1, len(rewards) // 4) :]
        runs[label] = {
            "policy": policy,
            "lag": lag,
            "objective": objective,
            "forward_weights": forward_weights,
            "reward_tail_mean": sum(tail) / len(tail) if tail else None,
            "clip_frac_mean": summary.get("clip_frac_mean"),
            "cap_frac_mean": summary.get("cap_frac_mean"),
            "kl_behaviour_last": summary.get("kl_behaviour_last"),
            "run": str(workdir),
            "wall_s": _span(workdir),
            "samples_trained": summary.get("samples_trained"),
            "reward_curve": summary.get("reward_curve") or [],
            "eval": [
                {"step": e["step"], "accuracy": e["accuracy"]}
                for e in summary.get("eval_curve") or []
                if e.get("accuracy") is not None
            ],
            "wasted_tokens_ratio": summary.get("wasted_tokens_ratio"),
            "lag_rule": summary.get("lag_rule"),
            "token_lag_mean": summary.get("token_lag_mean"),
            "over_bound_token_ratio": summary.get("over_bound_token_ratio"),
        }
    _draw(out, runs, model)
    return runs


def _span(workdir: Path) -> float:
    """Seconds from the first step shipped to the last one trained (the engines' start left
    out, which differs from run to run for reasons of its own)."""
    with SchedulerStore(workdir / "scheduler.sqlite", readonly=True) as store:
        rows = store.history()
    return max(float(r["done_at"]) for r in rows) - min(float(r["shipped_at"]) for r in rows)


def _draw(out: Path, runs: dict[str, Any], model: str) -> None:
    import matplotlib as mpl  # noqa: PLC0415 - only when drawing

    mpl.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    has_eval = any(r["eval"] for r in runs.values())
    fig, axes = plt.subplots(1, 2 if has_eval else 1, figsize=(12 if has_eval else 7, 4.5))
    reward_ax = axes[0] if has_eval else axes
    for label, r in runs.items():
        curve = [(p["step"], p["reward"]) for p in r["reward_curve"] if p.get("reward") is not None]
        wall = f", {r['wall_s']:.0f} s" if r.get("wall_s") else ""
        reward_ax.plot(*zip(*curve, strict=True), label=f"{label}{wall}")
        if has_eval and r["eval"]:
            axes[1].plot(
                [e["step"] for e in r["eval"]],
                [e["accuracy"] for e in r["eval"]],
                "o-",
                label=label,
            )
    reward_ax.set(xlabel="step (same samples per step in every run)", ylabel="mean reward")
    reward_ax.set_title(f"{model}: reward per step")
    reward_ax.legend()
    if has_eval:
        axes[1].set(xlabel="step", ylabel="held-out accuracy (greedy)")
        axes[1].set_title("held-out evaluation")
        axes[1].legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
