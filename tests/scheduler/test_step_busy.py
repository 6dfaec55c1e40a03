"""Per-step skewness (deltarl/scheduler/step_busy.py): recorded with each step in the store,
shown by the history, kept across retention's pruning, forgotten by a restore."""

from __future__ import annotations

from pathlib import Path

import pytest

from deltarl.scheduler.step_busy import skewness
from deltarl.scheduler.store import SchedulerStore
from tests.scheduler.helpers import Clock
from tests.scheduler.test_retention import step as retention_step


def step(store: SchedulerStore, n: int, busy: dict[str, float] | None) -> None:
    retention_step(store, n, busy=busy)


def test_skewness_is_max_over_mean_of_the_interval() -> None:
    assert skewness({"a": 1.0, "b": 1.0}, {"a": 4.0, "b": 2.0}) == pytest.approx(3 / 2)
    # an instance new since the first snapshot, or one whose counter went back (its engine
    # restarted), has no interval
    assert skewness({"a": 0.0, "b": 5.0}, {"a": 2.0, "b": 1.0, "c": 9.0}) is None
    assert skewness({"a": 0.0, "b": 5.0, "c": 0.0}, {"a": 2.0, "b": 1.0, "c": 6.0}) == (
        pytest.approx(6 / 4)
    )
    assert skewness({"a": 1.0, "b": 1.0}, {"a": 1.0, "b": 1.0}) is None  # nobody was busy


def test_history_shows_each_steps_skewness(tmp_path: Path) -> None:
    with SchedulerStore(tmp_path / "s.sqlite", clock=Clock()) as store:
        step(store, 1, {"a": 10.0, "b": 10.0})
        step(store, 2, {"a": 20.0, "b": 12.0})  # a: 10 s, b: 2 s -> 10 / 6
        step(store, 3, None)  # an older caller: no snapshot, no figure
        step(store, 4, {"a": 30.0, "b": 30.0})  # measured from step 2, the last snapshot
        got = [r["skewness"] for r in store.history()]
        assert got[0] is None
        assert got[2] is None
        assert got[1] == pytest.approx(10 / 6)
        assert got[3] == pytest.approx(18 / 14)  # a 10 s, b 18 s since step 2
        # history(last=1) finds the snapshot before its first row
        assert store.history(last=1)[0]["skewness"] == pytest.approx(18 / 14)


def test_pruning_keeps_the_base_of_the_next_steps_skewness(tmp_path: Path) -> None:
    with SchedulerStore(tmp_path / "s.sqlite", clock=Clock()) as store:
        for n, a in enumerate([1.0, 2.0, 3.0, 7.0], start=1):
            step(store, n, {"a": a, "b": float(n)})
        assert store.prune_steps(keep=1) == 3
        (row,) = store.history()
        assert row["step"] == 4
        assert row["skewness"] == pytest.approx(4 / 2.5)  # a 4 s, b 1 s since step 3


def test_restore_forgets_later_snapshots(tmp_path: Path) -> None:
    with SchedulerStore(tmp_path / "s.sqlite", clock=Clock()) as store:
        step(store, 1, {"a": 0.0, "b": 0.0})
        step(store, 2, {"a": 5.0, "b": 5.0})
        step(store, 3, {"a": 100.0, "b": 5.0})
        store.restore_to(1)
        step(store, 2, {"a": 3.0, "b": 1.0})
        history = store.history()
        assert [r["step"] for r in history] == [1, 2]
        assert history[1]["skewness"] == pytest.approx(3 / 2)
