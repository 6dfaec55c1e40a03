"""The curves PNG of ``deltarl up`` (deltarl/up_curves.py), from summaries without a run."""

from __future__ import annotations

import struct
from pathlib import Path

from deltarl import up_curves


def _size(png: Path) -> tuple[int, int]:
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk
    return width, height


def test_a_run_with_every_curve(tmp_path: Path) -> None:
    summary = {
        "steps": 3,
        "reward_curve": [{"step": s, "reward": 0.1 * s} for s in (1, 2, 3)],
        "eval_curve": [{"step": 0, "accuracy": 0.05}, {"step": 3, "accuracy": 0.2}],
        "refit_curve": [
            {"version": 1, "kind": "full", "wire_bytes": 2_000_000, "seconds": 0.5},
            {"version": 2, "kind": "delta", "wire_bytes": 40_000, "seconds": 0.1},
        ],
        "step_curve": [
            {"step": s, "lag_max": 1, "padding_ratio": 0.2, "sorting_wait": 0.5, "wasted_ratio": 0}
            for s in (1, 2, 3)
        ],
    }
    out = up_curves.draw(summary, tmp_path / "run.png", "a run")
    assert _size(out) == (1350, 720)  # 15 x 8 inches at 90 dpi


def test_a_run_with_nothing_recorded_still_draws(tmp_path: Path) -> None:
    """No eval rounds, no refits, None where a step recorded nothing: the panels say so."""
    summary = {
        "steps": 1,
        "reward_curve": [{"step": 1, "reward": None}],
        "step_curve": [{"step": 1, "lag_max": None, "padding_ratio": None}],
    }
    out = up_curves.draw(summary, tmp_path / "deep" / "run.png", "empty")
    assert _size(out) == (1350, 720)
