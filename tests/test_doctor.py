"""``deltarl doctor`` against real daemon processes (the synthetic trainer, the export and
apply agents, a reward daemon), healthy and then with one killed; and its version check."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson

from deltarl.doctor import check_refit, check_versions
from deltarl.transport.messages import Status
from tests.daemons.pipeline import Pipeline, default_tables, endpoint


def _doctor(config: Path, *args: str) -> tuple[int, dict[str, Any]]:
    proc = subprocess.run(
        [sys.executable, "-m", "deltarl.cli", "doctor", "--config", str(config), "--json", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    report = orjson.loads(proc.stdout)
    return proc.returncode, report


def _by_check(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["check"]: c for c in report["checks"]}


def test_doctor_on_a_healthy_pipeline_then_with_a_daemon_down(tmp_path: Path) -> None:
    tables = default_tables(tmp_path, "shm")
    tables["daemons"]["reward"] = {"control": endpoint(tmp_path, "reward")}
    pipe = Pipeline(tmp_path, tables)
    try:
        for daemon in ("apply", "export", "trainer", "reward"):
            pipe.start(daemon)
        pipe.wait("2 versions applied", lambda: pipe.status("apply")["applied"] >= 2)
        code, report = _doctor(
            pipe.config, "--exercise", "--reward-requests", "32", "--reward-p99", "10"
        )
        checks = _by_check(report)
        assert code == 0, [c for c in report["checks"] if c["status"] not in ("pass", "skip")]
        assert report["ok"] is True
        for name in ("config", "reachable", "versions", "refit", "refit (exercised)", "reward"):
            assert checks[name]["status"] == "pass", checks[name]
        assert "deltarl " in checks["versions"]["detail"]
        assert "applied and verified end to end" in checks["refit (exercised)"]["detail"]
        assert "over 32 calls" in checks["reward"]["detail"]
        assert checks["lengths"]["status"] == "skip"  # no scheduler in this pipeline
        assert checks["link"]["status"] == "skip"

        pipe.kill("apply")
        code, report = _doctor(pipe.config, "--timeout", "1")
        checks = _by_check(report)
        assert code == 1
        assert checks["reachable"]["status"] == "fail"
        assert checks["reachable"]["detail"].startswith("apply: down")
        assert checks["reachable"]["hint"]
    finally:
        pipe.kill_all()


def test_versions_that_differ_between_hosts_fail() -> None:
    def status(torch: str) -> Status:
        versions = {"deltarl": "0.1", "torch": torch, "vllm": None, "python": "3.11.7"}
        return Status("apply", "running", {"runtime": {"versions": versions}})

    same = check_versions({"a": status("2.13.0"), "b": status("2.13.0"), "c": "down"})
    assert same.status == "pass"
    differ = check_versions({"a": status("2.13.0"), "b": status("2.14.1")})
    assert differ.status == "fail"
    assert differ.detail == "torch: 2.13.0 on a, 2.14.1 on b"


def test_refit_passes_an_agent_ahead_of_the_export_agent_and_fails_one_behind() -> None:
    # with the pipeline running, the apply agent may have committed version 8 while the
    # export agent's answer still counts 7 as its last (its acknowledgement on the way)
    def statuses(active: int | None) -> dict[str, Status]:
        export = Status("export", "running", {"last": {"version": 7, "outcome": "active"}})
        return {"export": export, "apply": Status("apply", "running", {"active_version": active})}

    assert check_refit(statuses(7)).status == "pass"
    assert check_refit(statuses(8)).status == "pass"
    behind = check_refit(statuses(6))
    assert behind.status == "fail"
    assert behind.detail == "version 7 was sent; apply holds 6"
    assert check_refit(statuses(None)).status == "fail"


def test_a_table_that_does_not_load_fails_config(tmp_path: Path) -> None:
    bad = tmp_path / "deltarl.toml"
    bad.write_text("[daemons.apply]\ncontrol = 3\n")
    code, report = _doctor(bad)
    assert code == 1
    assert report["ok"] is False
    checks = _by_check(report)
    assert checks["config"]["status"] == "fail"
    assert "control must be str" in checks["config"]["detail"]
    assert checks["reachable"]["status"] == "skip"


def test_doctor_measures_a_stream_link_with_the_pipeline_running(tmp_path: Path) -> None:
    pipe = Pipeline(tmp_path, "stream")
    try:
        for daemon in ("apply", "export", "trainer"):
            pipe.start(daemon)
        pipe.wait("2 versions applied", lambda: pipe.status("apply")["applied"] >= 2)
        code, report = _doctor(pipe.config, "--link-seconds", "1")
        link = _by_check(report)["link"]
        assert code == 0, [c for c in report["checks"] if c["status"] not in ("pass", "skip")]
        assert link["status"] == "pass", link
        assert link["detail"].startswith("export -> 127.0.0.1:")
        assert "Mbit/s on one connection" in link["detail"]
        # The probe delivered nothing: the pipeline goes on applying versions.
        applied = pipe.status("apply")["applied"]
        pipe.wait("a version after the probe", lambda: pipe.status("apply")["applied"] > applied)
    finally:
        pipe.kill_all()
