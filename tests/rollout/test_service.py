"""The rollout core without an engine or a socket: submits, drain and hand-back.

The scheduler is an in-process ``Ask`` that records what it is sent and answers from a script;
the engine parts of the loop are covered with vLLM in test_rollout_daemon.py and test_up.py.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from deltarl.config.rl import RolloutConfig
from deltarl.engine.daemon import DaemonContext
from deltarl.rl.protocol import Heartbeat, SubmitGroup
from deltarl.rollout.service import RolloutService
from deltarl.transport.messages import Command, Error, Ok, Reply


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


def _service(scheduler: Scheduler, tmp_path: Path) -> RolloutService:
    cfg = RolloutConfig(
        control=f"ipc://{tmp_path}/r.sock",
        scheduler=f"ipc://{tmp_path}/s.sock",
        rollout_store="unused",
        idle_s=0.01,
    )
    return RolloutService(cfg, scheduler, DaemonContext("rollout"))


def test_a_submit_is_retried_until_the_scheduler_answers(tmp_path: Path) -> None:
    async def scenario() -> None:
        scheduler = Scheduler(TimeoutError("down"), ConnectionError("gone"), Ok())
        service = _service(scheduler, tmp_path)
        service.in_flight["g1"] = 0.0
        await service._submit("g1", [])
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
        service.in_flight["g1"] = 0.0
        await service._submit("g1", [])
        assert service.refused_groups == 1
        assert service.submitted_groups == 0
        await service.close()

    asyncio.run(scenario())


def test_drain_waits_for_the_groups_being_submitted(tmp_path: Path) -> None:
    async def scenario() -> None:
        scheduler = Scheduler(TimeoutError("down"), Ok())
        service = _service(scheduler, tmp_path)
        service.in_flight["g1"] = 0.0
        submit = asyncio.create_task(service._submit("g1", []))
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
        service.in_flight.update({"g1": 0.0, "g2": 0.0})
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
        service.in_flight["g1"] = 0.0
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
