"""Fault injection on the running refit pipeline (trainer, export and apply as processes, on
the stream link): kill -9 either agent, corrupt a chunk on the wire, cut the link mid-version,
hold a reader lease across flips.

In every case the pipeline ends bit-exact (the rollout store's active version equals the
trainer's published version of that number, byte for byte), and a reader process that leases
the rollout store in a loop and checks every snapshot's tensor digests against that version's
manifest never sees a half-applied or unverified version.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from deltarl.refit.manifest_store import ManifestStore, State
from deltarl.transport.control import request_sync
from deltarl.transport.messages import Ok, Resync
from tests.daemons.faultlib import FaultPipeline, FaultProxy, Helper
from tests.daemons.pipeline import assert_bit_exact

DAEMONS = ("apply", "export", "trainer")


@contextmanager
def running(pipe: FaultPipeline) -> Iterator[Helper]:
    """The three daemons and a checking reader; everything killed at the end, whatever
    happened."""
    for daemon in DAEMONS:
        pipe.start(daemon)
    reader = Helper("reader", pipe.tmp)
    try:
        yield reader
    finally:
        reader.kill()
        pipe.kill_all()


def finish(pipe: FaultPipeline, reader: Helper) -> int:
    """Quiesce, check bit-exactness and the reader's verdict, stop cleanly; the version."""
    version = pipe.quiesce()
    assert_bit_exact(pipe.tmp, version)
    seen = reader.result()
    assert seen["checks"] > 0, seen
    assert seen["mismatches"] == [], f"the reader saw bad bytes: {seen}\n{pipe.logs()}"
    assert seen["unverified"] == [], f"versions active without a manifest: {seen}"
    codes = pipe.stop_all()
    assert codes == dict.fromkeys(DAEMONS, 0), pipe.logs()
    return version


def poll(what: str, cond: Callable[[], object], timeout: float, every: float = 0.005) -> object:
    """``cond()``'s first truthy value, polled fast (for a window a 0.1 s poll would miss)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := cond():
            return value
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


def activated_after(tmp: Path, version: int) -> list:
    with ManifestStore(tmp / "versions.sqlite", readonly=True) as ms:
        return sorted(
            (
                r
                for r in ms.history()
                if r.version > version and r.state in (State.ACTIVE, State.SUPERSEDED)
            ),
            key=lambda r: r.version,
        )


def force_full_and_catch_it(pipe: FaultPipeline) -> int:
    """Ask the export agent for a full version and return its number once it is being sent."""
    assert request_sync(pipe.endpoint("export"), Resync(), 2.0) == Ok(
        "the next version is sent in full"
    )

    def sending() -> int | None:
        m = re.match(r"sending (\d+) \(full: resync", pipe.status("export")["detail"])
        return int(m.group(1)) if m else None

    return int(poll("the export agent sending a full version", sending, 30.0))  # type: ignore[arg-type]


@pytest.mark.timeout(120)
def test_apply_agent_killed_mid_transfer_converges(tmp_path: Path) -> None:
    pipe = FaultPipeline(tmp_path, params=3_000_000, interval_s=0.5)
    with running(pipe) as reader:
        pipe.wait("a version applied", lambda: pipe.status("apply")["applied"] >= 1, 90)
        session = pipe.status("apply")["session"]
        in_flight = force_full_and_catch_it(pipe)
        pipe.kill("apply")  # mid-transfer: its 6 MB are on the wire or being applied
        time.sleep(0.3)
        pipe.start("apply")
        pipe.wait(
            "versions applied after the restart",
            lambda: (st := pipe.status("apply"))["session"] != session and st["applied"] >= 2,
        )
        with ManifestStore(tmp_path / "versions.sqlite", readonly=True) as ms:
            record = ms.get(in_flight)
            # killed mid-transfer, before it acknowledged: the export agent failed it (its
            # stream sender may still resume it to the restarted apply agent, which verifies
            # and activates it whole: harmless, the next version is full anyway)
            assert record is not None
            assert record.state == State.FAILED, record
        finish(pipe, reader)
    # (read once quiet: the export agent marks a version active after the apply agent does)
    later = activated_after(tmp_path, in_flight - 1)
    assert later, "nothing activated after the restart"
    assert later[0].kind == "full", later


@pytest.mark.timeout(90)
def test_corrupt_chunk_is_refused_and_the_pipeline_recovers(tmp_path: Path) -> None:
    # Uncompressed, so the flipped byte reaches the apply agent's frame checksum.
    pipe = FaultPipeline(tmp_path, proxy=True, params=200_000, interval_s=0.3, compress=False)
    with FaultProxy(pipe.export_port, pipe.apply_port) as proxy, running(pipe) as reader:
        pipe.wait("2 versions applied", lambda: pipe.status("apply")["applied"] >= 2)
        proxy.corrupt_armed.set()
        pipe.wait("a corrupted chunk", lambda: proxy.corrupted is not None, 30)
        assert proxy.corrupted is not None
        bad = proxy.corrupted[0]
        pipe.wait(
            f"the apply agent refusing version {bad}",
            lambda: (pipe.status("apply")["last_failed"] or {}).get("version") == bad,
        )
        reason = pipe.status("apply")["last_failed"]["reason"]
        assert "checksum mismatch" in reason, reason
        assert pipe.status("apply")["active_version"] != bad
        pipe.wait(
            f"a version after {bad} active", lambda: pipe.status("apply")["active_version"] > bad
        )
        finish(pipe, reader)  # bit-exact, and no reader ever saw bytes unlike their manifest
        # The damaged send never became active; what came next (the same version sent again,
        # or a newer one if the trainer was quicker) came in full: the reference was dropped.
        later = activated_after(tmp_path, bad - 1)
        assert later[0].kind == "full", later


@pytest.mark.timeout(90)
def test_link_cut_mid_version_resumes(tmp_path: Path) -> None:
    # Small chunks, so a full version is many frames and the cut lands inside one.
    pipe = FaultPipeline(
        tmp_path, proxy=True, params=1_000_000, interval_s=0.3, chunk_bytes=32 << 10
    )
    with FaultProxy(pipe.export_port, pipe.apply_port) as proxy, running(pipe) as reader:
        pipe.wait("2 versions applied", lambda: pipe.status("apply")["applied"] >= 2)
        connections = proxy.connections
        proxy.cut_min_chunk = 4
        proxy.cut_armed.set()
        force_full_and_catch_it(pipe)  # a version of many chunks, if no delta is one
        pipe.wait("the cut", lambda: proxy.cut is not None, 30)
        assert proxy.cut is not None
        cut_version = proxy.cut[0]
        pipe.wait(
            f"a version after {cut_version} active",
            lambda: pipe.status("apply")["active_version"] > cut_version,
        )
        assert proxy.connections > connections  # the sender reconnected
        finish(pipe, reader)
        # The stream link resumed the version it was cut in: delivered, not failed.
        with ManifestStore(tmp_path / "versions.sqlite", readonly=True) as ms:
            record = ms.get(cut_version)
            assert record is not None
            assert record.state in (State.ACTIVE, State.SUPERSEDED), record


@pytest.mark.timeout(90)
def test_export_agent_restarted_sends_full(tmp_path: Path) -> None:
    pipe = FaultPipeline(tmp_path, params=200_000, interval_s=0.3)
    with running(pipe) as reader:
        pipe.wait("3 versions applied", lambda: pipe.status("apply")["applied"] >= 3)
        pipe.kill("export")
        # Versions the killed agent had sent (and maybe recorded) may still activate: count
        # from the newest one it recorded, not from what happened to be active at the kill.
        time.sleep(0.3)
        with ManifestStore(tmp_path / "versions.sqlite", readonly=True) as ms:
            latest = ms.latest()
        killed_at = max(pipe.status("apply")["active_version"], latest.version if latest else 0)
        pipe.start("export")
        pipe.wait(
            "2 versions after the restart",
            lambda: (
                pipe.status("apply")["active_version"] > killed_at
                and pipe.status("export")["sent"] >= 2
            ),
        )
        finish(pipe, reader)
    later = activated_after(tmp_path, killed_at)
    assert later, "nothing activated after the restart"
    assert later[0].kind == "full", later  # its reference was gone


@pytest.mark.timeout(90)
def test_a_held_lease_is_never_overwritten(tmp_path: Path) -> None:
    pipe = FaultPipeline(tmp_path, params=200_000, interval_s=0.2)
    with running(pipe) as reader:
        pipe.wait("3 versions applied", lambda: pipe.status("apply")["applied"] >= 3)
        hold = Helper("hold", tmp_path, "2.0")
        try:
            result = hold.result(timeout=60)
        finally:
            hold.kill()
        held = result["version"]
        assert result["version_at_end"] == held
        assert result["start"] == result["end"] == result["manifest"], "the held bytes changed"
        assert result["revoked"] is False  # 2 s: within the apply agent's 10 s lease bound
        # Versions kept coming during the hold, yet one flip past the held version at most:
        # the next write would go into its buffer, so the apply agent waited.
        assert result["published_at_end"] >= held + 2, result["published_at_end"]
        seen = set(result["active_seen"])
        assert len({v for v in seen if v > held}) <= 1, (held, sorted(seen))
        pipe.wait(
            "the apply agent proceeding after the hold",
            lambda: pipe.status("apply")["active_version"] >= held + 2,
        )
        assert pipe.status("apply")["last_failed"] is None, pipe.status("apply")
        finish(pipe, reader)


@pytest.mark.timeout(90)
def test_a_lease_held_past_the_bound_is_revoked_not_waited_for(tmp_path: Path) -> None:
    """A reader that falls behind (holds its lease past a 1 s bound) is told, not waited
    for: the apply agent revokes its lease and goes on activating versions, none is lost,
    and the reader learns its snapshot was revoked (so it discards what it read)."""
    pipe = FaultPipeline(tmp_path, params=200_000, interval_s=0.2, lease_bound_s=1.0)
    with running(pipe) as reader:
        pipe.wait("3 versions applied", lambda: pipe.status("apply")["applied"] >= 3)
        hold = Helper("hold", tmp_path, "30.0", "until-revoked")
        try:
            result = hold.result(timeout=60)
        finally:
            hold.kill()
        held = result["version"]
        assert result["start"] == result["manifest"], "the lease began on whole bytes"
        assert result["revoked"] is True, result
        # The agent went on past the one flip a waiting agent allows.
        pipe.wait(
            "the apply agent past the held version's buffer",
            lambda: pipe.status("apply")["active_version"] >= held + 2,
        )
        status = pipe.status("apply")
        assert status["revoked_leases"] >= 1, status
        assert status["last_failed"] is None, status
        finish(pipe, reader)


@pytest.mark.timeout(90)
def test_export_agent_restarted_mid_version_resends_it(tmp_path: Path) -> None:
    pipe = FaultPipeline(
        tmp_path, proxy=True, params=200_000, interval_s=0.3, steps=6, ack_timeout_s=5.0
    )
    with FaultProxy(pipe.export_port, pipe.apply_port) as proxy, running(pipe) as reader:
        proxy.drop_version = 6  # the trainer's last version: delivered half, then no more
        pipe.wait("version 6 half-delivered", proxy.dropped.is_set, 60)
        pipe.kill("export")
        proxy.drop_version = None
        pipe.start("export")
        # the export agent fails an unacknowledged version after 5 s: 15 s is plenty
        pipe.wait("version 6 active", lambda: pipe.status("apply")["active_version"] == 6, 15)
        finish(pipe, reader)
