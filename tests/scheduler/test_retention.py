"""Retention of the scheduler store (deltarl/scheduler/retention.py): S1-S3, batches, a crash.

The store is driven through its own transactions (issue, pool, ship, step_done, checkpoint),
as the service drives it; the crash test kills a real process with SIGKILL mid-prune.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from deltarl.config.errors import ConfigError
from deltarl.config.rl import SchedulerConfig
from deltarl.config.tables import build
from deltarl.rl.protocol import Batch, TakeBatch
from deltarl.scheduler.rows import PromptState
from deltarl.scheduler.store import SchedulerStore
from deltarl.transport.messages import Error
from tests.scheduler.helpers import Clock, make_service

GROUPS = 2  # groups per step


def step(
    store: SchedulerStore,
    n: int,
    *,
    checkpoint: bool = True,
    busy: dict[str, float] | None = None,
) -> None:
    """Prompts issued, pooled and shipped to step ``n`` (with the instances' ``busy``
    seconds), trained (and checkpointed)."""
    groups = store.issue(
        range(store.cursor, store.cursor + GROUPS),
        instance="a",
        session="s",
        weight_version=n - 1,
        lease_s=100.0,
    )
    for g in groups:
        data = f"samples of {g.group_id}".encode()
        store.pool(g.prompt_id, g.attempt, (f"d{g.group_id}", data), [1.0, 0.0], n - 1)
    assert len(store.ship(n, GROUPS, n - 1, max_lag=2, busy=busy).groups) == GROUPS
    assert store.step_done(n, n, {"loss": 0.1})
    if checkpoint:
        store.checkpoint(n)


def rows(path: Path) -> tuple[list[int], dict[int, tuple[str, int | None]]]:
    """(steps, prompt id -> (state, step)) straight from the file."""
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        steps = [s for (s,) in conn.execute("SELECT step FROM steps ORDER BY step")]
        prompts = {
            p: (s, t) for p, s, t in conn.execute("SELECT prompt_id, state, step FROM prompts")
        }
    return steps, prompts


def test_keeps_the_newest_steps_and_everything_after_the_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "s.sqlite"
    with SchedulerStore(path, clock=Clock()) as store:
        for n in range(1, 7):
            step(store, n)
        for n in range(7, 10):
            step(store, n, checkpoint=False)  # S1: the trainer may replay these
        assert store.prune_steps(keep=2) == 6  # 1..6 checkpointed; 8 and 9 are the newest 2
        assert store.prune_steps(keep=2) == 0
        assert store.pruned_through() == 6
        steps, prompts = rows(path)
        assert steps == [7, 8, 9]
        assert sorted(prompts) == list(range(12, 18))  # the prompts of steps 7-9, shipped
        assert {s for s, _ in prompts.values()} == {"shipped"}
        assert [r["step"] for r in store.history()] == [7, 8, 9]
        assert [r["step"] for r in store.history(last=2)] == [8, 9]
        # exact replay of a step after the checkpoint: the same groups, with their samples
        replay = store.ship(8, GROUPS, 9, max_lag=2)
        assert replay.replayed
        assert [g.prompt_id for g in replay.groups] == [14, 15]
        assert all(store.get_blob(g.samples_ref or "") for g in replay.groups)
        store.checkpoint(9)
        assert store.prune_steps(keep=2) == 1
        assert rows(path)[0] == [8, 9]


def test_only_trained_rows_go(tmp_path: Path) -> None:
    """S2: a row issued long ago (its instance lost it, the lease not yet out), a queued one
    and an abandoned one outlive every pruned step."""
    path = tmp_path / "s.sqlite"
    with SchedulerStore(path, clock=Clock()) as store:
        held = store.issue([0, 1, 2], instance="a", session="s", weight_version=0, lease_s=1e6)
        store.drop(1, held[1].attempt, "reward_error", 2, failure=True, max_failures=1)
        store.requeue_instance("a", "test", keep_session="s")  # nothing: same session
        store.drop(2, held[2].attempt, "lag_exceeded", 2)  # queued again
        for n in range(1, 6):
            step(store, n)
        assert store.prune_steps(keep=1) == 4
        _, prompts = rows(path)
        assert prompts[0] == ("issued", None)
        assert prompts[1] == ("abandoned", None)
        assert prompts[2][0] in ("queued", "trained")  # the cursor may have reissued it
        assert all(s != "trained" or t == 5 for s, t in prompts.values())
        assert store.counters()["abandoned_prompts"] == 1


def test_batches_are_bounded(tmp_path: Path) -> None:
    with SchedulerStore(tmp_path / "s.sqlite", clock=Clock()) as store:
        for n in range(1, 12):
            step(store, n)
        assert [store.prune_steps(keep=1, batch=4) for _ in range(4)] == [4, 4, 2, 0]
        assert store.pruned_through() == 10


def test_a_pruned_step_is_refused_not_refilled(tmp_path: Path) -> None:
    """S3: a trainer resumed from an old checkpoint asks for a pruned step: refused, and no
    new groups are shipped under its number."""

    async def go() -> None:
        svc, store, _ = make_service(tmp_path, keep_steps=1)
        for n in range(1, 4):
            step(store, n)
        svc.retain()
        assert store.pruned_through() == 2
        store.issue([6, 7], instance="a", session="s", weight_version=2, lease_s=100.0)
        for p in (6, 7):
            store.pool(p, 0, (f"d{p}", b"x"), [1.0], 2)
        late = await svc.take_batch(TakeBatch(step=2, groups=GROUPS, trainer_version=3))
        assert isinstance(late, Error)
        assert late.code == "checkpointed"
        assert "pruned" in late.message
        assert store.state_counts()["pooled"] == 2  # untouched
        fresh = await svc.take_batch(TakeBatch(step=4, groups=GROUPS, trainer_version=3))
        assert isinstance(fresh, Batch)
        assert [g["prompt_id"] for g in fresh.groups] == [6, 7]

    asyncio.run(go())


def test_keep_steps_is_validated() -> None:
    table = {"control": "ipc:///tmp/x.sock", "db": "/tmp/x.sqlite", "keep_steps": 0}
    with pytest.raises(ConfigError, match="keep_steps must be at least 1, got 0"):
        build(SchedulerConfig, "[daemons.scheduler]", table)
    assert SchedulerConfig(control="ipc:///tmp/x.sock", db=Path("x")).keep_steps == 1000


PRUNING_CHILD = textwrap.dedent(
    """
    import sys
    from deltarl.scheduler.store import SchedulerStore
    with SchedulerStore(sys.argv[1]) as store:
        print("READY", flush=True)
        while store.prune_steps(keep=1, batch=1):
            print("BATCH", flush=True)
    print("DONE", flush=True)
    """
)


def test_kill_9_mid_prune_leaves_a_consistent_store(tmp_path: Path) -> None:
    """Each batch is one transaction: whenever the pruning process dies, the steps kept are
    exactly those above ``pruned_through``, their prompts all there, none of the pruned."""
    path = tmp_path / "s.sqlite"
    total = 400
    with SchedulerStore(path, clock=Clock()) as store:
        for n in range(1, total + 1):
            step(store, n)
    rng = random.Random(7)
    seen = []
    for _ in range(5):
        child = subprocess.Popen(
            [sys.executable, "-c", PRUNING_CHILD, str(path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert child.stdout is not None
            assert child.stdout.readline().strip() == "READY", child.stderr
            # killed after a random number of committed batches, not a random time: a sleep
            # of up to 0.3 s let an idle machine prune all 399 before every kill
            for _ in range(rng.randint(1, 60)):
                if child.stdout.readline().strip() != "BATCH":
                    break
        finally:
            os.kill(child.pid, signal.SIGKILL)
            child.wait(timeout=10)
        with SchedulerStore(path, readonly=True) as reader:
            through = reader.pruned_through() or 0
        steps, prompts = rows(path)
        assert steps == list(range(through + 1, total + 1))
        assert sorted(prompts) == list(range(GROUPS * through, GROUPS * total))
        assert all(t is not None and t > through for _, t in prompts.values())
        seen.append(through)
    assert seen == sorted(seen)
    # the kills landed mid-prune (five kills after 1-60 batches each), not before or after
    assert any(0 < s < total - 1 for s in seen), seen
    with SchedulerStore(path) as store:  # and pruning carries on where the file says
        while store.prune_steps(keep=1):
            pass
        assert rows(path)[0] == [total]
        assert store.state_counts()[PromptState.TRAINED] == GROUPS
