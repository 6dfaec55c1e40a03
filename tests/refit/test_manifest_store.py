"""ManifestStore: the state machine, its invariants, crash atomicity and concurrent readers."""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from deltarl.codecs.frame import NO_BASE
from deltarl.codecs.manifest import ChunkEntry, RefitManifest, TensorEntry
from deltarl.refit.manifest_store import (
    TRANSITIONS,
    DuplicateVersionError,
    ManifestStore,
    ManifestStoreError,
    State,
    TransitionError,
    UnknownVersionError,
)


def manifest(version: int, base: int = NO_BASE, changed: int = 3) -> RefitManifest:
    return RefitManifest(
        version=version,
        base_version=base,
        kind="full" if base == NO_BASE else "delta",
        time=1_700_000_000.5,
        tensors=[TensorEntry("w", "bfloat16", [4, 8], "rice", changed, 40, "a" * 32)],
        chunks=[ChunkEntry(0, 100, 7), ChunkEntry(1, 28, 9)],
        model_xxh3_128="d" * 32,
    )


def to_active(store: ManifestStore, version: int) -> None:
    for state in ("uploaded", "verified", "active"):
        store.mark(version, state)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[ManifestStore]:
    with ManifestStore(tmp_path / "versions.sqlite") as s:
        yield s


def check_invariants(path: Path) -> dict[int, tuple[str, str, int]]:
    """I1-I3 straight from the file (no ManifestStore in the way); returns version -> row."""
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        rows = {
            v: (state, kind, base)
            for v, state, kind, base in conn.execute(
                "SELECT version, state, kind, base_version FROM versions"
            )
        }
    finally:
        conn.close()
    states = [s for s, _, _ in rows.values()]
    assert states.count("active") <= 1  # I1
    if "superseded" in states:
        assert states.count("active") == 1  # I2: something replaced every superseded one
    for v, (state, kind, base) in rows.items():
        assert state in {s.value for s in State}
        if kind == "full":
            assert base == NO_BASE
        else:
            assert base in rows  # I3: recorded on a recorded base
            assert base < v
    return rows


# -- the state machine --------------------------------------------------------------------


def test_record_starts_pending_with_the_manifest_numbers(tmp_path: Path) -> None:
    clock = itertools.count(100.0)
    with ManifestStore(tmp_path / "s.sqlite", clock=lambda: next(clock)) as s:
        rec = s.record(manifest(0))
        assert rec.state is State.PENDING
        assert (rec.version, rec.base_version, rec.kind) == (0, NO_BASE, "full")
        assert (rec.wire_bytes, rec.changed, rec.error) == (128, 3, None)
        assert rec.manifest == manifest(0)
        assert rec.created == rec.updated == 100.0
        later = s.mark(0, State.UPLOADED)
        assert (later.created, later.updated) == (100.0, 101.0)
        assert "manifest_json" not in repr(later)  # the JSON is long; keep reprs readable


def test_the_whole_life_of_versions_with_supersession_and_rollback(store: ManifestStore) -> None:
    store.record(manifest(0))
    assert store.active() is None
    to_active(store, 0)
    assert store.active().version == 0
    store.record(manifest(1, base=0))
    to_active(store, 1)
    assert store.active().version == 1
    assert store.get(0).state is State.SUPERSEDED  # demoted in the same transaction
    # Rollback: a superseded version may become active again; the current one is demoted.
    assert store.mark(0, "active").state is State.ACTIVE
    assert store.get(1).state is State.SUPERSEDED
    # A superseded version may still be declared bad, and then never comes back.
    store.mark(1, "failed", error="drift found at full alignment")
    assert store.get(1).error == "drift found at full alignment"
    with pytest.raises(TransitionError):
        store.mark(1, "active")


def test_every_transition_outside_the_table_is_refused(store: ManifestStore) -> None:
    # Walk version 0 into each state (superseded: by activating version 1), then try every
    # move from there.
    paths = {
        State.PENDING: [],
        State.UPLOADED: ["uploaded"],
        State.VERIFIED: ["uploaded", "verified"],
        State.ACTIVE: ["uploaded", "verified", "active"],
        State.SUPERSEDED: ["uploaded", "verified", "active", "activate 1"],
        State.FAILED: ["failed"],
    }
    assert set(paths) == set(State)
    for current, path in paths.items():
        for requested in State:
            with ManifestStore(store.path.with_name(f"{current}-{requested}.sqlite")) as s:
                s.record(manifest(0))
                for step in path:
                    if step == "activate 1":
                        s.record(manifest(1))
                        to_active(s, 1)
                    else:
                        s.mark(0, step, error="x" if step == "failed" else None)
                assert s.get(0).state is current
                error = "x" if requested is State.FAILED else None
                if requested in TRANSITIONS[current]:
                    assert s.mark(0, requested, error=error).state is requested
                    continue
                with pytest.raises(TransitionError) as info:
                    s.mark(0, requested, error=error)
                assert (info.value.version, info.value.current) == (0, current)
                assert info.value.requested is requested
                assert f"version 0: cannot go from {current} to {requested}" in str(info.value)
                assert s.get(0).state is current  # nothing changed


def test_transition_errors_say_what_is_allowed(store: ManifestStore) -> None:
    store.record(manifest(0))
    with pytest.raises(TransitionError, match=r"pending to active \(allowed from pending: fail"):
        store.mark(0, "active")
    store.mark(0, "failed", error="boom")
    with pytest.raises(TransitionError, match="failed is final"):
        store.mark(0, "uploaded")
    store.record(manifest(1))
    to_active(store, 1)
    with pytest.raises(TransitionError, match="left only by activating another one"):
        store.mark(1, "failed")
    with pytest.raises(TransitionError, match="superseded by activating another one"):
        store.mark(1, "superseded")
    with pytest.raises(TransitionError, match="active to active"):
        store.mark(1, "active")


def test_active_is_unique_even_against_a_raw_write(store: ManifestStore) -> None:
    store.record(manifest(0))
    to_active(store, 0)
    store.record(manifest(1, base=0))
    conn = sqlite3.connect(store.path)
    with pytest.raises(sqlite3.IntegrityError, match="UNIQUE"):
        conn.execute("UPDATE versions SET state = 'active' WHERE version = 1")
    conn.close()


def test_bad_requests_get_clear_errors(store: ManifestStore) -> None:
    with pytest.raises(UnknownVersionError, match="version 5 is not recorded"):
        store.mark(5, "uploaded")
    store.record(manifest(0))
    with pytest.raises(ManifestStoreError, match=r"unknown state 'live' \(states: pending"):
        store.mark(0, "live")
    with pytest.raises(ManifestStoreError, match="error text goes with state failed"):
        store.mark(0, "uploaded", error="oops")
    with pytest.raises(DuplicateVersionError, match="version 0 is recorded already"):
        store.record(manifest(0))
    with pytest.raises(ManifestStoreError, match="base 7, which this store has no record"):
        store.record(manifest(8, base=7))
    with pytest.raises(ManifestStoreError, match="must be an earlier version"):
        store.record(manifest(3, base=3))
    with pytest.raises(ManifestStoreError, match="versions are not negative"):
        store.record(manifest(-2))
    weird = RefitManifest(1, NO_BASE, "partial", 0.0, [], [], "d" * 32)
    with pytest.raises(ManifestStoreError, match="neither delta nor full"):
        store.record(weird)
    full_with_base = RefitManifest(1, 0, "full", 0.0, [], [], "d" * 32)
    with pytest.raises(ManifestStoreError, match="a full version has no base"):
        store.record(full_with_base)
    assert [r.version for r in store.history()] == [0]  # none of it was recorded
    assert store.mark(0, "uploaded").state is State.UPLOADED  # and no transaction was left open


def test_a_failure_fails_the_deltas_built_on_it_but_not_live_ones(store: ManifestStore) -> None:
    store.record(manifest(0))
    to_active(store, 0)
    store.record(manifest(1, base=0))
    store.record(manifest(2, base=1))
    store.mark(2, "uploaded")
    store.record(manifest(3, base=2))
    store.record(manifest(4))  # a full version stops the chain
    store.record(manifest(5, base=4))
    store.mark(1, "failed", error="receiver checksum mismatch")
    assert store.get(0).state is State.ACTIVE
    for v in (2, 3):
        assert store.get(v).state is State.FAILED
        assert store.get(v).error == "base version 1 failed: receiver checksum mismatch"
    assert store.get(4).state is State.PENDING
    assert store.get(5).state is State.PENDING
    with pytest.raises(ManifestStoreError, match="base 1, which failed"):
        store.record(manifest(6, base=1))


def test_reads_latest_history_last_full_and_resync_count(store: ManifestStore) -> None:
    assert store.latest() is None
    assert store.last_full() is None
    assert store.versions_since_full() is None
    assert store.history() == []
    store.record(manifest(0))
    assert store.versions_since_full() == 0
    to_active(store, 0)
    for v in range(1, 5):
        store.record(manifest(v, base=v - 1))
    store.mark(1, "uploaded")
    store.mark(4, "failed", error="encode crashed")
    assert store.latest().version == 4
    assert store.latest("pending").version == 3
    assert store.latest(State.UPLOADED).version == 1
    assert store.latest("verified") is None
    assert store.versions_since_full() == 3  # 1, 2, 3; the failed 4 sent nothing
    assert store.last_full().version == 0
    store.record(manifest(5))
    store.mark(5, "failed", error="full upload failed")
    assert store.last_full().version == 0  # a failed full version aligns nobody
    store.record(manifest(6))
    store.record(manifest(7, base=6))
    assert store.last_full().version == 6
    assert store.versions_since_full() == 1
    assert [r.version for r in store.history(3)] == [7, 6, 5]
    assert len(store.history(100)) == 8
    assert store.history(0) == []
    with pytest.raises(ValueError, match="must not be negative"):
        store.history(-1)
    assert store.get(2).state is State.PENDING
    assert store.get(99) is None


def test_reopen_keeps_everything_and_closed_store_refuses(tmp_path: Path) -> None:
    path = tmp_path / "s.sqlite"
    s = ManifestStore(path)
    s.record(manifest(0))
    to_active(s, 0)
    s.close()
    s.close()  # idempotent
    with pytest.raises(ManifestStoreError, match="is closed"):
        s.active()
    with ManifestStore(path) as again:
        assert again.active().version == 0
        assert again.active().manifest == manifest(0)
    check_invariants(path)


def test_readonly_store_reads_and_refuses_writes(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no manifest store"):
        ManifestStore(tmp_path / "absent.sqlite", readonly=True)
    path = tmp_path / "s.sqlite"
    with ManifestStore(path) as s:
        s.record(manifest(0))
    with ManifestStore(path, readonly=True) as r:
        assert r.latest().version == 0
        with pytest.raises(ManifestStoreError, match="opened read-only"):
            r.mark(0, "uploaded")
        with pytest.raises(ManifestStoreError, match="opened read-only"):
            r.record(manifest(1))


def test_a_foreign_or_newer_database_is_refused(tmp_path: Path) -> None:
    foreign = tmp_path / "foreign.sqlite"
    conn = sqlite3.connect(foreign)
    conn.execute("PRAGMA user_version = 7")
    conn.close()
    with pytest.raises(ManifestStoreError, match="schema 7, this deltarl reads 1"):
        ManifestStore(foreign)
    plain = tmp_path / "plain.sqlite"
    sqlite3.connect(plain).close()
    with pytest.raises(ManifestStoreError, match="not a manifest store"):
        ManifestStore(plain, readonly=True)


def test_wal_mode_on_disk(store: ManifestStore) -> None:
    conn = sqlite3.connect(store.path)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    conn.close()


# -- crashes and other processes ----------------------------------------------------------

CHILD_PRELUDE = textwrap.dedent(
    """
    import sys, time
    from deltarl.codecs.manifest import ChunkEntry, RefitManifest, TensorEntry
    from deltarl.refit.manifest_store import ManifestStore, State

    def manifest(version, base=-1):
        return RefitManifest(
            version, base, "full" if base == -1 else "delta", 0.0,
            [TensorEntry("w", "bfloat16", [4], "rice", 1, 4, "a" * 32)],
            [ChunkEntry(0, 64, 1)], "d" * 32,
        )
    """
)

# Stops for good right after the statement that demotes the active version, inside the
# activation's transaction, and says so: the parent kills it exactly between demote and promote.
MID_ACTIVATION_CHILD = CHILD_PRELUDE + textwrap.dedent(
    """
    class StopAfterDemote:
        def __init__(self, conn):
            self._conn = conn
        def execute(self, sql, params=()):
            cursor = self._conn.execute(sql, params)
            if "superseded" in params:
                print("MID", flush=True)
                time.sleep(60)
            return cursor
        def __getattr__(self, name):
            return getattr(self._conn, name)

    store = ManifestStore(sys.argv[1])
    store.record(manifest(0))
    for s in ("uploaded", "verified", "active"):
        store.mark(0, s)
    store.record(manifest(1, 0))
    store.mark(1, "uploaded")
    store.mark(1, "verified")
    store._conn = StopAfterDemote(store._conn)
    store.mark(1, "active")
    """
)

# Runs versions through their life as fast as it can, resuming from whatever it finds, the way
# an export agent restarted by systemd would: unfinished versions are failed, then onwards.
BUSY_CHILD = CHILD_PRELUDE + textwrap.dedent(
    """
    store = ManifestStore(sys.argv[1])
    for r in store.history(1000):
        if r.state in (State.PENDING, State.UPLOADED, State.VERIFIED):
            store.mark(r.version, "failed", error="interrupted by a restart")
    latest = store.latest()
    v = 0 if latest is None else latest.version + 1
    while True:
        active = store.active()
        since = store.versions_since_full()
        if active is None or since is None or since >= 4:
            store.record(manifest(v))
        else:
            store.record(manifest(v, active.version))
        store.mark(v, "uploaded")
        if v % 7 == 3:
            store.mark(v, "failed", error="receiver checksum mismatch")
        else:
            store.mark(v, "verified")
            store.mark(v, "active")
        print(v, flush=True)
        v += 1
    """
)


def spawn(code: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_kill_between_demote_and_promote_leaves_the_old_version_active(tmp_path: Path) -> None:
    path = tmp_path / "s.sqlite"
    child = spawn(MID_ACTIVATION_CHILD, str(path))
    try:
        assert child.stdout.readline().strip() == "MID", child.stderr.read()
        # The demote ran; its transaction is open. Another process must still see version 0
        # active, not "no version active".
        with ManifestStore(path, readonly=True) as reader:
            assert reader.active().version == 0
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
    rows = check_invariants(path)
    assert rows[0][0] == "active"
    assert rows[1][0] == "verified"
    with ManifestStore(path) as s:  # and the writer carries on where the file says
        assert s.mark(1, "active").state is State.ACTIVE
        assert s.get(0).state is State.SUPERSEDED
    check_invariants(path)


def test_kill_9_at_random_points_never_breaks_the_invariants(tmp_path: Path) -> None:
    path = tmp_path / "s.sqlite"
    rng = random.Random(1234)
    progress = []
    for _ in range(6):
        child = spawn(BUSY_CHILD, str(path))
        try:
            first = child.stdout.readline()
            assert first, child.stderr.read()
            time.sleep(rng.uniform(0.0, 0.15))  # somewhere in the middle of a transition
        finally:
            os.kill(child.pid, signal.SIGKILL)
            child.wait(timeout=10)
        rows = check_invariants(path)
        progress.append(len(rows))
    assert progress == sorted(progress)
    assert progress[-1] >= 6  # every round got at least one version through (usually dozens)
    states = [s for s, _, _ in check_invariants(path).values()]
    assert states.count("active") == 1


READER_CHILD = textwrap.dedent(
    """
    import json, sys, time
    from deltarl.refit.manifest_store import ManifestStore

    final = int(sys.argv[2])
    reads, actives, errors = 0, [], []
    with ManifestStore(sys.argv[1], readonly=True) as store:
        print("READY", flush=True)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            snapshot = store.history(10_000)  # one SELECT: one consistent snapshot
            reads += 1
            live = [r.version for r in snapshot if r.state == "active"]
            if len(live) > 1:
                errors.append(f"two active versions: {live}")
            superseded = any(r.state == "superseded" for r in snapshot)
            if superseded and not live:
                errors.append("a superseded version but none active")
            if live:
                if actives and live[0] < actives[-1]:
                    errors.append(f"active went back from {actives[-1]} to {live[0]}")
                if not actives or actives[-1] != live[0]:
                    actives.append(live[0])
                if live[0] == final:
                    break
    print(json.dumps({"reads": reads, "actives": actives, "errors": errors}), flush=True)
    """
)


def test_a_reader_process_sees_only_whole_transitions(tmp_path: Path) -> None:
    path = tmp_path / "s.sqlite"
    final = 60
    with ManifestStore(path) as store:
        store.record(manifest(0))
        to_active(store, 0)
        reader = spawn(READER_CHILD, str(path), str(final))
        try:
            assert reader.stdout.readline().strip() == "READY", reader.stderr.read()
            for v in range(1, final + 1):
                store.record(manifest(v, base=v - 1))
                to_active(store, v)
            out, err = reader.communicate(timeout=20)
        finally:
            if reader.poll() is None:
                reader.kill()
                reader.wait()
    assert reader.returncode == 0, err
    seen = json.loads(out)
    assert seen["errors"] == []
    assert seen["actives"][-1] == final
    assert seen["reads"] > 1
