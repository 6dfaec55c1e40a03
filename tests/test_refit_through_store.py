"""The codec and the weight store together, as the apply agent will use them.

A full version, then deltas, each applied into the store's inactive buffer with the active
buffer as the reference, verified against the manifest, then committed in one flip; a
reader in another process checks every leased snapshot against its manifest digests.
"""

import multiprocessing as mp
import time

import numpy as np
import pytest

from deltarl.codecs.checksum import tensor_digests
from deltarl.codecs.decoder import ChecksumMismatchError, VersionApply
from deltarl.codecs.encoder import DeltaEncoder
from deltarl.codecs.frame import FrameError
from deltarl.engine.weight_store import WeightStore
from deltarl.sim.realistic_deltas import RealisticDeltas


def _refit(store: WeightStore, chunks, manifest, base: int | None, version: int) -> None:
    with store.begin_write(timeout=5) as txn:
        if base is not None:
            assert txn.active_version == base
            if txn.base_version != base:
                txn.copy_from_active()
        va = VersionApply(store.layout, txn.buffer, txn.active, base=base, version=version)
        for c in chunks:
            va.apply(c.data)
        va.verify(manifest)
        txn.commit(version)


def _reader(name: str, root: str, digests: dict[int, list[str]], stop, ready, seen) -> None:
    from pathlib import Path  # noqa: PLC0415

    store = WeightStore.open(name, root=Path(root), readonly=True)
    bad = 0
    while not stop.is_set():
        try:
            with store.lease(timeout=5) as snap:
                got = tensor_digests(store.layout, snap.buffer)
                if got != digests[snap.version]:
                    bad += 1
                seen.append(snap.version)
            ready.set()
        except LookupError:
            continue
    store.close()
    if bad:
        raise SystemExit(f"{bad} snapshots did not match their manifest")


def test_full_then_deltas_through_the_store(tmp_path):
    gen = RealisticDeltas(400_000, seed=5)
    enc = DeltaEncoder(gen.layout, chunk_bytes=64 << 10)
    versions = [gen.publish()]
    for _ in range(4):
        gen.step()
        versions.append(gen.publish())
    encodings = []
    for v, buf in enumerate(versions):
        e = enc.encode(
            buf,
            None if v == 0 else versions[v - 1],
            target_version=v,
            base_version=None if v == 0 else v - 1,
        )
        encodings.append((list(e), e.manifest))
    digests = {v: [t.xxh3_128 for t in m.tensors] for v, (_, m) in enumerate(encodings)}

    ctx = mp.get_context("spawn")
    store = WeightStore.create("refit-test", gen.layout, root=tmp_path)
    stop, ready, seen = ctx.Event(), ctx.Event(), ctx.Manager().list()
    args = ("refit-test", str(tmp_path), digests, stop, ready, seen)
    reader = ctx.Process(target=_reader, args=args)
    _refit(store, *encodings[0], base=None, version=0)
    reader.start()
    try:
        assert ready.wait(120), "the reader process never leased a version"
        for v in range(1, len(versions)):
            _refit(store, *encodings[v], base=v - 1, version=v)
            time.sleep(0.05)  # let the reader lease each version
        with store.lease() as snap:
            assert snap.version == len(versions) - 1
            assert np.array_equal(snap.buffer, versions[-1])
    finally:
        stop.set()
        reader.join(60)
    assert reader.exitcode == 0
    assert len(set(seen)) >= 2  # it saw versions come and go, each one whole
    store.unlink()


def test_a_refused_delta_leaves_the_active_version(tmp_path):
    gen = RealisticDeltas(200_000, seed=6)
    enc = DeltaEncoder(gen.layout)
    v0 = gen.publish()
    gen.step()
    v1 = gen.publish()
    gen.step()
    v2 = gen.publish()
    full = enc.encode(v0, None, target_version=0)
    d12 = enc.encode(v2, v1, target_version=2, base_version=1)
    full_chunks, d12_chunks = list(full), list(d12)
    store = WeightStore.create("refused", gen.layout, root=tmp_path)
    _refit(store, full_chunks, full.manifest, base=None, version=0)
    # the store holds version 0; a delta from 1 must be refused, and nothing changes
    with pytest.raises(FrameError, match="holds version 0"):
        _refit(store, d12_chunks, d12.manifest, base=0, version=2)
    # a manifest whose checksums do not match what was applied never becomes active
    d01 = enc.encode(v1, v0, target_version=1, base_version=0)
    chunks01 = list(d01)
    wrong = d12.manifest
    with pytest.raises((FrameError, ChecksumMismatchError)):
        _refit(store, chunks01, wrong, base=0, version=1)
    with store.lease() as snap:
        assert snap.version == 0
        assert np.array_equal(snap.buffer, v0)
    store.unlink()
