"""The trainer, export and apply daemons as separate processes, over shm and over TCP.

A synthetic trainer publishes versions; the export agent diffs and sends them; the apply agent
applies them into the rollout store. Checked: the rollout store ends bit-exact equal to the
published store, the manifest store records every version's life, ``deltarl ctl status``
answers for each daemon, ``resync`` makes the next version full, SIGTERM stops each daemon
with status 0, and a ``kill -9``ed apply agent, restarted, gets a full version and converges.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from deltarl.launch import DaemonGroup
from deltarl.refit.manifest_store import ManifestStore, State
from deltarl.transport.control import request_sync
from deltarl.transport.messages import Ok, Resume, Rollback
from tests.daemons.pipeline import Pipeline, assert_bit_exact, refit_tables, shm_link

ROOT = Path(__file__).resolve().parents[2]


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
    assert_bit_exact(pipeline.tmp, version)
    # Each agent warmed its kernels as it started (codecs/kernel_warmth.py), before its
    # first version: loaded from the install's cache, or compiled into it.
    for agent in ("export", "apply"):
        kernels = pipeline.status(agent)["kernels"]
        assert kernels["state"] == "ready", kernels
        assert kernels["loaded"] + kernels["compiled"] > 0, kernels
        assert "codec kernels ready in" in pipeline.log(agent).read_text(), pipeline.logs()

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
    pipeline.wait(
        "a version after resync", lambda: pipeline.status("apply")["active_version"] > version
    )
    version = pipeline.quiesce()
    assert_bit_exact(pipeline.tmp, version)
    with ManifestStore(pipeline.tmp / "versions.sqlite", readonly=True) as ms:
        after = sorted(
            (r for r in ms.history() if r.version > last_before), key=lambda r: r.version
        )
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
    pipeline.wait(
        "a version after the rollback",
        lambda: pipeline.status("apply")["active_version"] > last_before,
    )
    version = pipeline.quiesce()
    assert_bit_exact(pipeline.tmp, version)
    with ManifestStore(pipeline.tmp / "versions.sqlite", readonly=True) as ms:
        after = sorted(
            (r for r in ms.history() if r.version > last_before), key=lambda r: r.version
        )
        assert after[0].kind == "full", after

    codes = pipeline.stop_all()
    assert codes == {"apply": 0, "export": 0, "trainer": 0}, pipeline.logs()


@pytest.mark.parametrize("coding", ["conditioned", "conditioned_rice", "conditioned_huffman"])
def test_conditioned_deltas_flow_bit_exact(tmp_path: Path, coding: str) -> None:
    """``delta_coding = "conditioned"``, ``"conditioned_rice"`` or ``"conditioned_huffman"``:
    the same daemons, deltas
    coded against the reference (the apply agent needs no setting); conditioned records
    really go over the link."""
    tables = refit_tables(tmp_path, export_link=shm_link(tmp_path))
    tables["daemons"]["export"]["delta_coding"] = coding
    pipe = Pipeline(tmp_path, tables)
    try:
        for daemon in ("apply", "export", "trainer"):
            pipe.start(daemon)
        pipe.wait("3 versions applied", lambda: pipe.status("apply")["applied"] >= 3)
        version = pipe.quiesce()
        assert_bit_exact(pipe.tmp, version)
        with ManifestStore(tmp_path / "versions.sqlite", readonly=True) as ms:
            deltas = [r for r in ms.history() if r.kind == "delta" and r.state != State.FAILED]
            assert deltas, ms.history()
            codings = {t.coding for r in deltas for t in r.manifest.tensors}
        assert "conditioned" in codings, codings
        assert pipe.status("export")["delta_coding"] == coding
        assert pipe.stop_all() == {"apply": 0, "export": 0, "trainer": 0}, pipe.logs()
    finally:
        pipe.kill_all()


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
    assert_bit_exact(pipeline.tmp, version)
    with ManifestStore(pipeline.tmp / "versions.sqlite", readonly=True) as ms:
        # the first version activated after the restart was full
        later = sorted(
            (
                r
                for r in ms.history()
                if r.version > killed_at and r.state in (State.ACTIVE, State.SUPERSEDED)
            ),
            key=lambda r: r.version,
        )
        assert later, "nothing activated after the restart"
        assert later[0].kind == "full", later
    codes = pipeline.stop_all()
    assert codes == {"apply": 0, "export": 0, "trainer": 0}, pipeline.logs()


# -- in one process each: a bad config, sd_notify (the cores: tests/refit/) -----------------


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
            assert seen[0].startswith("READY=1\nSTATUS=apply: ")  # once the socket serves
            assert "WATCHDOG=1" in seen[1:]  # every 0.1 s, from the daemon's event loop
            proc.send_signal(signal.SIGTERM)
            while "STOPPING=1" not in (msg := notify.recv(4096).decode()):
                assert msg == "WATCHDOG=1"
            assert proc.wait(30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_an_apply_agent_with_a_cold_kernel_cache(tmp_path: Path) -> None:
    """An apply agent whose numba cache is empty (a fresh host under the systemd units)
    compiles its kernels as it starts, says so, and applies its first versions after: no
    variant is compiled by a refit (the cache holds the same files after three versions as
    after the warm-up). Slow: the compile takes minutes of a core."""
    cache = tmp_path / "numba-cache"
    pipe = Pipeline(tmp_path)
    try:
        DaemonGroup.start(pipe, "apply", prefix=["env", f"NUMBA_CACHE_DIR={cache}"])
        for daemon in ("export", "trainer"):  # the apply agent takes its layout from the trainer
            pipe.start(daemon)
        pipe.wait("the apply agent", lambda: pipe.status("apply")["kernels"] is not None, 120)
        assert pipe.status("apply")["kernels"]["state"] == "warming"
        pipe.wait(
            "the warm-up",
            lambda: pipe.status("apply")["kernels"]["state"] != "warming",
            1500,
        )
        kernels = pipe.status("apply")["kernels"]
        assert kernels["state"] == "ready", kernels
        assert kernels["compiled"] > 0, kernels
        assert kernels["loaded"] == 0, kernels
        assert kernels["cache"].startswith(str(cache)), kernels
        warmed = sorted(p.name for p in cache.rglob("*") if p.is_file())
        pipe.wait("3 versions applied", lambda: pipe.status("apply")["applied"] >= 3, 300)
        version = pipe.quiesce()
        assert_bit_exact(tmp_path, version)
        assert sorted(p.name for p in cache.rglob("*") if p.is_file()) == warmed
        assert pipe.stop_all() == {"apply": 0, "export": 0, "trainer": 0}, pipe.logs()
        given_up = given_up_and_applied(pipe.log("export"), pipe.log("apply"))
        assert len(given_up) <= 1, given_up
    finally:
        pipe.kill_all()


def given_up_and_applied(export_log: Path, apply_log: Path) -> list[int]:
    """The versions the export agent gave up on that the apply agent activated all the same.

    While an apply agent stalls (its cold compile) the export agent gives up on version after
    version and withdraws what the link still holds of each; only a version whose every chunk
    the agent took before it stalled can still complete: the first one, at most. Without the
    withdrawal it activated, once it read again, every one newer than the last it activated
    (eight flips of the engines' weights in one run here)."""
    failed = {int(v) for v in re.findall(r"version (\d+) failed:", export_log.read_text())}
    active = [int(v) for v in re.findall(r"version (\d+) active \(", apply_log.read_text())]
    return [v for v in active if v in failed]


def test_an_apply_agent_whose_kernel_warm_up_fails_serves_on(tmp_path: Path) -> None:
    """The fault, in the agent's own process: its warm-up raises, as on a full disk (a
    ``sitecustomize`` on its PYTHONPATH puts a failing function in place of the codec's
    ``warm_up``). The agent says so in its status and its log, with the traceback, and
    applies versions anyway, bit-exact: its kernels load or compile as refits first use them."""
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(
        textwrap.dedent(
            """\
            import errno

            from deltarl.codecs import warmup


            def _fails() -> None:
                raise OSError(errno.ENOSPC, "no space left for the kernel cache (injected)")


            warmup.warm_up = _fails
            """
        )
    )
    path = os.pathsep.join(p for p in (str(inject), str(ROOT), os.environ.get("PYTHONPATH")) if p)
    pipe = Pipeline(tmp_path)
    try:
        DaemonGroup.start(pipe, "apply", prefix=["env", f"PYTHONPATH={path}"])
        for daemon in ("export", "trainer"):
            pipe.start(daemon)

        def warm_up_ended() -> bool:
            kernels = pipe.status("apply")["kernels"]
            return kernels is not None and kernels["state"] != "warming"

        pipe.wait("the apply agent's warm-up", warm_up_ended, 120)
        kernels = pipe.status("apply")["kernels"]
        assert kernels["state"] == "failed", kernels
        assert (
            kernels["error"] == "OSError: [Errno 28] no space left for the kernel cache (injected)"
        )
        log = pipe.log("apply").read_text()
        assert "the codec kernels' warm-up failed; refits compile as they go" in log, log
        assert "Traceback" in log, log
        assert "codec kernels ready" not in log, log
        pipe.wait("3 versions applied", lambda: pipe.status("apply")["applied"] >= 3, 300)
        version = pipe.quiesce()
        assert_bit_exact(tmp_path, version)
        assert pipe.status("export")["kernels"]["state"] == "ready"  # only the apply agent's
        assert pipe.stop_all() == {"apply": 0, "export": 0, "trainer": 0}, pipe.logs()
    finally:
        pipe.kill_all()


def test_an_apply_agent_stopped_while_it_compiles_its_kernels_stops_at_once(
    tmp_path: Path,
) -> None:
    """The fault: an operator stops an agent on a fresh host while it compiles its kernels
    (an empty numba cache: minutes of a core). The warm-up's thread must not hold the stop
    up nor crash the interpreter's teardown beside a compile: status 0, in seconds."""
    pipe = Pipeline(tmp_path)
    try:
        pipe.start("trainer")  # the apply agent takes its layout from the trainer's store
        pipe.wait("the trainer's store", lambda: pipe.status("trainer") is not None)
        cache = tmp_path / "numba-cache"
        DaemonGroup.start(pipe, "apply", prefix=["env", f"NUMBA_CACHE_DIR={cache}"])
        pipe.wait("the apply agent", lambda: pipe.status("apply")["kernels"] is not None, 120)
        time.sleep(2.0)  # into the compile
        assert pipe.status("apply")["kernels"]["state"] == "warming"
        started = time.monotonic()
        assert pipe.stop_all() == {"apply": 0, "trainer": 0}, pipe.logs()
        assert time.monotonic() - started < 20, pipe.logs()
        log = pipe.log("apply").read_text()
        assert "apply: stopped" in log, log
        assert "Fatal Python error" not in log, log
    finally:
        pipe.kill_all()
