"""Prefix affinity for requeued prompts (deltarl/scheduler/prefix_home.py, the ``deltarl``
policy): a prompt whose reward failed goes back to the instance that prefilled it while that
instance holds the same weight version and its wait is not too long; other requeues keep no
home. (That a benched straggler draws no share of the work: tests/scheduler/test_service.py.)"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from deltarl.rl.protocol import Heartbeat
from deltarl.scheduler import policy as policy_module
from deltarl.scheduler.policy import AFFINITY_SLACK, Candidates, InstanceLoad, PredictedWait
from deltarl.scheduler.policy import WorkRequest as Req
from deltarl.scheduler.rows import PromptState
from deltarl.transport.messages import Error
from tests.scheduler.helpers import make_service, samples, submission, work

RATE = 10.0  # tokens/s of every instance below


def _broken(prompt: str, text: str) -> float:
    """A reward function that fails: the group is dropped as ``reward_error``."""
    raise ValueError("cannot parse")


def _loads(a_tokens: float, b_tokens: float, a_version: int = 3) -> list[InstanceLoad]:
    return [
        InstanceLoad("a", 1, tokens_per_s=RATE, weight_version=a_version,
                     predicted_tokens=a_tokens),
        InstanceLoad("b", 1, tokens_per_s=RATE, weight_version=3, predicted_tokens=b_tokens),
    ]  # fmt: skip


def test_a_requeued_prompt_goes_home_within_the_slack() -> None:
    policy = PredictedWait()
    predicted = {7: 100.0}  # 10 s on either instance
    homed = Candidates([7], [], predicted, {7: ("a", 3)})
    # a's wait (15 s) is 5 s over b's (10 s), within one prompt-time (10 s): home
    assert policy.choose(Req("a", 1, 1), _loads(150.0, 100.0), homed) == [7]
    # and b, asking, leaves it for a
    assert policy.choose(Req("b", 1, 1), _loads(150.0, 100.0), homed) == []
    # without a home the least wait wins: b
    plain = Candidates([7], [], predicted)
    assert policy.choose(Req("a", 1, 1), _loads(150.0, 100.0), plain) == []
    assert policy.choose(Req("b", 1, 1), _loads(150.0, 100.0), plain) == [7]


def test_no_home_when_the_wait_is_too_long_or_the_version_moved_or_it_is_gone() -> None:
    policy = PredictedWait()
    predicted = {7: 100.0}
    homed = Candidates([7], [], predicted, {7: ("a", 3)})
    too_long = 100.0 + RATE * (AFFINITY_SLACK * 10.0) + 1.0  # just past the slack
    assert policy.choose(Req("b", 1, 1), _loads(too_long, 100.0), homed) == [7]
    # a refitted since: its cache holds nothing of version 3
    assert policy.choose(Req("b", 1, 1), _loads(150.0, 100.0, a_version=4), homed) == [7]
    # a is not among the live instances
    live_b = [_loads(150.0, 100.0)[1]]
    assert policy.choose(Req("b", 1, 1), live_b, homed) == [7]


@pytest.mark.parametrize("slack", [AFFINITY_SLACK, -1.0])
def test_a_prompt_whose_reward_failed_is_issued_back_to_its_instance(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, slack: float
) -> None:
    """a holds one group more than b when the failed prompt comes back: b has the least
    wait, but a is within one prompt's time of it, so the prompt waits for a. The control
    (a negative slack: never home) gives it to b, who asks first."""
    monkeypatch.setattr(policy_module, "AFFINITY_SLACK", slack)

    async def go() -> None:
        svc, store, _ = make_service(tmp_path, policy="deltarl", reward_retries=0)
        ok = svc.scorer.fn
        await svc.heartbeat(Heartbeat("b", "s1", weight_version=0))
        g, _ = (await work(svc, instance="a", n=2)).groups
        svc.scorer.fn = _broken
        reply = await svc.submit_group(submission(svc, "a", "s1", g["group_id"], samples(g, 4)))
        assert isinstance(reply, Error)
        assert reply.code == "reward_error"
        svc.scorer.fn = ok
        assert store.prefix_homes([g["prompt_id"]]) == {g["prompt_id"]: ("a", 0)}
        got_b = [x["prompt_id"] for x in (await work(svc, instance="b", n=4)).groups]
        got_a = [x["prompt_id"] for x in (await work(svc, instance="a", n=4)).groups]
        if slack >= 0:
            assert g["prompt_id"] not in got_b
            assert g["prompt_id"] in got_a
            assert store.counters()["prefix_home.hit"] == 1
        else:
            assert g["prompt_id"] in got_b
            assert store.counters()["prefix_home.miss"] == 1
        assert store.prefix_homes([g["prompt_id"]]) == {}  # issued: forgotten

    asyncio.run(go())


def test_a_refitted_home_and_other_requeues_keep_no_affinity(tmp_path: Path) -> None:
    async def go() -> None:
        svc, store, _ = make_service(tmp_path, policy="deltarl", reward_retries=0)
        w = await work(svc, instance="a", n=2)
        first, second = w.groups
        svc.scorer.fn = _broken
        await svc.submit_group(submission(svc, "a", "s1", first["group_id"], samples(first, 4)))
        assert store.prefix_homes([first["prompt_id"]]) == {first["prompt_id"]: ("a", 0)}
        # a restarts (a new session): what it held is requeued with no home, and the home
        # of the reward-failed one goes too (the engine's cache went with its process)
        await svc.heartbeat(Heartbeat("a", "s2", weight_version=0))
        assert store.group(second["prompt_id"]).state == PromptState.QUEUED
        assert store.prefix_homes([first["prompt_id"], second["prompt_id"]]) == {}
        got = await work(svc, instance="b", n=4)
        assert {first["prompt_id"], second["prompt_id"]} <= {x["prompt_id"] for x in got.groups}
        assert "prefix_home.hit" not in store.counters()


def test_a_home_that_refitted_is_passed_over_and_counted_a_miss(tmp_path: Path) -> None:
    async def go() -> None:
        svc, store, _ = make_service(tmp_path, policy="deltarl", reward_retries=0)
        ok = svc.scorer.fn
        (g,) = (await work(svc, instance="a", n=1)).groups
        svc.scorer.fn = _broken
        await svc.submit_group(submission(svc, "a", "s1", g["group_id"], samples(g, 4)))
        svc.scorer.fn = ok
        await svc.heartbeat(Heartbeat("a", "s1", weight_version=1))  # a refitted
        got = await work(svc, instance="b", n=4, version=1)
        assert g["prompt_id"] in [x["prompt_id"] for x in got.groups]
        assert store.counters()["prefix_home.miss"] == 1

    asyncio.run(go())
