"""`deltarl bench schedule --calibrate`: the cost model measured on the real engine (tiny model)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from deltarl.bench.schedule_calibrate import calibrate_placed

from deltarl.ops.placement import format_cpu_list
from deltarl.scheduler.store import SchedulerStore
from deltarl.sim.schedule_model import CostModel
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
    (line,) = proc.stdout.strip().splitlines()  # vLLM's logs went to stderr
    result = orjson.loads(line)
    assert result["calibrated"] is True
    assert result["cost_model"] == measured
    assert "decode fit R^2" in proc.stderr
    # Without --real: one engine, measured on whatever CPUs this process may use.
    calibration = result["calibration"]
    assert calibration["placement"] == {"cpus": None, "engines_sharing": 1}
    assert calibration["measured"] == measured
    assert calibration["ran_on"] == format_cpu_list(os.sched_getaffinity(0))


@pytest.mark.slow
def test_the_engine_is_measured_where_the_real_runs_engines_run(tmp_path: Path) -> None:
    """Pinned to one CPU that two engines share: the engine ran on that CPU alone, and the
    model takes each engine's steps to be twice what it measured."""
    cpu = str(min(os.sched_getaffinity(0)))
    cost, info = calibrate_placed(None, cpu, 2)
    assert info["ran_on"] == cpu
    assert info["placement"] == {"cpus": cpu, "engines_sharing": 2}
    assert cost == CostModel(**info["measured"]).time_shared(2)
    assert cost.decode_base_s == pytest.approx(2 * info["measured"]["decode_base_s"])
    assert cost.max_seqs == info["measured"]["max_seqs"]


@pytest.mark.slow
def test_the_real_half_runs_each_policy_on_the_daemons_and_measures_the_models_error(
    tmp_path: Path,
) -> None:
    """Three `deltarl up` runs (minutes on two cores), their trainer and engines pinned to a
    CPU each: `real` has the model half's shape plus model_error, each policy's run directory
    holds its store, the daemons ran where they were pinned, and the figures are sane."""
    trainer, rollout = max(os.sched_getaffinity(0)), min(os.sched_getaffinity(0))
    proc = subprocess.run(
        [sys.executable, "-m", "deltarl.cli", "bench", "schedule", "--json", "--prompts", "128",
         "--instances", "4", "--groups-per-step", "16", "--real", "--real-steps", "4",
         "--real-dir", str(tmp_path / "runs"), "--real-cpus", f"trainer={trainer}",
         "--real-cpus", f"rollout={rollout}"],
        capture_output=True, text=True, timeout=1800, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = proc.stdout.strip().splitlines()
    real = orjson.loads(line)["real"]
    assert {"workload", "instances", "policies", "speedup_vs_sync", "speedup_vs_least_requests",
            "model_error", "model_error_in_situ", "in_situ"} <= set(real)  # fmt: skip
    assert set(real["policies"]) == {"sync", "least_requests", "deltarl"}
    assert real["cpus"] == [f"trainer={trainer}", f"rollout={rollout}"]
    assert real["task"] == "long_tail"  # the default: lengths forced, long-tailed
    for policy, m in real["policies"].items():
        assert m["throughput_tok_s"] > 0, policy
        assert m["skewness"] >= 1
        run = tmp_path / "runs" / policy
        with SchedulerStore(run / "scheduler.sqlite", readonly=True) as store:
            lengths = {o for *_, outputs in store.length_records() for o in outputs}
        assert len(lengths) > 10, lengths
        assert f"pinned to CPUs {trainer}" in (run / "trainer.log").read_text()
        assert f"pinned to CPUs {rollout}" in (run / "rollout.log").read_text()
    assert real["model_error"] >= 0
    assert real["model_error_in_situ"] >= 0
    for policy, factor in real["in_situ"]["factor"].items():
        assert factor is not None, policy  # each run's engines stepped
        assert factor > 0, policy
        assert real["in_situ"]["model_throughput_tok_s"][policy] > 0


@pytest.mark.slow
def test_convergence_runs_three_loops_on_the_same_samples_and_draws_them(tmp_path: Path) -> None:
    png = tmp_path / "curves.png"
    proc = subprocess.run(
        [sys.executable, "-m", "deltarl.cli", "bench", "schedule", "--json", "--convergence",
         str(png), "--convergence-steps", "3", "--real-dir", str(tmp_path / "runs")],
        capture_output=True, text=True, timeout=1800, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = proc.stdout.strip().splitlines()
    runs = orjson.loads(line)["convergence"]
    assert set(runs) == {"sync", "deltarl, lag 1", "deltarl, lag 3"}
    assert len({r["samples_trained"] for r in runs.values()}) == 1  # the same samples each
    for r in runs.values():
        assert [p["step"] for p in r["reward_curve"]] == [1, 2, 3]
        assert r["wall_s"] > 0
    assert runs["sync"]["lag"] == 0
    for r in runs.values():
        assert r["objective"] == "decoupled"  # the default: no clip against stale tokens
        assert r["forward_weights"] == "published"  # the default: the engines' weights
        assert r["clip_frac_mean"] == 0.0
        assert 0.0 <= r["cap_frac_mean"] <= 1.0
        assert r["reward_tail_mean"] == r["reward_curve"][-1]["reward"]  # a quarter of 3
        # each run keeps its stores and logs for reading, not its checkpoints
        assert (Path(r["run"]) / "scheduler.sqlite").is_file()
        assert not (Path(r["run"]) / "checkpoints").exists()
    # Fresh samples and passes at the weights the engine serves: the trainer's policy is the
    # sampler's, so no importance weight reaches the cap and the KL to it is rounding.
    assert runs["sync"]["cap_frac_mean"] == 0.0
    assert runs["sync"]["kl_behaviour_last"] == pytest.approx(0.0, abs=1e-4)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
