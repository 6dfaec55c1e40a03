"""Reward scoring with a timeout and retries, alone and through the service; and the task."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from deltarl.rl.task import RepeatLetter, make_task
from deltarl.scheduler.reward import RewardFailedError, RewardScorer
from deltarl.scheduler.rows import PromptState
from deltarl.transport.messages import Error
from tests.scheduler.helpers import make_service, samples, submission, work


def test_task_prompts_are_deterministic_and_the_reward_is_the_letters_share():
    task = make_task("default", seed=3)
    assert [task.prompt(i) for i in range(50)] == [task.prompt(i) for i in range(50)]
    assert len({task.prompt(i) for i in range(50)}) == 4  # every letter turns up
    other = make_task("default", seed=4)
    assert [other.prompt(i) for i in range(10)] != [task.prompt(i) for i in range(10)]
    prompt = "Say a lot of b: "
    assert task.reward(prompt, "bbbbbbbb") == 1.0
    assert task.reward(prompt, "bbbbbbbbbbbbbbbb") == 1.0
    assert task.reward(prompt, "b") == 1 / 8  # stopping at once does not pay
    assert task.reward(prompt, "bbbbzzzz") == 0.5
    assert task.reward(prompt, "") == 0.0
    with pytest.raises(ValueError, match="not a prompt"):
        task.reward("hello", "b")
    with pytest.raises(IndexError):
        RepeatLetter(size=5).prompt(5)
    with pytest.raises(ValueError, match="unknown task"):
        make_task("nope")


def test_retries_recover_a_flaky_reward():
    calls = []

    def flaky(prompt: str, text: str) -> float:
        calls.append(text)
        if len(calls) == 1:
            raise RuntimeError("reward service hiccup")
        return 0.25

    counted: list[str] = []
    scorer = RewardScorer(flaky, timeout_s=1.0, retries=1, count=counted.append)
    assert asyncio.run(scorer.score_group("p", ["x"])) == [0.25]
    assert counted.count("reward.errors") == 1
    assert counted.count("reward.retries") == 1


def test_a_hanging_reward_times_out_after_its_retries():
    release = threading.Event()

    def hangs(prompt: str, text: str) -> float:
        release.wait(10)
        return 1.0

    counted: list[str] = []
    scorer = RewardScorer(hangs, timeout_s=0.05, retries=2, count=counted.append)
    t0 = time.monotonic()
    with pytest.raises(RewardFailedError) as e:
        asyncio.run(scorer.score_group("p", ["x"]))
    assert time.monotonic() - t0 < 5
    assert e.value.reason == "reward_timeout"
    assert counted.count("reward.timeouts") == 3
    assert scorer.stuck == 3  # abandoned threads, still running
    release.set()
    deadline = time.monotonic() + 5
    while scorer.stuck and time.monotonic() < deadline:
        time.sleep(0.01)
    assert scorer.stuck == 0


@pytest.mark.parametrize("value", [float("nan"), "1.0", None, True])
def test_a_reward_that_is_not_a_finite_number_is_an_error(value):
    scorer = RewardScorer(lambda p, t: value, timeout_s=1.0, retries=0)
    with pytest.raises(RewardFailedError) as e:
        asyncio.run(scorer.score("p", "x"))
    assert e.value.reason == "reward_error"


def test_a_group_whose_reward_fails_is_dropped_requeued_then_abandoned(tmp_path):
    def broken(prompt: str, text: str) -> float:
        raise ValueError("cannot parse")

    async def go():
        svc, store, _ = make_service(tmp_path, reward_retries=1, max_reward_failures=2)
        svc.scorer.fn = broken
        for attempt in range(2):
            w = await work(svc, n=1)
            (g,) = w.groups
            assert g["group_id"] == f"0.{attempt}"
            reply = await svc.submit_group(submission(svc, "a", "s1", g["group_id"], samples(g, 4)))
            assert isinstance(reply, Error)
            assert reply.code == "reward_error"
        c = store.counters()
        assert c["dropped_groups.reward_error"] == 2
        assert c["dropped_samples.reward_error"] == 8
        assert c["reward.retries"] == 8
        assert c["abandoned_prompts"] == 1
        assert store.group(0).state == PromptState.ABANDONED
        assert (await work(svc, n=1)).groups[0]["prompt_id"] == 1  # it is not issued again

    asyncio.run(go())


def test_a_slow_reward_times_out_through_the_service(tmp_path):
    def slow(prompt: str, text: str) -> float:
        time.sleep(0.5)
        return 1.0

    async def go():
        svc, store, _ = make_service(tmp_path, reward_timeout_s=0.05, reward_retries=1)
        svc.scorer.fn = slow
        w = await work(svc, n=1)
        (g,) = w.groups
        reply = await svc.submit_group(submission(svc, "a", "s1", g["group_id"], samples(g, 4)))
        assert isinstance(reply, Error)
        assert reply.code == "reward_timeout"
        assert store.counters()["dropped_groups.reward_timeout"] == 1
        assert store.group(0).state == PromptState.QUEUED

    asyncio.run(go())
