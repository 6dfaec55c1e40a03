"""The rollout daemon refuses to generate on weights it cannot prove.

The real rollout daemon (vLLM on the CPU) and the real scheduler run as processes; the apply
agent is played by a peer on the real control protocol whose ``status`` reports, for each
version, the manifest digest we choose. A wrong digest is the injected fault: the engine's
weights then do not match what the trainer published, so the daemon must reload every tensor,
still see the mismatch, and take no work (nothing issued by the scheduler). A later version
whose digest matches lifts the hold and generation starts.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from deltarl.codecs.checksum import model_digest, tensor_digests
from deltarl.engine.weight_store import WeightStore
from deltarl.transport.control import ControlServer, ControlTimeoutError, request_sync
from deltarl.transport.messages import GetStatus, Status

try:
    import vllm  # noqa: F401
except Exception as e:  # noqa: BLE001 - any import failure means: no vLLM here
    pytest.skip(f"vLLM cannot be imported here: {e}", allow_module_level=True)

pytestmark = pytest.mark.timeout(600)


class ApplyPeer:
    """Answers ``status`` like an apply agent, with the digests in ``self.digests``."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.digests: dict[str, str] = {}
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=asyncio.run, args=(self._serve(),), daemon=True)
        self._ready = threading.Event()

    async def _status(self, _: GetStatus) -> Status:
        return Status("apply", "running", {"digests": dict(self.digests)})

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        async with ControlServer(self.endpoint, {GetStatus: self._status}, name="apply-peer"):
            self._ready.set()
            await self._stop.wait()

    def __enter__(self) -> ApplyPeer:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None
        assert self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


def _publish(model: Any, tmp: Path, version: int) -> str:
    """Commit the model's bf16 weights as ``version`` of the store "rollout"; its digest."""
    from deltarl.trainer.publisher import Publisher  # noqa: PLC0415

    pub = Publisher(model, "rollout", root=tmp)
    try:
        pub.publish(version)
    finally:
        pub.close()
    with WeightStore.open("rollout", root=tmp, readonly=True) as store, store.lease() as snap:
        return model_digest(tensor_digests(store.layout, snap.buffer))


def _status(endpoint: str) -> dict[str, Any]:
    try:
        reply = request_sync(endpoint, GetStatus(), 2.0)
    except ControlTimeoutError:
        return {}
    return reply.fields if isinstance(reply, Status) else {}


def _wait(what: str, cond: Callable[[], bool], procs: dict[str, subprocess.Popen[bytes]],
          tmp: Path, timeout: float = 240) -> None:  # fmt: skip
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
    good_1 = _publish(model, tmp_path, 1)
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
apply_control = "ipc://{tmp_path}/apply.sock"
rollout_store = "rollout"
store_root = "{tmp_path}"
model_dir = "{model_dir}"
max_running_groups = 2
""")
    with ApplyPeer(f"ipc://{tmp_path}/apply.sock") as peer:
        peer.digests = {"1": "0" * 32}  # the fault: not the digest of what the store holds
        assert good_1 != "0" * 32
        for name in ("scheduler", "rollout"):
            with (tmp_path / f"{name}.log").open("ab") as log:
                procs[name] = subprocess.Popen(
                    [sys.executable, "-m", "deltarl.cli", name, "--config", str(config)],
                    stdout=log, stderr=subprocess.STDOUT,
                )  # fmt: skip
        rollout = f"ipc://{tmp_path}/rollout.sock"
        scheduler = f"ipc://{tmp_path}/scheduler.sock"
        _wait("the load of version 1 refused",
              lambda: _status(rollout).get("unverified") is not None, procs, tmp_path)  # fmt: skip
        time.sleep(2.0)  # time enough to ask for work, were it allowed to
        st = _status(rollout)
        assert st["weight_version"] == 1
        assert st["mismatches"] == 1
        assert st["verified"] == 0
        assert st["submitted_groups"] == 0
        assert "not generating" in st["detail"]
        assert _status(scheduler)["counters"].get("issued_groups", 0) == 0

        # Version 2 with its true digest: verified, and work flows.
        peer.digests = {"1": "0" * 32, "2": _publish(model, tmp_path, 2)}
        _wait("groups generated on verified weights",
              lambda: _status(rollout).get("submitted_groups", 0) >= 2,
              procs, tmp_path)  # fmt: skip
        st = _status(rollout)
        assert st["unverified"] is None
        assert st["weight_version"] == 2
        assert st["verified"] == 1
        assert [r["verified"] for r in st["refits"]] == [False, True]
