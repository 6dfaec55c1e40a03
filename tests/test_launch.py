"""``DaemonGroup`` with real daemons: start, status, waves of drain, a death, a timeout, and
the daemons ending with a harness killed without stopping them."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deltarl.launch import DaemonDied, DaemonGroup, WaitTimeout
from deltarl.ops.parent_death import HARNESS_PID_ENV
from deltarl.transport.messages import Drain, Ok, Status


def _group(tmp: Path, *names: str, bad: str | None = None) -> DaemonGroup:
    tables = []
    for name in names:
        lag = '"wait"' if name == bad else '"drop"'  # "wait" is refused: exit 78
        tables.append(f"""
[daemons.{name}]
control = "ipc://{tmp}/{name}.sock"
db = "{tmp}/{name}.sqlite"
on_lag_exceeded = {lag}
""")
    config = tmp / "deltarl.toml"
    config.write_text("".join(tables))
    return DaemonGroup(tmp, config, {n: f"ipc://{tmp}/{n}.sock" for n in names})


@pytest.fixture
def tmp(tmp_path: Path) -> Path:
    return tmp_path


def test_daemons_start_answer_and_stop_in_waves(tmp: Path) -> None:
    group = _group(tmp, "first", "second")
    try:
        for name in ("first", "second"):
            group.start(name, daemon="scheduler")
        group.wait("both answer", lambda: all(group.status(n) for n in ("first", "second")), 60)
        status = group.status("first")
        assert isinstance(status, Status)
        assert status.fields["runtime"]["pid"] == group.procs["first"].pid
        codes = group.stop(waves=[["second"]], timeout_s=60)
        stopped = list(codes)
    finally:
        group.stop(timeout_s=10)
    assert codes == {"second": 0, "first": 0}
    assert stopped == ["second", "first"]  # the named wave first, then the rest
    assert group.log("first").stat().st_size > 0


def test_a_daemon_that_exits_is_reported_not_waited_for(tmp: Path) -> None:
    group = _group(tmp, "good", "broken", bad="broken")
    try:
        group.start("good", daemon="scheduler")
        # Up before the broken one starts: a SIGTERM that lands while a daemon still imports
        # (before its handler is installed) ends it with -15 instead of a drain.
        group.wait("good answers", lambda: group.status("good") is not None, 60)
        group.start("broken", daemon="scheduler")
        with pytest.raises(DaemonDied, match="broken exited with status 78"):
            group.wait("something that never happens", lambda: False, 60)
        assert "on_lag_exceeded" in group.tail("broken")
        assert "broken" in group.logs()
    finally:
        codes = group.stop(timeout_s=30)
    assert codes == {"good": 0, "broken": 78}


def test_a_wait_runs_out_and_a_drain_is_answered(tmp: Path) -> None:
    group = _group(tmp, "only")
    try:
        group.start("only", daemon="scheduler")
        group.wait("it answers", lambda: group.status("only") is not None, 60)
        started = time.monotonic()
        with pytest.raises(WaitTimeout, match="waiting for the impossible"):
            group.wait("the impossible", lambda: False, 0.5)
        assert time.monotonic() - started < 5
        reply = group.request("only", Drain())
        assert isinstance(reply, Ok), reply
        assert reply.detail.startswith("draining")
        assert group.procs["only"].wait(60) == 0  # a drained daemon exits by itself
    finally:
        group.stop(timeout_s=10)
    assert group.request("only", Drain(), timeout_s=0.3) is None  # nobody answers now


def test_kill_reports_the_signal(tmp: Path) -> None:
    group = _group(tmp, "victim")
    try:
        group.start("victim", daemon="scheduler")
        group.wait("it answers", lambda: group.status("victim") is not None, 60)
        assert group.kill("victim") == -9
        assert group.dead() == "victim exited with status -9"
    finally:
        group.stop(timeout_s=10)


HARNESS = """
import sys, time
from pathlib import Path
from tests.test_launch import _group
tmp = Path(sys.argv[1])
group = _group(tmp, "child")
group.start("child", daemon="scheduler")
group.wait("it answers", lambda: group.status("child") is not None, 120)
print(group.procs["child"].pid, flush=True)
time.sleep(600)  # killed by the test, never stopping its group
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_a_killed_harness_takes_its_daemons_with_it(tmp: Path) -> None:
    # the fault: the process that started the daemons dies by SIGKILL, with no cleanup of its
    # own (a test's timeout killing a bench did that, and its daemons ran on for good)
    root = Path(__file__).resolve().parents[1]
    harness = subprocess.Popen(
        [sys.executable, "-c", HARNESS, str(tmp)], cwd=root, stdout=subprocess.PIPE, text=True
    )
    try:
        assert harness.stdout is not None
        pid = int(harness.stdout.readline())
        assert _alive(pid)
        harness.kill()
        harness.wait(10)
        deadline = time.monotonic() + 60
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid), "the daemon outlived the harness that started it"
        # it was told by SIGTERM, so it drained and stopped as on a shutdown
        assert "SIGTERM" in (tmp / "child.log").read_text()
    finally:
        harness.kill()
        with contextlib.suppress(ProcessLookupError, UnboundLocalError):
            os.kill(pid, signal.SIGKILL)


def test_a_daemon_whose_harness_is_gone_does_not_start(tmp: Path) -> None:
    # the harness died before the daemon could ask to be signalled: it would never be told
    config = tmp / "deltarl.toml"
    config.write_text(f'[daemons.late]\ncontrol = "ipc://{tmp}/late.sock"\ndb = "{tmp}/l.sqlite"\n')
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "deltarl.cli",
            "scheduler",
            "--config",
            str(config),
            "--name",
            "late",
        ],
        env={**os.environ, HARNESS_PID_ENV: "1"},  # not this daemon's parent
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 1
    assert "the process that started this daemon (pid 1) has exited" in out.stderr
