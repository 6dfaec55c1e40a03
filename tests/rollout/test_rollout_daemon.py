"""The rollout daemon refuses to generate on weights it cannot prove.

The real rollout daemon (vLLM on the CPU) and the real scheduler run as processes; the test
plays the apply agent, committing each version into the rollout store with the manifest digest
we choose. A wrong digest is the injected fault: the engine's weights then do not match what
the trainer published, so the daemon must reload every tensor, still see the mismatch, and
take no work (nothing issued by the scheduler). A later version committed with its true digest
lifts the hold and generation starts. Nothing but the store is asked: the worker reads the
digest under the lease it loads from.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from deltarl.codecs.checksum import model_digest, tensor_digests
from deltarl.engine.weight_store import WeightStore
from deltarl.transport.control import ControlTimeoutError, request_sync
from deltarl.transport.messages import GetStatus, Status

try:
    import vllm  # noqa: F401
except Exception as e:  # noqa: BLE001 - any import failure means: no vLLM here
    pytest.skip(f"vLLM cannot be imported here: {e}", allow_module_level=True)

pytestmark = pytest.mark.timeout(600)


def _publish(model: Any, tmp: Path, version: int, digest: str | None) -> str:
    """Commit the model's bf16 weights as ``version`` of the store "rollout" with ``digest``
    as its manifest digest (None: the true one, with each tensor's, as the apply agent
    commits them); returns the true digest of the bytes."""
    from deltarl.trainer.publisher import Publisher  # noqa: PLC0415

    def commit(store: str, digest: str | None) -> str:
        pub = Publisher(model, store, root=tmp)
        try:
            pub.publish(version, digest=digest)
        finally:
            pub.close()
        with WeightStore.open(store, root=tmp, readonly=True) as ws, ws.lease() as snap:
            return model_digest(tensor_digests(ws.layout, snap.buffer))

    true = commit("scratch", None)  # the same bytes, to learn their digest first
    # None: the publisher's own tensor digests and their model digest (the true one), as the
    # apply agent commits a verified version's
    commit("rollout", digest)
    return true


def _status(endpoint: str) -> dict[str, Any]:
    try:
        reply = request_sync(endpoint, GetStatus(), 2.0)
    except ControlTimeoutError:
        return {}
    return reply.fields if isinstance(reply, Status) else {}


def _wait(
    what: str,
    cond: Callable[[], bool],
    procs: dict[str, subprocess.Popen[bytes]],
    tmp: Path,
    timeout: float = 240,
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name, p in procs.items():
            assert p.poll() is None, f"{name} exited: {(tmp / f'{name}.log').read_text()[-3000:]}"
        if cond():
            return
        time.sleep(0.3)
    logs = "\n".join(f"--- {n}\n{(tmp / f'{n}.log').read_text()[-3000:]}" for n in procs)
    raise AssertionError(f"timed out waiting for {what}\n{logs}")


@pytest.fixture
def procs() -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    running: dict[str, subprocess.Popen[bytes]] = {}
    yield running
    for p in running.values():
        if p.poll() is None:
            p.kill()
            p.wait(10)


def test_unverified_weights_are_not_used(
    tmp_path: Path, procs: dict[str, subprocess.Popen[bytes]]
) -> None:
    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    from deltarl.rl.tiny_model import ensure_default_model  # noqa: PLC0415

    model_dir = ensure_default_model(tmp_path / "models")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    # the fault: version 1 committed with a digest that is not the one of its bytes
    good_1 = _publish(model, tmp_path, 1, "0" * 32)
    config = tmp_path / "deltarl.toml"
    config.write_text(f"""
[daemons.scheduler]
control = "ipc://{tmp_path}/scheduler.sock"
db = "{tmp_path}/scheduler.sqlite"
group_size = 2
groups_per_step = 2

[daemons.rollout]
control = "ipc://{tmp_path}/rollout.sock"
scheduler = "ipc://{tmp_path}/scheduler.sock"
rollout_store = "rollout"
store_root = "{tmp_path}"
model_dir = "{model_dir}"
max_running_groups = 2
""")
    assert good_1 != "0" * 32
    for name in ("scheduler", "rollout"):
        with (tmp_path / f"{name}.log").open("ab") as log:
            procs[name] = subprocess.Popen(
                [sys.executable, "-m", "deltarl.cli", name, "--config", str(config)],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
    rollout = f"ipc://{tmp_path}/rollout.sock"
    scheduler = f"ipc://{tmp_path}/scheduler.sock"
    _wait(
        "the load of version 1 refused",
        lambda: _status(rollout).get("unverified") is not None,
        procs,
        tmp_path,
    )
    time.sleep(2.0)  # time enough to ask for work, were it allowed to
    st = _status(rollout)
    assert st["weight_version"] == 1
    assert st["mismatches"] == 1
    assert st["verified"] == 0
    assert st["submitted_groups"] == 0
    assert "not generating" in st["detail"]
    assert _status(scheduler)["counters"].get("issued_groups", 0) == 0

    # Version 2 with its true digest: verified, and work flows.
    _publish(model, tmp_path, 2, None)
    _wait(
        "groups generated on verified weights",
        lambda: _status(rollout).get("submitted_groups", 0) >= 2,
        procs,
        tmp_path,
    )
    st = _status(rollout)
    assert st["unverified"] is None
    assert st["weight_version"] == 2
    assert st["verified"] == 1
    assert [r["verified"] for r in st["refits"]] == [False, True]
    # Version 2's changed layers were found from the digests committed with it, unhashed.
    assert st["refits"][-1]["chosen_by"] == "committed"


def test_a_submit_waiting_on_the_reward_service_does_not_hold_the_engine(tmp_path: Path) -> None:
    """The injected fault: the scheduler answers one group's submit "reward unavailable" (its
    reward service is out), again and again. The submit waits and is sent again, in a task of
    its own: the engine goes on generating, and the other group, a longer one, is generated
    and submitted meanwhile. With the submits between steps, every retry held the engine."""
    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    from deltarl.config.rl import RolloutConfig  # noqa: PLC0415
    from deltarl.engine.daemon import DaemonContext  # noqa: PLC0415
    from deltarl.reward.protocol import REWARD_UNAVAILABLE  # noqa: PLC0415
    from deltarl.rl.protocol import GetWork, SubmitGroup, Work  # noqa: PLC0415
    from deltarl.rl.tiny_model import ensure_default_model  # noqa: PLC0415
    from deltarl.rollout.service import RolloutService  # noqa: PLC0415
    from deltarl.transport.blobs import blob_digest  # noqa: PLC0415
    from deltarl.transport.messages import Command, Error, Ok, Reply  # noqa: PLC0415

    model_dir = ensure_default_model(tmp_path / "models")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    _publish(model, tmp_path, 1, None)

    def group(gid: str, length: int) -> dict[str, Any]:
        sampling = {"max_tokens": 64, "seed": 1, "lengths": [length, length]}
        return {"group_id": gid, "prompt_id": 0, "prompt": "two and two", "n": 2,
                "sampling": sampling}  # fmt: skip

    submits: list[str] = []
    issued = False

    async def scheduler(command: Command, timeout_s: float) -> Reply:
        nonlocal issued
        if isinstance(command, GetWork):
            if issued:
                return Work([], wait_s=0.05, reason="nothing more in this test")
            issued = True
            return Work([group("short", 2), group("long", 48)])
        if isinstance(command, SubmitGroup):
            submits.append(command.group_id)
            if command.group_id == "short":
                return Error(REWARD_UNAVAILABLE, "the reward service is out (injected)")
        return Ok()

    async def put(data: bytes, timeout_s: float) -> str:
        return blob_digest(data)

    async def scenario() -> None:
        config = RolloutConfig(
            control=f"ipc://{tmp_path}/rollout.sock",
            scheduler=f"ipc://{tmp_path}/scheduler.sock",
            rollout_store="rollout",
            store_root=tmp_path,
            model_dir=model_dir,
            idle_s=0.01,
        )
        service = RolloutService(config, scheduler, DaemonContext("rollout"), put)
        run = asyncio.create_task(service.run())
        try:
            async with asyncio.timeout(240):
                while service.submitted_groups == 0:
                    if run.done():
                        run.result()  # the daemon failed: say why
                    await asyncio.sleep(0.05)
            assert submits.count("long") == 1
            assert submits.count("short") >= 1
            assert service.submitting == {"short"}  # still held, its submit still waiting
            assert not service.in_flight
        finally:
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)
            await service.close()
        assert not service._submits  # the waiting submit was cancelled with the close

    asyncio.run(scenario())


def test_a_refit_sends_a_heartbeat_at_once(tmp_path: Path) -> None:
    """A new version is when the scheduler finds groups doomed, and they run on until a
    heartbeat's answer names them: after each refit the daemon beats at once, not a whole
    ``heartbeat_s`` (here 60 s) later."""
    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    from deltarl.config.rl import RolloutConfig  # noqa: PLC0415
    from deltarl.engine.daemon import DaemonContext  # noqa: PLC0415
    from deltarl.rl.protocol import Heartbeat, Work  # noqa: PLC0415
    from deltarl.rl.tiny_model import ensure_default_model  # noqa: PLC0415
    from deltarl.rollout.service import RolloutService  # noqa: PLC0415
    from deltarl.transport.messages import Command, Ok, Reply  # noqa: PLC0415

    model_dir = ensure_default_model(tmp_path / "models")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    _publish(model, tmp_path, 1, None)
    beats: list[int | None] = []  # the engine version of each heartbeat

    async def scheduler(command: Command, timeout_s: float) -> Reply:
        if isinstance(command, Heartbeat):
            beats.append(command.weight_version)
            return Ok()
        return Work([], wait_s=0.05, reason="nothing in this test")

    async def until(what: str, cond: Callable[[], bool], run: asyncio.Task[None]) -> None:
        try:
            async with asyncio.timeout(30):
                while not cond():
                    if run.done():
                        run.result()  # the daemon failed: say why
                    await asyncio.sleep(0.05)
        except TimeoutError:
            raise AssertionError(f"no {what} within 30 s: heartbeats at {beats}") from None

    async def scenario() -> None:
        config = RolloutConfig(
            control=f"ipc://{tmp_path}/rollout.sock",
            scheduler=f"ipc://{tmp_path}/scheduler.sock",
            rollout_store="rollout",
            store_root=tmp_path,
            model_dir=model_dir,
            heartbeat_s=60.0,
        )
        service = RolloutService(config, scheduler, DaemonContext("rollout"))
        run = asyncio.create_task(service.run())
        try:
            await until("the first heartbeat", lambda: beats == [1], run)
            _publish(model, tmp_path, 2, None)
            await until("a heartbeat at version 2", lambda: beats[-1] == 2, run)
            assert beats == [1, 2]
        finally:
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)
            await service.close()

    asyncio.run(scenario())
