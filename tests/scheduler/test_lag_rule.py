"""The lag rule (``lag_rule``, deltarl/scheduler/token_lag.py): which token of a group its lag
is measured from, and the age of the trained tokens recorded per step under either rule."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from deltarl.config.rl import SchedulerConfig
from deltarl.config.tables import build
from deltarl.rl.protocol import Batch, Heartbeat, TakeBatch
from deltarl.rl.samples import Sample
from deltarl.scheduler import token_lag
from deltarl.scheduler.store import SchedulerStore
from deltarl.transport.messages import Ok
from tests.scheduler.helpers import make_service, samples, submission, work


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def spanning(item: dict[str, Any], n: int, versions: list[int]) -> list[dict[str, Any]]:
    """``n`` completions whose 8 tokens were sampled by ``versions`` (a partial rollout that
    lived through refits)."""
    out = samples(item, n)
    for s in out:
        s["token_versions"] = list(versions)
    return out


async def submit_spanning(svc: Any, w: Any, versions: list[int]) -> None:
    for g in w.groups:
        reply = await svc.submit_group(
            submission(svc, "a", "s1", g["group_id"], spanning(g, g["n"], versions))
        )
        assert isinstance(reply, Ok), reply


def test_versions_of_counts_every_token_by_the_version_that_sampled_it() -> None:
    def sample(versions: list[int]) -> Sample:
        n = len(versions)
        return Sample([1], list(range(n)), [-1.0] * n, versions, "x", "stop")

    got = token_lag.versions_of([sample([3, 3, 4, 5]), sample([4, 4]), sample([])])
    assert got == {3: 2, 4: 3, 5: 1}
    assert sum(got.values()) == 6
    assert token_lag.versions_of([sample(list(np.int32([7, 7])))]) == {7: 2}


def test_an_unknown_lag_rule_is_refused() -> None:
    table = {"control": "ipc:///x", "db": "/x", "lag_rule": "newest"}
    with pytest.raises(ValueError, match="lag_rule"):
        build(SchedulerConfig, "scheduler", table)


@pytest.mark.parametrize(
    ("rule", "shipped", "dropped"),
    [("oldest_token", 0, 2), ("partial", 2, 0)],
)
def test_a_partial_rollout_ships_by_its_newest_token_only_under_partial(
    tmp_path: Path, rule: str, shipped: int, dropped: int
) -> None:
    """Lag bound 1, trainer at version 3. Both groups' tokens run from version 1 to 3 (they
    lived through two refits). Their oldest token is 2 behind: ``oldest_token`` drops them;
    their newest is current: ``partial`` ships them, and records what that cost: each sample's
    8 tokens are 3 at v1, 3 at v2 and 2 at v3, and the v1 ones are over the bound."""

    async def go() -> None:
        svc, store, _ = make_service(
            tmp_path, on_lag_exceeded="drop", max_policy_lag_steps=1, lag_rule=rule
        )
        w = await work(svc, n=2, version=1)
        await submit_spanning(svc, w, [1, 1, 1, 2, 2, 2, 3, 3])
        batch = await svc.take_batch(TakeBatch(step=1, groups=2, trainer_version=3))
        assert isinstance(batch, Batch)
        assert len(batch.groups) == shipped
        assert store.counters().get("dropped_groups.lag_exceeded", 0) == dropped
        if shipped:
            assert [g["lag"] for g in batch.groups] == [0, 0]
            row = store.history()[-1]
            # per group: 4 samples x (3 tokens at lag 2, 3 at lag 1, 2 at lag 0)
            assert row["token_lag_mean"] == pytest.approx((3 * 2 + 3 * 1) / 8)
            assert row["over_bound_token_ratio"] == pytest.approx(3 / 8)
            assert row["lag_max"] == 0
        # nothing is left noted for groups that left the pool
        with store._read() as conn:
            assert conn.execute("SELECT COUNT(*) FROM group_versions").fetchone()[0] == 0

    run(go())


def test_under_the_strict_rule_no_trained_token_is_over_the_bound(tmp_path: Path) -> None:
    async def go() -> None:
        svc, store, _ = make_service(tmp_path, on_lag_exceeded="drop", max_policy_lag_steps=2)
        w = await work(svc, n=2, version=1)
        await submit_spanning(svc, w, [1, 1, 2, 2, 2, 2, 3, 3])
        batch = await svc.take_batch(TakeBatch(step=1, groups=2, trainer_version=3))
        assert [g["lag"] for g in batch.groups] == [2, 2]  # from the oldest token
        row = store.history()[-1]
        assert row["over_bound_token_ratio"] == 0
        assert row["token_lag_mean"] == pytest.approx((2 * 2 + 4 * 1 + 2 * 0) / 8)

    run(go())


def test_partial_still_drops_a_group_whose_newest_token_is_over_the_bound(tmp_path: Path) -> None:
    """An instance that fell behind (never refitted) keeps sampling with old weights: its
    group's newest token is old, and the bound holds on it."""

    async def go() -> None:
        svc, store, _ = make_service(
            tmp_path, on_lag_exceeded="drop", max_policy_lag_steps=1, lag_rule="partial"
        )
        w = await work(svc, n=2, version=0)
        await submit_spanning(svc, w, [0] * 8)
        batch = await svc.take_batch(TakeBatch(step=1, groups=2, trainer_version=2))
        assert isinstance(batch, Batch)
        assert batch.groups == []
        assert store.counters()["dropped_groups.lag_exceeded"] == 2

    run(go())


def test_partial_never_aborts_a_held_group_as_doomed(tmp_path: Path) -> None:
    """Under ``oldest_token`` a held group whose oldest token is over the bound is aborted
    (test_dispatch_policies); under ``partial`` it goes on under the new weights."""

    async def go() -> None:
        svc, store, _ = make_service(
            tmp_path, max_policy_lag_steps=1, pool_capacity=16, lag_rule="partial"
        )
        w = await work(svc, n=1, version=0)
        gid = w.groups[0]["group_id"]
        svc.trainer_version = 5
        beat = Heartbeat("a", "s1", 5, held=[gid], reports_held=True, progress={gid: [0, 40]})
        assert isinstance(await svc.heartbeat(beat), Ok)
        assert "requeued.doomed" not in store.counters()

    run(go())


def test_the_figures_survive_a_reopen_and_go_with_a_restore(tmp_path: Path) -> None:
    async def go() -> None:
        svc, store, _ = make_service(
            tmp_path, on_lag_exceeded="drop", max_policy_lag_steps=1, lag_rule="partial"
        )
        for step in (1, 2):
            w = await work(svc, n=2, version=step)
            await submit_spanning(svc, w, [step - 1] * 4 + [step] * 4)
            batch = await svc.take_batch(TakeBatch(step=step, groups=2, trainer_version=step))
            assert len(batch.groups) == 2
        store.close()
        again = SchedulerStore(tmp_path / "sched.sqlite")
        rows = again.history()
        assert [r["token_lag_mean"] for r in rows] == [0.5, 0.5]
        assert [r["over_bound_token_ratio"] for r in rows] == [0.0, 0.0]
        again.restore_to(1)
        assert [r["step"] for r in again.history()] == [1]
        with again._read() as conn:
            assert conn.execute("SELECT COUNT(*) FROM step_token_lag").fetchone()[0] == 1
        again.close()

    run(go())


@pytest.mark.parametrize(("cap", "shipped"), [(1, 0), (2, 2), (None, 2)])
def test_partial_with_a_cap_drops_a_group_whose_oldest_token_is_over_it(
    tmp_path: Path, cap: int | None, shipped: int
) -> None:
    """``max_token_lag_steps``: the groups' newest tokens are current (within the bound of 1)
    and their oldest 2 behind the trainer. A cap of 1 drops them at ship time; 2, or none,
    ships them."""

    async def go() -> None:
        svc, store, _ = make_service(
            tmp_path,
            on_lag_exceeded="drop",
            max_policy_lag_steps=1,
            lag_rule="partial",
            max_token_lag_steps=cap,
        )
        w = await work(svc, n=2, version=1)
        await submit_spanning(svc, w, [1, 1, 1, 2, 2, 2, 3, 3])
        batch = await svc.take_batch(TakeBatch(step=1, groups=2, trainer_version=3))
        assert isinstance(batch, Batch)
        assert len(batch.groups) == shipped
        assert store.counters().get("dropped_groups.lag_exceeded", 0) == 2 - shipped

    run(go())


def test_partial_with_a_cap_aborts_a_held_group_past_it(tmp_path: Path) -> None:
    """A held group whose oldest token is already past the cap would be dropped at ship: it
    is aborted as doomed, as under ``oldest_token``; one within the cap goes on."""

    async def go() -> None:
        svc, store, _ = make_service(
            tmp_path,
            max_policy_lag_steps=1,
            pool_capacity=16,
            lag_rule="partial",
            max_token_lag_steps=3,
        )
        w = await work(svc, n=2, version=0)
        doomed, kept = (g["group_id"] for g in w.groups)
        svc.trainer_version = 5
        beat = Heartbeat(
            "a",
            "s1",
            5,
            held=[doomed, kept],
            reports_held=True,
            progress={doomed: [1, 40], kept: [2, 12]},  # 4 behind (> 3), and 3 (not)
        )
        reply = await svc.heartbeat(beat)
        assert reply.abort == [doomed]  # type: ignore[union-attr]
        assert store.counters()["requeued.doomed"] == 1

    run(go())


def test_a_cap_below_the_bound_is_refused() -> None:
    table = {
        "control": "ipc:///x",
        "db": "/x",
        "lag_rule": "partial",
        "max_policy_lag_steps": 2,
        "max_token_lag_steps": 1,
    }
    with pytest.raises(ValueError, match="max_token_lag_steps"):
        build(SchedulerConfig, "scheduler", table)
