"""``deltarl chaos`` end to end: the real command, the five real daemons, real SIGKILLs.

The default run kills three daemons (seed 6: the scheduler, the export agent and the trainer,
so the trainer's replay from its checkpoint is in it; a rollout restart costs a vLLM start,
left to the slow test) and checks the JSON contract and the target. The slow test is the
issue's target run, K = 20. What makes the counts able to fail is tested on its own:
tests/test_chaos_checker.py corrupts a store under the real checker.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.installed import require_vllm

require_vllm()

KEYS: dict[str, type] = {
    "kills": int,
    "steps": int,
    "half_applied_seen": int,
    "non_bit_exact": int,
    "lost_samples": int,
    "duplicate_samples": int,
    "versions_monotonic": bool,
    "converged_s_max": float,
}


def _chaos(home: Path, *args: str, timeout: float) -> tuple[dict[str, Any], Path]:
    proc = subprocess.run(
        [sys.executable, "-m", "deltarl.cli", "chaos", "--json", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, "DELTARL_HOME": str(home)},
    )
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout + proc.stderr[-6000:]
    result: dict[str, Any] = orjson.loads(lines[0])
    assert proc.returncode == 0, f"{result}\n{proc.stderr[-6000:]}"
    assert list(result) == list(KEYS)  # exactly the contract's keys, in its order
    for key, kind in KEYS.items():
        assert type(result[key]) is kind, (key, result[key])
    run_dir = next((home / "runs").iterdir())
    return result, run_dir


def _target(result: dict[str, Any], kills: int) -> None:
    assert result["kills"] == kills
    for key in ("half_applied_seen", "non_bit_exact", "lost_samples", "duplicate_samples"):
        assert result[key] == 0, (key, result)
    assert result["versions_monotonic"] is True
    assert result["steps"] >= 1


@pytest.mark.timeout(180)
def test_chaos_three_kills_json_contract_and_target(tmp_path: Path) -> None:
    result, run_dir = _chaos(tmp_path / "home", "--kills", "3", "--seed", "6", timeout=170)
    _target(result, 3)
    details = orjson.loads((run_dir / "chaos.json").read_bytes())
    assert [k["daemon"] for k in details["kill_log"]] == ["scheduler", "export", "trainer"]
    assert details["problems"] == []
    # The checker was really at work: it proved leases and engine loads, not nothing.
    assert details["checker"]["leases"] > 0
    assert details["checker"]["engine_loads_checked"] > 0
    assert details["scheduler"]["accepted"] > 0


# Seed 34 kills every daemon at least three times (the rollout daemon four).
@pytest.mark.slow
@pytest.mark.timeout(1000)
def test_chaos_twenty_kills_meets_the_target(tmp_path: Path) -> None:
    result, run_dir = _chaos(tmp_path / "home", "--kills", "20", "--seed", "34", timeout=990)
    _target(result, 20)
    details = orjson.loads((run_dir / "chaos.json").read_bytes())
    assert {k["daemon"] for k in details["kill_log"]} == {
        "scheduler",
        "trainer",
        "export",
        "apply",
        "rollout",
    }
