"""The dispatch policies (fifo, least_requests, sync, deltarl) and a plan loaded by the scheduler:
its order, its binding to the store, its online correction and the figures it records."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from deltarl.rl.protocol import Beat, GetWork, Heartbeat, StepDone, TakeBatch, Work
from deltarl.rl.task import RepeatLetter
from deltarl.scheduler.length_predictor import LengthPredictor, Record, load_history, prompt_key
from deltarl.scheduler.plan import PlanError, build_plan, write_plan
from deltarl.scheduler.policy import (
    Candidates,
    InstanceLoad,
    PredictedWait,
    WorkRequest,
    make_policy,
)
from deltarl.scheduler.rows import PromptState
from deltarl.transport.messages import Ok
from tests.scheduler.helpers import make_service, submit_all, work

TASK = RepeatLetter(seed=0)
LENGTHS = {"a": 100, "b": 10, "c": 50, "d": 20}
"""The history's completion tokens per sample for each letter's prompt."""


def run(coro):
    return asyncio.run(coro)


def write_a_plan(path: Path, size: int = 16, **kw) -> Path:
    records = [
        Record("default", prompt_key(t), t, (LENGTHS[t[13]],) * 4)
        for t in (RepeatLetter.TEMPLATE.format(x) for x in "abcd")
    ]
    args = {
        "task": "default",
        "seed": 0,
        "size": size,
        "prompt": TASK.prompt,
        "predictor": LengthPredictor(records, "default", default_tokens=30),
        "group_size": 4,
        "groups_per_step": 2,
        "instances": 2,
        "max_batch_tokens": 4096,
        "max_skew": 10.0,
    }
    args.update(kw)
    write_plan(build_plan(**args), path)
    return path


# -- the policies alone --------------------------------------------------------------------


def test_every_policy_is_known_by_name():
    assert {make_policy(n).name for n in ("fifo", "least_requests", "sync", "deltarl")} == {
        "fifo",
        "least_requests",
        "sync",
        "deltarl",
    }
    assert make_policy("sync").max_lag == 0
    with pytest.raises(ValueError, match="known"):
        make_policy("nope")
    # the scheduler's lookahead sets deltarl's window and nothing else's
    assert make_policy("deltarl", 512).lookahead == 512
    assert make_policy("deltarl", 512).name == "deltarl"
    assert make_policy("fifo", 512).lookahead == 0


def test_the_scheduler_dispatches_with_its_configured_lookahead(tmp_path):
    svc, _, _ = make_service(tmp_path, policy="deltarl", lookahead=7)
    assert svc.policy.lookahead == 7
    (tmp_path / "neg").mkdir()
    with pytest.raises(ValueError, match="lookahead"):
        make_service(tmp_path / "neg", policy="deltarl", lookahead=-1)


def test_predicted_wait_gives_the_asker_the_longest_first_while_its_wait_is_least():
    policy = PredictedWait()
    predicted = {0: 10.0, 1: 400.0, 2: 30.0, 3: 200.0}
    loads = [InstanceLoad("a", 0, tokens_per_s=10.0), InstanceLoad("b", 0, tokens_per_s=10.0)]
    got = policy.choose(WorkRequest("a", 4, 4), loads, Candidates([], range(4), predicted))
    # LPT: 400 to a (ties go to the asker), 200 to b, 30 to b (200 < 400), 10 to b.
    assert got == [1]
    busy = [InstanceLoad("a", 1, tokens_per_s=10.0, predicted_tokens=400.0), loads[1]]
    got_b = policy.choose(WorkRequest("b", 4, 4), busy, Candidates([], [0, 2, 3], predicted))
    assert got_b == [3, 2, 0]


def test_predicted_wait_gives_a_slower_instance_less():
    policy = PredictedWait()
    predicted = dict.fromkeys(range(12), 100.0)
    loads = [InstanceLoad("fast", 0, tokens_per_s=30.0), InstanceLoad("slow", 0, tokens_per_s=10.0)]
    fast = policy.choose(WorkRequest("fast", 12, 12), loads, Candidates([], range(12), predicted))
    slow = policy.choose(WorkRequest("slow", 12, 12), loads, Candidates([], range(12), predicted))
    assert len(fast) == 9
    assert len(slow) == 3


def test_predicted_wait_serves_queued_prompts_before_fresh_ones():
    policy = PredictedWait()
    predicted = {7: 1.0, 8: 500.0}
    got = policy.choose(
        WorkRequest("a", 1, 1), [InstanceLoad("a", 0)], Candidates([7], [8], predicted)
    )
    assert got == [7]


# -- the synchronous baseline in the service --------------------------------------------------


def test_sync_issues_one_step_then_waits_for_training_and_the_refit(tmp_path):
    async def go():
        svc, _, _ = make_service(tmp_path, policy="sync", on_lag_exceeded="drop")
        w = await work(svc, n=8, version=0)
        assert len(w.groups) == 2  # one step: groups_per_step
        assert (await work(svc, n=8, version=0)).groups == []  # the step is not trained yet
        await submit_all(svc, w, version=0)
        assert len((await svc.take_batch(TakeBatch(1, 2, trainer_version=0))).groups) == 2
        assert (await work(svc, n=8, version=0)).groups == []  # training
        assert isinstance(await svc.step_done(StepDone(1, 1)), Ok)
        assert (await work(svc, n=8, version=0)).groups == []  # not refitted
        assert len((await work(svc, n=8, version=1)).groups) == 2

    run(go())


# -- a plan in the scheduler ----------------------------------------------------------------


def test_a_plan_sets_the_order_and_the_store_is_bound_to_it(tmp_path):
    plan = write_a_plan(tmp_path / "plan.json")

    async def go():
        svc, store, _ = make_service(tmp_path, plan=plan, policy="deltarl")
        w = await work(svc, n=2)
        for g in w.groups:
            assert g["prompt"] == TASK.prompt(svc.plan.plan.order[g["prompt_id"]])
        assert store.meta("plan") is not None
        store.close()
        with pytest.raises(PlanError, match="positions of the plan"):
            make_service(tmp_path)
        other = write_a_plan(tmp_path / "other.json", size=12)
        with pytest.raises(PlanError, match="was started on the plan"):
            make_service(tmp_path, plan=other)

    run(go())


def test_a_plan_is_refused_on_a_store_that_issued_without_one(tmp_path):
    async def go():
        svc, store, _ = make_service(tmp_path)
        await work(svc, n=2)
        store.close()
        with pytest.raises(PlanError, match="without a plan"):
            make_service(tmp_path, plan=write_a_plan(tmp_path / "plan.json"))

    run(go())


@pytest.mark.parametrize(
    ("override", "word"),
    [({"group_size": 8}, "group_size"), ({"seed": 3}, "seed"), ({"dataset_size": 5}, "size")],
)
def test_a_plan_made_for_another_scheduler_is_refused(tmp_path, override, word):
    with pytest.raises(PlanError, match=word):
        make_service(tmp_path, plan=write_a_plan(tmp_path / "plan.json"), **override)


def test_a_plan_ends_the_dataset_at_its_size(tmp_path):
    async def go():
        svc, store, _ = make_service(tmp_path, plan=write_a_plan(tmp_path / "p.json", size=3))
        got = []
        for _ in range(4):
            w = await work(svc, n=2)
            got += [g["prompt_id"] for g in w.groups]
            await submit_all(svc, w)
            await svc.take_batch(TakeBatch(len(got), 2, trainer_version=0))
        assert sorted(got) == [0, 1, 2]
        assert store.cursor == 3

    run(go())


def test_finished_groups_correct_the_predictions_and_their_error_is_recorded(tmp_path):
    """The plan predicts 10-100 tokens a sample; every group comes back with 8. Each pooled
    group pulls its bucket's correction down; each step records the prediction error of its
    groups (the plan's alone, and as dispatched); a restart rebuilds the correction."""
    plan = write_a_plan(tmp_path / "plan.json", size=16)

    async def go():
        svc, store, _ = make_service(tmp_path, plan=plan, policy="deltarl", pool_capacity=16)
        for step in (1, 2, 3):
            await submit_all(svc, await work(svc, n=2))
            batch = await svc.take_batch(TakeBatch(step, 2, trainer_version=0))
            assert len(batch.groups) == 2
        assert all(f < 1.0 for f, n in zip(svc.plan.factors, svc.plan.observed, strict=True) if n)
        rows = {r["step"]: r for r in store.history()}
        assert rows[1]["predicted_groups"] == 2
        assert rows[1]["length_error"] <= rows[1]["length_error_plan"]
        assert rows[3]["length_error"] < rows[3]["length_error_plan"]  # learned: closer
        factors = list(svc.plan.factors)
        store.close()
        svc2, _, _ = make_service(tmp_path, plan=plan, policy="deltarl")
        assert svc2.plan.factors == pytest.approx(factors)
        assert svc2.status_fields()["plan"]["observed"] == svc.plan.observed

    run(go())


def test_the_history_records_every_groups_lengths_with_or_without_a_plan(tmp_path):
    """Without a plan nothing is predicted before the run's history can (run_lengths.py), but
    the lengths are kept for a later plan, and the
    step's sorting wait is its groups' pool wait over their generation time: 5 s / 10 s."""

    async def go():
        svc, store, clock = make_service(tmp_path)
        w = await work(svc, n=2)
        clock.advance(10.0)
        await submit_all(svc, w)
        clock.advance(5.0)
        await svc.take_batch(TakeBatch(1, 2, trainer_version=0))
        step = store.history()[0]
        assert step["predicted_groups"] == 0
        assert step["length_error"] is None
        assert step["sorting_wait"] == pytest.approx(0.5)
        store.close()
        records = load_history([tmp_path / "sched.sqlite"])
        assert [r.outputs for r in records] == [(8, 8, 8, 8)] * 2
        assert records[0].text.startswith("Say a lot of")

    run(go())


def test_deltarl_without_a_plan_still_balances_by_throughput(tmp_path):
    async def go():
        svc, _, _ = make_service(tmp_path, policy="deltarl", pool_capacity=16)
        await svc.heartbeat(Heartbeat("fast", "s", weight_version=0, tokens_per_s=30.0))
        await svc.heartbeat(Heartbeat("slow", "s", weight_version=0, tokens_per_s=10.0))
        fast = await svc.get_work(GetWork("fast", "s", max_groups=8, weight_version=0))
        slow = await svc.get_work(GetWork("slow", "s", max_groups=8, weight_version=0))
        assert isinstance(fast, Work)
        assert isinstance(slow, Work)
        # Of the 16 the pool allows, fast gets its cap (8: it would get 12), slow what falls
        # to it of the 8 left next to fast's 8 held at three times its rate: 3, and the 4th
        # on the tie at 0.3 s of predicted wait each (a tie goes to the asker).
        assert (len(fast.groups), len(slow.groups)) == (8, 4)
        assert len(svc.store.groups(PromptState.ISSUED)) == len(fast.groups) + len(slow.groups)

    run(go())


# -- stale work: groups that can no longer ship are stopped -----------------------------------


def test_a_held_group_over_the_lag_bound_is_requeued_aborted_and_its_tokens_wasted(tmp_path):
    """Lag bound 1. Two groups issued at version 0; the trainer reaches version 2. The one
    whose oldest token is version 0 is doomed (2 - 0 > 1): the heartbeat answers Beat with
    it, it is queued again as a new attempt, its late submit is refused, and its 40 tokens so
    far are wasted in the next step. The other's oldest token is version 1: it stays."""

    async def go():
        svc, store, _ = make_service(tmp_path, max_policy_lag_steps=1, pool_capacity=16)
        w = await work(svc, n=2, version=0)
        doomed, kept = (g["group_id"] for g in w.groups)
        svc.trainer_version = 2
        beat = Heartbeat(
            "a",
            "s1",
            weight_version=2,
            held=[doomed, kept],
            reports_held=True,
            progress={doomed: [0, 40], kept: [1, 12], "e3.0.0": [0, 5]},
        )
        reply = await svc.heartbeat(beat)
        assert isinstance(reply, Beat)
        assert reply.abort == [doomed]
        assert store.counters()["requeued.doomed"] == 1
        prompt = int(doomed.split(".")[0])
        assert store.group(prompt).state == PromptState.QUEUED
        assert store.group(prompt).attempt == 1
        late = await submit_all(svc, Work([w.groups[0]]), version=0)
        assert late[0].code == "stale_group"
        # Heard again: nothing more to abort.
        assert isinstance(await svc.heartbeat(beat), Ok)
        # The waste is the next step's.
        await submit_all(svc, await work(svc, n=2, version=2), version=2)
        await svc.take_batch(TakeBatch(1, 2, trainer_version=2))
        row = store.history()[0]
        assert (row["wasted_tokens"], row["wasted_groups"]) == (40, 1)

    run(go())


def test_without_a_trainer_version_or_progress_nothing_is_aborted(tmp_path):
    async def go():
        svc, _, _ = make_service(tmp_path, max_policy_lag_steps=0)
        w = await work(svc, n=1, version=0)
        gid = w.groups[0]["group_id"]
        beat = Heartbeat("a", "s1", 0, held=[gid], reports_held=True, progress={gid: [0, 9]})
        assert isinstance(await svc.heartbeat(beat), Ok)  # the trainer not heard from yet
        svc.trainer_version = 0
        assert isinstance(await svc.heartbeat(beat), Ok)  # lag 0: within the bound
        bad = Heartbeat("a", "s1", 0, progress={gid: "junk", "x": [None, 3]})
        svc.trainer_version = 5
        assert isinstance(await svc.heartbeat(bad), Ok)  # malformed figures are ignored

    run(go())
