"""The trainer core in one process, with no socket: the scheduler is an in-process ``Ask``.

What the process tests (test_daemon.py) cover through real processes and kill -9 is here at
the level of the core: steps are taken, reported and checkpointed in order; a scheduler that
does not answer is waited for and said so; a drain lets the step in flight finish and the close
checkpoints it; pause holds after the step in flight.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from deltarl.config import ConfigError
from deltarl.config.rl import RLTrainerConfig
from deltarl.rl.protocol import Batch, Checkpointed, StepDone, TakeBatch
from deltarl.trainer.checkpoint import Checkpointer
from deltarl.trainer.grpo import GRPOBatch
from deltarl.trainer.service import TrainerService, train_device
from deltarl.transport.messages import Command, Ok, Reply
from tests.trainer.test_checkpoint import synthetic_groups
from tests.trainer.tiny import save_tiny_model, shipped


@dataclass
class Scheduler:
    """Ships ``synthetic_groups`` for every step (their samples on ``fetch``, its samples
    endpoint); records what the trainer told it."""

    down_for: int = 0
    """Answer this many requests with a timeout first."""
    done: list[int] = field(default_factory=list)
    checkpointed: list[int] = field(default_factory=list)
    taken: list[int] = field(default_factory=list)
    gate: asyncio.Event = field(default_factory=asyncio.Event)
    blobs: dict[str, bytes] = field(default_factory=dict)
    fetch_down_for: int = 0
    """Answer this many fetches of samples with a timeout first."""

    async def __call__(self, command: Command, timeout_s: float) -> Reply:
        if self.down_for > 0:
            self.down_for -= 1
            raise TimeoutError("scheduler down")
        if isinstance(command, TakeBatch):
            await self.gate.wait()
            self.taken.append(command.step)
            items, blobs = shipped(synthetic_groups(command.step, groups=command.groups))
            self.blobs.update(blobs)
            return Batch(command.step, items)
        if isinstance(command, StepDone):
            self.done.append(command.step)
        elif isinstance(command, Checkpointed):
            self.checkpointed.append(command.step)
        return Ok()

    async def fetch(self, refs: list[str], timeout_s: float) -> list[bytes]:
        if self.fetch_down_for > 0:
            self.fetch_down_for -= 1
            raise TimeoutError("samples endpoint down")
        return [self.blobs[r] for r in refs]


def _config(tmp_path: Path, **overrides: object) -> RLTrainerConfig:
    values: dict[str, object] = {
        "control": f"ipc://{tmp_path}/trainer.sock",
        "scheduler": f"ipc://{tmp_path}/scheduler.sock",
        "published_store": "pub",
        "store_root": tmp_path,
        "model_dir": save_tiny_model(tmp_path / "model"),
        "checkpoint_dir": tmp_path / "ckpt",
        "checkpoint_every": 2,
        "groups_per_step": 2,
        "micro_batch": 3,
        "wait_s": 0.02,
        "threads": 1,
    }
    values.update(overrides)
    return RLTrainerConfig(**values)  # type: ignore[arg-type]


async def _until(predicate: object, timeout_s: float = 60.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():  # type: ignore[operator]  # noqa: ASYNC110 - state of a thread
            await asyncio.sleep(0.01)


def test_steps_are_reported_then_checkpointed(tmp_path: Path) -> None:
    async def scenario() -> None:
        scheduler = Scheduler()
        scheduler.gate.set()
        trainer = TrainerService(_config(tmp_path, max_steps=3), scheduler, scheduler.fetch)
        run = asyncio.create_task(trainer.run())
        await _until(lambda: trainer.activity == "finished")
        run.cancel()
        await asyncio.wait({run})
        await trainer.close()
        assert scheduler.done == [1, 2, 3]
        # Every 2 steps, and at max_steps; each only after its StepDone was answered.
        assert scheduler.checkpointed == [2, 3]
        assert Checkpointer(tmp_path / "ckpt").steps() == [2, 3]

    asyncio.run(scenario())


def test_a_silent_scheduler_is_waited_for_and_said(tmp_path: Path) -> None:
    async def scenario() -> None:
        scheduler = Scheduler(down_for=3)
        scheduler.gate.set()
        trainer = TrainerService(_config(tmp_path, max_steps=1), scheduler, scheduler.fetch)
        run = asyncio.create_task(trainer.run())
        await _until(lambda: trainer.error is not None)
        assert "scheduler down" in str(trainer.status_fields()["error"])
        await _until(lambda: trainer.activity == "finished")
        run.cancel()
        await asyncio.wait({run})
        await trainer.close()
        assert scheduler.done == [1]
        assert trainer.error is None  # cleared by the step that went through

    asyncio.run(scenario())


def test_drain_finishes_the_step_in_flight_and_close_checkpoints_it(tmp_path: Path) -> None:
    async def scenario() -> None:
        scheduler = Scheduler()
        trainer = TrainerService(
            _config(tmp_path, checkpoint_every=100), scheduler, scheduler.fetch
        )
        run = asyncio.create_task(trainer.run())
        await _until(lambda: trainer.activity == "waiting for a batch")
        scheduler.gate.set()
        await _until(lambda: trainer.activity == "training")
        await asyncio.wait_for(trainer.drain(), 60)
        assert trainer.step >= 1  # the step in flight finished
        await asyncio.sleep(0.1)
        taken = list(scheduler.taken)
        await asyncio.sleep(0.2)
        assert scheduler.taken == taken  # no new batch after the drain
        run.cancel()
        await asyncio.wait({run})
        await trainer.close()
        last = trainer.step
        assert scheduler.done[-1] == last
        assert scheduler.checkpointed == [last]  # no checkpoint was due: close wrote it

    asyncio.run(scenario())


def test_pause_holds_after_the_step_in_flight(tmp_path: Path) -> None:
    async def scenario() -> None:
        scheduler = Scheduler()
        scheduler.gate.set()
        trainer = TrainerService(_config(tmp_path), scheduler, scheduler.fetch)
        run = asyncio.create_task(trainer.run())
        await _until(lambda: trainer.step >= 1)
        assert trainer.gate is not None
        trainer.gate.pause()
        await _until(lambda: trainer.activity == "paused")
        assert trainer.state() == "paused"
        held = trainer.step
        await asyncio.sleep(0.3)
        assert trainer.step == held
        trainer.gate.resume()
        await _until(lambda: trainer.step > held)
        run.cancel()
        await asyncio.wait({run})
        await trainer.close()

    asyncio.run(scenario())


def test_samples_are_fetched_by_reference_and_a_silent_endpoint_is_waited_for(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        scheduler = Scheduler(fetch_down_for=2)
        scheduler.gate.set()
        trainer = TrainerService(_config(tmp_path, max_steps=1), scheduler, scheduler.fetch)
        run = asyncio.create_task(trainer.run())
        await _until(lambda: trainer.error is not None)
        assert "samples endpoint down" in str(trainer.status_fields()["error"])
        await _until(lambda: trainer.activity == "finished")
        run.cancel()
        await asyncio.wait({run})
        await trainer.close()
        assert scheduler.done == [1]
        assert scheduler.taken == [1, 1, 1]  # asked again until the samples came
        assert trainer.metrics["groups"] == {"s1g0": 4, "s1g1": 4}
        assert trainer.metrics["samples"] == 8

    asyncio.run(scenario())


def test_samples_that_are_not_their_digests_bytes_stall_the_step(tmp_path: Path) -> None:
    async def scenario() -> None:
        scheduler = Scheduler()
        scheduler.gate.set()

        async def forged(refs: list[str], timeout_s: float) -> list[bytes]:
            real = await scheduler.fetch(refs, timeout_s)
            return [real[1], *real[1:]]  # the first group's digest, the second's bytes

        trainer = TrainerService(_config(tmp_path, max_steps=1), scheduler, forged)
        run = asyncio.create_task(trainer.run())
        await _until(lambda: trainer.activity == "stalled")
        assert "are not the bytes of" in str(trainer.error)
        assert trainer.step == 0  # nothing trained on bytes nobody validated
        run.cancel()
        await asyncio.wait({run})
        await trainer.close()

    asyncio.run(scenario())


def test_the_training_device_follows_the_config(tmp_path: Path) -> None:
    assert train_device(_config(tmp_path, device="cpu")) == torch.device("cpu")
    if torch.cuda.is_available():
        assert train_device(_config(tmp_path), rank=1).type == "cuda"
        return
    assert train_device(_config(tmp_path)) == torch.device("cpu")  # "auto" without a GPU
    with pytest.raises(ConfigError, match="torch sees no GPU"):
        train_device(_config(tmp_path, device="cuda"))
    with pytest.raises(ValueError, match='device must be "auto", "cpu" or "cuda"'):
        _config(tmp_path, device="tpu")


def test_a_batch_moves_to_the_models_device_whole() -> None:
    batch = GRPOBatch(
        input_ids=torch.zeros((2, 3), dtype=torch.int64),
        attention_mask=torch.ones((2, 3), dtype=torch.int64),
        loss_mask=torch.ones((2, 2)),
        behaviour_logprobs=torch.zeros((2, 2)),
        advantages=torch.ones(2),
        rewards=torch.ones(2),
    )
    moved = batch.to(torch.device("meta"))
    assert {f.name for f in dataclasses.fields(moved)} == {
        f.name for f in dataclasses.fields(batch)
    }
    assert all(getattr(moved, f.name).device.type == "meta" for f in dataclasses.fields(moved))
    assert batch.input_ids.device.type == "cpu"  # the original is untouched
