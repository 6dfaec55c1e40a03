"""The group life cycle through SchedulerService on a real sqlite store (no sockets)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from deltarl.config.rl import Sampling
from deltarl.rl.protocol import (
    Batch,
    Checkpointed,
    GetHistory,
    Heartbeat,
    History,
    StepDone,
    SubmitGroup,
    TakeBatch,
    Work,
)
from deltarl.scheduler.policy import Candidates, InstanceLoad, WorkRequest
from deltarl.scheduler.rows import PromptState
from deltarl.transport.messages import Error, Ok
from tests.scheduler.helpers import make_service, samples, submission, submit_all, work


def run(coro):
    return asyncio.run(coro)


def test_life_cycle_replay_and_checkpoint(tmp_path):
    async def go():
        svc, store, _ = make_service(tmp_path)
        w = await work(svc, n=2)
        assert [g["prompt_id"] for g in w.groups] == [0, 1]
        assert w.groups[0]["prompt"].startswith("Say a lot of ")
        assert all(isinstance(r, Ok) for r in await submit_all(svc, w))
        assert store.state_counts()["pooled"] == 2

        batch = await svc.take_batch(TakeBatch(step=1, groups=2, trainer_version=0))
        assert isinstance(batch, Batch)
        assert [g["prompt_id"] for g in batch.groups] == [0, 1]
        assert all(r == 1.0 for g in batch.groups for r in g["rewards"])
        assert all(len(g["rewards"]) == 4 for g in batch.groups)
        assert all(store.get_blob(g["samples_ref"]) is not None for g in batch.groups)
        assert [g["lag"] for g in batch.groups] == [0, 0]

        # The trainer dies before its checkpoint and asks for step 1 again: the same groups.
        again = await svc.take_batch(TakeBatch(step=1, groups=2, trainer_version=0))
        assert again == batch
        assert isinstance(await svc.step_done(StepDone(1, 1, {"loss": 0.5, "step_s": 0.2})), Ok)
        assert isinstance(await svc.checkpointed(Checkpointed(1)), Ok)
        assert store.state_counts()["trained"] == 2
        late = await svc.take_batch(TakeBatch(step=1, groups=2, trainer_version=0))
        assert isinstance(late, Error)
        assert late.code == "checkpointed"

        hist = await svc.history(GetHistory())
        assert isinstance(hist, History)
        (step,) = hist.steps
        assert step["step"] == 1
        assert step["version"] == 1
        assert step["reward_mean"] == 1.0
        assert step["samples"] == 8
        assert step["metrics"]["loss"] == 0.5
        assert step["checkpointed"] is True
        assert hist.config["group_size"] == 4
        assert hist.counters["trained_groups"] == 2

    run(go())


def test_batch_waits_until_the_step_can_be_filled(tmp_path):
    async def go():
        svc, _, _ = make_service(tmp_path)
        w = await work(svc, n=1)
        await submit_all(svc, w)
        batch = await svc.take_batch(TakeBatch(step=1, groups=2, trainer_version=0))
        assert isinstance(batch, Batch)
        assert batch.groups == []
        assert batch.wait_s > 0
        wrong = await svc.take_batch(TakeBatch(step=1, groups=3, trainer_version=0))
        assert isinstance(wrong, Error)
        assert "groups_per_step" in wrong.message

    run(go())


def test_missed_heartbeats_requeue_in_flight_work(tmp_path):
    async def go():
        svc, store, clock = make_service(tmp_path, heartbeat_timeout_s=5.0)
        w = await work(svc, "a", n=2)
        clock.advance(6.0)
        svc.expire()
        assert "a" not in svc.instances
        assert store.state_counts()["queued"] == 2
        assert store.counters()["requeued.heartbeat_missed"] == 2
        # The requeued prompts go out again, as new attempts, to another instance.
        w2 = await work(svc, "b", n=2)
        assert [g["prompt_id"] for g in w2.groups] == [0, 1]
        assert [g["group_id"] for g in w2.groups] == ["0.1", "1.1"]
        # The dead instance's late submission is refused and counted, never pooled.
        late = await submit_all(svc, w, "a")
        assert all(isinstance(r, Error) and r.code == "stale_group" for r in late)
        assert store.counters()["dropped_groups.stale_submit"] == 2
        assert store.counters()["dropped_samples.stale_submit"] == 8
        assert all(isinstance(r, Ok) for r in await submit_all(svc, w2, "b"))
        assert store.state_counts()["pooled"] == 2

    run(go())


def test_lease_runs_out_although_the_instance_heartbeats(tmp_path):
    async def go():
        svc, store, clock = make_service(tmp_path, lease_s=30.0)
        await work(svc, "a", n=1)  # suppose the Work reply was lost: never submitted
        for _ in range(4):
            clock.advance(9.0)
            await work(svc, "a", n=0)  # heartbeats and asks for nothing
        svc.expire()
        assert store.counters()["requeued.lease_expired"] == 1
        assert store.group(0).state == PromptState.QUEUED

    run(go())


def test_new_session_requeues_the_old_sessions_groups(tmp_path):
    async def go():
        svc, store, _ = make_service(tmp_path)
        await work(svc, "a", "s1", n=2)
        w = await work(svc, "a", "s2", n=2)  # restarted: the first two are requeued
        assert store.counters()["requeued.session_changed"] == 2
        assert [g["group_id"] for g in w.groups] == ["0.1", "1.1"]

    run(go())


def test_duplicate_submit_is_idempotent(tmp_path):
    async def go():
        svc, store, _ = make_service(tmp_path)
        w = await work(svc, n=1)
        g = w.groups[0]
        cmd = submission(svc, "a", "s1", g["group_id"], samples(g, 4))
        first, second = await asyncio.gather(svc.submit_group(cmd), svc.submit_group(cmd))
        third = await svc.submit_group(cmd)
        assert all(isinstance(r, Ok) for r in (first, second, third))
        assert store.counters()["pooled_groups"] == 1
        assert store.counters()["submit.duplicate"] == 2

    run(go())


def test_bad_samples_are_refused_and_counted(tmp_path):
    async def go():
        svc, store, _ = make_service(tmp_path)
        w = await work(svc, n=1)
        g = w.groups[0]
        reply = await svc.submit_group(submission(svc, "a", "s1", g["group_id"], samples(g, 3)))
        assert isinstance(reply, Error)
        assert reply.code == "bad_samples"
        assert store.counters()["dropped_groups.bad_samples"] == 1
        assert store.group(0).state == PromptState.QUEUED

    run(go())


def test_pool_capacity_holds_back_work(tmp_path):
    async def go():
        svc, store, _ = make_service(tmp_path, pool_capacity=4)
        w = await work(svc, n=10)
        assert len(w.groups) == 4
        full = await work(svc, n=1)
        assert full.groups == []
        assert full.reason.startswith("pool full")
        await submit_all(svc, w)
        assert (await work(svc, n=1)).groups == []  # pooled groups hold their slots too
        await svc.take_batch(TakeBatch(step=1, groups=2, trainer_version=0))
        assert len((await work(svc, n=10)).groups) == 2
        assert store.cursor == 6

    run(go())


def test_dataset_end(tmp_path):
    async def go():
        svc, store, _ = make_service(tmp_path, dataset_size=3)
        assert len((await work(svc, n=8)).groups) == 3
        done = await work(svc, n=1)
        assert done.reason == "dataset exhausted"
        assert store.cursor == 3

    run(go())


def test_lag_drop_drops_stale_groups_and_requeues_their_prompts(tmp_path):
    async def go():
        svc, store, _ = make_service(tmp_path, on_lag_exceeded="drop", max_policy_lag_steps=1)
        w = await work(svc, n=2, version=0)
        await submit_all(svc, w, version=0)
        batch = await svc.take_batch(TakeBatch(step=1, groups=2, trainer_version=2))
        assert isinstance(batch, Batch)
        assert batch.groups == []
        assert store.counters()["dropped_groups.lag_exceeded"] == 2
        assert store.counters()["dropped_samples.lag_exceeded"] == 8
        assert store.state_counts()["queued"] == 2
        # "drop" never gates: an instance far behind still gets work.
        assert len((await work(svc, n=1, version=0)).groups) == 1

    run(go())


def test_lag_within_the_bound_ships(tmp_path):
    async def go():
        svc, _, _ = make_service(tmp_path, on_lag_exceeded="drop", max_policy_lag_steps=2)
        w = await work(svc, n=2, version=3)
        await submit_all(svc, w, version=3)
        batch = await svc.take_batch(TakeBatch(step=1, groups=2, trainer_version=5))
        assert [g["lag"] for g in batch.groups] == [2, 2]

    run(go())


def test_lag_throttle_holds_back_an_instance_that_is_too_far_behind(tmp_path):
    async def go():
        svc, store, _ = make_service(tmp_path, on_lag_exceeded="throttle", max_policy_lag_steps=1)
        await svc.take_batch(TakeBatch(step=1, groups=2, trainer_version=4))  # learn version 4
        held = await work(svc, n=2, version=2)
        assert held.groups == []
        assert held.reason.startswith("throttle")
        assert held.sync_to is None
        assert store.counters()["lag.throttled"] == 1
        # Within the bound it gets work, until what is ahead would arrive too late: with
        # groups_per_step 2, two issued groups already fill the next step.
        ok = await work(svc, n=2, version=3)
        assert len(ok.groups) == 2
        assert (await work(svc, n=2, version=3)).reason.startswith("throttle")
        assert len((await work(svc, n=2, version=4)).groups) == 2
        assert store.counters()["lag.throttled"] == 2

    run(go())


def test_lag_throttle_issues_only_the_groups_predicted_within_the_bound(tmp_path):
    """One GetWork for many groups: with groups_per_step 2 and bound 1, an instance at the
    trainer's version may fill the next step and the one after (4 groups), not more; the
    groups it was given all ship within the bound."""

    async def go():
        svc, store, _ = make_service(
            tmp_path, on_lag_exceeded="throttle", max_policy_lag_steps=1, pool_capacity=16
        )
        await svc.take_batch(TakeBatch(step=1, groups=2, trainer_version=0))  # learn version 0
        w = await work(svc, n=8, version=0)
        assert len(w.groups) == 4
        await submit_all(svc, w, version=0)
        assert len((await svc.take_batch(TakeBatch(1, 2, trainer_version=0))).groups) == 2
        await svc.step_done(StepDone(1, 1))
        assert len((await svc.take_batch(TakeBatch(2, 2, trainer_version=1))).groups) == 2
        assert store.counters().get("dropped_groups.lag_exceeded", 0) == 0

    run(go())


def test_lag_sync_asks_the_instance_to_refit(tmp_path):
    async def go():
        svc, store, _ = make_service(tmp_path, on_lag_exceeded="sync", max_policy_lag_steps=1)
        await svc.take_batch(TakeBatch(step=1, groups=2, trainer_version=4))
        held = await work(svc, n=2, version=2)
        assert held.groups == []
        assert held.sync_to == 4
        assert store.counters()["lag.sync"] == 1
        assert len((await work(svc, n=2, version=3)).groups) == 2

    run(go())


def test_stale_groups_are_dropped_at_ship_time_under_every_policy(tmp_path):
    async def go():
        svc, store, _ = make_service(tmp_path, on_lag_exceeded="sync", max_policy_lag_steps=0)
        w = await work(svc, n=2, version=0)
        await submit_all(svc, w, version=0)
        await svc.step_done(StepDone(0, 1))  # unknown step: refused, version not learned
        batch = await svc.take_batch(TakeBatch(step=1, groups=2, trainer_version=1))
        assert batch.groups == []
        assert store.counters()["dropped_groups.lag_exceeded"] == 2

    run(go())


def test_wasted_tokens_are_the_stale_groups_tokens_recorded_with_the_next_step(tmp_path):
    """Each group: 4 samples of 8 completion tokens. Step 1 trains 2 groups and wastes none;
    then 2 groups go stale and are dropped while step 2 cannot be filled (their 64 tokens wait
    for it); step 2 trains 2 fresh groups and carries the waste: ratio 64 / 128. The figures
    survive a restart of the scheduler (they are in its store)."""

    async def go():
        svc, store, _ = make_service(tmp_path, on_lag_exceeded="drop", max_policy_lag_steps=0)
        await submit_all(svc, await work(svc, n=2, version=0), version=0)
        assert len((await svc.take_batch(TakeBatch(1, 2, trainer_version=0))).groups) == 2
        await submit_all(svc, await work(svc, n=2, version=0), version=0)
        stale = await svc.take_batch(TakeBatch(2, 2, trainer_version=1))
        assert stale.groups == []
        assert store.counters()["dropped_groups.lag_exceeded"] == 2
        await submit_all(svc, await work(svc, n=2, version=1), version=1)
        assert len((await svc.take_batch(TakeBatch(2, 2, trainer_version=1))).groups) == 2
        store.close()
        _, reopened, _ = make_service(tmp_path)
        rows = {r["step"]: r for r in reopened.history()}
        assert (rows[1]["trained_tokens"], rows[1]["wasted_tokens"]) == (64, 0)
        assert rows[1]["wasted_ratio"] == 0
        assert (rows[2]["trained_tokens"], rows[2]["wasted_tokens"]) == (64, 64)
        assert rows[2]["wasted_groups"] == 2
        assert rows[2]["wasted_ratio"] == 0.5

    run(go())


def test_a_straggler_is_benched_its_work_requeued_and_it_rejoins_after_the_cooldown(tmp_path):
    """Three busy instances; c decodes at a tenth of its peers' rate per running group. After
    the 30 s window it is benched: its groups go back to the queue, it gets no work, and after
    the 60 s cooldown it gets work again. A blip shorter than the window benches nobody."""

    async def beat(svc, name: str, rate: float) -> None:
        await svc.heartbeat(Heartbeat(name, "s1", weight_version=0, running_groups=2,
                                      tokens_per_s=rate))  # fmt: skip

    async def go():
        svc, store, clock = make_service(
            tmp_path, straggler_ratio=0.3, straggler_window_s=30.0, straggler_cooldown_s=60.0,
            pool_capacity=32,
        )  # fmt: skip
        for name in ("a", "b", "c"):
            await work(svc, instance=name, n=2)
        for _ in range(2):  # a 20 s blip: within the window
            for name, rate in (("a", 100.0), ("b", 120.0), ("c", 10.0)):
                await beat(svc, name, rate)
            clock.advance(10.0)
        await beat(svc, "c", 100.0)  # recovered: the window starts again
        assert store.counters().get("stragglers.benched", 0) == 0
        for _ in range(4):
            for name, rate in (("a", 100.0), ("b", 120.0), ("c", 10.0)):
                await beat(svc, name, rate)
            clock.advance(10.0)
        assert store.counters()["stragglers.benched"] == 1
        assert store.counters()["requeued.straggler"] == 2
        assert not [g for g in store.groups(PromptState.ISSUED) if g.instance == "c"]
        held = await work(svc, instance="c", n=2)
        assert held.groups == []
        assert held.reason.startswith("straggler: benched")
        assert svc.status_fields()["instances"]["c"]["benched_s"] > 0
        # the others go on, and the benched one draws no share: a's share of the 28 groups
        # of room over a and b is 16 (14 more than it holds), not 11 as over three
        assert len((await work(svc, instance="a", n=12)).groups) == 12
        clock.advance(61.0)
        for name, rate in (("a", 100.0), ("b", 120.0)):
            await beat(svc, name, rate)
        assert len((await work(svc, instance="c", n=2)).groups) == 2  # back, judged again

    run(go())


class _EveryOther:
    """A policy that takes every other fresh prompt: the ones it passes over must be queued."""

    name = "every-other"
    lookahead = 0
    max_lag = None
    forecasts_landing = False

    def choose(
        self, request: WorkRequest, instances: Sequence[InstanceLoad], candidates: Candidates
    ) -> list[int]:
        return [*candidates.queued, *list(candidates.fresh)[::2]][: request.room]


def test_a_policy_that_skips_fresh_prompts_skips_none(tmp_path):
    async def go():
        svc, store, _ = make_service(tmp_path)
        svc.policy = _EveryOther()
        w = await work(svc, n=4)
        assert [g["prompt_id"] for g in w.groups] == [0, 2]
        assert store.cursor == 3
        assert store.group(1).state == PromptState.QUEUED
        w2 = await work(svc, n=4)
        assert [g["prompt_id"] for g in w2.groups][:1] == [1]

    run(go())


def test_a_restarted_service_continues_from_the_store(tmp_path):
    async def go():
        svc, store, _ = make_service(tmp_path)
        w = await work(svc, n=2)
        store.close()
        svc2, store2, _ = make_service(tmp_path)
        # The instance kept its session: its submissions are accepted by the new process.
        assert "a" in svc2.instances
        assert all(isinstance(r, Ok) for r in await submit_all(svc2, w))
        assert store2.cursor == 2
        assert store2.starts() == 2

    run(go())


@pytest.mark.parametrize("bad", ["nope", "7.0", "0.5"])
def test_unknown_groups_are_refused(tmp_path, bad):
    async def go():
        svc, store, _ = make_service(tmp_path)
        await work(svc, n=1)
        reply = await svc.submit_group(SubmitGroup("a", "s1", bad, "0" * 32))
        assert isinstance(reply, Error)
        assert store.state_counts()["pooled"] == 0

    run(go())


def test_work_replies_are_plain_json(tmp_path):
    async def go():
        svc, _, _ = make_service(tmp_path)
        w = await work(svc, n=1)
        assert isinstance(w, Work)
        (g,) = w.groups
        assert set(g) == {"group_id", "prompt_id", "prompt", "n", "sampling"}
        assert set(g["sampling"]) == {"temperature", "top_p", "max_tokens", "seed"}

    run(go())


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_a_batch_carries_the_temperature_its_groups_were_sampled_at(tmp_path, temperature):
    async def go():
        svc, _, _ = make_service(tmp_path, sampling=Sampling(temperature, max_tokens=8))
        w = await work(svc, n=2)
        assert all(g["sampling"]["temperature"] == temperature for g in w.groups)
        assert all(isinstance(r, Ok) for r in await submit_all(svc, w))
        batch = await svc.take_batch(TakeBatch(step=1, groups=2, trainer_version=0))
        assert isinstance(batch, Batch)
        assert len(batch.groups) == 2
        assert batch.temperature == temperature  # the trainer's log-probs are taken at it

    run(go())


@pytest.mark.parametrize("ratio", [-0.1, 1.0, 2.0])
def test_a_straggler_ratio_outside_0_1_is_refused(tmp_path, ratio):
    with pytest.raises(ValueError, match=r"straggler_ratio must be in \[0, 1\)"):
        make_service(tmp_path, straggler_ratio=ratio)
