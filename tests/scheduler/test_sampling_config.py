"""Sampling the trainer's log-probabilities cannot match is a configuration error; any positive
temperature is not."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from deltarl.config import ConfigError, load
from deltarl.config.rl import Sampling, SchedulerConfig
from deltarl.daemons.scheduler import main as scheduler_main


@pytest.mark.parametrize(
    ("key", "value", "why"),
    [
        ("temperature", 0.0, "must be positive and finite"),
        ("temperature", -0.5, "must be positive and finite"),
        ("temperature", math.inf, "must be positive and finite"),
        ("temperature", math.nan, "must be positive and finite"),
        ("top_p", 0.9999, "must be 1.0.*importance ratio"),
        ("top_p", 0.5, "must be 1.0.*importance ratio"),
    ],
)
def test_sampling_the_trainer_cannot_match_is_refused(key: str, value: float, why: str) -> None:
    with pytest.raises(ValueError, match=rf"{key} {why}"):
        Sampling(**{key: value})


@pytest.mark.parametrize("temperature", [0.3, 0.7, 1.0, 1.5])
def test_any_positive_temperature_is_taken(temperature: float) -> None:
    # The trainer divides its logits by the Batch's temperature (tests/trainer/test_grpo.py),
    # which matches what the engine records (tests/rollout/test_vllm_engine.py).
    assert Sampling(temperature=temperature, max_tokens=4).temperature == temperature


def _config(tmp: Path, sampling: str) -> Path:
    path = tmp / "deltarl.toml"
    path.write_text(f"""
[daemons.scheduler]
control = "ipc://{tmp}/s.sock"
db = "{tmp}/s.sqlite"

[daemons.scheduler.sampling]
{sampling}
""")
    return path


def test_a_config_with_greedy_or_top_p_sampling_exits_78(tmp_path: Path) -> None:
    for bad_table, why in (
        ("temperature = 0.0\nmax_tokens = 8", r"temperature must be positive"),
        ("top_p = 0.9\nmax_tokens = 8", r"top_p must be 1\.0"),
    ):
        bad = _config(tmp_path, bad_table)
        with pytest.raises(ConfigError, match=why):
            load(SchedulerConfig, "scheduler", str(bad))
        assert scheduler_main(["--config", str(bad)]) == 78
    good = _config(tmp_path, "temperature = 0.8\ntop_p = 1\nmax_tokens = 8")
    sampling = load(SchedulerConfig, "scheduler", str(good)).sampling_params
    assert (sampling.temperature, sampling.max_tokens) == (0.8, 8)
