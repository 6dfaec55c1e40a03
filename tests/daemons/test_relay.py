"""Fan-out through a relay tree: export -> apply (root) -> apply-b (stream) and apply-c (shm).

The export agent sends each version once, to the root; the root relays every chunk as it
arrived. Checked: all three rollout stores end bit-exact equal to the trainer's version, every
version reached every member, and a member killed with ``kill -9`` and restarted converges again
(the tree's session changes, so everyone gets a full version, then deltas resume).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from deltarl.engine.weight_store import WeightStore
from deltarl.refit.manifest_store import ManifestStore, State
from deltarl.transport.control import request_sync
from deltarl.transport.messages import Ok, Pause, Resume
from tests.daemons.test_refit_pipeline import PARAMS, Pipeline, _free_port

MEMBERS = {"apply": "rollout", "apply-b": "rollout-b", "apply-c": "rollout-c"}


def _stream(port: int) -> str:
    return f'type = "stream"\nhost = "127.0.0.1"\nport = {port}\nconnections = 2\n'


def _config(tmp: Path) -> str:
    root_port, b_port = _free_port(), _free_port()
    shm_c = f'type = "shm"\nname = "c"\nroot = "{tmp}"\n'
    apply_tables = ""
    for name, store in MEMBERS.items():
        apply_tables += f"""
[daemons.{name}]
control = "ipc://{tmp}/{name}.sock"
rollout_store = "{store}"
store_root = "{tmp}"
layout_store = "pub"
"""
        link = {"apply": _stream(root_port), "apply-b": _stream(b_port), "apply-c": shm_c}[name]
        apply_tables += f"\n[daemons.{name}.link]\n{link}"
        if name == "apply":
            apply_tables += f"""
[[daemons.apply.relay]]
name = "b"
control = "ipc://{tmp}/apply-b.sock"
[daemons.apply.relay.link]
{_stream(b_port)}
[[daemons.apply.relay]]
name = "c"
control = "ipc://{tmp}/apply-c.sock"
[daemons.apply.relay.link]
{shm_c}"""
    return f"""
[daemons.trainer]
control = "ipc://{tmp}/trainer.sock"
published_store = "pub"
store_root = "{tmp}"
params = {PARAMS}
interval_s = 0.3

[daemons.export]
control = "ipc://{tmp}/export.sock"
published_store = "pub"
store_root = "{tmp}"
manifest_store = "{tmp}/versions.sqlite"
apply_control = "ipc://{tmp}/apply.sock"
full_resync_every = 50
ack_timeout_s = 20.0
poll_s = 0.02

[daemons.export.link]
{_stream(root_port)}
{apply_tables}"""


class Tree(Pipeline):
    def __init__(self, tmp: Path) -> None:
        super().__init__(tmp, "stream")
        self.config.write_text(_config(tmp))

    def start(self, daemon: str) -> None:
        if daemon not in ("apply-b", "apply-c"):
            super().start(daemon)
            return
        args = [sys.executable, "-m", "deltarl.cli", "apply", "--config", str(self.config),
                "--name", daemon]  # fmt: skip
        log = (self.tmp / f"{daemon}.log").open("ab")
        self.procs[daemon] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)

    def quiesce_tree(self) -> int:
        assert request_sync(self.endpoint("trainer"), Pause(), 2.0) == Ok("paused")
        self.wait("the trainer's last step", lambda: not self.status("trainer")["stepping"])
        version = self.status("trainer")["version"]
        self.wait(
            f"version {version} active everywhere",
            lambda: (
                all(self.status(m)["active_version"] == version for m in MEMBERS)
                and self.status("export")["reference_version"] == version
            ),
        )
        return version


@pytest.fixture
def tree(tmp_path: Path) -> Iterator[Tree]:
    t = Tree(tmp_path)
    try:
        yield t
    finally:
        for p in t.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)


def _assert_all_bit_exact(tmp: Path, version: int) -> None:
    with WeightStore.open("pub", root=tmp, readonly=True) as pub, pub.lease() as want:
        assert want.version == version
        for store in MEMBERS.values():
            with WeightStore.open(store, root=tmp, readonly=True) as out, out.lease() as got:
                assert got.version == version, store
                assert np.array_equal(want.buffer, got.buffer), store


def _start_all(tree: Tree) -> None:
    for daemon in ("apply-b", "apply-c", "apply", "export", "trainer"):
        tree.start(daemon)


def test_relay_tree_delivers_every_version_to_every_member(tree: Tree) -> None:
    _start_all(tree)
    tree.wait("4 versions on every member",
              lambda: all(tree.status(m)["applied"] >= 4 for m in MEMBERS))  # fmt: skip
    version = tree.quiesce_tree()
    _assert_all_bit_exact(tree.tmp, version)

    root = tree.status("apply")
    members: dict[str, Any] = root["tree"]["members"]
    assert set(members) == {"b", "c"}
    for m in members.values():
        assert m["reachable"]
        assert m["active_version"] == version
        assert m["relayed_bytes"] > 0
        assert m["dropped_versions"] == 0
    # Every version the root applied, each child applied too: one send fed three stores.
    applied = {m: tree.status(m)["applied"] for m in MEMBERS}
    assert applied["apply-b"] == applied["apply-c"] == applied["apply"], applied
    with ManifestStore(tree.tmp / "versions.sqlite", readonly=True) as ms:
        kinds = [r.kind for r in sorted(ms.history(), key=lambda r: r.version)
                 if r.state in (State.ACTIVE, State.SUPERSEDED)]  # fmt: skip
    assert kinds[0] == "full", kinds
    assert "delta" in kinds, kinds

    codes = tree.stop_all()
    assert set(codes.values()) == {0}, tree.logs()


def test_killed_member_rejoins_and_the_tree_converges(tree: Tree) -> None:
    _start_all(tree)
    tree.wait("2 versions on every member",
              lambda: all(tree.status(m)["applied"] >= 2 for m in MEMBERS))  # fmt: skip
    os.kill(tree.procs["apply-c"].pid, signal.SIGKILL)
    assert tree.procs.pop("apply-c").wait(10) == -signal.SIGKILL
    killed_at = tree.status("trainer")["version"]
    # The rest of the tree keeps receiving versions while c is down.
    tree.wait("versions while c is down",
              lambda: tree.status("apply-b")["active_version"] > killed_at + 1)  # fmt: skip
    tree.start("apply-c")
    tree.wait("c active again",
              lambda: tree.status("apply-c")["active_version"] is not None
              and tree.status("apply-c")["active_version"] > killed_at + 1)  # fmt: skip
    assert request_sync(tree.endpoint("trainer"), Resume(), 2.0) in (
        Ok("was not paused"), Ok("resumed"))  # fmt: skip
    version = tree.quiesce_tree()
    _assert_all_bit_exact(tree.tmp, version)
    with ManifestStore(tree.tmp / "versions.sqlite", readonly=True) as ms:
        later = [
            r.kind
            for r in sorted(ms.history(), key=lambda r: r.version)
            if r.version > killed_at and r.state in (State.ACTIVE, State.SUPERSEDED)
        ]
    # a full version brought c back (its new session changed the tree's); deltas resumed
    assert "full" in later, later
    codes = tree.stop_all()
    assert set(codes.values()) == {0}, tree.logs()
