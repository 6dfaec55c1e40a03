"""`deltarl bench schedule --calibrate`: the cost model measured on the real engine (tiny model)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson

from tests.installed import require_vllm

require_vllm()


def test_the_cost_model_is_measured_written_and_used(tmp_path: Path) -> None:
    cost = tmp_path / "cost.json"
    proc = subprocess.run(
        [sys.executable, "-m", "deltarl.cli", "bench", "schedule", "--json", "--calibrate",
         str(cost), "--prompts", "128", "--instances", "4", "--groups-per-step", "16"],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    measured = orjson.loads(cost.read_bytes())
    # A decode step costs something, more with more sequences or context; a prompt token
    # costs something to prefill; the engine runs up to its max_num_seqs.
    assert measured["decode_base_s"] > 0
    assert measured["decode_per_seq_s"] + measured["decode_per_kctx_s"] > 0
    assert measured["prefill_per_token_s"] > 0
    assert measured["max_seqs"] == 48
    result = orjson.loads(proc.stdout.strip().splitlines()[-1])
    assert result["calibrated"] is True
    assert result["cost_model"] == measured
    assert "decode fit R^2" in proc.stderr
