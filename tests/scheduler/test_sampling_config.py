"""Sampling settings the trainer's log-probabilities cannot match are a configuration error."""

from __future__ import annotations

from pathlib import Path

import pytest

from deltarl.config import ConfigError, load
from deltarl.config.rl import Sampling, SchedulerConfig
from deltarl.daemons.scheduler import main as scheduler_main


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("temperature", 0.0),
        ("temperature", 0.7),
        ("temperature", 1.5),
        ("top_p", 0.9999),
        ("top_p", 0.5),
    ],
)
def test_sampling_other_than_temperature_and_top_p_one_is_refused(key: str, value: float) -> None:
    with pytest.raises(ValueError, match=rf"{key} must be 1.0.*importance ratio"):
        Sampling(**{key: value})
    assert Sampling(temperature=1.0, top_p=1.0, max_tokens=4).max_tokens == 4


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


def test_a_config_with_temperature_not_one_exits_78(tmp_path: Path) -> None:
    bad = _config(tmp_path, "temperature = 0.8\nmax_tokens = 8")
    with pytest.raises(ConfigError, match=r"temperature must be 1\.0"):
        load(SchedulerConfig, "scheduler", str(bad))
    assert scheduler_main(["--config", str(bad)]) == 78
    good = _config(tmp_path, "temperature = 1.0\ntop_p = 1\nmax_tokens = 8")
    assert load(SchedulerConfig, "scheduler", str(good)).sampling_params.max_tokens == 8
