"""The rollout core without an engine or a socket: submits, drain and hand-back.

The scheduler is an in-process ``Ask`` that records what it is sent and answers from a script,
and its samples endpoint an in-process put that keeps the blobs; the engine parts of the loop
are covered with vLLM in test_rollout_daemon.py and test_up.py.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from deltarl.config.rl import RolloutConfig
from deltarl.engine.daemon import DaemonContext
from deltarl.rl.protocol import Heartbeat, SubmitGroup
from deltarl.rl.samples import decode_group
from deltarl.rollout.service import RolloutService, _differing
from deltarl.transport.blobs import BlobTooLargeError, blob_digest
from deltarl.transport.messages import Command, Error, Ok, Reply

SAMPLE = {
    "prompt_token_ids": [1, 2],
    "token_ids": [3, 4, 5],
    "logprobs": [-0.1, -0.2, -0.3],
    "token_versions": [7, 7, 7],
    "text": "abc",
    "finish_reason": "length",
}


class Scheduler:
    """Answers each command with the next scripted answer (an exception is raised)."""

    def __init__(self, *answers: Reply | Exception) -> None:
        self.answers = list(answers)
        self.sent: list[Command] = []

    async def __call__(self, command: Command, timeout_s: float) -> Reply:
        self.sent.append(command)
        answer = self.answers.pop(0) if self.answers else Ok()
        if isinstance(answer, Exception):
            raise answer
        return answer


class Samples:
    """The scheduler's samples endpoint: keeps what is put, after scripted failures."""

    def __init__(self, *failures: Exception) -> None:
        self.failures = list(failures)
        self.blobs: dict[str, bytes] = {}
        self.puts = 0

    async def __call__(self, data: bytes, timeout_s: float) -> str:
        self.puts += 1
        if self.failures:
            raise self.failures.pop(0)
        self.blobs[blob_digest(data)] = data
        return blob_digest(data)


def _service(
    scheduler: Scheduler, tmp_path: Path, samples: Samples | None = None
) -> RolloutService:
    cfg = RolloutConfig(
        control=f"ipc://{tmp_path}/r.sock",
        scheduler=f"ipc://{tmp_path}/s.sock",
        rollout_store="unused",
        idle_s=0.01,
    )
    service = RolloutService(cfg, scheduler, DaemonContext("rollout"), samples or Samples())
    service.prompt_ids.update({"1.0": 1, "2.0": 2})
    return service


async def _submitted(service: RolloutService, group_id: str, samples: list[dict[str, Any]]) -> None:
    """Submit as the daemon's loop does (a task beside the engine's steps) and wait for it."""
    service._submit_beside(group_id, samples)
    await asyncio.gather(*service._submits)
    if service._submit_failure is not None:
        raise service._submit_failure


def test_a_finished_group_is_put_then_submitted_by_digest(tmp_path: Path) -> None:
    async def scenario() -> None:
        scheduler, samples = Scheduler(), Samples()
        service = _service(scheduler, tmp_path, samples)
        service.in_flight["1.0"] = 0.0
        await _submitted(service, "1.0", [SAMPLE, SAMPLE])
        (submit,) = scheduler.sent
        assert isinstance(submit, SubmitGroup)
        group = decode_group(samples.blobs[submit.samples_ref])
        assert (group.group_id, group.prompt_id, len(group.samples)) == ("1.0", 1, 2)
        assert group.samples[0].token_ids.tolist() == [3, 4, 5]
        assert group.samples[1].text == "abc"
        assert service.submitted_groups == 1
        assert "1.0" not in service.prompt_ids
        assert RolloutConfig("ipc:///x/r.sock", "ipc:///x/s.sock", "r").samples_endpoint == (
            "ipc:///x/s.sock.samples"
        )
        await service.close()

    asyncio.run(scenario())


def test_a_put_nobody_answers_is_retried_and_a_refused_one_drops_the_group(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        scheduler, samples = Scheduler(), Samples(TimeoutError("down"), ConnectionError("x"))
        service = _service(scheduler, tmp_path, samples)
        service.in_flight["1.0"] = 0.0
        await _submitted(service, "1.0", [SAMPLE])
        assert samples.puts == 3
        assert [type(c) for c in scheduler.sent] == [SubmitGroup]
        too_large = Samples(BlobTooLargeError("a blob of 9 bytes is over the bound of 8"))
        refused = _service(Scheduler(), tmp_path, too_large)
        await _submitted(refused, "2.0", [SAMPLE])
        assert refused.refused_groups == 1
        assert not refused.submitting
        # Samples the binary form cannot carry are not submitted; the scheduler requeues them.
        await _submitted(refused, "1.0", [{**SAMPLE, "token_ids": ["x", "y", "z"]}])
        assert refused.failed_groups == 1
        await service.close()
        await refused.close()

    asyncio.run(scenario())


def test_a_submit_is_retried_until_the_scheduler_answers(tmp_path: Path) -> None:
    async def scenario() -> None:
        scheduler = Scheduler(TimeoutError("down"), ConnectionError("gone"), Ok())
        service = _service(scheduler, tmp_path)
        service.in_flight["1.0"] = 0.0
        await _submitted(service, "1.0", [])
        assert [type(c) for c in scheduler.sent] == [SubmitGroup] * 3
        assert service.submitted_groups == 1
        assert not service.in_flight
        assert not service.submitting
        await service.close()

    asyncio.run(scenario())


def test_a_refused_group_is_dropped_and_counted(tmp_path: Path) -> None:
    async def scenario() -> None:
        scheduler = Scheduler(Error("stale_group", "lease expired"))
        service = _service(scheduler, tmp_path)
        service.in_flight["1.0"] = 0.0
        await _submitted(service, "1.0", [])
        assert service.refused_groups == 1
        assert service.submitted_groups == 0
        await service.close()

    asyncio.run(scenario())


def test_a_submit_refused_for_reward_unavailable_is_held_and_sent_again(tmp_path: Path) -> None:
    # The scheduler's reward service is out and it kept the group issued: not a refusal.
    async def scenario() -> None:
        scheduler = Scheduler(Error("reward_unavailable", "circuit breaker open"), Ok())
        service = _service(scheduler, tmp_path)
        service.in_flight["1.0"] = 0.0
        submit = asyncio.ensure_future(_submitted(service, "1.0", [SAMPLE]))
        while len(scheduler.sent) < 1:  # noqa: ASYNC110 - the scripted scheduler has no event
            await asyncio.sleep(0.01)
        assert service.submitting == {"1.0"}  # still held: heartbeats keep listing it
        await submit
        assert [type(c) for c in scheduler.sent] == [SubmitGroup] * 2
        assert (service.submitted_groups, service.refused_groups) == (1, 0)
        assert service.status_fields()["reward_waits"] == 1
        await service.close()

    asyncio.run(scenario())


def test_drain_waits_for_the_groups_being_submitted(tmp_path: Path) -> None:
    async def scenario() -> None:
        scheduler = Scheduler(TimeoutError("down"), Ok())
        service = _service(scheduler, tmp_path)
        service.in_flight["1.0"] = 0.0
        submit = asyncio.create_task(_submitted(service, "1.0", []))
        await asyncio.sleep(0)
        drain = asyncio.create_task(service.drain())
        await asyncio.sleep(0.1)
        assert not drain.done()  # the submit is being retried (0.5 s between tries)
        await asyncio.wait_for(drain, 5)
        assert submit.done()
        assert service.submitted_groups == 1
        assert service.draining
        await service.close()
        # Nothing was unfinished: no hand-back heartbeat.
        assert not any(isinstance(c, Heartbeat) for c in scheduler.sent)

    asyncio.run(scenario())


def test_close_hands_back_unfinished_groups(tmp_path: Path) -> None:
    async def scenario() -> None:
        scheduler = Scheduler()
        service = _service(scheduler, tmp_path)
        service.in_flight.update({"1.0": 0.0, "2.0": 0.0})
        await service.close()
        (beat,) = scheduler.sent
        assert isinstance(beat, Heartbeat)
        assert beat.held == []
        assert beat.reports_held
        assert beat.session == service.session

    asyncio.run(scenario())


def test_a_hand_back_nobody_hears_does_not_fail_the_close(tmp_path: Path) -> None:
    async def scenario() -> None:
        scheduler = Scheduler(TimeoutError("down"))
        service = _service(scheduler, tmp_path)
        service.in_flight["1.0"] = 0.0
        await service.close()  # the leases run out instead; no exception
        assert len(scheduler.sent) == 1

    asyncio.run(scenario())


def test_status_fields_say_what_the_core_does(tmp_path: Path) -> None:
    async def scenario() -> None:
        service = _service(Scheduler(), tmp_path)
        assert service.state() == "running"
        service.gate.pause()
        assert service.state() == "paused"
        fields = service.status_fields()
        assert fields["instance"] == "rollout"
        assert fields["detail"] == "starting"
        await service.close()

    asyncio.run(scenario())


def test_a_submit_beside_the_steps_that_fails_stops_the_loop(tmp_path: Path) -> None:
    # The injected fault: the samples endpoint raises what no retry handles (a bug). The
    # submit runs in a task of its own; the daemon's next round raises it, as the submit
    # did when it ran between steps.
    async def scenario() -> None:
        service = _service(Scheduler(), tmp_path, Samples(RuntimeError("a bug in the put")))
        service.in_flight["1.0"] = 0.0
        service._submit_beside("1.0", [SAMPLE])
        assert service.submitting == {"1.0"}  # counted as submitting at once
        assert not service.in_flight
        while service._submits:  # noqa: ASYNC110 - the task's end has no event of its own
            await asyncio.sleep(0.01)
        with pytest.raises(RuntimeError, match="a bug in the put"):
            await service._one_round()
        await service.close()

    asyncio.run(scenario())


def test_a_digest_mismatch_names_the_tensors_that_differ() -> None:
    """What the operator reads in ``unverified`` and the log when the engine's digest is not
    the manifest's: the tensors the worker found held otherwise than the committed digests."""
    assert _differing({"differ": [], "differ_count": 0}) == ""
    assert _differing({}) == ""  # a worker of an older deltarl names none
    assert _differing({"differ": ["a.w"], "differ_count": 1}) == " (tensors that differ: a.w)"
    many = {"differ": ["a", "b"], "differ_count": 5}
    assert _differing(many) == " (tensors that differ: a, b and 3 more)"
