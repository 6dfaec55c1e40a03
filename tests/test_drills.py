"""``deltarl drill rollback`` against real daemon processes (the synthetic trainer, the export
and apply agents): back one version and forward again, bit-exact at the end; and refused,
saying why, without an apply agent."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson

from deltarl.transport.control import request_sync
from deltarl.transport.messages import GetStatus, Status
from tests.daemons.pipeline import Pipeline, assert_bit_exact


def _drill(config: Path, *args: str) -> tuple[int, dict[str, Any]]:
    proc = subprocess.run(
        [sys.executable, "-m", "deltarl.cli", "drill", "rollback", "--config", str(config),
         "--json", *args],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    return proc.returncode, orjson.loads(proc.stdout)


def test_the_rollback_drill_goes_back_and_forward(tmp_path: Path) -> None:
    pipe = Pipeline(tmp_path)
    try:
        for daemon in ("apply", "export", "trainer"):
            pipe.start(daemon)
        pipe.wait("3 versions applied", lambda: pipe.status("apply")["applied"] >= 3)
        code, report = _drill(pipe.config, "--timeout", "60")
        assert code == 0, report
        assert report["ok"] is True
        assert report["rolled_back_to"] < report["newest"]
        assert report["rollback_s"] >= 0
        assert report["forward_s"] >= 0
        # The trainer was running: the drill paused it and resumed it.
        pipe.wait(
            "a version after the drill",
            lambda: pipe.status("apply")["active_version"] > report["newest"],
        )
        version = pipe.quiesce()
        assert_bit_exact(tmp_path, version)
    finally:
        pipe.kill_all()


def test_a_drill_without_an_apply_agent_fails_and_says_why(tmp_path: Path) -> None:
    pipe = Pipeline(tmp_path)
    try:
        for daemon in ("export", "trainer"):  # the apply agent of the config is down
            pipe.start(daemon)
        pipe.wait("the trainer up", lambda: pipe.status("trainer") is not None)
        code, report = _drill(pipe.config, "--timeout", "10")
        assert code == 1
        assert report == {
            "ok": False,
            "error": "the drill needs an export agent and an apply agent answering",
        }
        # Refused before it touched anything: the trainer was not paused.
        status = request_sync(pipe.endpoint("trainer"), GetStatus(), 2.0)
        assert isinstance(status, Status)
        assert status.state == "running"
    finally:
        pipe.kill_all()
