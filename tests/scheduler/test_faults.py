"""Injected faults the scheduler must survive: malformed samples, lost Work replies, and
retried submits of refused groups."""

from __future__ import annotations

import asyncio
import math
import threading
from pathlib import Path
from typing import Any

import pytest

from deltarl.rl.protocol import Heartbeat, SubmitGroup, TakeBatch
from deltarl.rl.samples import decode_group
from deltarl.scheduler.rows import PromptState
from deltarl.scheduler.service import SchedulerService
from deltarl.transport.blobs import blob_digest
from deltarl.transport.messages import Error, Ok, from_body
from tests.scheduler.helpers import encoded, make_service, samples, submission, work


def run(coro: Any) -> Any:
    return asyncio.run(coro)


# -- malformed samples are dropped before the pool ----------------------------------------


def _break(s: dict[str, Any], fault: str) -> None:
    """A sample the binary form can carry and ``decode_group`` refuses (types it cannot carry,
    a string log-probability or a float token id, are refused by ``Sample`` at the rollout)."""
    match fault:
        case "short_logprobs":
            s["logprobs"] = s["logprobs"][:-1]
        case "short_versions":
            s["token_versions"] = s["token_versions"][:-1]
        case "no_versions":
            s["token_versions"] = []
        case "negative_version":
            s["token_versions"][1] = -1
        case "nan_logprob":
            s["logprobs"][3] = math.nan
        case "inf_logprob":
            s["logprobs"][0] = -math.inf
        case "positive_logprob":
            s["logprobs"][0] = 0.5
        case "empty_prompt":
            s["prompt_token_ids"] = []
        case "negative_prompt_token":
            s["prompt_token_ids"] = [-1, 2]
        case "negative_token":
            s["token_ids"][0] = -3
        case "no_token_ids":
            s["token_ids"] = []
        case _:
            raise AssertionError(fault)


FAULTS = [
    "short_logprobs",
    "short_versions",
    "no_versions",
    "negative_version",
    "nan_logprob",
    "inf_logprob",
    "positive_logprob",
    "empty_prompt",
    "negative_prompt_token",
    "negative_token",
    "no_token_ids",
]


@pytest.mark.parametrize("fault", FAULTS)
def test_a_malformed_sample_drops_the_group_before_the_pool(tmp_path: Path, fault: str) -> None:
    async def go() -> None:
        svc, store, _ = make_service(tmp_path)
        (g,) = (await work(svc, n=1)).groups
        bad = samples(g, 4)
        _break(bad[2], fault)
        cmd = submission(svc, "a", "s1", g["group_id"], bad)
        reply = await svc.submit_group(cmd)
        assert isinstance(reply, Error), reply
        assert reply.code == "bad_samples"
        assert "sample 2" in reply.message
        c = store.counters()
        assert c["dropped_groups.bad_samples"] == 1
        assert c["dropped_samples.bad_samples"] == 4
        assert "pooled_groups" not in c
        assert store.group(0).state == PromptState.QUEUED
        assert store.get_blob(cmd.samples_ref) is None  # the refused blob is not kept
        # The prompt goes out again; good samples of the new attempt are pooled and shipped.
        (g2,) = (await work(svc, n=1)).groups
        assert g2["group_id"] == "0.1"
        ok = await svc.submit_group(submission(svc, "a", "s1", "0.1", samples(g2, 4)))
        assert isinstance(ok, Ok)

    run(go())


BLOB_FAULTS = {
    "missing": (lambda data: None, 0),
    "truncated": (lambda data: data[:-5], 0),
    "flipped_bit": (lambda data: data[:40] + bytes([data[40] ^ 4]) + data[41:], 0),
    "garbage": (lambda data: b"not samples at all", 0),
    "other_group": (lambda data: encoded("9.0", samples({"prompt": "Say a lot of a"}, 4)), 4),
}


@pytest.mark.parametrize("fault", sorted(BLOB_FAULTS))
def test_a_malformed_blob_drops_the_group_before_the_pool(tmp_path: Path, fault: str) -> None:
    """Samples whose bytes cannot be trusted are refused as bad_samples, counted by what a
    sound header says they hold (nothing, when the framing itself is broken)."""

    async def go() -> None:
        svc, store, _ = make_service(tmp_path)
        (g,) = (await work(svc, n=1)).groups
        corrupt, counted = BLOB_FAULTS[fault]
        data = corrupt(encoded(g["group_id"], samples(g, 4)))
        digest = blob_digest(data or b"never put")
        if data is not None:
            store.put_blob(digest, data)
        reply = await svc.submit_group(SubmitGroup("a", "s1", g["group_id"], digest))
        assert isinstance(reply, Error), reply
        assert reply.code == "bad_samples"
        c = store.counters()
        assert c["dropped_groups.bad_samples"] == 1
        assert c.get("dropped_samples.bad_samples", 0) == counted
        assert store.group(0).state == PromptState.QUEUED
        assert store.blob_stats()["blobs"] == 0

    run(go())


def test_a_prompt_that_always_yields_bad_samples_is_abandoned(tmp_path: Path) -> None:
    async def go() -> None:
        svc, store, _ = make_service(tmp_path, max_reward_failures=3)
        for attempt in range(3):
            (g,) = (await work(svc, n=1)).groups
            assert g["group_id"] == f"0.{attempt}"
            bad = samples(g, 4)
            bad[0]["logprobs"] = [math.nan] * 8
            reply = await svc.submit_group(submission(svc, "a", "s1", g["group_id"], bad))
            assert isinstance(reply, Error)
            assert reply.code == "bad_samples"
        assert "abandoned" in reply.message
        assert store.group(0).state == PromptState.ABANDONED
        c = store.counters()
        assert c["abandoned_prompts"] == 1
        assert c["dropped_groups.bad_samples"] == 3
        assert (await work(svc, n=1)).groups[0]["prompt_id"] == 1

    run(go())


# -- heartbeats that say what the instance holds -------------------------------------------


def test_the_heartbeat_fields_decode_and_default_to_the_old_behaviour() -> None:
    old = from_body(Heartbeat, {"instance": "a", "session": "s"})
    assert old.held == []
    assert old.reports_held is False
    new = from_body(
        Heartbeat, {"instance": "a", "session": "s", "held": ["0.0"], "reports_held": True}
    )
    assert new.held == ["0.0"]
    assert new.reports_held is True


def test_a_lost_work_reply_is_requeued_by_the_next_heartbeat(tmp_path: Path) -> None:
    async def go() -> None:
        svc, store, clock = make_service(tmp_path, pool_capacity=2, lease_s=300.0)
        w = await work(svc, "a", n=2)  # suppose the reply for group 1.0 was lost
        assert [g["group_id"] for g in w.groups] == ["0.0", "1.0"]
        # Within the grace the Work reply may still be on its way: nothing is taken back.
        await svc.heartbeat(Heartbeat("a", "s1", held=[], reports_held=True))
        assert store.state_counts()["issued"] == 2
        clock.advance(6.0)
        # An old client (no reports_held) keeps the old behaviour whatever held says.
        await svc.heartbeat(Heartbeat("a", "s1", held=[]))
        assert store.state_counts()["issued"] == 2
        # Another instance's report does not touch a's groups.
        await svc.heartbeat(Heartbeat("b", "t1", held=[], reports_held=True))
        assert store.state_counts()["issued"] == 2
        full = await work(svc, "a", n=1)
        assert full.reason.startswith("pool full")
        await svc.heartbeat(Heartbeat("a", "s1", held=["0.0"], reports_held=True))
        assert store.group(1).state == PromptState.QUEUED
        assert store.group(0).state == PromptState.ISSUED
        assert store.counters()["requeued.not_held"] == 1
        # Its pool slot is free at once, not after the 300 s lease.
        (again,) = (await work(svc, "b", "t1", n=1)).groups
        assert again["group_id"] == "1.1"
        # A late submit of the requeued attempt is refused as stale, counted once however
        # often it is retried.
        late = submission(svc, "a", "s1", "1.0", samples(w.groups[1], 4))
        for _ in range(3):
            reply = await svc.submit_group(late)
            assert isinstance(reply, Error)
            assert reply.code == "stale_group"
        c = store.counters()
        assert c["dropped_groups.stale_submit"] == 1
        assert c["dropped_samples.stale_submit"] == 4
        assert c["submit.duplicate"] == 2
        ok = await svc.submit_group(submission(svc, "a", "s1", "0.0", samples(w.groups[0], 4)))
        assert isinstance(ok, Ok)

    run(go())


def _blocking_reward(svc: SchedulerService, fail: bool = False) -> threading.Event:
    release = threading.Event()

    def reward(prompt: str, text: str) -> float:
        release.wait(5.0)
        if fail:
            raise ValueError("cannot parse")
        return 1.0

    svc.scorer.fn = reward
    return release


def test_a_group_being_scored_is_not_taken_back_by_a_heartbeat(tmp_path: Path) -> None:
    async def go() -> None:
        svc, store, clock = make_service(tmp_path)
        (g,) = (await work(svc, "a", n=1)).groups
        release = _blocking_reward(svc)
        # The daemon stopped listing the group once it sent the submit (a daemon should keep
        # it until the reply; the scheduler guards the scoring window anyway).
        task = asyncio.ensure_future(
            svc.submit_group(submission(svc, "a", "s1", g["group_id"], samples(g, 4)))
        )
        await asyncio.sleep(0.05)
        clock.advance(6.0)
        await svc.heartbeat(Heartbeat("a", "s1", held=[], reports_held=True))
        assert "requeued.not_held" not in store.counters()
        release.set()
        assert isinstance(await task, Ok)
        assert store.group(0).state == PromptState.POOLED

    run(go())


# -- a retried submit of a dropped group is answered the same and counted once ----------


def test_a_retried_submit_after_a_reward_drop_is_not_counted_again(tmp_path: Path) -> None:
    async def go() -> None:
        svc, store, _ = make_service(tmp_path, reward_retries=0)
        (g,) = (await work(svc, n=1)).groups
        release = _blocking_reward(svc, fail=True)
        release.set()
        cmd = submission(svc, "a", "s1", g["group_id"], samples(g, 4))
        first = await svc.submit_group(cmd)
        assert isinstance(first, Error)
        assert first.code == "reward_error"
        again = await svc.submit_group(cmd)  # the client lost the first reply
        assert again == first
        store.close()
        # The answer is durable: a restarted scheduler gives it too.
        svc2, store2, _ = make_service(tmp_path, reward_retries=0)
        assert await svc2.submit_group(cmd) == first
        c = store2.counters()
        assert c["dropped_groups.reward_error"] == 1
        assert c["dropped_samples.reward_error"] == 4
        assert "dropped_groups.stale_submit" not in c
        assert "dropped_samples.stale_submit" not in c
        assert c["submit.duplicate"] == 2

    run(go())


def test_a_retried_submit_after_bad_samples_is_not_counted_again(tmp_path: Path) -> None:
    async def go() -> None:
        svc, store, _ = make_service(tmp_path)
        (g,) = (await work(svc, n=1)).groups
        cmd = submission(svc, "a", "s1", g["group_id"], samples(g, 3))
        first = await svc.submit_group(cmd)
        assert isinstance(first, Error)
        assert first.code == "bad_samples"
        assert await svc.submit_group(cmd) == first
        c = store.counters()
        assert c["dropped_groups.bad_samples"] == 1
        assert "dropped_groups.stale_submit" not in c

    run(go())


def test_a_reward_failure_after_the_lease_ran_out_is_counted_once_as_stale(
    tmp_path: Path,
) -> None:
    async def go() -> None:
        svc, store, clock = make_service(tmp_path, reward_retries=0, lease_s=30.0)
        (g,) = (await work(svc, n=1)).groups
        release = _blocking_reward(svc, fail=True)
        cmd = submission(svc, "a", "s1", g["group_id"], samples(g, 4))
        task = asyncio.ensure_future(svc.submit_group(cmd))
        await asyncio.sleep(0.05)
        clock.advance(31.0)
        svc.expire()  # requeued while it is scored
        release.set()
        first = await task
        assert isinstance(first, Error)
        assert first.code == "stale_group"
        assert await svc.submit_group(cmd) == first
        c = store.counters()
        assert c["dropped_groups.stale_submit"] == 1
        assert c["dropped_samples.stale_submit"] == 4
        assert "dropped_groups.reward_error" not in c

    run(go())


def test_a_batch_never_holds_a_malformed_sample(tmp_path: Path) -> None:
    async def go() -> None:
        svc, store, _ = make_service(tmp_path)
        w = await work(svc, n=2)
        good, bad = w.groups
        bad_samples = samples(bad, 4)
        bad_samples[1]["token_versions"] = [0]
        await svc.submit_group(submission(svc, "a", "s1", good["group_id"], samples(good, 4)))
        await svc.submit_group(submission(svc, "a", "s1", bad["group_id"], bad_samples))
        (again,) = (await work(svc, n=1)).groups
        await svc.submit_group(submission(svc, "a", "s1", again["group_id"], samples(again, 4)))
        batch = await svc.take_batch(TakeBatch(step=1, groups=2, trainer_version=0))
        for g in batch.groups:
            decoded = decode_group(store.get_blob(g["samples_ref"]))  # raises if malformed
            assert len(decoded.samples) == len(g["rewards"]) == 4
            for s in decoded.samples:
                assert len(s.token_ids) == len(s.logprobs) == len(s.token_versions)
        assert store.state_counts()["shipped"] == 2

    run(go())
