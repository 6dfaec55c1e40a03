"""``deltarl bench export-cost`` runs its three modes for real (small and short here) and
prints the JSON object its docstring promises."""

from __future__ import annotations

import subprocess
import sys

import orjson


def test_export_cost_json_contract() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "deltarl.cli", "bench", "export-cost", "--params", "200000",
         "--seconds", "3", "--json"],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1
    r = orjson.loads(lines[0])
    assert r["params"] == 200_000
    assert set(r["step_s"]) == {"alone", "with_export", "niced"}
    assert all(v > 0 for v in r["step_s"].values())
    for mode in ("with_export", "niced"):
        ratio = r["step_s"][mode] / r["step_s"]["alone"]  # of the rounded step times
        assert abs(r["slowdown"][mode] - ratio) < 1e-3
        assert r["versions_sent"][mode] > 0  # the export agent really ran and sent
