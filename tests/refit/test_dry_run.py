"""``deltarl export-dry-run`` against a real (synthetic) trainer daemon publishing versions:
sizes and changed ratios reported, every delta applied bit-exact to a copy, nothing sent."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import orjson

from deltarl.transport.control import request_sync
from deltarl.transport.messages import Ok, Pause
from tests.daemons.pipeline import Pipeline


def _dry_run(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "deltarl.cli", "export-dry-run", "--config", str(config), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_a_dry_run_measures_deltas_and_sends_nothing(tmp_path: Path) -> None:
    pipe = Pipeline(tmp_path)
    try:
        pipe.start("trainer")  # no export or apply agent: nothing could receive anything
        pipe.wait("a version published", lambda: pipe.status("trainer")["version"] is not None)
        config = tmp_path / "deltarl.toml"
        proc = _dry_run(config, "--versions", "3", "--json", "--timeout", "120")
        assert proc.returncode == 0, proc.stderr
        report = orjson.loads(proc.stdout)
        assert report["ok"] is True
        assert report["sent"] == 0
        rows = report["versions"]
        assert [r["kind"] for r in rows] == ["full", "delta", "delta"]
        assert all(r["bit_exact"] for r in rows)
        for before, after in itertools.pairwise(rows):
            assert after["base"] == before["version"] < after["version"]
        for r in rows[1:]:
            assert 0 < r["changed"] < r["elements"]
            assert r["wire_bytes"] < rows[0]["wire_bytes"]  # a delta is smaller than full
            assert r["most_changed"]
            assert r["most_changed"][0]["changed_ratio"] >= r["changed_ratio"]
        # No manifest store was written: nothing was recorded as sent.
        assert not (tmp_path / "versions.sqlite").exists()

        text = _dry_run(config, "--versions", "2")
        assert text.returncode == 0, text.stderr
        assert "nothing was sent: a dry run" in text.stdout
    finally:
        pipe.kill_all()


def test_a_trainer_that_publishes_nothing_times_out(tmp_path: Path) -> None:
    pipe = Pipeline(tmp_path)
    try:
        pipe.start("trainer")
        pipe.wait("a version published", lambda: pipe.status("trainer")["version"] is not None)
        assert request_sync(pipe.endpoint("trainer"), Pause(), 2.0) == Ok("paused")
        pipe.wait("the trainer's last step", lambda: not pipe.status("trainer")["stepping"])
        proc = _dry_run(tmp_path / "deltarl.toml", "--versions", "3", "--timeout", "2")
        assert proc.returncode == 3
        assert "1 of 3 versions published within 2 s" in proc.stderr
    finally:
        pipe.kill_all()


def test_no_published_store_is_a_config_error(tmp_path: Path) -> None:
    pipe = Pipeline(tmp_path)  # writes the config; starts nothing
    proc = _dry_run(pipe.config, "--versions", "1")
    assert proc.returncode == 2
    assert "deltarl export-dry-run:" in proc.stderr
