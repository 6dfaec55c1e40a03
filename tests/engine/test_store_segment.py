"""The segment file: header format, names, and the liveness checks behind stale cleanup."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from deltarl.engine.layout import Layout
from deltarl.engine.segment import (
    HEADER_NBYTES,
    PAGE,
    SegmentFormatError,
    SegmentHeader,
    process_alive,
    process_start_ticks,
    same_file,
    segment_path,
)

LAYOUT = Layout.pack([("a", "bfloat16", (3, 5)), ("b", "int32", (7,))])


def test_header_round_trip(tmp_path: Path) -> None:
    table = LAYOUT.to_json()
    header = SegmentHeader.plan(table, LAYOUT.nbytes, len(LAYOUT))
    assert header.creator_pid == os.getpid()
    assert header.layout_offset == HEADER_NBYTES
    assert header.buffer_offsets[0] % PAGE == 0
    assert header.buffer_offsets[1] % PAGE == 0
    assert header.buffer_offsets[1] >= header.buffer_offsets[0] + LAYOUT.nbytes
    assert header.digests_offset >= header.buffer_offsets[1] + LAYOUT.nbytes
    assert header.digests_offset % PAGE == 0
    assert header.digests_stride == PAGE  # two tensors' digests, a page each buffer
    assert header.file_nbytes == header.digests_offset + 2 * PAGE
    assert SegmentHeader.unpack(header.pack(), tmp_path) == header
    assert header.parse_layout(table, tmp_path) == LAYOUT


def test_a_header_without_digest_tables_reads_as_having_none(tmp_path: Path) -> None:
    """A segment of an older deltarl: bytes 120-135 zero, the file ending after buffer 1."""
    planned = SegmentHeader.plan(LAYOUT.to_json(), LAYOUT.nbytes, len(LAYOUT))
    data = bytearray(planned.pack())
    data[120:136] = bytes(16)
    data[112:120] = planned.digests_offset.to_bytes(8, "little")  # file_nbytes: no tables
    header = SegmentHeader.unpack(bytes(data), tmp_path)
    assert (header.digests_offset, header.digests_stride) == (0, 0)
    assert header.parse_layout(LAYOUT.to_json(), tmp_path) == LAYOUT


@pytest.mark.parametrize(
    ("at", "value"),
    [
        (120, 4097),  # tables off their page
        (120, 4096),  # tables inside the layout table and buffers
        (128, 100),  # a stride that is not whole pages
        (128, 1 << 40),  # tables past the end of the file
    ],
)
def test_corrupt_digest_tables_are_refused(tmp_path: Path, at: int, value: int) -> None:
    data = bytearray(SegmentHeader.plan(LAYOUT.to_json(), LAYOUT.nbytes, len(LAYOUT)).pack())
    data[at : at + 8] = value.to_bytes(8, "little")
    with pytest.raises(SegmentFormatError, match="corrupt weight store header"):
        SegmentHeader.unpack(bytes(data), tmp_path)


def test_digest_tables_too_small_for_the_layout_are_refused(tmp_path: Path) -> None:
    many = Layout.pack([(f"t{i}", "bfloat16", (2,)) for i in range(300)])  # 4800 bytes
    header = SegmentHeader.plan(many.to_json(), many.nbytes, 10)
    with pytest.raises(SegmentFormatError, match="cannot hold 300 tensors"):
        header.parse_layout(many.to_json(), tmp_path)


def test_header_identity_is_readable_across_versions(tmp_path: Path) -> None:
    data = bytearray(SegmentHeader.plan(b"{}", 0, 0).pack())
    data[8:12] = (2).to_bytes(4, "little")
    with pytest.raises(SegmentFormatError, match="format version 2"):
        SegmentHeader.unpack(bytes(data), tmp_path)
    identity = SegmentHeader.unpack(bytes(data), tmp_path, check_version=False)
    assert identity.creator_pid == os.getpid()


def test_corrupt_geometry_is_refused(tmp_path: Path) -> None:
    data = bytearray(SegmentHeader.plan(LAYOUT.to_json(), LAYOUT.nbytes, len(LAYOUT)).pack())
    data[88:96] = (4097).to_bytes(8, "little")  # buffer 0 off its page
    with pytest.raises(SegmentFormatError, match="corrupt weight store header"):
        SegmentHeader.unpack(bytes(data), tmp_path)


def test_layout_table_must_match_the_header(tmp_path: Path) -> None:
    header = SegmentHeader.plan(LAYOUT.to_json(), LAYOUT.nbytes + 64, len(LAYOUT))
    with pytest.raises(SegmentFormatError, match="layout table says"):
        header.parse_layout(LAYOUT.to_json(), tmp_path)
    with pytest.raises(SegmentFormatError, match="corrupt layout table"):
        header.parse_layout(b"{not json", tmp_path)


def test_segment_path(tmp_path: Path) -> None:
    assert segment_path("a-b_c.1", tmp_path) == tmp_path / "deltarl-a-b_c.1"
    assert segment_path("x", None) == Path("/dev/shm/deltarl-x")
    with pytest.raises(ValueError, match="bad weight store name"):
        segment_path("../x", tmp_path)


def test_process_liveness_checks_start_time() -> None:
    me = os.getpid()
    started = process_start_ticks(me)
    assert started is not None
    assert process_alive(me, started)
    assert process_alive(me, 0)  # start time unknown: the pid decides
    assert not process_alive(me, started + 1)  # same pid, other process: a reused pid
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert process_start_ticks(gone.pid) is None
    assert not process_alive(gone.pid, 0)
    assert not process_alive(0, 0)


def test_zombie_counts_as_dead() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        # Not reaped yet: wait until it has exited (state Z) without collecting it.
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
        assert process_start_ticks(child.pid) is None
    finally:
        child.wait()


def test_same_file(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"1")
    fd = os.open(path, os.O_RDONLY)
    try:
        assert same_file(fd, path)
        path.unlink()
        assert not same_file(fd, path)
        path.write_bytes(b"2")
        assert not same_file(fd, path)
    finally:
        os.close(fd)
