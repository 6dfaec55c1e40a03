"""Held-out evaluation rounds through SchedulerService on a real sqlite store (no sockets)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import pytest

from deltarl.rl.arithmetic import Arithmetic, parse, solve
from deltarl.rl.protocol import (
    Batch,
    GetHistory,
    GetWork,
    Heartbeat,
    History,
    StepDone,
    SubmitGroup,
    TakeBatch,
    Work,
)
from deltarl.scheduler.service import SchedulerService
from deltarl.transport.blobs import blob_digest
from deltarl.transport.messages import Error, Ok
from tests.scheduler.helpers import encoded, make_service

EVAL_SIZE = Arithmetic().eval_size


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(coro)


def arithmetic(tmp: Path, **overrides: Any) -> tuple[SchedulerService, Any, Any]:
    values = {"task": "arithmetic", "eval_every": 2, "pool_capacity": 8, **overrides}
    return make_service(tmp, **values)


def completion(prompt: str, *, right: bool, version: int) -> dict[str, Any]:
    value = solve(parse(prompt)) + (0 if right else 1)
    return {
        "prompt_token_ids": [1, 2, 3],
        "token_ids": [4, 5],
        "logprobs": [-0.5, -0.25],
        "token_versions": [version, version],
        "text": f"Answer: {value}",
        "finish_reason": "stop",
    }


def put(svc: SchedulerService, group_id: str, samples: list[dict[str, Any]]) -> str:
    data = encoded(group_id, samples)
    digest = blob_digest(data)
    svc.store.put_blob(digest, data)
    return digest


async def ask(
    svc: SchedulerService, n: int, version: int, instance: str = "a", session: str = "s1"
) -> Work:
    await svc.heartbeat(Heartbeat(instance, session, weight_version=version))
    reply = await svc.get_work(GetWork(instance, session, max_groups=n, weight_version=version))
    assert isinstance(reply, Work), reply
    return reply


async def answer(
    svc: SchedulerService,
    item: dict[str, Any],
    *,
    right: bool,
    version: int,
    instance: str = "a",
    session: str = "s1",
) -> Any:
    ref = put(svc, item["group_id"], [completion(item["prompt"], right=right, version=version)])
    return await svc.submit_group(SubmitGroup(instance, session, item["group_id"], ref))


async def finish_round(svc: SchedulerService, version: int, right: int) -> None:
    """Ask until the open round is all issued; the first ``right`` eval prompts answered right."""
    answered = 0
    while svc.store.eval_open() is not None:
        w = await ask(svc, 8, version)
        evals = [g for g in w.groups if g.get("eval")]
        assert evals, w
        for item in evals:
            assert isinstance(await answer(svc, item, right=answered < right, version=version), Ok)
            answered += 1
        await pool_training(svc, w, version)  # the training groups beside them, as an engine


def training_samples(item: dict[str, Any], version: int) -> list[dict[str, Any]]:
    return [completion(item["prompt"], right=True, version=version)] * item["n"]


async def pool_training(svc: SchedulerService, w: Work, version: int) -> None:
    for item in w.groups:
        if not item.get("eval"):
            ref = put(svc, item["group_id"], training_samples(item, version))
            assert isinstance(
                await svc.submit_group(SubmitGroup("a", "s1", item["group_id"], ref)), Ok
            )


def test_the_baseline_round_is_greedy_and_takes_half_the_slots_beside_training(
    tmp_path: Path,
) -> None:
    async def go() -> None:
        svc, store, _ = arithmetic(tmp_path)
        w = await ask(svc, 8, version=0)
        evals = [g for g in w.groups if g.get("eval")]
        train = [g for g in w.groups if not g.get("eval")]
        assert len(evals) == 4
        assert len(train) == 4
        task = Arithmetic()
        for i, item in enumerate(evals):
            assert item["group_id"] == f"e0.{i}.0"
            assert (item["prompt_id"], item["prompt"], item["n"]) == (i, task.eval_prompt(i), 1)
            assert item["sampling"]["temperature"] == 0.0
            assert item["sampling"]["max_tokens"] == svc.config.sampling.max_tokens
        assert all(g["sampling"]["temperature"] == 1.0 for g in train)
        # eval groups take no pool slot and count in no training counter
        assert store.state_counts()["issued"] == 4
        assert store.counters()["issued_groups"] == 4
        assert store.counters()["eval.issued_groups"] == 4

        assert isinstance(await answer(svc, evals[0], right=True, version=0), Ok)
        again = await answer(svc, evals[0], right=True, version=0)
        assert isinstance(again, Ok)
        assert "duplicate" in again.detail
        counters = store.counters()
        assert counters.get("submit.duplicate", 0) == 0
        assert counters["eval.duplicate"] == 1
        assert counters.get("pooled_samples", 0) == 0
        assert counters["eval.samples"] == 1
        assert store.blob_stats()["blobs"] == 0  # released at once: nothing trains on it

    run(go())


def test_an_eval_share_of_one_sends_the_round_out_before_any_training_group(
    tmp_path: Path,
) -> None:
    async def go() -> None:
        svc, store, _ = arithmetic(tmp_path, eval_share=1.0, eval_prompts=12)
        first = await ask(svc, 8, version=0)
        assert [g.get("eval") for g in first.groups] == [True] * 8
        second = await ask(svc, 8, version=0)
        evals = [g for g in second.groups if g.get("eval")]
        # the round's last 4, then training fills what is left
        assert [g["prompt_id"] for g in evals] == [8, 9, 10, 11]
        assert len(second.groups) == 8
        assert store.counters()["issued_groups"] == 4

    run(go())


@pytest.mark.parametrize("share", [0.0, -0.5, 1.5])
def test_an_eval_share_outside_zero_to_one_is_refused(tmp_path: Path, share: float) -> None:
    with pytest.raises(ValueError, match="eval_share must be in"):
        arithmetic(tmp_path, eval_share=share)


def test_a_round_at_every_eval_every_steps_measured_on_the_new_weights(tmp_path: Path) -> None:
    async def go() -> None:
        svc, store, _ = arithmetic(tmp_path, eval_every=2, groups_per_step=2, group_size=2)
        await finish_round(svc, version=0, right=EVAL_SIZE // 4)
        for step in (1, 2):
            while store.state_counts()["pooled"] < 2:
                await pool_training(svc, await ask(svc, 2, version=step - 1), step - 1)
            batch = await svc.take_batch(TakeBatch(step, 2, trainer_version=step - 1))
            assert isinstance(batch, Batch)
            assert len(batch.groups) == 2
            assert not any(str(g["group_id"]).startswith("e") for g in batch.groups)
            assert isinstance(await svc.step_done(StepDone(step, step, {})), Ok)
        # step 1 opened nothing; step 2 opened a round on version 2: an engine still on 1
        # gets training work only, one on 2 gets the eval groups
        assert store.eval_open() is not None
        behind = await ask(svc, 4, version=1)
        assert not any(g.get("eval") for g in behind.groups)
        await finish_round(svc, version=2, right=EVAL_SIZE // 2)

        hist = await svc.history(GetHistory())
        assert isinstance(hist, History)
        base, second = hist.evals
        assert (base["step"], base["version_min"], base["version_max"]) == (0, 0, 0)
        assert base["accuracy"] == pytest.approx(0.25)
        assert (second["step"], second["target_version"]) == (2, 2)
        assert (second["version_min"], second["version_max"]) == (2, 2)
        assert second["accuracy"] == pytest.approx(0.5)
        assert second["samples"] == EVAL_SIZE
        assert second["finished"]
        assert not second["partial"]
        # a wrong answer in the right form earns the format credit, not accuracy
        assert second["reward_mean"] == pytest.approx(0.5 * 1.0 + 0.5 * 0.1)
        rows = {r["step"]: r for r in hist.steps}
        assert rows[1]["eval_accuracy"] is None
        assert rows[1]["eval_samples"] == 0
        assert rows[2]["eval_accuracy"] == pytest.approx(0.5)
        assert (rows[2]["eval_version_min"], rows[2]["eval_version_max"]) == (2, 2)
        assert rows[2]["eval_partial"] is False
        # replaying step 2 (a trainer restart) opens nothing new
        assert isinstance(await svc.step_done(StepDone(2, 2, {})), Ok)
        assert store.eval_open() is None
        assert store.counters()["eval.rounds"] == 2

    run(go())


def test_lost_eval_groups_are_issued_again_after_a_scheduler_and_a_rollout_restart(
    tmp_path: Path,
) -> None:
    async def go() -> None:
        # leases shorter than the heartbeat timeout: a lease, not a silence, takes groups back
        svc, store, clock = arithmetic(tmp_path, lease_s=5.0)
        w = await ask(svc, 8, version=0)
        assert any(g.get("eval") for g in w.groups)
        # the scheduler restarts on its store: the same round, still open
        svc2 = SchedulerService(svc.config, store, monotonic=clock)
        assert store.eval_open() is not None
        assert store.counters()["eval.rounds"] == 1
        # the rollout daemon restarted too (a new session): its eval groups are queued again
        again = await ask(svc2, 8, version=0, session="s2")
        reissued = [g for g in again.groups if g.get("eval")]
        assert [g["group_id"] for g in reissued] == [f"e0.{i}.1" for i in range(4)]
        assert store.counters()["eval.requeued.session_changed"] == 4
        # a lease running out brings groups back as well; their late submits are refused
        clock.advance(svc2.config.lease_s + 1)
        svc2.expire()
        assert store.counters()["eval.requeued.lease_expired"] == 4
        for item in reissued:
            late = await answer(svc2, item, right=True, version=0, session="s2")
            assert isinstance(late, Error)
            assert late.code == "stale_group"
        assert store.counters()["eval.stale"] == 4
        assert store.counters().get("dropped_groups.stale_submit", 0) == 0
        while store.eval_open() is not None:
            more = await ask(svc2, 8, version=0, session="s2")
            for item in (g for g in more.groups if g.get("eval")):
                assert isinstance(await answer(svc2, item, right=True, version=0, session="s2"), Ok)
        (base,) = store.eval_rounds()
        assert base["samples"] == EVAL_SIZE
        assert base["accuracy"] == 1.0

    run(go())


def test_an_unscorable_eval_group_makes_its_round_partial(tmp_path: Path) -> None:
    async def go() -> None:
        svc, store, _ = arithmetic(tmp_path)
        first = True
        while store.eval_open() is not None:
            w = await ask(svc, 8, version=0)
            for item in (g for g in w.groups if g.get("eval")):
                if first:  # two samples where one was asked: refused, not retried
                    sample = completion(item["prompt"], right=True, version=0)
                    ref = put(svc, item["group_id"], [sample, sample])
                    reply = await svc.submit_group(SubmitGroup("a", "s1", item["group_id"], ref))
                    assert isinstance(reply, Error)
                    assert reply.code == "bad_samples"
                    first = False
                    continue
                assert isinstance(await answer(svc, item, right=True, version=0), Ok)
        (base,) = store.eval_rounds()
        assert base["partial"]
        assert base["failed"] == 1
        assert base["samples"] == EVAL_SIZE - 1
        assert base["accuracy"] == 1.0
        assert store.counters().get("dropped_groups.bad_samples", 0) == 0

    run(go())


def test_a_round_is_not_opened_while_one_is_unfinished(tmp_path: Path) -> None:
    async def go() -> None:
        svc, store, _ = arithmetic(tmp_path, eval_every=1, groups_per_step=2, group_size=2)
        while store.state_counts()["pooled"] < 2:
            w = await ask(svc, 2, version=0)
            await pool_training(svc, w, 0)
        assert isinstance(await svc.take_batch(TakeBatch(1, 2, 0)), Batch)
        assert isinstance(await svc.step_done(StepDone(1, 1, {})), Ok)
        assert store.counters()["eval.skipped_busy"] == 1  # the baseline is still running
        assert [r["step"] for r in store.eval_rounds()] == [0]

    run(go())


def test_eval_prompts_takes_the_first_prompts_of_the_split(tmp_path: Path) -> None:
    async def go() -> None:
        svc, store, _ = arithmetic(tmp_path, eval_prompts=5)
        await finish_round(svc, version=0, right=5)
        (base,) = store.eval_rounds()
        assert (base["size"], base["samples"], base["accuracy"]) == (5, 5, 1.0)

    run(go())


def test_a_task_without_a_held_out_split_has_no_eval(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def go() -> None:
        with caplog.at_level(logging.WARNING, logger="deltarl.scheduler.evaluation"):
            svc, store, _ = make_service(tmp_path, eval_every=1)
        assert "has no held-out split" in caplog.text
        w = await ask(svc, 4, version=0)
        assert len(w.groups) == 4
        assert not any(g.get("eval") for g in w.groups)
        assert store.eval_rounds() == []
        assert not svc.evals.enabled

    run(go())


def test_eval_groups_a_heartbeat_does_not_hold_are_issued_again(tmp_path: Path) -> None:
    async def go() -> None:
        svc, store, clock = arithmetic(tmp_path)
        w = await ask(svc, 8, version=0)  # the Work reply is lost on its way
        held = [g["group_id"] for g in w.groups if not g.get("eval")]
        clock.advance(svc.config.not_held_grace_s + 1)
        beat = Heartbeat("a", "s1", weight_version=0, held=held, reports_held=True)
        assert isinstance(await svc.heartbeat(beat), Ok)
        assert store.counters()["eval.requeued.not_held"] == 4
        assert store.counters().get("requeued.not_held", 0) == 0  # the training ones are held
        again = await ask(svc, 8, version=0)
        assert [g["group_id"] for g in again.groups if g.get("eval")][:4] == [
            f"e0.{i}.1" for i in range(4)
        ]

    run(go())
