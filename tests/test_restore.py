"""The restore drill on the real pipeline (``deltarl up``'s daemons, vLLM on the CPU): the
trainer is stopped after step 7, the scheduler forgets the steps after 5 (``deltarl ctl
scheduler restore --to 5``), the trainer's checkpoint of step 5 becomes the one it resumes
from under a new version number (``deltarl trainer-restore``), and the run goes on to step
12. Checked: every version number is new (none names two weights), the engine loads and
verifies them, no prompt is trained twice in the final history, and every prompt trained in
the forgotten steps is trained again or still on its way."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from deltarl import ctl, up
from deltarl.engine.weight_store import WeightStore
from tests.installed import require_vllm

require_vllm()

pytestmark = pytest.mark.timeout(900)


@pytest.fixture
def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[up.Run]:
    monkeypatch.setenv("DELTARL_HOME", str(tmp_path / "home"))
    r = up.prepare(up._parse(["--steps", "12", "--workdir", str(tmp_path / "run")]))
    try:
        yield r
    finally:
        r.stop(timeout=30)
        subprocess.run(["rm", "-rf", str(r.shm)], check=False)


def _wait(r: up.Run, what: str, cond: Callable[[], bool], timeout: float = 400) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.3)
    tails = "\n".join(f"--- {d}\n{r.tail(d)}" for d in r.order)
    raise AssertionError(f"timed out waiting for {what}\n{tails}")


def _trainer(r: up.Run) -> dict[str, object]:
    return r.status("trainer") or {}


def _trained_by_step(r: up.Run) -> dict[str, int]:
    """Prompt id -> the step the trainer reported training it in (StepDone metrics)."""
    history = r.history()
    assert history is not None
    trained: dict[str, int] = {}
    for row in history.steps:
        for group in (row.get("metrics") or {}).get("groups") or {}:
            prompt = group.split(".")[0]
            assert prompt not in trained, f"prompt {prompt} in steps {trained[prompt]} and {row}"
            trained[prompt] = int(row["step"])
    return trained


def test_restore_to_an_older_checkpoint(run: up.Run, capsys: pytest.CaptureFixture[str]) -> None:
    for daemon in run.order:
        run.start(daemon)
    _wait(run, "step 7", lambda: int(_trainer(run).get("step") or 0) >= 7)
    # Stop the trainer as systemctl stop would: it finishes its step in flight and saves it.
    proc = run.procs.pop("trainer")
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(120) == 0
    before = _trained_by_step(run)
    forgotten = {p for p, s in before.items() if s > 5}
    assert forgotten
    with WeightStore.open("published", root=run.shm, readonly=True) as published:
        highest = published.active_version  # the trainer's last (the step it finished)
    assert highest is not None
    assert highest >= 7

    assert ctl.main(["scheduler", "restore", "--to", "5", "--config", str(run.config)]) == 0
    assert "restored to step 5" in capsys.readouterr().out
    restored = subprocess.run(
        [sys.executable, "-m", "deltarl.cli", "trainer-restore", "--config", str(run.config),
         "--step", "5"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert restored.returncode == 0, restored.stderr
    assert f"resumes from step 5 as version {highest + 1}" in restored.stdout

    run.start("trainer")
    _wait(run, "step 12 after the restore", lambda: int(_trainer(run).get("step") or 0) >= 12)
    # Version numbers only went up: step 12 is version highest + 1 + 7.
    assert _trainer(run)["version"] == highest + 1 + 7
    _wait(
        run,
        "the engine on the newest version",
        lambda: (run.status("rollout") or {}).get("weight_version") == highest + 8,
    )
    engine = run.status("rollout") or {}
    assert engine["mismatches"] == 0  # every load proven against its manifest

    after = _trained_by_step(run)  # asserts: no prompt in two steps
    assert sorted(set(after.values())) == list(range(1, 13))
    # Steps 1-5 kept their prompts; the forgotten steps' prompts were trained again in the
    # new steps 6-12, or are still on their way (queued, issued or pooled).
    assert {p: s for p, s in after.items() if s <= 5} == {p: s for p, s in before.items() if s <= 5}
    with sqlite3.connect(f"file:{run.directory}/scheduler.sqlite?mode=ro", uri=True) as conn:
        state = dict(conn.execute("SELECT CAST(prompt_id AS TEXT), state FROM prompts"))
    for prompt in forgotten:
        assert prompt in after or state[prompt] in ("queued", "issued", "pooled"), prompt
    codes = run.stop()
    assert set(codes.values()) == {0}, codes
