"""Data-parallel trainer ranks (deltarl/trainer/ranks.py) as real processes.

Two runs of the trainer daemon with ``ranks = 2`` against the test scheduler of
tests/trainer/test_daemon.py. Run A trains 7 steps uninterrupted (a checkpoint every step).
Run B checkpoints every 3 steps and loses a rank twice:

1. after step 4 its second rank (a process the daemon started) is killed with SIGKILL: rank 0
   fails at its next collective, checkpoints its last whole step (4) and exits 1;
2. started again, as its supervisor would, it starts a fresh second rank, both restore step
   4, and after step 5 rank 0 itself is killed with SIGKILL: its second rank dies with it;
3. started a third time, both ranks restore step 4 again, step 5 is replayed, and the run ends.

Every version B publishes, the replayed one included, is the same bytes as A's of that number.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
from pathlib import Path

import pytest
import torch

from deltarl.trainer.checkpoint import Checkpointer
from deltarl.trainer.ranks import share
from deltarl.transport.control import ControlClient
from tests.trainer.test_daemon import (
    STEPS,
    SchedulerPeer,
    finish_run,
    start,
    status,
    wait_for,
    write_config,
)
from tests.trainer.tiny import save_tiny_model

RANKS = "ranks = 2"


def children(pid: int) -> list[int]:
    """The processes ``pid`` started, from any of its threads (the training thread starts
    the ranks)."""
    return [
        int(c)
        for task in Path(f"/proc/{pid}/task").iterdir()
        for c in (task / "children").read_text().split()
    ]


async def run_a(run: Path, model_dir: Path) -> SchedulerPeer:
    config, log = write_config(run, model_dir, 1, RANKS), run / "trainer.log"
    peer = SchedulerPeer(run)
    async with (
        peer.server(f"ipc://{run}/scheduler.sock"),
        ControlClient(f"ipc://{run}/trainer.sock") as client,
    ):
        proc = start(config, log)
        try:
            await finish_run(client, proc, log)
        finally:
            proc.kill()
            proc.wait()
    return peer


async def run_b(run: Path, model_dir: Path) -> tuple[SchedulerPeer, list[int]]:
    config, log = write_config(run, model_dir, 3, RANKS), run / "trainer.log"
    peer = SchedulerPeer(run, hold_from=5)
    codes = []
    async with (
        peer.server(f"ipc://{run}/scheduler.sock"),
        ControlClient(f"ipc://{run}/trainer.sock") as client,
    ):

        async def held() -> bool:
            return peer.held.is_set()

        proc = start(config, log)
        try:
            await wait_for("step 5 to be asked", held, proc, log)
            st = await status(client)
            assert st is not None
            assert (st.fields["ranks"], st.fields["ranks_alive"]) == (2, 2)
            (worker,) = children(proc.pid)
            # 1. SIGKILL rank 1 after step 4, between the checkpoints of steps 3 and 6: rank 0
            # fails at its next collective, checkpoints its last whole step (4) and exits 1.
            os.kill(worker, signal.SIGKILL)
            peer.held.clear()
            peer.hold_from = 6
            codes.append(await asyncio.to_thread(proc.wait, 120))
            assert Checkpointer(run / "ckpt").steps() == [3, 4]
            # 2. Restarted, it trains step 5 with a fresh rank 1; then SIGKILL rank 0 itself
            # before any checkpoint of step 5: its rank 1 dies with it.
            proc = start(config, log)
            await wait_for("step 6 to be asked", held, proc, log)
            (worker,) = children(proc.pid)
            proc.kill()
            codes.append(proc.wait())
            await wait_for_exit(worker)
            assert Checkpointer(run / "ckpt").steps() == [3, 4]
            # 3. Restarted again: step 5 is replayed from checkpoint 4, then steps 6 and 7.
            peer.hold_from = None
            proc = start(config, log)
            await finish_run(client, proc, log)
            codes.append(proc.returncode)
        finally:
            proc.kill()
            proc.wait()
    return peer, codes


async def wait_for_exit(pid: int) -> None:
    for _ in range(200):
        if _state(pid) in ("gone", "Z"):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"rank process {pid} outlived rank 0")


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return "gone"


def test_rows_are_shared_out_whole_and_in_order() -> None:
    for rows in (0, 1, 7, 8, 64):
        for world in (1, 2, 3):
            spans = [share(rows, r, world) for r in range(world)]
            assert spans[0][0] == 0
            assert spans[-1][1] == rows
            assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))


@pytest.mark.timeout(600)
def test_a_killed_rank_is_replayed_bit_exactly(tmp_path: Path) -> None:
    model_dir = save_tiny_model(tmp_path / "model", seed=3)
    a = asyncio.run(run_a(tmp_path / "a", model_dir))
    b, codes = asyncio.run(run_b(tmp_path / "b", model_dir))
    try:
        # the group failed as a whole (exit 1), rank 0 was killed (-9), then it finished
        assert codes == [1, -9, 0]
        assert [d.step for d in a.done] == list(range(1, STEPS + 1))
        assert [d.step for d in b.done] == [1, 2, 3, 4, 5, 5, 6, 7]  # 5 replayed
        for d in a.done:  # the whole step's figures, not rank 0's share
            assert d.metrics["samples"] == 8
        assert set(a.published) == set(b.published) == set(range(STEPS + 1))
        for version, reads in a.published.items():
            assert len(set(reads)) == 1, version
            assert set(b.published[version]) == set(reads), f"version {version} differs"
        final = [
            Checkpointer(tmp_path / r / "ckpt").read(
                Checkpointer(tmp_path / r / "ckpt").path_of(STEPS)
            )
            for r in ("a", "b")
        ]
        for name, t in final[0]["model"].items():
            assert torch.equal(t, final[1]["model"][name]), name
        assert a.published[STEPS][0] != a.published[0][0]  # it trained
    finally:
        a.close()
        b.close()
    assert "rank 1 of 2" in (tmp_path / "a" / "ckpt" / "rank1.log").read_text()
