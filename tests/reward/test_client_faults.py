"""The scheduler's reward client against a real reward daemon process, fault by fault: a slow
scorer (timeouts, retries), the concurrency bound, the rate limit, bad replies. The scheduler
is its core (``SchedulerService``) on a real store, with the real client."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from deltarl.config.reward import RewardClientConfig
from deltarl.reward.protocol import ScoreGroup, Scores
from deltarl.rl.task import make_task
from deltarl.scheduler.service import SchedulerService
from deltarl.transport.control import ControlServer
from deltarl.transport.messages import Error, Ok, Reply
from tests.reward.helpers import RewardDaemon
from tests.scheduler.helpers import make_service, samples, submission, work


def _scheduler(tmp: Path, endpoint: str, **client: Any) -> SchedulerService:
    svc, _, _ = make_service(
        tmp, pool_capacity=16, groups_per_step=2, reward=RewardClientConfig(endpoint, **client)
    )
    return svc


async def _submit_all(svc: SchedulerService, n: int) -> list[Reply]:
    """``n`` groups issued and submitted at once, as several instances' submits arrive."""
    w = await work(svc, n=n)
    return list(
        await asyncio.gather(
            *(
                svc.submit_group(submission(svc, "a", "s1", g["group_id"], samples(g, g["n"])))
                for g in w.groups
            )
        )
    )


def _with_daemon(tmp: Path, daemon: RewardDaemon, body: Callable[[], Awaitable[None]]) -> None:
    daemon.start()
    try:
        asyncio.run(body())
    finally:
        daemon.stop()


def test_remote_rewards_are_the_tasks_rewards(tmp_path: Path) -> None:
    daemon = RewardDaemon(tmp_path)

    async def body() -> None:
        await daemon.status()
        svc = _scheduler(tmp_path, daemon.endpoint)
        try:
            assert await _submit_all(svc, 2) == [Ok("pooled"), Ok("pooled")]
            task = make_task("default")
            for g in svc.store.groups():  # samples(): every text is the prompt's letter x 8
                letter = task.prompt(g.prompt_id).removeprefix("Say a lot of ")[0]
                assert g.rewards == [task.reward(task.prompt(g.prompt_id), letter * 8)] * 4
                assert g.rewards == [1.0] * 4
            status = svc.status_fields()["reward"]
            assert status["breaker"] == "closed"
            assert status["service"] == daemon.endpoint
            assert svc.counters()["reward.calls"] == 2  # one call per group
            remote = await daemon.status()
            assert remote.fields["counters"]["scored_groups"] == 2
            assert remote.fields["counters"]["scored_samples"] == 8
        finally:
            await svc.close()

    _with_daemon(tmp_path, daemon, body)


def test_slow_scorer_times_out_and_the_retry_scores(tmp_path: Path) -> None:
    daemon = RewardDaemon(tmp_path, delays="1.5,0")  # every other call is slow

    async def body() -> None:
        await daemon.status()
        svc = _scheduler(tmp_path, daemon.endpoint, timeout_s=0.5, retries=1, backoff_s=0.05)
        try:
            w = await work(svc, n=2)
            for g in w.groups:  # one after the other: slow, fast, slow, fast
                reply = await svc.submit_group(
                    submission(svc, "a", "s1", g["group_id"], samples(g, g["n"]))
                )
                assert reply == Ok("pooled")
            counters = svc.counters()
            assert counters["reward.timeouts"] == 2
            assert counters["reward.retries"] == 2
            assert counters["reward.calls"] == 4
            assert svc.status_fields()["reward"]["breaker"] == "closed"
            assert svc.reward_window.errors == 2  # the step's reward_errors
        finally:
            await svc.close()

    _with_daemon(tmp_path, daemon, body)


def test_scorer_too_slow_for_every_try_drops_the_group_as_today(tmp_path: Path) -> None:
    daemon = RewardDaemon(tmp_path, delays="1.5")

    async def body() -> None:
        await daemon.status()
        svc = _scheduler(tmp_path, daemon.endpoint, timeout_s=0.3, retries=1, backoff_s=0.05)
        try:
            (reply,) = await _submit_all(svc, 1)
            assert isinstance(reply, Error), reply
            assert reply.code == "reward_timeout"
            counters = svc.counters()
            assert counters["dropped_groups.reward_timeout"] == 1
            assert counters["reward.timeouts"] == 2
            (group,) = svc.store.groups()
            assert group.state == "queued"  # its prompt is issued again
            assert group.reward_failures == 1
        finally:
            await svc.close()

    _with_daemon(tmp_path, daemon, body)


def test_client_concurrency_limit_bounds_calls_in_flight(tmp_path: Path) -> None:
    daemon = RewardDaemon(tmp_path, delays="0.3", max_concurrency=8)

    async def body() -> None:
        await daemon.status()
        svc = _scheduler(tmp_path, daemon.endpoint, max_concurrency=2, timeout_s=5.0)
        try:
            replies = await _submit_all(svc, 6)
            assert replies == [Ok("pooled")] * 6
            assert svc.status_fields()["reward"]["peak_in_flight"] == 2
            remote = await daemon.status()
            assert remote.fields["peak_in_flight"] == 2
        finally:
            await svc.close()

    _with_daemon(tmp_path, daemon, body)


def test_daemon_concurrency_limit_bounds_groups_scored_at_once(tmp_path: Path) -> None:
    daemon = RewardDaemon(tmp_path, delays="0.3", max_concurrency=2)

    async def body() -> None:
        await daemon.status()
        svc = _scheduler(tmp_path, daemon.endpoint, max_concurrency=8, timeout_s=5.0)
        try:
            replies = await _submit_all(svc, 6)
            assert replies == [Ok("pooled")] * 6
            assert svc.status_fields()["reward"]["peak_in_flight"] == 6  # all sent at once
            remote = await daemon.status()
            assert remote.fields["peak_in_flight"] == 2  # but scored two at a time
        finally:
            await svc.close()

    _with_daemon(tmp_path, daemon, body)


def test_rate_limit_is_honoured(tmp_path: Path) -> None:
    daemon = RewardDaemon(tmp_path)

    async def body() -> None:
        await daemon.status()
        svc = _scheduler(tmp_path, daemon.endpoint, rate_per_s=5.0, burst=1, timeout_s=5.0)
        try:
            t0 = time.monotonic()
            replies = await _submit_all(svc, 6)
            elapsed = time.monotonic() - t0
            assert replies == [Ok("pooled")] * 6
            # One call at once, then one every 0.2 s: five waits.
            assert elapsed >= 0.95, elapsed
            assert svc.counters()["reward.rate_limited"] == 5
        finally:
            await svc.close()

    _with_daemon(tmp_path, daemon, body)


class _BrokenRewardService:
    """A reward service that answers, but wrongly: what ``reply`` makes of each call."""

    def __init__(self, tmp: Path, reply: Callable[[ScoreGroup], Reply]) -> None:
        self.endpoint = f"ipc://{tmp}/broken.sock"
        self.reply = reply
        self.calls = 0
        self.server = ControlServer(self.endpoint, {ScoreGroup: self.score}, name="broken")

    async def score(self, cmd: ScoreGroup) -> Reply:
        self.calls += 1
        return self.reply(cmd)


async def _against(
    tmp: Path, reply: Callable[[ScoreGroup], Reply], **client: Any
) -> tuple[Reply, SchedulerService, _BrokenRewardService]:
    broken = _BrokenRewardService(tmp, reply)
    async with broken.server:
        svc = _scheduler(tmp, broken.endpoint, timeout_s=2.0, backoff_s=0.01, **client)
        try:
            (answer,) = await _submit_all(svc, 1)
        finally:
            await svc.close()
    return answer, svc, broken


@pytest.mark.parametrize(
    "reply",
    [
        lambda cmd: Scores([0.5] * (len(cmd.texts) - 1)),  # one reward short
        lambda cmd: Scores(["high"] * len(cmd.texts)),  # not numbers
        lambda cmd: Ok("scored"),  # not Scores at all
    ],
)
def test_bad_replies_are_counted_retried_and_drop_the_group(
    tmp_path: Path, reply: Callable[[ScoreGroup], Reply]
) -> None:
    answer, svc, broken = asyncio.run(_against(tmp_path, reply, retries=2, breaker_failures=5))
    assert isinstance(answer, Error), answer
    assert answer.code == "reward_error"
    assert "bad reply" in answer.message
    assert broken.calls == 3
    counters = svc.store.counters()
    assert counters["reward.bad_replies"] == 3
    assert counters["dropped_groups.reward_error"] == 1


def test_bad_replies_that_open_the_breaker_keep_the_group(tmp_path: Path) -> None:
    answer, svc, broken = asyncio.run(
        _against(tmp_path, lambda _: Ok(), retries=2, breaker_failures=2)
    )
    assert isinstance(answer, Error), answer
    assert answer.code == "reward_unavailable"
    assert broken.calls == 2  # the third try is refused by the open breaker
    counters = svc.store.counters()
    assert counters["reward.circuit_open"] == 1
    assert counters["reward.breaker.open"] == 1
    assert "dropped_groups.reward_error" not in counters
    (group,) = svc.store.groups()
    assert group.state == "issued"  # still the instance's: it submits again later
    assert group.reward_failures == 0


def test_scorer_errors_are_retried_without_opening_the_breaker(tmp_path: Path) -> None:
    # The service answered: it is well, the group is the problem (a judge's unparseable
    # reply, a checker that raised); the group is dropped as an in-process failure is.
    answer, svc, broken = asyncio.run(
        _against(
            tmp_path,
            lambda _: Error("reward_error", "judge: no 'Score: N'"),
            retries=2,
            breaker_failures=1,
        )
    )
    assert isinstance(answer, Error), answer
    assert answer.code == "reward_error"
    assert broken.calls == 3
    counters = svc.store.counters()
    assert counters["reward.errors"] == 3
    assert counters["dropped_groups.reward_error"] == 1
    assert "reward.breaker.open" not in counters
