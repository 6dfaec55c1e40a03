"""One delta with every kind of record, in one chunk and in several, for the fault tests.

``assert_refused`` is the check every fault test makes: the frame is refused with a message
that names what is wrong, and neither the target nor the reference has changed.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

from deltarl.codecs.decoder import VersionApply
from deltarl.codecs.encoder import DeltaEncoder
from deltarl.codecs.frame import FrameError
from deltarl.codecs.manifest import RefitManifest
from deltarl.engine.layout import Layout

BASE, TARGET = 3, 4
ITEM = 1024  # elements per item, so the larger tensors have several records


@dataclasses.dataclass(frozen=True)
class Case:
    layout: Layout
    ref: np.ndarray
    cur: np.ndarray
    chunk: bytes  # the whole delta BASE -> TARGET in one chunk
    manifest: RefitManifest
    chunks: list[bytes]  # the same delta in several small chunks
    chunks_manifest: RefitManifest


@functools.cache
def make_case() -> Case:
    """Built once per process; tests copy its buffers before writing."""
    layout = Layout.pack(
        [
            ("emb", "bfloat16", (64, 64)),  # scattered changes: rice
            ("blk", "bfloat16", (3001,)),  # runs of changes: bitmap; last range not /8
            ("w", "float32", (300,)),  # everything changed: dense
            ("i8", "int8", (700,)),  # rice, 1-byte elements
            ("bias", "float16", ()),  # a 0-d tensor, changed: dense
            ("none", "int32", (0,)),  # empty
        ]
    )
    rng = np.random.default_rng(20240607)
    ref = rng.integers(0, 256, layout.nbytes, dtype=np.uint8)
    cur = ref.copy()
    v = layout.view(cur, "emb")
    idx = rng.choice(v.size, 80, replace=False)
    v[idx] += rng.choice(np.array([1, 0xFFFF], np.uint16), 80)
    v = layout.view(cur, "blk")
    v[np.arange(v.size) % 70 < 30] += 1  # 30 changed, 40 unchanged: gaps that escape Rice
    layout.view(cur, "w")[:] += 1
    v = layout.view(cur, "i8")
    v[rng.choice(v.size, 40, replace=False)] += 3
    layout.view(cur, "bias")[:] += 1

    def encode(chunk_bytes: int) -> tuple[list[bytes], RefitManifest]:
        enc = DeltaEncoder(
            layout,
            chunk_bytes=chunk_bytes,
            item_elems=ITEM,
            dense_threshold=0.5,
        )
        e = enc.encode(cur, ref, target_version=TARGET, base_version=BASE)
        chunks = [c.data for c in e]
        assert e.manifest is not None
        return chunks, e.manifest

    (chunk,), manifest = encode(1 << 20)
    chunks, chunks_manifest = encode(4096)
    assert len(chunks) >= 2
    codings = {t.name: t.coding for t in manifest.tensors}
    assert codings == {
        "emb": "rice",
        "blk": "bitmap",
        "w": "dense",
        "i8": "rice",
        "bias": "dense",
        "none": "unchanged",
    }
    return Case(layout, ref, cur, chunk, manifest, chunks, chunks_manifest)


def assert_refused(
    case: Case,
    frame: bytes,
    match: str,
    *,
    base: int | None = BASE,
    version: int = TARGET,
) -> FrameError:
    """The frame is refused with a matching message, separately and in place, writing nothing."""
    ref = case.ref.copy()
    target = case.ref.copy()
    before = target.tobytes()
    apply = VersionApply(case.layout, target, ref, base=base, version=version)
    with pytest.raises(FrameError, match=match) as err:
        apply.apply(frame)
    assert target.tobytes() == before
    assert ref.tobytes() == before
    assert not apply.applied

    inplace = VersionApply(case.layout, ref, ref, base=base, version=version)
    with pytest.raises(FrameError, match=match):
        inplace.apply(frame)
    assert ref.tobytes() == before
    return err.value


def apply_ok(case: Case, frame: bytes) -> np.ndarray:
    target = case.ref.copy()
    VersionApply(case.layout, target, case.ref, base=BASE, version=TARGET).apply(frame)
    return target
