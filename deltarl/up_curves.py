"""The curves of a ``deltarl up`` run as one PNG: what happened, at a glance.

Six panels from the run's summary (deltarl/up_summary.py), all per step or per version:
the mean reward (the learning signal), held-out accuracy (when eval rounds ran), the refit
time of every version the engine loaded (export pick-up to engine, deltas and full versions
marked apart), their bytes on the wire, the bubbles (training padding, sorting wait, wasted
tokens) and the policy lag. Drawn headless (Agg): no display is needed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _points(curve: list[dict[str, Any]], x: str, y: str) -> tuple[list[float], list[float]]:
    pairs = [(float(p[x]), float(p[y])) for p in curve if p.get(y) is not None]
    return [a for a, _ in pairs], [b for _, b in pairs]


def draw(summary: dict[str, Any], out: Path, title: str) -> Path:
    """Write the curves of ``summary`` to ``out`` (a PNG); returns ``out``."""
    import matplotlib as mpl  # noqa: PLC0415 - only when drawing

    mpl.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    reward, evals, refit_s, refit_b, bubbles, lag = axes.flat

    reward.plot(*_points(summary.get("reward_curve") or [], "step", "reward"), ".-")
    reward.set(title="mean reward per step", xlabel="step", ylabel="reward")

    curve = summary.get("eval_curve") or []
    if curve:
        evals.plot(*_points(curve, "step", "accuracy"), "o-")
    else:
        evals.text(0.5, 0.5, "no held-out rounds in this run", ha="center", va="center")
    evals.set(title="held-out accuracy (greedy)", xlabel="step", ylabel="accuracy")

    refits = summary.get("refit_curve") or []
    for kind, mark in (("delta", "."), ("full", "s")):
        mine = [r for r in refits if r["kind"] == kind]
        if mine:
            refit_s.plot(*_points(mine, "version", "seconds"), mark, label=kind)
            refit_b.plot(
                [r["version"] for r in mine],
                [r["wire_bytes"] / 1e6 for r in mine],
                mark,
                label=kind,
            )
    refit_s.set(title="refit: export pick-up to engine", xlabel="version", ylabel="seconds")
    refit_b.set(title="refit: bytes on the wire", xlabel="version", ylabel="MB")
    refit_b.set_yscale("log")
    for ax in (refit_s, refit_b):
        if refits:
            ax.legend()

    steps = summary.get("step_curve") or []
    for key, label in (
        ("padding_ratio", "training padding"),
        ("sorting_wait", "sorting wait"),
        ("wasted_ratio", "wasted tokens"),
    ):
        xs, ys = _points(steps, "step", key)
        if xs:
            bubbles.plot(xs, ys, ".-", label=label)
    bubbles.set(title="bubbles", xlabel="step", ylabel="ratio")
    if bubbles.lines:
        bubbles.legend()

    lag.plot(*_points(steps, "step", "lag_max"), ".-")
    lag.set(title="policy lag (largest in the step)", xlabel="step", ylabel="versions")

    fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
