"""Fan-out through a relay tree: export -> apply (root) -> apply-b (stream) and apply-c (shm).

The export agent sends each version once, to the root; the root relays every chunk as it
arrived. Checked: all three rollout stores end bit-exact equal to the trainer's version, every
version reached every member, and a member killed with ``kill -9`` and restarted converges again
(the tree's session changes, so everyone gets a full version, then deltas resume).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from deltarl.engine.weight_store import WeightStore
from deltarl.refit.manifest_store import ManifestStore, State
from deltarl.transport.control import request_sync
from deltarl.transport.curve import make_keys
from deltarl.transport.data_keys import KEYS_ENV
from deltarl.transport.messages import Ok, Resume
from deltarl.transport.ports import free_port
from deltarl.transport.stream_wire import MSG_CHUNK, MSG_MANIFEST, pack_header
from tests.daemons.pipeline import (
    Pipeline,
    apply_table,
    refit_tables,
    shm_link,
    stream_link,
)
from tests.transport.linkdata import encoded_versions

MEMBERS = {"apply": "rollout", "apply-b": "rollout-b", "apply-c": "rollout-c"}


def _tables(tmp: Path) -> dict[str, Any]:
    root_port, b_port = free_port(), free_port()
    links = {
        "apply": stream_link(root_port, connections=2),
        "apply-b": stream_link(b_port, connections=2),
        "apply-c": shm_link(tmp, "c"),
    }
    tables = refit_tables(tmp, export_link=links["apply"], export={"full_resync_every": 50})
    daemons = tables["daemons"]
    for name, store in MEMBERS.items():
        daemons[name] = apply_table(tmp, name, links[name], store)
    daemons["apply"]["relay"] = [
        {
            "name": label,
            "control": daemons[child]["control"],
            "events": daemons[child]["events"],
            "link": links[child],
        }
        for label, child in (("b", "apply-b"), ("c", "apply-c"))
    ]
    return tables


class Tree(Pipeline):
    def __init__(self, tmp: Path) -> None:
        super().__init__(tmp, _tables(tmp))

    def quiesce_tree(self) -> int:
        return self.quiesce(tuple(MEMBERS))


@pytest.fixture
def tree(tmp_path: Path) -> Iterator[Tree]:
    t = Tree(tmp_path)
    try:
        yield t
    finally:
        t.kill_all()


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
    tree.wait(
        "4 versions on every member", lambda: all(tree.status(m)["applied"] >= 4 for m in MEMBERS)
    )
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
        kinds = [
            r.kind
            for r in sorted(ms.history(), key=lambda r: r.version)
            if r.state in (State.ACTIVE, State.SUPERSEDED)
        ]
    assert kinds[0] == "full", kinds
    assert "delta" in kinds, kinds

    codes = tree.stop_all()
    assert set(codes.values()) == {0}, tree.logs()


def test_killed_member_rejoins_and_the_tree_converges(tree: Tree) -> None:
    _start_all(tree)
    tree.wait(
        "2 versions on every member", lambda: all(tree.status(m)["applied"] >= 2 for m in MEMBERS)
    )
    os.kill(tree.procs["apply-c"].pid, signal.SIGKILL)
    assert tree.procs.pop("apply-c").wait(10) == -signal.SIGKILL
    killed_at = tree.status("trainer")["version"]
    # The rest of the tree keeps receiving versions while c is down.
    tree.wait(
        "versions while c is down", lambda: tree.status("apply-b")["active_version"] > killed_at + 1
    )
    tree.start("apply-c")
    tree.wait(
        "c active again",
        lambda: (
            tree.status("apply-c")["active_version"] is not None
            and tree.status("apply-c")["active_version"] > killed_at + 1
        ),
    )
    assert request_sync(tree.endpoint("trainer"), Resume(), 2.0) in (
        Ok("was not paused"),
        Ok("resumed"),
    )
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


def test_a_sealed_tree_checks_the_origin_at_every_member_and_refuses_strangers(
    tree: Tree, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With the cluster's keys, the export agent seals every manifest; the root relays the
    # sealed bytes as they came, and every member checks the origin's seal (stream hops are
    # TLS 1.3, the shm hop is not: its member's seal check is what proves the version).
    monkeypatch.setenv(KEYS_ENV, str(make_keys(tree.tmp / "keys")))
    _start_all(tree)
    tree.wait(
        "3 versions on every member", lambda: all(tree.status(m)["applied"] >= 3 for m in MEMBERS)
    )
    # A stranger on apply-b's stream port: a self-consistent version as plain frames.
    chunks, manifest = encoded_versions(11)[0]
    wire = b"".join(pack_header(MSG_CHUNK, 10**6, i, len(c)) + c for i, c in enumerate(chunks))
    wire += pack_header(MSG_MANIFEST, 10**6, 0, len(manifest)) + manifest
    port = tree.tables["daemons"]["apply-b"]["link"]["port"]
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as s,
        contextlib.suppress(OSError),
    ):
        s.sendall(wire)
        s.settimeout(2)
        reply = s.recv(1 << 16)  # a TLS alert at most (record type 21), never an ack
        assert reply[:1] in (b"", b"\x15"), reply[:16]
    version = tree.quiesce_tree()
    _assert_all_bit_exact(tree.tmp, version)
    assert tree.status("export")["sealed"]
    for m in MEMBERS:
        st = tree.status(m)
        assert st["sealed"], m
        assert st["seal_failures"] == 0, m
        assert st["refused_items"] == 0, m  # the stranger's frames never reached an agent
    codes = tree.stop_all()
    assert set(codes.values()) == {0}, tree.logs()
