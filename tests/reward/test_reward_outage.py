"""The reward daemon killed under a real scheduler daemon, and started again: the breaker
opens, submits are answered reward_unavailable (counted, the groups kept issued), the restart
closes it, scoring resumes, and nothing is lost: every group is pooled, none dropped, no
prompt is nearer abandonment. The test plays the rollout instance and the trainer over the
real control and samples sockets, as test_daemon_crash does."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

from deltarl.rl.protocol import (
    Batch,
    GetHistory,
    GetWork,
    History,
    SubmitGroup,
    TakeBatch,
    Work,
)
from deltarl.transport.messages import Error, GetStatus, Ok, Reply, Status
from tests.reward.helpers import ROOT, RewardDaemon
from tests.scheduler.helpers import encoded, samples
from tests.scheduler.test_daemon_crash import Client


def _scheduler_config(tmp: Path, reward_endpoint: str) -> Path:
    path = tmp / "scheduler.toml"
    path.write_text(f"""
[daemons.scheduler]
control = "ipc://{tmp}/scheduler.sock"
db = "{tmp}/scheduler.sqlite"
group_size = 2
groups_per_step = 4
pool_capacity = 8
max_policy_lag_steps = 1000
tick_s = 0.2

[daemons.scheduler.reward]
endpoint = "{reward_endpoint}"
timeout_s = 0.5
retries = 1
backoff_s = 0.05
breaker_failures = 2
breaker_cooldown_s = 1.0
""")
    return path


async def _submit(client: Client, group: dict[str, object]) -> Reply:
    gid = str(group["group_id"])
    ref = await client.put(encoded(gid, samples(group, 2)))
    return await client.ask(SubmitGroup("inst", "sess", gid, ref))


async def _status(client: Client) -> dict[str, object]:
    reply = await client.ask(GetStatus())
    assert isinstance(reply, Status), reply
    return reply.fields


async def _play(client: Client, reward: RewardDaemon) -> dict[str, int]:
    """The scheduler's counters at the end."""
    await reward.status()
    work = await client.ask(GetWork("inst", "sess", max_groups=4))
    assert isinstance(work, Work), work
    groups = work.groups
    assert len(groups) == 4
    for g in groups[:2]:
        assert await _submit(client, g) == Ok("pooled")

    reward.kill()
    first = await _submit(client, groups[2])  # two timeouts: the breaker opens
    assert isinstance(first, Error), first
    assert first.code == "reward_unavailable"
    t0 = time.monotonic()
    second = await _submit(client, groups[3])  # refused at once: the breaker is open
    assert isinstance(second, Error), second
    assert second.code == "reward_unavailable"
    assert time.monotonic() - t0 < 0.5
    fields = await _status(client)
    assert fields["reward"]["breaker"] == "open"  # type: ignore[index]
    counters = fields["counters"]
    assert counters["reward.breaker.open"] == 1  # type: ignore[index]
    assert counters["reward.circuit_open"] >= 1  # type: ignore[index]
    assert fields["groups"]["issued"] == 2  # type: ignore[index] - kept, not dropped

    reward.start()
    await reward.status()
    deadline = time.monotonic() + 30
    pending = list(groups[2:])
    while pending:  # what the rollout daemon does with reward_unavailable: again, later
        assert time.monotonic() < deadline, "scoring did not resume"
        reply = await _submit(client, pending[0])
        if reply == Ok("pooled"):
            pending.pop(0)
            continue
        assert isinstance(reply, Error), reply
        assert reply.code == "reward_unavailable"
        await asyncio.sleep(0.2)
    fields = await _status(client)
    assert fields["reward"]["breaker"] == "closed"  # type: ignore[index]
    counters = fields["counters"]
    assert counters["reward.breaker.closed"] == 1  # type: ignore[index]
    assert not [k for k in counters if k.startswith("dropped_")]  # type: ignore[union-attr]
    assert fields["groups"]["pooled"] == 4  # type: ignore[index]

    batch = await client.ask(TakeBatch(1, 4, trainer_version=0))
    assert isinstance(batch, Batch), batch
    assert len(batch.groups) == 4
    history = await client.ask(GetHistory())
    assert isinstance(history, History), history
    (step,) = history.steps
    assert step["reward_calls"] == 4
    assert 0 < step["reward_p50_s"] <= step["reward_p99_s"]
    assert step["reward_errors"] >= 3  # two timeouts and at least one refusal
    return dict(counters)  # type: ignore[call-overload]


def test_reward_daemon_killed_and_restarted_loses_nothing(tmp_path: Path) -> None:
    reward = RewardDaemon(tmp_path)
    config = _scheduler_config(tmp_path, reward.endpoint)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    log = (tmp_path / "scheduler.log").open("ab")
    cmd = [sys.executable, "-m", "deltarl.cli", "scheduler", "--config", str(config)]
    scheduler = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=log)
    reward.start()
    try:
        counters = asyncio.run(_play(Client(f"ipc://{tmp_path}/scheduler.sock"), reward))
    finally:
        reward.stop()
        scheduler.terminate()
        assert scheduler.wait(30) == 0
    text = (tmp_path / "scheduler.log").read_text()
    # Logged once per transition, not once per refused group (a probe sent before the
    # restarted daemon answered opens the breaker again: one more transition).
    assert text.count("circuit breaker open") == counters["reward.breaker.open"], text
    assert counters["reward.circuit_open"] > counters["reward.breaker.open"]
    assert text.count("breaker closed") == 1, text
