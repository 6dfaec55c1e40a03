"""The daemon runtime (deltarl/engine/daemon.py) with a small core, in one process, over real
ZeroMQ control sockets."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import pytest

from deltarl.engine.daemon import DaemonContext, DaemonCore, PauseGate, serve
from deltarl.engine.supervisor import EscalationError
from deltarl.transport.control import ControlClient, Handler
from deltarl.transport.messages import (
    Command,
    Drain,
    Error,
    GetStatus,
    Ok,
    Pause,
    Reply,
    Resume,
    Resync,
    Rollback,
    Shutdown,
    Status,
)


class Core(DaemonCore):
    """Works in numbered items; ``drain`` lets the item in flight finish and takes no more."""

    daemon: ClassVar[str] = "toy"

    def __init__(self, *, fail: Exception | None = None, finish: bool = False) -> None:
        self.gate = PauseGate()
        self.fail = fail
        self.finish = finish
        self.items_done = 0
        self.in_flight = False
        self.draining = False
        self.drained = False
        self.closed = 0
        self.hold_drain = False
        self.running_now = 0
        self.max_running = 0
        self.item_s = 0.05

    async def run(self) -> None:
        if self.fail is not None:
            await asyncio.sleep(0.05)
            raise self.fail
        if self.finish:
            return
        while not self.draining:
            if self.gate is not None:
                await self.gate.resumed()
            self.in_flight = True
            await asyncio.sleep(self.item_s)
            self.items_done += 1
            self.in_flight = False
        await asyncio.Event().wait()

    async def drain(self) -> None:
        self.draining = True
        while self.in_flight or self.hold_drain:  # noqa: ASYNC110 - a test's knobs
            await asyncio.sleep(0.01)
        self.drained = True

    async def close(self) -> None:
        self.closed += 1

    def status_fields(self) -> dict[str, Any]:
        return {"items_done": self.items_done}

    async def _slow(self, _: Command) -> Reply:
        self.running_now += 1
        self.max_running = max(self.max_running, self.running_now)
        await asyncio.sleep(0.1)
        self.running_now -= 1
        return Ok("done")

    def handlers(self) -> Mapping[type[Command], Handler]:
        return {Resync: self._slow}

    def concurrent_handlers(self) -> Mapping[type[Command], Handler]:
        return {Rollback: self._slow}


def _endpoint(tmp_path: Path) -> str:
    return f"ipc://{tmp_path}/toy.sock"


async def _run(core: DaemonCore, tmp_path: Path, drain_timeout_s: float = 5.0) -> asyncio.Task:
    async def build(_: DaemonContext) -> DaemonCore:
        return core

    task = asyncio.create_task(
        serve("toy", _endpoint(tmp_path), build, drain_timeout_s=drain_timeout_s)
    )
    await asyncio.sleep(0.2)  # bound and started
    return task


def test_status_pause_resume_and_runtime_fields(tmp_path: Path) -> None:
    async def scenario() -> None:
        core = Core()
        task = await _run(core, tmp_path)
        async with ControlClient(_endpoint(tmp_path)) as client:
            st = await client.request(GetStatus())
            assert isinstance(st, Status)
            assert (st.daemon, st.state) == ("toy", "running")
            assert "items_done" in st.fields
            runtime = st.fields["runtime"]
            assert runtime["pid"] == os.getpid()
            assert runtime["draining"] is False
            assert set(runtime["mailboxes"]) == {"toy:control", "toy:core"}
            assert runtime["loop_lag"]["interval_s"] > 0
            assert await client.request(Pause()) == Ok("paused")
            assert await client.request(Pause()) == Ok("already paused")
            await asyncio.sleep(0.15)
            done = core.items_done
            await asyncio.sleep(0.2)
            assert core.items_done <= done + 1  # at most the item in flight finished
            st = await client.request(GetStatus())
            assert st.state == "paused"
            assert await client.request(Resume()) == Ok("resumed")
            await asyncio.sleep(0.2)
            assert core.items_done > done + 1
            assert await client.request(Shutdown()) == Ok("stopping")
        await task
        assert core.closed == 1
        assert not core.drained  # shutdown stops; it does not drain

    asyncio.run(scenario())


def test_core_commands_are_serialised_concurrent_ones_are_not(tmp_path: Path) -> None:
    async def scenario() -> None:
        core = Core()
        task = await _run(core, tmp_path)
        async with ControlClient(_endpoint(tmp_path)) as client:
            replies = await asyncio.gather(*(client.request(Resync()) for _ in range(3)))
            assert replies == [Ok("done")] * 3
            assert core.max_running == 1  # one at a time, through the core's mailbox
            core.max_running = 0
            await asyncio.gather(*(client.request(Rollback()) for _ in range(3)))
            assert core.max_running == 3  # concurrent handlers bypass the mailbox
            st = await client.request(GetStatus())
            assert st.fields["runtime"]["mailboxes"]["toy:core"]["total_received"] == 3
            await client.request(Shutdown())
        await task

    asyncio.run(scenario())


def test_a_core_without_a_gate_does_not_pause(tmp_path: Path) -> None:
    async def scenario() -> None:
        core = Core()
        core.gate = None
        task = await _run(core, tmp_path)
        async with ControlClient(_endpoint(tmp_path)) as client:
            reply = await client.request(Pause())
            assert isinstance(reply, Error)
            assert reply.code == "unsupported"
            await client.request(Shutdown())
        await task

    asyncio.run(scenario())


def test_drain_finishes_the_work_in_flight_then_stops(tmp_path: Path) -> None:
    async def scenario() -> None:
        core = Core()
        core.item_s = 0.3
        task = await _run(core, tmp_path)
        async with ControlClient(_endpoint(tmp_path)) as client:
            while not core.in_flight:  # noqa: ASYNC110 - the core's state
                await asyncio.sleep(0.01)
            core.hold_drain = True  # keep draining long enough to ask for status meanwhile
            reply = await client.request(Drain())
            assert isinstance(reply, Ok)
            assert "draining" in reply.detail
            await asyncio.sleep(0.1)
            st = await client.request(GetStatus())  # still answered while the core drains
            assert st.state == "draining"
            assert st.fields["runtime"]["stop_reason"] == "drain command"
            core.hold_drain = False
        await task
        assert core.drained
        assert not core.in_flight  # the item in flight finished, none started after
        assert core.closed == 1

    asyncio.run(scenario())


def test_a_drain_that_does_not_finish_is_cut_short(tmp_path: Path) -> None:
    async def scenario() -> None:
        core = Core()
        core.hold_drain = True  # never finishes
        task = await _run(core, tmp_path, drain_timeout_s=0.3)
        async with ControlClient(_endpoint(tmp_path)) as client:
            await client.request(Drain())
        await asyncio.wait_for(task, 5)
        assert not core.drained
        assert core.closed == 1

    asyncio.run(scenario())


def test_sigterm_drains_and_sigint_stops(tmp_path: Path) -> None:
    async def scenario(sig: signal.Signals) -> Core:
        core = Core()
        task = await _run(core, tmp_path)
        os.kill(os.getpid(), sig)
        await asyncio.wait_for(task, 5)
        return core

    assert asyncio.run(scenario(signal.SIGTERM)).drained
    core = asyncio.run(scenario(signal.SIGINT))
    assert not core.drained
    assert core.closed == 1


def test_a_failing_work_loop_takes_the_daemon_down(tmp_path: Path) -> None:
    async def scenario() -> None:
        core = Core(fail=RuntimeError("engine died"))
        task = await _run(core, tmp_path)
        with pytest.raises(EscalationError) as info:
            await asyncio.wait_for(task, 5)
        assert isinstance(info.value.__cause__, RuntimeError)
        assert str(info.value.__cause__) == "engine died"
        assert core.closed == 1

    asyncio.run(scenario())


def test_work_that_ends_stops_the_daemon(tmp_path: Path) -> None:
    async def scenario() -> None:
        core = Core(finish=True)
        task = await _run(core, tmp_path)
        await asyncio.wait_for(task, 5)
        assert core.closed == 1

    asyncio.run(scenario())


def test_a_build_error_binds_nothing(tmp_path: Path) -> None:
    async def build(_: DaemonContext) -> DaemonCore:
        raise ValueError("bad config")

    async def scenario() -> None:
        with pytest.raises(ValueError, match="bad config"):
            await serve("toy", _endpoint(tmp_path), build)
        assert not (tmp_path / "toy.sock").exists()

    asyncio.run(scenario())
