"""The real ``deltarl scheduler`` daemon, killed with SIGKILL mid-run and restarted: every prompt
is trained exactly once. The test itself plays a rollout instance and a trainer through the real
protocol over the real control and samples sockets, retrying each request until it is answered,
as the real clients do; the trainer also "crashes" once and replays from its last checkpoint.
"""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from deltarl.rl.protocol import (
    REPLIES,
    Batch,
    Checkpointed,
    GetWork,
    Heartbeat,
    StepDone,
    SubmitGroup,
    TakeBatch,
    Work,
)
from deltarl.rl.samples import decode_group
from deltarl.scheduler.store import SchedulerStore
from deltarl.transport.blobs import BlobClient, BlobProtocolError, BlobTimeoutError
from deltarl.transport.control import ControlClient, ControlProtocolError, ControlTimeoutError
from deltarl.transport.messages import Command, Error, GetStatus, Reply, Status
from tests.scheduler.helpers import encoded, samples

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = 30
GROUPS_PER_STEP = 3
STEPS = PROMPTS // GROUPS_PER_STEP
GROUP_SIZE = 2
KILLS = 8


def _config(tmp: Path) -> Path:
    path = tmp / "deltarl.toml"
    path.write_text(f"""
[daemons.scheduler]
control = "ipc://{tmp}/scheduler.sock"
db = "{tmp}/scheduler.sqlite"
group_size = {GROUP_SIZE}
groups_per_step = {GROUPS_PER_STEP}
pool_capacity = 9
dataset_size = {PROMPTS}
max_policy_lag_steps = 1000
on_lag_exceeded = "drop"
lease_s = 3.0
heartbeat_timeout_s = 5.0
tick_s = 0.2
seed = 7

[daemons.scheduler.sampling]
temperature = 1.0
max_tokens = 8
""")
    return path


class Daemon:
    def __init__(self, config: Path, tmp: Path) -> None:
        self.config = config
        self.log = (tmp / "scheduler.log").open("ab")
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        cmd = [sys.executable, "-m", "deltarl.cli", "scheduler", "--config", str(self.config)]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.log, stderr=self.log)
        self.starts += 1

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()  # SIGKILL: no cleanup of any kind
        self.proc.wait(10)


class Client:
    """Retries every request until a reply comes: the commands are idempotent by design."""

    def __init__(self, endpoint: str) -> None:
        self.client = ControlClient(endpoint, replies=REPLIES)
        self.blobs = BlobClient(f"{endpoint}.samples")  # the derived samples endpoint
        self.requests = 0

    async def put(self, data: bytes) -> str:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                return await self.blobs.put(data, timeout=2.0)
            except (BlobTimeoutError, BlobProtocolError):
                await asyncio.sleep(0.1)
        raise AssertionError("no answer to a put in 60 s")

    async def get(self, refs: list[str]) -> list[bytes]:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                return await self.blobs.get(refs, timeout=2.0)
            except (BlobTimeoutError, BlobProtocolError):
                await asyncio.sleep(0.1)
        raise AssertionError("no answer to a get in 60 s")

    async def ask(self, command: Command) -> Reply:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            self.requests += 1
            try:
                return await self.client.request(command, timeout=2.0)
            except (ControlTimeoutError, ControlProtocolError):
                await asyncio.sleep(0.1)
        raise AssertionError(f"no reply to {command.TAG} in 60 s")


def _snapshot(db: Path) -> tuple[Any, ...]:
    with SchedulerStore(db, readonly=True) as store:
        return (store.cursor, store.state_counts(), store.counters(), store.history())


async def _play(
    daemon: Daemon, endpoint: str, db: Path, rng: random.Random
) -> dict[int, list[int]]:
    """Instance and trainer, interleaved; SIGKILL the scheduler now and then, mid-request."""
    client = Client(endpoint)
    trained: dict[int, list[int]] = {}
    step, checkpointed, trainer_crashed = 1, 0, False
    kills = {"before": 0, "after": 0}
    next_kill = 5

    async def ask(command: Command) -> Reply:
        """Every ninth request or so (not a heartbeat: it writes nothing), SIGKILL the
        scheduler while it is in flight, alternately (1) a few milliseconds in, most often
        before its change commits, and (2) once its change is in the store, before the client
        reads the reply. Either way the reply is lost and the client asks again."""
        nonlocal next_kill
        if (
            client.requests < next_kill
            or isinstance(command, Heartbeat)
            or sum(kills.values()) >= KILLS
        ):
            return await client.ask(command)
        next_kill = client.requests + 9
        mode = "after" if sum(kills.values()) % 2 else "before"
        before = _snapshot(db)
        lost = asyncio.ensure_future(client.ask(command))
        if mode == "before":
            await asyncio.sleep(rng.uniform(0.0, 0.004))
        else:
            until = time.monotonic() + 2.0  # an empty Work or Batch changes nothing
            # Polling: the change is written by another process, no event can tell us.
            while _snapshot(db) == before and time.monotonic() < until:  # noqa: ASYNC110
                await asyncio.sleep(0.002)
        daemon.kill()
        lost.cancel()
        kills[mode] += 1
        daemon.start()
        return await client.ask(command)

    deadline = time.monotonic() + 240
    while step <= STEPS:
        assert time.monotonic() < deadline, f"stuck at step {step}"
        await ask(Heartbeat("inst", "sess-1", weight_version=step - 1))
        work = await ask(GetWork("inst", "sess-1", max_groups=3, weight_version=step - 1))
        assert isinstance(work, Work), work
        for g in work.groups:
            good = rng.random() < 0.5
            data = encoded(g["group_id"], samples(g, g["n"], step - 1, good))
            ref = await client.put(data)
            reply = await ask(SubmitGroup("inst", "sess-1", g["group_id"], ref))
            assert not isinstance(reply, Error) or reply.code == "stale_group", reply
        batch = await ask(TakeBatch(step, GROUPS_PER_STEP, trainer_version=step - 1))
        assert isinstance(batch, Batch), batch
        if not batch.groups:
            await asyncio.sleep(batch.wait_s)
            continue
        ids = [g["prompt_id"] for g in batch.groups]
        # What the trainer does: the samples by reference from the samples socket.
        blobs = await client.get([g["samples_ref"] for g in batch.groups])
        for g, blob in zip(batch.groups, blobs, strict=True):
            assert decode_group(blob).group_id == g["group_id"]
            assert len(g["rewards"]) == GROUP_SIZE
        if step in trained:  # a replay after the trainer's crash: the very same groups
            assert trained[step] == ids
        trained[step] = ids
        await ask(StepDone(step, step, {"step_s": 0.01, "loss": 1.0 / step}))
        if step % 2 == 0:
            await ask(Checkpointed(step))
            checkpointed = step
        if step == 5 and not trainer_crashed:
            # The trainer dies after step 5 and restarts from the checkpoint of step 4.
            trainer_crashed = True
            step = checkpointed + 1
            continue
        step += 1
    await ask(Checkpointed(STEPS))
    await client.client.close()
    await client.blobs.close()
    return trained


def _ctl(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "deltarl.cli", "ctl", "scheduler", *args, "--config", str(config)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )


def test_kill_9_of_the_scheduler_trains_every_prompt_exactly_once(tmp_path):
    config = _config(tmp_path)
    daemon = Daemon(config, tmp_path)
    daemon.start()
    endpoint = f"ipc://{tmp_path}/scheduler.sock"
    try:
        trained = asyncio.run(
            _play(daemon, endpoint, tmp_path / "scheduler.sqlite", random.Random(11))
        )
        assert daemon.starts == 1 + KILLS

        order = [p for s in sorted(trained) for p in trained[s]]
        assert sorted(order) == list(range(PROMPTS))  # none twice, none skipped
        assert sorted(trained) == list(range(1, STEPS + 1))

        with SchedulerStore(tmp_path / "scheduler.sqlite", readonly=True) as store:
            assert store.cursor == PROMPTS
            assert store.state_counts()["trained"] == PROMPTS
            assert store.starts() == 1 + KILLS
            counters = store.counters()
            blobs = store.blob_stats()
        assert counters["trained_groups"] == PROMPTS
        assert blobs["blobs"] == blobs["unreferenced"]  # trained groups released theirs
        print("counters after the kills:", counters)  # which paths the kills exercised
        # Replies lost after the commit: a Work nobody received (its lease ran out and the
        # prompts went out again) and a submit sent twice were among them.
        assert counters.get("requeued.lease_expired", 0) + counters.get("submit.duplicate", 0) > 0

        status = asyncio.run(_status(endpoint))
        assert status.fields["cursor"] == PROMPTS
        assert status.fields["pool"]["capacity"] == 9
        assert "inst" in status.fields["instances"]

        js = _ctl(config, "history", "--json")
        assert js.returncode == 0, js.stderr
        report: dict[str, Any] = orjson.loads(js.stdout)
        body = report["reply"]["body"]
        assert [s["step"] for s in body["steps"]] == list(range(1, STEPS + 1))
        assert all(
            s["checkpointed"] and s["samples"] == GROUP_SIZE * GROUPS_PER_STEP
            for s in body["steps"]
        )
        assert all(0.0 <= s["reward_mean"] <= 1.0 for s in body["steps"])
        assert body["steps"][-1]["metrics"]["loss"] == 1.0 / STEPS
        assert body["config"]["dataset_size"] == PROMPTS
        assert body["config"]["sampling"]["max_tokens"] == 8

        table = _ctl(config, "history")
        assert table.returncode == 0, table.stderr
        assert table.stdout.splitlines()[0].split()[:2] == ["step", "trainer"]
        assert len(table.stdout.splitlines()) == 1 + STEPS + 1  # header, steps, drops

        down = _ctl(config, "shutdown")
        assert down.returncode == 0, down.stderr
        assert daemon.proc is not None
        assert daemon.proc.wait(15) == 0
    finally:
        if daemon.proc is not None and daemon.proc.poll() is None:
            daemon.kill()
        daemon.log.close()


async def _status(endpoint: str) -> Status:
    async with ControlClient(endpoint, replies=REPLIES) as client:
        reply = await client.request(GetStatus(), timeout=5.0)
    assert isinstance(reply, Status), reply
    return reply


def test_a_bad_config_exits_with_ex_config(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text(f"""
[daemons.scheduler]
control = "ipc://{tmp_path}/s.sock"
db = "{tmp_path}/s.sqlite"
on_lag_exceeded = "wait"
""")
    cmd = [sys.executable, "-m", "deltarl.cli", "scheduler", "--config", str(path)]
    done = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 78
    assert "on_lag_exceeded" in done.stderr
    path.write_text(
        path.read_text().replace('"wait"', '"drop"') + "[daemons.scheduler.sampling]\ntop_k = 5\n"
    )
    done = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 78
    assert "top_k" in done.stderr
