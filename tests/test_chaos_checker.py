"""The checker process of ``deltarl chaos`` finds what it is there to find.

Each test runs the real checker (``python -m deltarl.chaos_checker``) as a process against a
real weight store, then does to the store what a broken apply agent could: bytes of the active
version changed behind the store's back (no new version, no new digest), or the active version
moved backwards. A clean store beside it must give no finding, so the check can fail both ways.
The engine side's comparison runs against a real manifest store: a load whose digest is not
the manifest's, or that the rollout daemon did not verify, is a finding; the manifest's is not.
"""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from deltarl.chaos_checker import EngineChecker, Findings, Manifests
from deltarl.codecs.checksum import model_digest, tensor_digests
from deltarl.codecs.frame import NO_BASE
from deltarl.codecs.manifest import ChunkEntry, RefitManifest
from deltarl.engine.layout import Layout
from deltarl.engine.weight_store import WeightStore
from deltarl.refit.manifest_store import ManifestStore

ROOT = Path(__file__).resolve().parents[1]
LAYOUT = Layout.pack([("a", "bfloat16", (256, 64)), ("b", "float32", (1000,))])

pytestmark = pytest.mark.timeout(60)


def _commit(store: WeightStore, version: int, seed: int) -> None:
    with store.begin_write() as txn:
        rng = np.random.default_rng(seed)
        txn.buffer[:] = rng.integers(0, 256, txn.buffer.size, dtype=np.uint8)
        txn.commit(version, digest=model_digest(tensor_digests(LAYOUT, txn.buffer)))


class Checker:
    def __init__(self, root: Path, name: str) -> None:
        self.out = root / f"{name}-checker.json"
        argv = [sys.executable, "-m", "deltarl.chaos_checker", "--root", str(root)]
        argv += ["--store", name, "--out", str(self.out)]
        self.proc = subprocess.Popen(argv, cwd=ROOT, stderr=subprocess.PIPE)

    def result(self) -> dict[str, Any]:
        self.proc.send_signal(signal.SIGTERM)
        _, err = self.proc.communicate(timeout=30)
        assert self.proc.returncode == 0, err.decode()
        found: dict[str, Any] = orjson.loads(self.out.read_bytes())
        return found


def _leased(checker: Checker, seconds: float = 1.5) -> None:
    """Long enough for many leases (one every 20 ms), however slow the import."""
    time.sleep(seconds)
    assert checker.proc.poll() is None


@pytest.fixture
def stores(tmp_path: Path) -> tuple[WeightStore, WeightStore]:
    root = tmp_path / "shm"
    root.mkdir(mode=0o700)
    clean = WeightStore.create("clean", LAYOUT, root=root)
    bad = WeightStore.create("bad", LAYOUT, root=root)
    for store in (clean, bad):
        _commit(store, 1, seed=1)
        _commit(store, 2, seed=2)
    return clean, bad


def test_bytes_changed_behind_the_store_are_seen(stores: tuple[WeightStore, WeightStore]) -> None:
    clean, bad = stores
    root = bad.path.parent
    watch_clean, watch_bad = Checker(root, "clean"), Checker(root, "bad")
    time.sleep(3.0)  # both import and lease; then the bad one's active buffer is written
    active = bad.status()["active_index"]
    offset = bad.header.buffer_offsets[active] + LAYOUT.tensors[1].offset
    fd = os.open(bad.path, os.O_RDWR)
    try:
        with mmap.mmap(fd, bad.header.file_nbytes) as mm:
            mm[offset : offset + 8] = bytes(8) if mm[offset : offset + 8] != bytes(8) else b"x" * 8
    finally:
        os.close(fd)
    _leased(watch_bad)
    found_bad, found_clean = watch_bad.result(), watch_clean.result()
    assert found_clean["leases"] > 10
    assert found_clean["half_applied"] == []
    assert found_clean["versions_leased"] == [2]
    assert found_bad["leases"] > 10
    assert len(found_bad["half_applied"]) == 1, found_bad["half_applied"]  # counted once
    seen = found_bad["half_applied"][0]
    assert seen["version"] == 2
    assert seen["committed"] == clean.lease().digest  # what version 2 should read as
    assert seen["read"] != seen["committed"]


def test_a_version_going_backwards_is_seen(stores: tuple[WeightStore, WeightStore]) -> None:
    clean, bad = stores
    root = bad.path.parent
    watch_clean, watch_bad = Checker(root, "clean"), Checker(root, "bad")
    time.sleep(3.0)
    assert bad.rollback() == 1  # 2 -> 1: whole and digested, but backwards
    _commit(clean, 3, seed=3)  # forwards: fine
    _leased(watch_bad)
    found_bad, found_clean = watch_bad.result(), watch_clean.result()
    assert found_bad["store_backwards"] == [[2, 1]]
    assert found_bad["half_applied"] == []  # rolled back to a whole version
    assert found_clean["store_backwards"] == []
    assert found_clean["versions_leased"] == [2, 3]


def test_an_engine_load_unlike_its_manifest_is_not_bit_exact(tmp_path: Path) -> None:
    path = tmp_path / "versions.sqlite"
    with ManifestStore(path) as ms:
        ms.record(RefitManifest(4, NO_BASE, "full", 0.0, [], [ChunkEntry(0, 1, 1)], "d" * 32))
    found = Findings()
    engine = EngineChecker("ipc:///nonexistent", Manifests(path), found)
    engine.check_load("s1", 4, "d" * 32, verified=True)  # the manifest's digest: fine
    engine.check_load("s1", 4, "d" * 32, verified=True)  # the same load polled again
    engine.check_load("s1", 5, "e" * 32, verified=True)  # no manifest yet: checked later
    assert found.non_bit_exact == []
    assert found.engine_loads_checked == 1
    engine.check_load("s2", 4, "e" * 32, verified=True)  # another digest than the manifest's
    engine.check_load("s3", 4, "d" * 32, verified=False)  # the daemon's own check failed
    assert [(f["session"], f["verified"]) for f in found.non_bit_exact] == [
        ("s2", True),
        ("s3", False),
    ]
