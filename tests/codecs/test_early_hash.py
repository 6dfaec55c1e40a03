"""VersionApply's early hashes on the hash pool: the next chunk is decoded while they run, a
chunk that writes a tensor under its hash never lets the torn digest count, and nothing hashed
early still reads the target once ``verify`` or ``close`` returns (faults injected by holding
the pool's hashes on an event)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from deltarl.codecs import checksum
from deltarl.codecs.decoder import ChecksumMismatchError, VersionApply
from deltarl.codecs.encoder import DeltaEncoder
from deltarl.codecs.frame import FrameError
from deltarl.codecs.manifest import RefitManifest
from deltarl.engine.layout import Layout

TENSORS = 8
ELEMS = 4096  # bf16: 8 KiB a tensor, so a chunk of 8 KiB starts about one tensor further on
WAIT_S = 10.0  # long enough never to end a test that works; a hang shows as a failure


@dataclass
class Delta:
    layout: Layout
    ref: np.ndarray
    cur: np.ndarray
    chunks: list[bytes]
    manifest: RefitManifest


@pytest.fixture(scope="module")
def delta() -> Delta:
    layout = Layout.pack([(f"t{i}", "bfloat16", (ELEMS,)) for i in range(TENSORS)])
    rng = np.random.default_rng(7)
    ref = rng.integers(0, 256, layout.nbytes, dtype=np.uint8)
    cur = ref.copy()
    for i in range(TENSORS):
        v = layout.view(cur, i)
        idx = rng.choice(v.size, 200, replace=False)
        v[idx] += np.uint16(1)
    enc = DeltaEncoder(layout, chunk_bytes=2 * ELEMS, item_elems=ELEMS // 2)
    e = enc.encode(cur, ref, target_version=2, base_version=1)
    chunks = [c.data for c in e]
    assert e.manifest is not None
    # each chunk starts about a tensor further on and lets the ones before it be hashed:
    # several early hashes are in flight at once in the tests below
    assert len(chunks) >= TENSORS - 1, len(chunks)
    return Delta(layout, ref, cur, chunks, e.manifest)


class CountingPool(ThreadPoolExecutor):
    """The pool, counting what is handed to it (dropped or not)."""

    submitted = 0

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        self.submitted += 1
        return super().submit(fn, *args, **kwargs)


class HeldHashes:
    """Replaces ``tensor_digest`` on the pool's threads: each call takes its digest of the
    bytes as they are when it starts, then waits for ``release`` before returning it, so a
    test can write the target, or end the apply, while the hash is running."""

    def __init__(self, pool: CountingPool) -> None:
        self.pool = pool
        self.release = threading.Event()
        self.started = 0
        self.running = 0
        self.lock = threading.Lock()
        self._real = checksum.tensor_digest

    def __call__(self, bits: np.ndarray) -> str:
        digest = self._real(bits)
        with self.lock:
            self.started += 1
            self.running += 1
        try:
            assert self.release.wait(WAIT_S), "a held hash was never released"
            return digest
        finally:
            with self.lock:
                self.running -= 1


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> Iterator[HeldHashes]:
    # Every early hash goes to the pool, however small, even on a one-CPU runner.
    monkeypatch.setattr(checksum, "HASH_THREADS", 2)
    monkeypatch.setattr(checksum, "PARALLEL_MIN_BYTES", 0)
    # A pool of its own with two threads, whatever the host: at most two hashes run at once.
    pool = CountingPool(2, thread_name_prefix="held-xxh3")
    monkeypatch.setattr(checksum, "_pool", pool)
    hashes = HeldHashes(pool)
    monkeypatch.setattr(checksum, "tensor_digest", hashes)
    yield hashes
    hashes.release.set()  # a failed test leaves nothing waiting
    pool.shutdown(wait=True)


def _in_thread(fn: Callable[[], object]) -> threading.Thread:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


def test_chunks_are_applied_while_the_early_hashes_run(delta: Delta, held: HeldHashes) -> None:
    target = delta.ref.copy()
    apply = VersionApply(delta.layout, target, target, base=1, version=2)
    done = threading.Event()

    def apply_all() -> None:
        for c in delta.chunks:
            apply.apply(c)
        done.set()

    _in_thread(apply_all)
    # every chunk applied while no early hash has returned: none waited for them
    assert done.wait(WAIT_S), "apply waited for an early hash"
    assert held.started >= 1
    assert held.running >= 1
    held.release.set()
    apply.verify(delta.manifest)
    assert target.tobytes() == delta.cur.tobytes()
    assert held.running == 0


def test_a_tensor_written_under_its_early_hash_is_hashed_again(
    delta: Delta, held: HeldHashes
) -> None:
    # fault: out of order, the last chunks land first, so the tensors before them are
    # hashed holding the base; the chunks that write them land while those hashes still run
    # (each took its digest of the base and is held): every such digest is stale, and
    # verify must hash those tensors again rather than fail on, or pass by, a torn one
    target = delta.ref.copy()
    apply = VersionApply(delta.layout, target, target, base=1, version=2)
    apply.apply(delta.chunks[-1])
    for c in delta.chunks[:-1]:
        apply.apply(c)
    assert held.running >= 1  # still held while the chunks wrote their tensors
    held.release.set()
    assert target.tobytes() == delta.cur.tobytes()
    assert apply.early_digests() == {}  # every one went stale: none is used
    apply.verify(delta.manifest)


def test_a_tensor_wrong_when_hashed_early_fails_verify(delta: Delta, held: HeldHashes) -> None:
    # fault: tensor 0's bytes are wrong when the next chunk's landing hands it to the pool
    target = delta.ref.copy()
    apply = VersionApply(delta.layout, target, target, base=1, version=2)
    apply.apply(delta.chunks[0])
    delta.layout.view(target, 0)[0] ^= np.uint16(0x40)
    for c in delta.chunks[1:]:
        apply.apply(c)
    held.release.set()
    assert 0 in apply.early_digests()
    with pytest.raises(ChecksumMismatchError, match=r"differ after apply: t0"):
        apply.verify(delta.manifest)


def test_close_waits_for_running_hashes_and_drops_the_rest(delta: Delta, held: HeldHashes) -> None:
    # the apply is given up (a refused chunk, a failed version) while early hashes run and
    # more wait for the pool: close returns only once none reads the target, and the ones
    # waiting never start
    target = delta.ref.copy()
    apply = VersionApply(delta.layout, target, target, base=1, version=2)
    for c in delta.chunks:
        apply.apply(c)
    closed = threading.Event()
    _in_thread(lambda: (apply.close(), closed.set()))
    assert not closed.wait(0.2), "close returned while a hash still read the target"
    started = held.started
    # two run, held; the rest wait behind them and must be dropped, not run
    assert started == 2
    assert held.pool.submitted > started + 1, held.pool.submitted
    held.release.set()
    assert closed.wait(WAIT_S)
    assert held.running == 0
    assert held.started == started, "a hash dropped by close started after all"


def test_a_refused_verify_leaves_no_hash_running(delta: Delta, held: HeldHashes) -> None:
    # fault: the manifest lists a chunk that never came; the refusal must not leave early
    # hashes reading a target the caller now gives up
    target = delta.ref.copy()
    apply = VersionApply(delta.layout, target, target, base=1, version=2)
    for c in delta.chunks[:-1]:
        apply.apply(c)
    refused = threading.Event()

    def verify() -> None:
        with pytest.raises(FrameError, match="have not arrived"):
            apply.verify(delta.manifest)
        refused.set()

    _in_thread(verify)
    assert not refused.wait(0.2), "verify refused while a hash still read the target"
    held.release.set()
    assert refused.wait(WAIT_S)
    assert held.running == 0
