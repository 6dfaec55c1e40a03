"""Held-out evaluation through the real daemons: the scheduler and the rollout daemon (vLLM on
the CPU, the tiny model) as processes, the test playing the trainer and the apply agent.

The arithmetic task's eval split is generated greedily before training (the step-0 baseline,
on version 0) and after step 1 (on version 1, which the test publishes with the step). Each
round must be recorded at its step and at the weight version its samples were generated with,
and no eval sample may enter the training pool or its counters.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from deltarl.rl.protocol import REPLIES, Batch, GetHistory, History, StepDone, TakeBatch
from deltarl.transport.control import ControlTimeoutError, request_sync
from deltarl.transport.messages import Ok
from tests.rollout.test_rollout_daemon import _publish, _status, _wait, procs

__all__ = ["procs"]  # the fixture, shared with the daemon test

pytestmark = pytest.mark.timeout(300)


def _history(endpoint: str) -> History | None:
    try:
        reply = request_sync(endpoint, GetHistory(), 2.0, replies=REPLIES)
    except ControlTimeoutError:
        return None
    return reply if isinstance(reply, History) else None


def _round(endpoint: str, step: int) -> dict[str, Any] | None:
    history = _history(endpoint)
    found = [r for r in (history.evals if history else []) if r["step"] == step]
    return found[0] if found and found[0]["finished"] else None


def test_eval_rounds_are_recorded_at_their_step_and_version(
    tmp_path: Path, procs: dict[str, subprocess.Popen[bytes]]
) -> None:
    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    from deltarl.rl.tiny_model import ensure_default_model  # noqa: PLC0415

    model_dir = ensure_default_model(tmp_path / "models")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    _publish(model, tmp_path, 0, None)
    scheduler = f"ipc://{tmp_path}/scheduler.sock"
    config = tmp_path / "deltarl.toml"
    config.write_text(f"""
[daemons.scheduler]
control = "{scheduler}"
db = "{tmp_path}/scheduler.sqlite"
task = "arithmetic"
eval_every = 1
eval_prompts = 24
group_size = 2
groups_per_step = 2
pool_capacity = 4

[daemons.scheduler.sampling]
max_tokens = 8

[daemons.rollout]
control = "ipc://{tmp_path}/rollout.sock"
scheduler = "{scheduler}"
rollout_store = "rollout"
store_root = "{tmp_path}"
model_dir = "{model_dir}"
max_running_groups = 8
heartbeat_s = 0.5
""")
    for name in ("scheduler", "rollout"):
        with (tmp_path / f"{name}.log").open("ab") as log:
            procs[name] = subprocess.Popen(
                [sys.executable, "-m", "deltarl.cli", name, "--config", str(config)],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
    size = 24
    _wait("the baseline round", lambda: _round(scheduler, 0) is not None, procs, tmp_path)
    _wait(
        "a step's training groups pooled",
        lambda: _status(scheduler).get("pool", {}).get("pooled", 0) >= 2,
        procs,
        tmp_path,
    )
    batch = request_sync(scheduler, TakeBatch(1, 2, trainer_version=0), 5.0, replies=REPLIES)
    assert isinstance(batch, Batch)
    assert len(batch.groups) == 2
    assert not any(str(g["group_id"]).startswith("e") for g in batch.groups)
    # the trainer publishes step 1 as version 1, the apply agent commits it, StepDone follows
    _publish(model, tmp_path, 1, None)
    done = request_sync(scheduler, StepDone(1, 1, {"loss": 0.0}), 5.0, replies=REPLIES)
    assert isinstance(done, Ok)
    _wait("the round of step 1", lambda: _round(scheduler, 1) is not None, procs, tmp_path)

    history = _history(scheduler)
    assert history is not None
    base, first = history.evals
    assert (base["step"], base["target_version"]) == (0, 0)
    assert (base["version_min"], base["version_max"]) == (0, 0)
    assert (first["step"], first["target_version"]) == (1, 1)
    # handed only to an engine holding version 1: every token of the round is version 1's
    assert (first["version_min"], first["version_max"]) == (1, 1)
    for r in (base, first):
        assert r["samples"] == size
        assert not r["partial"]
        assert r["accuracy"] is not None
        assert 0.0 <= r["accuracy"] <= 1.0
    # versions 0 and 1 hold the same bytes and decoding is greedy: the same answers
    assert first["reward_mean"] == base["reward_mean"]
    (row,) = [r for r in history.steps if r["step"] == 1]
    assert row["eval_accuracy"] == first["accuracy"]
    assert (row["eval_version_min"], row["eval_version_max"]) == (1, 1)
    assert row["eval_samples"] == size
    counters = history.counters
    assert counters["eval.samples"] == 2 * size
    assert counters["eval.rounds"] == 2
    # nothing of the eval reached the training pool: every pooled group is a training group
    assert counters["pooled_samples"] == 2 * counters["pooled_groups"]
    assert _status(scheduler)["samples"]["unreferenced"] == 0
