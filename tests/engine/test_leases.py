"""OFD byte-range locks and the reader's Snapshot, tested directly on a plain file."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from deltarl.engine import leases
from deltarl.engine.layout import Layout
from deltarl.engine.leases import NoVersionError, Snapshot, take_lease
from deltarl.engine.version_pointer import BufferState, VersionPointer


@pytest.fixture
def opener(tmp_path: Path) -> Iterator[Callable[[], int]]:
    """Opens new descriptions of one file (each its own lock owner); closes them at the end."""
    path = tmp_path / "locks"
    path.write_bytes(b"\0" * 16)
    fds: list[int] = []

    def open_fd() -> int:
        fds.append(os.open(path, os.O_RDWR))
        return fds[-1]

    yield open_fd
    for fd in fds:
        with contextlib.suppress(OSError):  # a test may have closed it already
            os.close(fd)


def test_shared_locks_coexist_and_exclude_a_writer(opener) -> None:
    a, b, c = opener(), opener(), opener()
    assert leases.try_lock(a, 0, exclusive=False)
    assert leases.try_lock(b, 0, exclusive=False)
    assert not leases.try_lock(c, 0, exclusive=True)
    assert leases.try_lock(c, 1, exclusive=True)  # another byte, another lock
    assert leases.holder(c, 0) == "shared"
    assert leases.holder(a, 1) == "exclusive"
    leases.unlock(a, 0)
    os.close(b)  # closing the description drops its lock
    assert leases.holder(c, 0) == "none"
    assert leases.try_lock(c, 0, exclusive=True)


def test_descriptions_in_one_process_conflict(opener) -> None:
    # The property that makes per-lease fds work: POSIX locks would merge these.
    a, b = opener(), opener()
    assert leases.try_lock(a, 2, exclusive=True)
    assert not leases.try_lock(b, 2, exclusive=False)
    assert leases.holder(a, 2) == "none"  # a's own lock never conflicts with a


def test_wait_lock_times_out(opener) -> None:
    a, b = opener(), opener()
    assert leases.try_lock(a, 0, exclusive=True)
    start = time.monotonic()
    assert not leases.wait_lock(b, 0, exclusive=False, timeout=0.05)
    assert 0.05 <= time.monotonic() - start < 1.0


@pytest.mark.parametrize("timeout", [2.0, None])
def test_wait_lock_gets_it_once_released(opener, timeout: float | None) -> None:
    a, b = opener(), opener()
    assert leases.try_lock(a, 0, exclusive=True)
    timer = threading.Timer(0.05, leases.unlock, (a, 0))
    timer.start()
    try:
        assert leases.wait_lock(b, 0, exclusive=True, timeout=timeout)
    finally:
        timer.join()
    assert leases.holder(a, 0) == "exclusive"


def test_lock_span_covers_every_role(opener) -> None:
    a, b = opener(), opener()
    assert leases.try_lock(a, leases.LOCK_ATTACH, exclusive=False)
    assert not leases.try_lock(b, 0, exclusive=True, length=leases.LOCK_SPAN)
    leases.unlock(a, leases.LOCK_ATTACH)
    assert leases.try_lock(b, 0, exclusive=True, length=leases.LOCK_SPAN)


LAYOUT = Layout.pack([("w", "bfloat16", (2, 3)), ("flag", "bool", (2,)), ("none", "float32", (0,))])


def _buffers() -> tuple[np.ndarray, np.ndarray]:
    bufs = (np.zeros(LAYOUT.nbytes, np.uint8), np.zeros(LAYOUT.nbytes, np.uint8))
    LAYOUT.view(bufs[1], "w")[:] = 0x4000  # bf16 2.0
    LAYOUT.view(bufs[1], "flag")[:] = [1, 0]
    for b in bufs:
        b.flags.writeable = False
    return bufs


def test_snapshot_views_and_tensors(opener) -> None:
    bufs = _buffers()
    snap = Snapshot(opener(), bufs[1], LAYOUT, index=1, generation=4, version=9)
    w = snap.tensor("w")
    assert w.dtype == torch.bfloat16
    assert torch.equal(w, torch.full((2, 3), 2.0, dtype=torch.bfloat16))
    assert torch.equal(snap.tensor("flag"), torch.tensor([True, False]))
    empty = snap.tensor(2)
    assert empty.dtype == torch.float32
    assert empty.shape == (0,)
    assert snap.array("w").dtype == np.uint16
    with snap:
        pass
    assert snap.released
    with pytest.raises(RuntimeError, match="released"):
        snap.tensor("w")


def test_take_lease_follows_the_pointer(opener) -> None:
    words = np.zeros(64, np.uint64)
    pointer = VersionPointer(words)
    bufs = _buffers()
    with pytest.raises(NoVersionError):
        take_lease(opener(), pointer, bufs, LAYOUT, timeout=0.1, name="t")
    pointer.mark(1, BufferState.READY, 9)
    pointer.flip(1)
    fd = opener()
    with take_lease(fd, pointer, bufs, LAYOUT, timeout=0.1, name="t") as snap:
        assert (snap.version, snap.index, snap.generation) == (9, 1, 1)
        assert leases.holder(opener(), leases.LOCK_BUFFER[1]) == "shared"


def test_take_lease_refuses_a_corrupt_active_buffer(opener) -> None:
    pointer = VersionPointer(np.zeros(64, np.uint64))
    pointer.mark(0, BufferState.READY, 1)
    pointer.flip(0)
    pointer.mark(0, BufferState.WRITING)  # breaks I1: the pointer names a non-READY buffer
    fd = opener()
    with pytest.raises(RuntimeError, match="active buffer 0 is WRITING, not READY"):
        take_lease(fd, pointer, _buffers(), LAYOUT, timeout=0.1, name="t")
