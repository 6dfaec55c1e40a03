"""The trainer daemon as a real process against a test scheduler speaking the real protocol.

The scheduler here is a ``ControlServer`` with handlers for TakeBatch, StepDone and
Checkpointed, and a ``BlobServer`` on the derived samples endpoint, that ships deterministic
groups per step (the same groups whenever a step is
asked again, as the real one replays). At every TakeBatch and StepDone it reads the trainer's
published store, so it sees every version the trainer publishes.

Run A trains 7 steps without interruption (a checkpoint every step: the fp32 masters of every
version). Run B trains with a checkpoint every 3 steps, is killed with SIGKILL after step 5,
restarts, and trains to step 7. Then: B's final bytes equal A's (bit-exact resume), B asked
for steps 4.. again after the restart, and every version is bf16 of its step's fp32 masters.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash
from safetensors.torch import load_file

from deltarl.config import ConfigError, load
from deltarl.config.rl import RLTrainerConfig
from deltarl.engine.layout import Layout
from deltarl.engine.weight_store import WeightStore
from deltarl.rl.protocol import Batch, Checkpointed, StepDone, TakeBatch
from deltarl.trainer.checkpoint import Checkpointer
from deltarl.transport.blobs import BlobServer, MemoryBlobs, samples_endpoint
from deltarl.transport.control import (
    ControlClient,
    ControlProtocolError,
    ControlServer,
    ControlTimeoutError,
)
from deltarl.transport.messages import GetStatus, Ok, Pause, Resume, Shutdown, Status
from tests.test_systemd_units import SYSTEMD, commented_table
from tests.trainer.test_checkpoint import synthetic_groups
from tests.trainer.tiny import save_tiny_model, shipped

STEPS = 7


@dataclass
class SchedulerPeer:
    """The scheduler's side of TakeBatch / StepDone / Checkpointed, recording what it saw."""

    store_root: Path
    hold_from: int | None = None
    """TakeBatch for this step or later is answered empty (wait) until cleared."""
    asked: list[tuple[int, int]] = field(default_factory=list)
    """(step, trainer_version) of every TakeBatch answered with groups."""
    done: list[StepDone] = field(default_factory=list)
    checkpointed: list[int] = field(default_factory=list)
    published: dict[int, list[str]] = field(default_factory=dict)
    """The xxh3-128 digest of every read of each version's bytes."""
    held: asyncio.Event = field(default_factory=asyncio.Event)
    store: WeightStore | None = None
    blobs: MemoryBlobs = field(default_factory=MemoryBlobs)

    def _snapshot(self) -> None:
        if self.store is None:
            self.store = WeightStore.open("pub", root=self.store_root, readonly=True)
        with self.store.lease() as snap:
            digest = xxhash.xxh3_128_hexdigest(snap.buffer)
            self.published.setdefault(snap.version, []).append(digest)

    async def on_take(self, cmd: TakeBatch) -> Batch:
        if self.hold_from is not None and cmd.step >= self.hold_from:
            self.held.set()
            return Batch(cmd.step, [], wait_s=0.05, reason="held by the test")
        self._snapshot()
        self.asked.append((cmd.step, cmd.trainer_version))
        items, blobs = shipped(synthetic_groups(cmd.step, groups=cmd.groups))
        self.blobs.blobs.update(blobs)
        return Batch(cmd.step, items)

    async def on_done(self, cmd: StepDone) -> Ok:
        self._snapshot()
        self.done.append(cmd)
        return Ok()

    async def on_checkpointed(self, cmd: Checkpointed) -> Ok:
        self.checkpointed.append(cmd.step)
        return Ok()

    @contextlib.asynccontextmanager
    async def server(self, endpoint: str) -> AsyncIterator[None]:
        handlers = {
            TakeBatch: self.on_take,
            StepDone: self.on_done,
            Checkpointed: self.on_checkpointed,
        }
        async with (
            ControlServer(endpoint, handlers, name="scheduler"),
            BlobServer(samples_endpoint(endpoint), self.blobs),
        ):
            yield

    def close(self) -> None:
        if self.store is not None:
            self.store.close()


def write_config(run: Path, model_dir: Path, checkpoint_every: int, extra: str = "") -> Path:
    run.mkdir(parents=True, exist_ok=True)
    path = run / "deltarl.toml"
    path.write_text(f"""
[daemons.trainer]
control = "ipc://{run}/trainer.sock"
scheduler = "ipc://{run}/scheduler.sock"
published_store = "pub"
store_root = "{run}"
model_dir = "{model_dir}"
checkpoint_dir = "{run}/ckpt"
checkpoint_every = {checkpoint_every}
keep_checkpoints = 100
groups_per_step = 2
micro_batch = 3
max_steps = {STEPS}
weight_decay = 0.01
kl_coef = 0.05
wait_s = 0.05
threads = 1
{extra}
""")
    return path


def start(config: Path, log: Path) -> subprocess.Popen[bytes]:
    args = [sys.executable, "-m", "deltarl.cli", "trainer", "--config", str(config)]
    with log.open("ab") as f:
        return subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT)


async def status(client: ControlClient) -> Status | None:
    try:
        reply = await client.request(GetStatus(), timeout=2.0)
    except (ControlTimeoutError, ControlProtocolError):
        return None
    return reply if isinstance(reply, Status) else None


def _tail(log: Path) -> str:
    return log.read_text()[-4000:]


async def wait_for(
    what: str, check: Callable[[], Awaitable[bool]], proc: subprocess.Popen[bytes], log: Path
) -> None:
    deadline = time.monotonic() + 180
    while not await check():
        if proc.poll() is not None:
            raise AssertionError(f"trainer exited ({proc.returncode}) before {what}:\n{_tail(log)}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}:\n{_tail(log)}")
        await asyncio.sleep(0.05)


async def finish_run(client: ControlClient, proc: subprocess.Popen[bytes], log: Path) -> None:
    async def finished() -> bool:
        st = await status(client)
        return st is not None and st.state == "finished"

    await wait_for("the last step", finished, proc, log)
    st = await status(client)
    assert st is not None
    assert st.fields["step"] == STEPS
    assert st.fields["published_version"] == STEPS
    assert st.fields["checkpoint_step"] == STEPS
    assert set(st.fields["metrics"]) >= {
        "loss",
        "kl",
        "clip_frac",
        "tokens",
        "grad_norm",
        "step_s",
        "publish_s",
        "reward_mean",
    }
    assert isinstance(await client.request(Shutdown()), Ok)
    assert await asyncio.to_thread(proc.wait, 60) == 0


async def run_a(run: Path, model_dir: Path) -> SchedulerPeer:
    config, log = write_config(run, model_dir, checkpoint_every=1), run / "trainer.log"
    peer = SchedulerPeer(run)
    async with (
        peer.server(f"ipc://{run}/scheduler.sock"),
        ControlClient(f"ipc://{run}/trainer.sock") as client,
    ):
        proc = start(config, log)
        try:
            # Paused before its first step, it takes no batch (and keeps answering).
            async def answers() -> bool:
                return await status(client) is not None

            await wait_for("the control socket", answers, proc, log)
            assert isinstance(await client.request(Pause()), Ok)
            await asyncio.sleep(1.5)
            st = await status(client)
            assert st is not None
            assert st.state == "paused"
            assert peer.asked == []
            assert isinstance(await client.request(Resume()), Ok)
            await finish_run(client, proc, log)
        finally:
            proc.kill()
            proc.wait()
    return peer


async def run_b(run: Path, model_dir: Path) -> tuple[SchedulerPeer, int]:
    config, log = write_config(run, model_dir, checkpoint_every=3), run / "trainer.log"
    peer = SchedulerPeer(run, hold_from=6)
    async with (
        peer.server(f"ipc://{run}/scheduler.sock"),
        ControlClient(f"ipc://{run}/trainer.sock") as client,
    ):
        proc = start(config, log)
        try:

            async def held() -> bool:
                return peer.held.is_set()

            await wait_for("step 6 to be asked", held, proc, log)
            proc.kill()  # SIGKILL, between the checkpoints of steps 3 and 6
            assert proc.wait() == -9
            asked_before = len(peer.asked)
            assert Checkpointer(run / "ckpt").steps() == [3]
            assert peer.published.keys() == set(range(6))  # versions 0 .. 5 were out
            peer.hold_from = None
            proc = start(config, log)
            await finish_run(client, proc, log)
        finally:
            proc.kill()
            proc.wait()
    return peer, asked_before


def bf16_digest(store_layout_names: list[str], fp32: dict[str, torch.Tensor]) -> str:
    """The digest of the buffer a store of this layout must hold for these fp32 masters."""
    layout = Layout.pack((n, "bfloat16", tuple(fp32[n].shape)) for n in store_layout_names)
    buf = np.zeros(layout.nbytes, dtype=np.uint8)
    for tid, name in enumerate(store_layout_names):
        dst = torch.from_numpy(layout.view(buf, tid)).view(torch.bfloat16)
        dst.copy_(fp32[name].reshape(-1).to(torch.bfloat16))
    return xxhash.xxh3_128_hexdigest(buf)


@pytest.mark.timeout(600)
def test_killed_trainer_resumes_bit_exactly(tmp_path: Path) -> None:
    model_dir = save_tiny_model(tmp_path / "model", seed=3)
    a = asyncio.run(run_a(tmp_path / "a", model_dir))
    b, asked_before = asyncio.run(run_b(tmp_path / "b", model_dir))
    try:
        # (b) the steps asked: 1..5, then after the restart again from checkpoint + 1, with the
        # checkpoint's version as the trainer's version; Checkpointed(3) is said again.
        assert a.asked == [(s, s - 1) for s in range(1, STEPS + 1)]
        assert b.asked[:asked_before] == [(s, s - 1) for s in range(1, 6)]
        assert b.asked[asked_before:] == [(s, s - 1) for s in range(4, STEPS + 1)]
        assert a.checkpointed == list(range(1, STEPS + 1))
        assert b.checkpointed == [3, 3, 6, 7]
        assert [d.step for d in b.done] == [1, 2, 3, 4, 5, 4, 5, 6, 7]
        assert all(d.version == d.step for d in a.done + b.done)
        for d in a.done:
            assert d.metrics["groups"] == {f"s{d.step}g0": 4, f"s{d.step}g1": 4}
            assert d.metrics["samples"] == 8

        # (a) bit-exact: every version B ever published (the replayed 4 and 5 twice, the
        # republished 3) is A's version of the same number, the final one included.
        assert set(a.published) == set(b.published) == set(range(STEPS + 1))
        for version, reads in a.published.items():
            assert len(set(reads)) == 1, version
            assert set(b.published[version]) == set(reads), f"version {version} differs"
        final_a = Checkpointer(tmp_path / "a" / "ckpt").read(
            Checkpointer(tmp_path / "a" / "ckpt").path_of(STEPS)
        )
        final_b = Checkpointer(tmp_path / "b" / "ckpt").read(
            Checkpointer(tmp_path / "b" / "ckpt").path_of(STEPS)
        )
        for name, t in final_a["model"].items():
            assert torch.equal(t, final_b["model"][name]), name
        for pid, state in final_a["optimizer"]["state"].items():
            for key, t in state.items():
                assert torch.equal(t, final_b["optimizer"]["state"][pid][key]), (pid, key)

        # (c) every version is bf16 of the fp32 masters of its step (A checkpointed each).
        store = WeightStore.open("pub", root=tmp_path / "a", readonly=True)
        names = [s.name for s in store.layout.tensors]
        store.close()
        initial = load_file(model_dir / "model.safetensors")
        assert a.published[0][0] == bf16_digest(names, initial)
        ck = Checkpointer(tmp_path / "a" / "ckpt")
        for step in range(1, STEPS + 1):
            masters = ck.read(ck.path_of(step))["model"]
            assert a.published[step][0] == bf16_digest(names, masters), step
        # Training moved the weights (otherwise all of the above would hold trivially).
        assert a.published[STEPS][0] != a.published[0][0]
    finally:
        a.close()
        b.close()


def test_config_is_checked(tmp_path: Path) -> None:
    path = write_config(tmp_path, tmp_path / "model", checkpoint_every=1)
    cfg = load(RLTrainerConfig, "trainer", str(path))
    assert cfg.checkpoint_every == 1
    assert cfg.lr == 5e-3
    assert cfg.kl_coef == 0.05
    assert cfg.store_root == tmp_path
    bad = path.read_text().replace("micro_batch = 3", "micro_batch = 0")
    path.write_text(bad)
    with pytest.raises(ConfigError, match=r"\[daemons.trainer\].*micro_batch must be at least 1"):
        load(RLTrainerConfig, "trainer", str(path))
    path.write_text(
        bad.replace("micro_batch = 0", "micro_batch = 3").replace(
            'scheduler = "ipc://', 'scheduler = "udp://'
        )
    )
    with pytest.raises(ConfigError, match="bad control endpoint"):
        load(RLTrainerConfig, "trainer", str(path))


def test_missing_model_dir_exits_with_ex_config(tmp_path: Path) -> None:
    path = write_config(tmp_path, tmp_path / "nowhere", checkpoint_every=1)
    proc = subprocess.run(
        [sys.executable, "-m", "deltarl.cli", "trainer", "--config", str(path)],
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 78, proc.stderr.decode()[-2000:]
    assert b"holds no config.json" in proc.stderr


async def run_sigterm(run: Path, model_dir: Path) -> SchedulerPeer:
    config, log = write_config(run, model_dir, checkpoint_every=100), run / "trainer.log"
    peer = SchedulerPeer(run, hold_from=4)
    async with peer.server(f"ipc://{run}/scheduler.sock"):
        proc = start(config, log)
        try:

            async def held() -> bool:
                return peer.held.is_set()

            await wait_for("step 4 to be asked", held, proc, log)
            proc.terminate()
            assert await asyncio.to_thread(proc.wait, 60) == 0, _tail(log)
        finally:
            proc.kill()
            proc.wait()
    return peer


def test_sigterm_checkpoints_the_last_step(tmp_path: Path) -> None:
    """A clean stop (systemd's SIGTERM) loses no training: the last step is checkpointed and
    the scheduler told, though no checkpoint was due."""
    model_dir = save_tiny_model(tmp_path / "model", seed=3)
    peer = asyncio.run(run_sigterm(tmp_path / "run", model_dir))
    try:
        assert [d.step for d in peer.done] == [1, 2, 3]
        assert peer.checkpointed == [3]
        assert Checkpointer(tmp_path / "run" / "ckpt").steps() == [3]
    finally:
        peer.close()


def test_the_example_trainer_table_is_a_config_this_daemon_accepts(tmp_path: Path) -> None:
    table = commented_table((SYSTEMD / "deltarl.toml.example").read_text(), "trainer")
    (tmp_path / "t.toml").write_text(table)
    cfg = load(RLTrainerConfig, "trainer", str(tmp_path / "t.toml"))
    assert cfg.lr == 1e-6
    assert cfg.checkpoint_dir == Path("/var/lib/deltarl/checkpoints")
