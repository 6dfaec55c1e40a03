"""WeightStore: the double buffer, its version pointer, leases, and the faults it must survive.

Cross-process tests run helpers with ``sys.executable -c`` and talk to them over stdin/stdout
lines, so every fault (a held lease, a writer killed mid-write, a dead creator) is real.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash

from deltarl.engine import leases
from deltarl.engine.layout import Layout
from deltarl.engine.weight_store import (
    BufferState,
    LeaseTimeout,
    NoVersionError,
    RollbackError,
    SegmentFormatError,
    WeightStore,
    WriterBusy,
    cleanup_stale,
)

REPO = Path(__file__).resolve().parents[2]

LAYOUT = Layout.pack(
    [
        ("embed", "bfloat16", (256, 512)),
        ("norm", "float32", (512,)),
        ("head", "bfloat16", (512, 256)),
        ("step", "int64", (1,)),
    ]
)

# Prepended to every helper process: the same layout and pattern as the tests use.
PRELUDE = textwrap.dedent(
    """
    import json, os, random, sys, time
    from pathlib import Path
    import numpy as np
    from deltarl.engine.layout import Layout
    from deltarl.engine.weight_store import WeightStore
    root = Path(sys.argv[1])
    arg = sys.argv[2:]
    LAYOUT = Layout.from_json(os.environ["LAYOUT_JSON"])
    def pattern(v):
        return np.uint64((v * 0x9E3779B97F4A7C15 + 0x5BD1E995) % 2**64)
    def say(msg):
        print(msg, flush=True)
    """
)


def pattern(v: int) -> np.uint64:
    """A word that differs for every version (odd multiplier: a bijection mod 2**64)."""
    return np.uint64((v * 0x9E3779B97F4A7C15 + 0x5BD1E995) % 2**64)


def fill(txn_buffer: np.ndarray, v: int) -> None:
    txn_buffer.view(np.uint64)[:] = pattern(v)


def commit_pattern(store: WeightStore, v: int) -> None:
    with store.begin_write(timeout=5) as txn:
        fill(txn.buffer, v)
        txn.commit(v)


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen[str]]]:
    """Start helper processes; any still running at teardown is killed."""
    procs: list[subprocess.Popen[str]] = []

    def start(body: str, *args: object) -> subprocess.Popen[str]:
        code = PRELUDE + textwrap.dedent(body)
        env = {**os.environ, "PYTHONPATH": str(REPO), "LAYOUT_JSON": LAYOUT.to_json().decode()}
        proc = subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path), *map(str, args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env=env,
        )
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def expect(proc: subprocess.Popen[str], line: str) -> None:
    assert proc.stdout is not None
    got = proc.stdout.readline().strip()
    assert got == line, f"helper said {got!r} instead of {line!r} (exit code {proc.poll()})"


def tell(proc: subprocess.Popen[str], line: str) -> None:
    assert proc.stdin is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()


def sigkill(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL


@pytest.fixture
def store(tmp_path: Path) -> Iterator[WeightStore]:
    with WeightStore.create("w", LAYOUT, root=tmp_path) as s:
        yield s


# ---- create / open ------------------------------------------------------------------------


def test_create_open_round_trip(tmp_path: Path) -> None:
    with WeightStore.create("policy.v1", LAYOUT, root=tmp_path) as created:
        assert created.path == tmp_path / "deltarl-policy.v1"
        assert created.active_version is None
        with WeightStore.open("policy.v1", root=tmp_path, layout=LAYOUT) as opened:
            assert opened.layout == LAYOUT
            assert opened.header.creation_id == created.header.creation_id
            assert opened.header.creator_pid == os.getpid()
            with created.begin_write() as txn:
                assert txn.active is None
                assert txn.base_version is None
                txn.array("embed")[:] = 0x3F80  # bf16 1.0
                txn.array("norm")[:] = np.float32(-2.5).view(np.uint32)
                txn.array("step")[:] = 7
                txn.commit(1)
            assert opened.active_version == 1
            with opened.lease() as snap:
                assert snap.version == 1
                embed = snap.tensor("embed")
                assert embed.dtype == torch.bfloat16
                assert embed.shape == (256, 512)
                assert torch.equal(embed, torch.ones(256, 512, dtype=torch.bfloat16))
                assert torch.equal(snap.tensor(1), torch.full((512,), -2.5))
                assert snap.tensor("step").item() == 7
                assert snap.array("head").dtype == np.uint16
                assert not snap.buffer.flags.writeable
                assert not snap.array(0).flags.writeable
                assert snap.buffer.nbytes == LAYOUT.nbytes


def test_buffers_are_page_aligned_in_the_file(store: WeightStore) -> None:
    offsets = store.header.buffer_offsets
    assert all(off % 4096 == 0 for off in offsets)
    assert offsets[1] - offsets[0] >= LAYOUT.nbytes
    assert store.path.stat().st_size >= offsets[1] + LAYOUT.nbytes


def test_permissions_default_0600(store: WeightStore) -> None:
    assert store.path.stat().st_mode & 0o777 == 0o600


def test_permissions_explicit_mode_ignores_umask(tmp_path: Path) -> None:
    old = os.umask(0o077)
    try:
        with WeightStore.create("shared", LAYOUT, mode=0o640, root=tmp_path) as s:
            assert s.path.stat().st_mode & 0o777 == 0o640
    finally:
        os.umask(old)


@pytest.mark.parametrize("name", ["", "a/b", "..", ".", "a b", "x" * 201, "caf\u00e9", "a\0b"])
def test_bad_names_are_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError, match="bad weight store name"):
        WeightStore.create(name, LAYOUT, root=tmp_path)
    with pytest.raises(ValueError, match="bad weight store name"):
        WeightStore.open(name, root=tmp_path)


def test_open_missing_says_so(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no weight store 'nope'"):
        WeightStore.open("nope", root=tmp_path)


def test_open_foreign_file_names_the_magic(tmp_path: Path) -> None:
    (tmp_path / "deltarl-foreign").write_bytes(b"not a segment at all" * 500)
    with pytest.raises(SegmentFormatError, match=r"not a deltarl weight store.*magic b'not a se'"):
        WeightStore.open("foreign", root=tmp_path)
    (tmp_path / "deltarl-empty").write_bytes(b"")
    with pytest.raises(SegmentFormatError, match="only 0 bytes"):
        WeightStore.open("empty", root=tmp_path)


def test_open_wrong_format_version_names_both(store: WeightStore, tmp_path: Path) -> None:
    with store.path.open("r+b") as f:
        f.seek(8)
        f.write((99).to_bytes(4, "little"))
    with pytest.raises(SegmentFormatError, match=r"format version 99.*reads version 1"):
        WeightStore.open("w", root=tmp_path)


def test_open_truncated_segment(store: WeightStore, tmp_path: Path) -> None:
    os.truncate(store.path, store.header.buffer_offsets[1])
    with pytest.raises(SegmentFormatError, match="truncated"):
        WeightStore.open("w", root=tmp_path)


def test_open_with_other_layout_is_refused(store: WeightStore, tmp_path: Path) -> None:
    other = Layout.pack([("embed", "bfloat16", (256, 512))])
    with pytest.raises(SegmentFormatError, match="different layout"):
        WeightStore.open("w", root=tmp_path, layout=other)


def test_readonly_store_cannot_write(store: WeightStore, tmp_path: Path) -> None:
    commit_pattern(store, 1)
    with WeightStore.open("w", root=tmp_path, readonly=True) as ro:
        with pytest.raises(PermissionError, match="read-only"):
            ro.begin_write()
        with pytest.raises(PermissionError, match="read-only"):
            ro.rollback()
        with ro.lease() as snap:
            assert snap.version == 1
            with pytest.raises(ValueError, match="read-only"):
                snap.buffer[0] = 1


def test_closed_store_refuses_use(tmp_path: Path) -> None:
    s = WeightStore.create("c", LAYOUT, root=tmp_path)
    s.close()
    s.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        s.lease()
    with pytest.raises(RuntimeError, match="closed"):
        s.begin_write()


def test_unlink_removes_only_its_own_file(tmp_path: Path) -> None:
    first = WeightStore.create("u", LAYOUT, root=tmp_path)
    first.unlink()
    assert not first.path.exists()
    with WeightStore.create("u", LAYOUT, root=tmp_path) as second:
        first.unlink()  # the name now belongs to another segment: left alone
        assert second.path.exists()
        first.close()


# ---- transactions -------------------------------------------------------------------------


def test_lease_before_any_version(store: WeightStore) -> None:
    with pytest.raises(NoVersionError, match="no version yet"):
        store.lease()


def test_versions_must_increase(store: WeightStore) -> None:
    commit_pattern(store, 5)
    with store.begin_write() as txn:
        fill(txn.buffer, 5)
        with pytest.raises(ValueError, match="does not increase over the active version 5"):
            txn.commit(5)
        with pytest.raises(ValueError, match=r"\[0, 2\*\*63\)"):
            txn.commit(-1)
        txn.commit(3, allow_older=True)
    assert store.active_version == 3


def test_exception_in_with_block_aborts(store: WeightStore) -> None:
    commit_pattern(store, 1)
    txn = store.begin_write()

    def write_then_fail() -> None:
        with txn:
            fill(txn.buffer, 2)
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        write_then_fail()
    assert txn.done
    assert store.active_version == 1
    assert store.status()["buffers"][1]["state"] == "EMPTY"
    with store.begin_write() as txn2:
        assert txn2.base_version is None  # the aborted write left unknown contents
    with store.lease() as snap:
        assert np.all(snap.buffer.view(np.uint64) == pattern(1))


def test_abort_before_writing_keeps_the_old_version(store: WeightStore) -> None:
    commit_pattern(store, 1)
    commit_pattern(store, 2)
    with store.begin_write() as txn:
        assert txn.base_version == 1
        assert txn.active_version == 2
        txn.abort()
    assert store.rollback() == 1  # still a rollback target


def test_copy_from_active_then_patch(store: WeightStore) -> None:
    commit_pattern(store, 1)
    with store.begin_write() as txn:
        assert txn.active is not None
        assert not txn.active.flags.writeable
        txn.copy_from_active()
        assert txn.base_version == 1
        txn.array("step")[:] = 42
        txn.commit(2)
    with store.lease() as snap:
        assert snap.array("step")[0] == 42
        assert np.all(snap.array("embed").view(np.uint64) == pattern(1))


def test_transaction_is_single_use(store: WeightStore) -> None:
    txn = store.begin_write()
    txn.commit(1)
    with pytest.raises(RuntimeError, match="already committed or aborted"):
        txn.commit(2)
    with pytest.raises(RuntimeError, match="already committed or aborted"):
        _ = txn.buffer
    txn.abort()  # idempotent after the end


def test_second_writer_waits_then_gives_up(store: WeightStore) -> None:
    with store.begin_write():
        with pytest.raises(WriterBusy, match=r"another writer .* 0\.10 s"):
            store.begin_write(timeout=0.1)
        with pytest.raises(WriterBusy, match="cannot roll back"):
            store.rollback(timeout=0.1)
        assert store.status()["writer_busy"]
    with store.begin_write(timeout=0.1) as txn:
        txn.commit(1)


def test_reader_times_out_when_the_active_buffer_stays_locked(store: WeightStore) -> None:
    commit_pattern(store, 1)
    fd = os.open(store.path, os.O_RDWR)
    try:  # injected fault: something holds the active buffer exclusively
        assert leases.try_lock(fd, leases.LOCK_BUFFER[0], exclusive=True)
        with pytest.raises(LeaseTimeout, match=r"within 0\.05 s \(buffer 0"):
            store.lease(timeout=0.05)
    finally:
        os.close(fd)
    with store.lease(timeout=0.05) as snap:
        assert snap.version == 1


def test_released_lease_refuses_views(store: WeightStore) -> None:
    commit_pattern(store, 1)
    snap = store.lease()
    snap.release()
    snap.release()
    assert snap.released
    with pytest.raises(RuntimeError, match="lease on version 1 was released"):
        snap.array("embed")


def test_status_reports_buffers_and_locks(store: WeightStore, tmp_path: Path) -> None:
    commit_pattern(store, 1)
    with store.lease():
        st = store.status()
    assert st["name"] == "w"
    assert st["creator_pid"] == os.getpid()
    assert st["creator_alive"]
    assert st["active_index"] == 0
    assert st["active_version"] == 1
    assert st["buffers"][0] == {
        "index": 0,
        "state": "READY",
        "version": 1,
        "active": True,
        "lock": "shared",
        "tensor_digests": False,  # commit_pattern commits none
    }
    assert st["buffers"][1]["state"] == BufferState.EMPTY.name
    assert not st["attached_elsewhere"]
    with WeightStore.open("w", root=tmp_path):
        assert store.status()["attached_elsewhere"]
    assert store.status()["buffers"][0]["lock"] == "none"


def test_generation_counts_every_version_made_active(store: WeightStore) -> None:
    assert store.generation == 0
    commit_pattern(store, 1)
    commit_pattern(store, 2)
    store.rollback(5.0)
    assert store.generation == 3
    with store.begin_write() as txn:  # the same version number again: a new generation
        fill(txn.buffer, 2)
        txn.commit(2, allow_older=True)
    with store.lease() as snap:
        assert (snap.version, snap.generation, store.generation) == (2, 4, 4)


# ---- rollback -----------------------------------------------------------------------------


def test_rollback_flips_back_and_readers_see_it(store: WeightStore, tmp_path: Path) -> None:
    commit_pattern(store, 1)
    commit_pattern(store, 2)
    with WeightStore.open("w", root=tmp_path, readonly=True) as reader:
        held = reader.lease()  # a lease on version 2 does not block the flip
        assert store.rollback(timeout=0.5) == 1
        assert held.version == 2
        assert np.all(held.buffer.view(np.uint64) == pattern(2))
        with reader.lease() as snap:
            assert snap.version == 1
            assert np.all(snap.buffer.view(np.uint64) == pattern(1))
        # The next writer targets the rolled-back buffer, which the old lease still pins.
        with pytest.raises(LeaseTimeout, match=r"buffer 1 \(version 2\) is still leased"):
            store.begin_write(timeout=0.1)
        held.release()
        with store.begin_write(timeout=1) as txn:
            assert txn.base_version == 2
            txn.commit(3)
    assert store.active_version == 3


def test_rollback_with_nothing_to_roll_back_to(store: WeightStore) -> None:
    with pytest.raises(RollbackError, match="no version was ever committed"):
        store.rollback()
    commit_pattern(store, 1)
    with pytest.raises(RollbackError, match=r"other buffer \(1\) is EMPTY"):
        store.rollback()
    commit_pattern(store, 2)
    store.rollback()
    with pytest.raises(
        RollbackError, match="version 2, which is not older than the active version 1"
    ):
        store.rollback()
    assert store.active_version == 1


# ---- across processes ---------------------------------------------------------------------

TORN_WRITER = """
s = WeightStore.open("torn", root=root)
end = time.monotonic() + float(arg[0])
v, commits = s.active_version, 0
while time.monotonic() < end:
    v += 1
    with s.begin_write(timeout=10) as txn:
        txn.buffer.view(np.uint64)[:] = pattern(v)
        txn.commit(v)
    commits += 1
say(json.dumps({"commits": commits}))
"""

TORN_READER = """
s = WeightStore.open("torn", root=root, readonly=True)
end = time.monotonic() + float(arg[0])
versions, torn, backwards = [], 0, 0
while time.monotonic() < end:
    with s.lease(timeout=10) as snap:
        words = snap.buffer.view(np.uint64)
        want = pattern(snap.version)
        first = bool(words[0] == want)
        time.sleep(random.random() * 0.002)  # hold it a while: a writer must not touch it
        if not first or np.count_nonzero(words != want):
            torn += 1
    if versions and snap.version < versions[-1]:
        backwards += 1
    versions.append(snap.version)
say(json.dumps({"leases": len(versions), "distinct": len(set(versions)), "torn": torn,
                "backwards": backwards}))
"""


@pytest.mark.timeout(60)
def test_readers_never_see_a_torn_version(tmp_path: Path, spawn) -> None:
    with WeightStore.create("torn", LAYOUT, root=tmp_path) as s:
        commit_pattern(s, 1)
        readers = [spawn(TORN_READER, 3.0) for _ in range(2)]
        writer = spawn(TORN_WRITER, 3.0)
        wrote = json.loads(writer.stdout.readline())
        results = [json.loads(r.stdout.readline()) for r in readers]
        assert writer.wait() == 0
        assert all(r.wait() == 0 for r in readers)
    assert wrote["commits"] >= 20
    for res in results:
        assert res["torn"] == 0
        assert res["backwards"] == 0
        assert res["distinct"] >= 5, res


LEASE_HOLDER = """
s = WeightStore.open("w", root=root, readonly=True)
snap = s.lease()
say(f"leased {snap.version}")
sys.stdin.readline()
snap.release()
say("released")
time.sleep(60)
"""


@pytest.mark.timeout(60)
def test_writer_waits_for_a_reader_in_another_process(store: WeightStore, spawn) -> None:
    commit_pattern(store, 1)
    reader = spawn(LEASE_HOLDER)
    expect(reader, "leased 1")
    commit_pattern(store, 2)  # buffer 1: free, so no wait
    with pytest.raises(LeaseTimeout, match=r"buffer 0 \(version 1\) is still leased.*0\.30 s"):
        store.begin_write(timeout=0.3)
    assert store.status()["buffers"][0]["lock"] == "shared"
    tell(reader, "go")
    expect(reader, "released")
    commit_pattern(store, 3)
    assert store.active_version == 3


@pytest.mark.timeout(60)
def test_sigkilled_reader_leaves_no_lease(store: WeightStore, spawn) -> None:
    commit_pattern(store, 1)
    reader = spawn(LEASE_HOLDER)
    expect(reader, "leased 1")
    commit_pattern(store, 2)
    with pytest.raises(LeaseTimeout):
        store.begin_write(timeout=0.1)
    sigkill(reader)
    commit_pattern(store, 3)  # the kernel dropped the dead reader's lock
    assert store.active_version == 3


LAGGING_READER = """
s = WeightStore.open("w", root=root, readonly=True)
snap = s.lease()
first = int(snap.buffer.view(np.uint64)[0])
say(f"leased {snap.version}")
sys.stdin.readline()  # fell behind: the writer's bound passes meanwhile
last = int(snap.buffer.view(np.uint64)[-1])
say(json.dumps({"revoked": snap.revoked, "torn": first != last}))
try:
    snap.check_not_revoked()
except Exception as e:
    say(type(e).__name__)
snap.release()
with s.lease() as fresh:
    say(json.dumps({"version": fresh.version, "revoked": fresh.revoked}))
"""


@pytest.mark.timeout(60)
def test_a_lagging_reader_is_revoked_and_told_not_waited_for(
    store: WeightStore, spawn, caplog: pytest.LogCaptureFixture
) -> None:
    """I4: past its bound the writer revokes the lease instead of losing the version; the
    reader, which read across the overwrite, learns it and discards the read. A lease on the
    active buffer is never revoked, and a fresh lease after it is whole."""
    commit_pattern(store, 1)
    reader = spawn(LAGGING_READER)
    expect(reader, "leased 1")
    commit_pattern(store, 2)  # buffer 1
    with store.lease() as current:  # on buffer 1: the writer does not touch it
        with caplog.at_level(logging.WARNING), store.begin_write(0.3, revoke=True) as txn:
            assert txn.revoked
            fill(txn.buffer, 3)  # into buffer 0, under the lagging reader's lease
            txn.commit(3)
        assert not current.revoked
    assert "leases are revoked" in caplog.text
    tell(reader, "go")
    told = json.loads(reader.stdout.readline())
    assert told == {"revoked": True, "torn": True}, told
    expect(reader, "LeaseRevoked")
    assert json.loads(reader.stdout.readline()) == {"version": 3, "revoked": False}
    assert reader.wait(10) == 0


DYING_WRITER = """
s = WeightStore.open("w", root=root)
txn = s.begin_write(timeout=5)
half = txn.buffer.nbytes // 2
txn.buffer[:half] = 0xAB
say("writing")
time.sleep(60)
"""


@pytest.mark.timeout(60)
def test_writer_killed_mid_write(store: WeightStore, tmp_path: Path, spawn, caplog) -> None:
    commit_pattern(store, 1)
    with store.lease() as snap:
        before = xxhash.xxh3_64_intdigest(snap.buffer)
    writer = spawn(DYING_WRITER)
    expect(writer, "writing")
    sigkill(writer)

    st = store.status()
    assert st["buffers"][1]["state"] == "WRITING"
    assert not st["writer_busy"]
    with WeightStore.open("w", root=tmp_path, readonly=True) as reader, reader.lease() as snap:
        assert snap.version == 1
        assert xxhash.xxh3_64_intdigest(snap.buffer) == before

    with caplog.at_level(logging.WARNING), store.begin_write(timeout=1) as txn:
        assert txn.index == 1
        assert txn.base_version is None
        fill(txn.buffer, 2)
        txn.commit(2)
    assert "a writer died while writing buffer 1" in caplog.text
    with store.lease() as snap:
        assert snap.version == 2
        assert np.all(snap.buffer.view(np.uint64) == pattern(2))
    assert store.rollback() == 1


# ---- stale segments -----------------------------------------------------------------------

CREATOR = """
stores = [WeightStore.create(name, LAYOUT, root=root) for name in arg]
say("created")
time.sleep(60)
"""


@pytest.mark.timeout(60)
def test_stale_segment_is_replaced_live_one_refused(tmp_path: Path, spawn, caplog) -> None:
    creator = spawn(CREATOR, "s")
    expect(creator, "created")
    with pytest.raises(FileExistsError, match=f"belongs to live process {creator.pid}"):
        WeightStore.create("s", LAYOUT, root=tmp_path)
    sigkill(creator)
    with caplog.at_level(logging.WARNING), WeightStore.create("s", LAYOUT, root=tmp_path) as s:
        assert s.header.creator_pid == os.getpid()
    assert "removed stale weight store" in caplog.text


@pytest.mark.timeout(60)
def test_dead_creator_but_attached_reader_is_kept(tmp_path: Path, spawn) -> None:
    creator = spawn(CREATOR, "s")
    expect(creator, "created")
    reader = WeightStore.open("s", root=tmp_path, readonly=True)
    sigkill(creator)
    assert not reader.status()["creator_alive"]
    with pytest.raises(FileExistsError, match="still in use"):
        WeightStore.create("s", LAYOUT, root=tmp_path)
    assert cleanup_stale(tmp_path) == []
    reader.close()
    with WeightStore.create("s", LAYOUT, root=tmp_path):
        pass


@pytest.mark.timeout(60)
def test_cleanup_stale_removes_dead_segments_only(tmp_path: Path, spawn) -> None:
    creator = spawn(CREATOR, "dead1", "dead2")
    expect(creator, "created")
    sigkill(creator)
    done = subprocess.run([sys.executable, "-c", "pass"], check=True)  # a pid that is gone
    assert done.returncode == 0
    with WeightStore.create("alive", LAYOUT, root=tmp_path) as alive:
        (tmp_path / "deltarl-junk").write_bytes(b"x" * 64)  # ours by name, not by content
        assert sorted(cleanup_stale(tmp_path)) == ["deltarl-dead1", "deltarl-dead2"]
        assert alive.path.exists()
        assert (tmp_path / "deltarl-junk").exists()
        assert cleanup_stale(tmp_path) == []


def test_cleanup_stale_removes_abandoned_half_created_files(tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    abandoned = tmp_path / f".deltarl-x.{gone.pid}.0badcafe.tmp"
    abandoned.write_bytes(b"")
    mine = tmp_path / f".deltarl-y.{os.getpid()}.0badcafe.tmp"
    mine.write_bytes(b"")
    assert cleanup_stale(tmp_path) == [abandoned.name]
    assert mine.exists()


def test_create_refuses_a_live_segment_of_this_process(store: WeightStore, tmp_path: Path) -> None:
    with pytest.raises(FileExistsError, match=r"already exists.*live process"):
        WeightStore.create("w", LAYOUT, root=tmp_path)
    assert not list(tmp_path.glob(".deltarl-*"))  # the temporary file is gone


def test_full_tmpfs_is_a_clear_error_at_create(tmp_path: Path, monkeypatch) -> None:
    def no_room(fd: int, offset: int, length: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    with pytest.raises(OSError, match=r"no room for weight store 'big'.*file system holding it"):
        WeightStore.create("big", LAYOUT, root=tmp_path)
    assert not list(tmp_path.iterdir())
