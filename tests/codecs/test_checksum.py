"""Per-tensor digests: hashed on several threads, the same digests as one thread, in order."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from deltarl.codecs import checksum
from deltarl.codecs.checksum import _parts, tensor_digests
from deltarl.engine.layout import Layout


@given(st.lists(st.integers(0, 1000), min_size=1, max_size=40), st.integers(1, 9))
def test_parts_cover_every_index_once_in_order(sizes: list[int], parts: int) -> None:
    runs = _parts(sizes, parts)
    assert 1 <= len(runs) <= parts
    assert [i for r in runs for i in r] == list(range(len(sizes)))
    assert all(len(r) > 0 for r in runs)


def test_parts_balance_bytes() -> None:
    runs = _parts([10] * 100, 4)
    assert [len(r) for r in runs] == [25, 25, 25, 25]
    # one tensor larger than a share gets a run of its own; the rest share the others
    runs = _parts([100, 1, 1, 1, 1], 2)
    assert runs == [range(1), range(1, 5)]


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_digests_match_one_thread_whatever_the_split(
    monkeypatch: pytest.MonkeyPatch, threads: int
) -> None:
    # above PARALLEL_MIN_BYTES, so the pool does the work when threads > 1
    specs = [(f"t{i}", "bfloat16", (int(n),)) for i, n in enumerate([5 << 20, 7, 3 << 20, 0, 1])]
    specs += [(f"u{i}", "float32", (1 << 20,)) for i in range(3)]
    layout = Layout.pack(specs)
    buf = np.random.default_rng(0).integers(0, 256, layout.nbytes, dtype=np.uint8)
    want = [xxhash.xxh3_128_hexdigest(layout.view(buf, i).tobytes()) for i in range(len(layout))]
    assert layout.nbytes >= checksum.PARALLEL_MIN_BYTES
    monkeypatch.setattr(checksum, "HASH_THREADS", threads)
    assert tensor_digests(layout, buf) == want
    chosen = [6, 0, 3, 2]
    assert tensor_digests(layout, buf, chosen) == [want[i] for i in chosen]


def test_a_forked_child_hashes_with_its_own_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The parent's pool has threads; a forked child inherits the object but not the threads,
    so it must make its own, not wait for ever on the inherited one."""
    monkeypatch.setattr(checksum, "HASH_THREADS", 2)
    layout = Layout.pack([(f"t{i}", "uint8", (12 << 20,)) for i in range(2)])
    buf = np.arange(layout.nbytes, dtype=np.uint64).astype(np.uint8)
    want = tensor_digests(layout, buf)  # the parent's pool now exists, with its threads
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: hash, report, leave without running the parent's cleanup
        try:
            ok = tensor_digests(layout, buf) == want
            os.write(write, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(write)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung hashing on the parent's pool")
    assert os.read(read, 1) == b"1"
    os.close(read)


def test_hash_threads_count_the_cpus_this_process_may_use():
    # a daemon pinned to one CPU hashes on one thread, however many the host has
    probe = (
        "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
        "from deltarl.codecs import checksum; print(checksum.HASH_THREADS)"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "1", out.stderr


def test_digests_as_written_are_the_tensors_digests_in_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Large tensors go to the pool, small ones are hashed at once; either way the digests
    come back in the order added, equal to ``tensor_digests``, and leaving the block waits
    for every hash still running."""
    monkeypatch.setattr(checksum, "HASH_THREADS", 2)  # the pool, even on a one-CPU runner
    layout = Layout.pack(
        [("big0", "bfloat16", (3 << 20,)), ("small", "float32", (7,)), ("big1", "int8", (5 << 20,))]
    )
    buf = np.random.default_rng(3).integers(0, 256, layout.nbytes, dtype=np.uint8)
    own = checksum.tensor_digest

    def slow(bits: np.ndarray) -> str:
        time.sleep(0.2)  # still running when the block is left, unless it is waited for
        return own(bits)

    monkeypatch.setattr(checksum, "tensor_digest", slow)
    with checksum.DigestsAsWritten() as hashes:
        for tid in range(len(layout)):
            hashes.add(layout.view(buf, tid))
        pending = [p for p in hashes._parts if not isinstance(p, str)]
        assert len(pending) == 2  # the two large ones were handed to the pool
    assert all(p.done() for p in pending)
    assert hashes.digests() == tensor_digests(layout, buf)
