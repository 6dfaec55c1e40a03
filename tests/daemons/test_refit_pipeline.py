"""The trainer, export and apply daemons as separate processes, over shm and over TCP.

A synthetic trainer publishes versions; the export agent diffs and sends them; the apply agent
applies them into the rollout store. Checked: the rollout store ends bit-exact equal to the
published store, the manifest store records every version's life, ``deltarl ctl status``
answers for each daemon, ``resync`` makes the next version full, SIGTERM stops each daemon
with status 0, and a ``kill -9``ed apply agent, restarted, gets a full version and converges.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from deltarl.engine.weight_store import WeightStore
from deltarl.refit.manifest_store import ManifestStore, State
from deltarl.transport.control import ControlTimeoutError, request_sync
from deltarl.transport.messages import GetStatus, Ok, Pause, Resume, Rollback, Status

PARAMS = 200_000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(tmp: Path, link: str) -> str:
    if link == "shm":
        link_table = f'type = "shm"\nname = "t"\nroot = "{tmp}"\n'
    else:
        link_table = f'type = "stream"\nhost = "127.0.0.1"\nport = {_free_port()}\n'
    return f"""
[daemons.trainer]
control = "ipc://{tmp}/trainer.sock"
published_store = "pub"
store_root = "{tmp}"
params = {PARAMS}
interval_s = 0.3

[daemons.export]
control = "ipc://{tmp}/export.sock"
events = "ipc://{tmp}/export-events.sock"
published_store = "pub"
store_root = "{tmp}"
manifest_store = "{tmp}/versions.sqlite"
apply_control = "ipc://{tmp}/apply.sock"
full_resync_every = 4
ack_timeout_s = 20.0
poll_s = 0.02

[daemons.export.link]
{link_table}
[daemons.apply]
control = "ipc://{tmp}/apply.sock"
events = "ipc://{tmp}/apply-events.sock"
rollout_store = "rollout"
store_root = "{tmp}"
layout_store = "pub"

[daemons.apply.link]
{link_table}"""


class Pipeline:
    def __init__(self, tmp: Path, link: str) -> None:
        self.tmp = tmp
        self.config = tmp / "deltarl.toml"
        self.config.write_text(_config(tmp, link))
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def endpoint(self, daemon: str) -> str:
        return f"ipc://{self.tmp}/{daemon}.sock"

    def start(self, daemon: str) -> None:
        args = [sys.executable, "-m", "deltarl.cli", daemon, "--config", str(self.config)]
        if daemon == "trainer":
            args.insert(4, "--synthetic")
        log = (self.tmp / f"{daemon}.log").open("ab")
        self.procs[daemon] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)

    def status(self, daemon: str) -> dict[str, Any]:
        reply = request_sync(self.endpoint(daemon), GetStatus(), 2.0)
        assert isinstance(reply, Status), reply
        return reply.fields

    def wait(self, what: str, cond: Callable[[], bool], timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, p in self.procs.items():
                assert p.poll() is None, f"{name} exited {p.returncode}: {self.log(name)}"
            try:
                if cond():
                    return
            except ControlTimeoutError:
                pass  # a daemon still starting
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}; logs:\n{self.logs()}")

    def log(self, daemon: str) -> str:
        return (self.tmp / f"{daemon}.log").read_text(errors="replace")[-3000:]

    def logs(self) -> str:
        return "\n".join(f"--- {d}\n{self.log(d)}" for d in self.procs)

    def quiesce(self) -> int:
        """Pause the trainer and wait until its last version is active on the rollout side."""
        assert request_sync(self.endpoint("trainer"), Pause(), 2.0) == Ok("paused")
        self.wait("the trainer's last step", lambda: not self.status("trainer")["stepping"])
        version = self.status("trainer")["version"]
        self.wait(
            f"version {version} active",
            lambda: (
                self.status("apply")["active_version"] == version
                and self.status("export")["reference_version"] == version
            ),
        )
        return version

    def stop_all(self) -> dict[str, int]:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        return {name: p.wait(30) for name, p in self.procs.items()}


@pytest.fixture
def pipeline(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Pipeline]:
    pipe = Pipeline(tmp_path, getattr(request, "param", "shm"))
    try:
        yield pipe
    finally:
        for p in pipe.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)


def _assert_bit_exact(tmp: Path, version: int) -> None:
    with (
        WeightStore.open("pub", root=tmp, readonly=True) as pub,
        WeightStore.open("rollout", root=tmp, readonly=True) as out,
        pub.lease() as a,
        out.lease() as b,
    ):
        assert a.version == b.version == version
        assert np.array_equal(a.buffer, b.buffer)


def _ctl_status(pipe: Pipeline, daemon: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "deltarl.cli", "ctl", pipe.endpoint(daemon), "status", "--json"],
        capture_output=True,
        check=True,
        timeout=30,
    )
    return orjson.loads(out.stdout)


@pytest.mark.parametrize("pipeline", ["shm", "stream"], indirect=True)
def test_versions_flow_bit_exact(pipeline: Pipeline) -> None:
    for daemon in ("apply", "export", "trainer"):
        pipeline.start(daemon)
    pipeline.wait("3 versions applied", lambda: pipeline.status("apply")["applied"] >= 3)
    version = pipeline.quiesce()
    _assert_bit_exact(pipeline.tmp, version)

    for daemon in ("trainer", "export", "apply"):
        reply = _ctl_status(pipeline, daemon)
        assert reply["ok"] is True, reply
        assert "export" in str(reply) or daemon != "export"

    with ManifestStore(pipeline.tmp / "versions.sqlite", readonly=True) as ms:
        history = ms.history()
        assert ms.active() is not None
        assert ms.active().version == version
        states = {r.state for r in history}
        first = min(history, key=lambda r: r.version)
        assert first.kind == "full"
        assert State.SUPERSEDED in states
        assert State.ACTIVE in states
        assert any(r.kind == "delta" for r in history)
        last_before = ms.latest().version

    # resync: the next version is full, whatever the delta chain
    subprocess.run(
        [sys.executable, "-m", "deltarl.cli", "ctl", pipeline.endpoint("export"), "resync"],
        check=True,
        capture_output=True,
        timeout=30,
    )
    assert request_sync(pipeline.endpoint("trainer"), Resume(), 2.0) == Ok("resumed")
    pipeline.wait("a version after resync", lambda: pipeline.status("apply")["active_version"]
                  > version)  # fmt: skip
    version = pipeline.quiesce()
    _assert_bit_exact(pipeline.tmp, version)
    with ManifestStore(pipeline.tmp / "versions.sqlite", readonly=True) as ms:
        after = sorted((r for r in ms.history() if r.version > last_before),
                       key=lambda r: r.version)  # fmt: skip
        assert after[0].kind == "full", after

    # rollback on the apply agent: the previous version is active again, and since the
    # receiver no longer holds the reference, the export agent's next version is full
    reply = request_sync(pipeline.endpoint("apply"), Rollback(), 5.0)
    assert isinstance(reply, Ok), reply
    assert pipeline.status("apply")["active_version"] < version
    last_before = version
    # (the export agent does not resend the version rolled back from: that would undo the
    # rollback; the trainer's next version is what comes, in full)
    assert request_sync(pipeline.endpoint("trainer"), Resume(), 2.0) == Ok("resumed")
    pipeline.wait("a version after the rollback",
                  lambda: pipeline.status("apply")["active_version"] > last_before)  # fmt: skip
    version = pipeline.quiesce()
    _assert_bit_exact(pipeline.tmp, version)
    with ManifestStore(pipeline.tmp / "versions.sqlite", readonly=True) as ms:
        after = sorted((r for r in ms.history() if r.version > last_before),
                       key=lambda r: r.version)  # fmt: skip
        assert after[0].kind == "full", after

    codes = pipeline.stop_all()
    assert codes == {"apply": 0, "export": 0, "trainer": 0}, pipeline.logs()


def test_killed_apply_agent_converges_again(pipeline: Pipeline) -> None:
    for daemon in ("apply", "export", "trainer"):
        pipeline.start(daemon)
    pipeline.wait("2 versions applied", lambda: pipeline.status("apply")["applied"] >= 2)
    session = pipeline.status("apply")["session"]
    os.kill(pipeline.procs["apply"].pid, signal.SIGKILL)
    assert pipeline.procs["apply"].wait(10) == -signal.SIGKILL
    killed_at = pipeline.status("trainer")["version"]
    time.sleep(0.5)  # the export agent is mid-send or waiting for an acknowledgement
    pipeline.start("apply")
    pipeline.wait(
        "versions applied after the restart",
        lambda: (st := pipeline.status("apply"))["session"] != session and st["applied"] >= 2,
    )
    version = pipeline.quiesce()
    _assert_bit_exact(pipeline.tmp, version)
    with ManifestStore(pipeline.tmp / "versions.sqlite", readonly=True) as ms:
        # the first version activated after the restart was full
        later = sorted((r for r in ms.history() if r.version > killed_at
                        and r.state in (State.ACTIVE, State.SUPERSEDED)),
                       key=lambda r: r.version)  # fmt: skip
        assert later, "nothing activated after the restart"
        assert later[0].kind == "full", later
    codes = pipeline.stop_all()
    assert codes == {"apply": 0, "export": 0, "trainer": 0}, pipeline.logs()


# -- the parts, in this process: config errors, the apply agent's refusals, the full rule --


def test_a_bad_config_exits_78_and_names_the_key(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    cases = {
        '[daemons.export]\ncontrol = "ipc:///x"\n': "missing key 'published_store'",
        '[daemons.apply]\ncontrol = "ipc:///x"\nrollout_store = "r"\nlink = {type = "shm"}\n'
        "colour = 3\n": "unknown key(s) ['colour']",
        '[daemons.apply]\ncontrol = "nope"\nrollout_store = "r"\nlink = {type = "shm"}\n': (
            "bad control endpoint"
        ),
        '[daemons.apply]\ncontrol = "ipc:///x"\nrollout_store = "r"\nlink = {type = "udp"}\n': (
            "type must be one of"
        ),
        "[daemons.trainer]\n": "no [daemons.apply] table",
    }
    for text, needle in cases.items():
        bad.write_text(text)
        daemon = "export" if "export" in text else "apply"
        proc = subprocess.run(
            [sys.executable, "-m", "deltarl.cli", daemon, "--config", str(bad)],
            check=False,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 78, proc.stderr
        assert needle in proc.stderr, proc.stderr


def _versions(n: int) -> tuple[Any, list[np.ndarray]]:
    from deltarl.sim.realistic_deltas import RealisticDeltas  # noqa: PLC0415 - torch

    gen = RealisticDeltas(PARAMS, seed=3)
    out = [gen.publish()]
    for _ in range(n - 1):
        gen.step()
        out.append(gen.publish())
    return gen.layout, out


def test_apply_agent_refuses_what_it_cannot_apply(tmp_path: Path) -> None:
    import asyncio  # noqa: PLC0415

    from deltarl.codecs.encoder import DeltaEncoder  # noqa: PLC0415
    from deltarl.daemons.apply import ApplyAgent  # noqa: PLC0415
    from deltarl.daemons.config import ApplyConfig, DaemonShell  # noqa: PLC0415
    from deltarl.transport.base import (  # noqa: PLC0415
        ReceivedChunk,
        ReceivedManifest,
        ShmLinkConfig,
    )

    layout, vs = _versions(5)
    enc = DeltaEncoder(layout, chunk_bytes=64 << 10)

    def encoded(v: int, base: int | None) -> tuple[list[bytes], bytes]:
        e = enc.encode(vs[v], None if base is None else vs[base], target_version=v,
                       base_version=base)  # fmt: skip
        chunks = [c.data for c in e]
        assert e.manifest is not None
        return chunks, e.manifest.to_json()

    async def send(agent: ApplyAgent, v: int, chunks: list[bytes], manifest: bytes) -> None:
        released = []
        for i, data in enumerate(chunks + chunks[:1]):  # one chunk twice: harmless
            chunk = ReceivedChunk(v, i % len(chunks), data, lambda: released.append(1))
            await agent._on_chunk(chunk)
        await agent._on_manifest(ReceivedManifest(v, manifest))
        assert len(released) == len(chunks) + 1  # every chunk was released

    async def scenario() -> None:
        store = WeightStore.create("r", layout, root=tmp_path)
        cfg = ApplyConfig(control="ipc:///unused", rollout_store="r", link=ShmLinkConfig())
        agent = ApplyAgent(cfg, DaemonShell("apply", cfg.control, {}), store)
        assert agent.needs_full  # an empty store needs a full version
        await send(agent, 0, *encoded(0, None))
        await send(agent, 1, *encoded(1, 0))
        st = (await agent.on_status(GetStatus())).fields
        assert st["active_version"] == 1
        assert not st["needs_full"]
        # a delta on a version the store does not hold is refused, and asks for a full one
        await send(agent, 3, *encoded(3, 2))
        st = (await agent.on_status(GetStatus())).fields
        assert st["active_version"] == 1
        assert st["needs_full"]
        assert st["last_failed"]["version"] == 3
        assert "refused" in st["last_failed"]["reason"]
        # chunks that disagree with their manifest never become active
        chunks, _ = encoded(2, 1)
        _, wrong = encoded(2, 0)
        await send(agent, 2, chunks, wrong)
        st = (await agent.on_status(GetStatus())).fields
        assert st["active_version"] == 1
        assert st["last_failed"]["version"] == 2
        # a full version clears needs_full; rollback flips back to the version kept
        agent.finished.pop(3)
        await send(agent, 3, *encoded(3, None))
        st = (await agent.on_status(GetStatus())).fields
        assert st["active_version"] == 3
        assert not st["needs_full"]
        with store.lease() as snap:
            assert np.array_equal(snap.buffer, vs[3])
        assert await agent.on_rollback(Rollback()) == Ok("rolled back to version 1")
        with store.lease() as snap:
            assert snap.version == 1
            assert np.array_equal(snap.buffer, vs[1])
        # a version half-received as a delta, then re-sent in full (the export agent restarted)
        delta_chunks, _ = encoded(4, 1)
        await agent._on_chunk(ReceivedChunk(4, 0, delta_chunks[0]))
        assert (await agent.on_status(GetStatus())).fields["applying"] == 4
        await send(agent, 4, *encoded(4, None))
        with store.lease() as snap:
            assert snap.version == 4
            assert np.array_equal(snap.buffer, vs[4])
        agent.close()

    asyncio.run(scenario())


def test_export_full_rule() -> None:
    from types import SimpleNamespace  # noqa: PLC0415

    from deltarl.daemons.export import ExportAgent  # noqa: PLC0415

    agent: Any = SimpleNamespace(
        ref=np.zeros(1), ref_version=5, ref_session="s", resync_pending=False,
        deltas_in_a_row=0, config=SimpleNamespace(full_resync_every=3),
    )  # fmt: skip
    rule = ExportAgent._full_reason
    ok = {"session": "s", "active_version": 5, "needs_full": False}
    assert rule(agent, ok, 6) is None
    assert "restarted" in rule(agent, {**ok, "session": "t"}, 6)
    assert "holds 4" in rule(agent, {**ok, "active_version": 4}, 6)
    assert "asked" in rule(agent, {**ok, "needs_full": True}, 6)
    assert "not newer" in rule(agent, ok, 5)
    agent.deltas_in_a_row = 3
    assert "periodic" in rule(agent, ok, 6)
    agent.deltas_in_a_row, agent.resync_pending = 0, True
    assert rule(agent, ok, 6) == "resync command"
    agent.ref = None
    assert rule(agent, ok, 6) == "no reference"


def test_apply_agent_speaks_sd_notify(tmp_path: Path) -> None:
    from deltarl.engine.layout import Layout  # noqa: PLC0415

    (tmp_path / "layout.json").write_bytes(Layout.pack([("w", "bfloat16", (8,))]).to_json())
    (tmp_path / "c.toml").write_text(f"""
[daemons.apply]
control = "ipc://{tmp_path}/apply.sock"
rollout_store = "r"
store_root = "{tmp_path}"
layout_file = "{tmp_path}/layout.json"
link = {{type = "shm", name = "n", root = "{tmp_path}"}}
""")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
        notify.bind(str(tmp_path / "notify"))
        notify.settimeout(60)
        env = {**os.environ, "NOTIFY_SOCKET": str(tmp_path / "notify"), "WATCHDOG_USEC": "200000"}
        args = [sys.executable, "-m", "deltarl.cli", "apply", "--config", str(tmp_path / "c.toml")]
        proc = subprocess.Popen(args, env=env, stderr=subprocess.PIPE)
        try:
            seen = [notify.recv(4096).decode() for _ in range(3)]
            assert seen[0].startswith("READY=1\nSTATUS=apply: serving ipc://")
            assert "WATCHDOG=1" in seen[1:]  # every 0.1 s, from the daemon's event loop
            proc.send_signal(signal.SIGTERM)
            while "STOPPING=1" not in (msg := notify.recv(4096).decode()):
                assert msg == "WATCHDOG=1"
            assert proc.wait(30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
