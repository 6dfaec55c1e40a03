"""Chunks leave the encoder while later tensors are still to be encoded."""

import numpy as np
import pytest

from deltarl.codecs.checksum import model_digest, tensor_digests
from deltarl.codecs.decoder import ChecksumMismatchError, VersionApply
from deltarl.codecs.encoder import DeltaEncoder
from deltarl.engine.layout import Layout
from tests.codecs.test_roundtrip import assert_tiles


def test_the_first_chunk_is_yielded_before_the_other_waves_are_encoded(monkeypatch):
    layout = Layout.pack([(f"w{i}", "bfloat16", (4096,)) for i in range(4)])
    rng = np.random.default_rng(0)
    ref = rng.integers(0, 256, layout.nbytes, dtype=np.uint8)
    cur = ref.copy()
    cur.view(np.uint16)[::50] += np.uint16(1)  # sparse: the whole delta is far below a chunk
    enc = DeltaEncoder(layout, chunk_bytes=8192)  # waves of one 8 KiB tensor each
    waves = []
    real = enc._encode_wave
    monkeypatch.setattr(
        enc,
        "_encode_wave",
        lambda e, wave, *a, **kw: (waves.append(wave), real(e, wave, *a, **kw))[1],
    )
    encoding = enc.encode(cur, ref, target_version=1, base_version=0)
    chunks = iter(encoding)
    first = next(chunks)
    assert len(waves) == 1, "the first chunk waited for later waves"
    rest = list(chunks)
    assert len(waves) == 4
    assert len(rest) == 3  # one chunk per wave
    target = ref.copy()
    apply = VersionApply(layout, target, target, base=0, version=1)
    for c in [first, *rest]:
        apply.apply(c.data)
    assert encoding.manifest is not None
    apply.verify(encoding.manifest)
    assert np.array_equal(target, cur)


def _wave_bytes(layout: Layout, enc: DeltaEncoder) -> list[int]:
    waves = list(enc._waves())
    # every element once, in layout order
    flat = [(tid, lo, hi) for wave in waves for tid, lo, hi in wave]
    assert [tid for tid, _, _ in flat] == sorted(tid for tid, _, _ in flat)
    for i, spec in enumerate(layout.tensors):
        assert_tiles([(lo, hi) for tid, lo, hi in flat if tid == i], spec.numel)
    return [sum((hi - lo) * layout.tensors[t].itemsize for t, lo, hi in w) for w in waves]


def test_a_large_tensor_spans_waves_of_chunk_bytes():
    # a model's shape: a large embedding first, layers, a large output head last; the first
    # chunk waits for 16 MiB of the embedding, not for all of its 24 MiB
    mib = 1 << 20
    entries = [("emb", "bfloat16", (12 * mib,))]
    entries += [(f"l{i}", "bfloat16", (mib // 2 + 64 * i,)) for i in range(16)]
    entries += [("head", "bfloat16", (12 * mib,))]
    layout = Layout.pack(entries)
    chunk = 16 * mib
    enc = DeltaEncoder(layout, chunk_bytes=chunk)
    sizes = _wave_bytes(layout, enc)
    assert sizes[0] == chunk  # a piece of the embedding
    assert all(chunk <= s < chunk + enc.item_elems * 2 for s in sizes[:-1])
    assert sizes[-1] <= chunk  # what is left of the head
    assert sum(sizes) == layout.nbytes
    waves = list(enc._waves())
    assert waves[0] == [(0, 0, 8 * mib)]
    assert waves[1][0] == (0, 8 * mib, 12 * mib)  # the rest of the embedding leads wave 1


def test_a_model_smaller_than_the_first_wave_is_one_wave():
    layout = Layout.pack([("a", "float32", (100,)), ("b", "int8", (7,)), ("e", "int32", (0,))])
    enc = DeltaEncoder(layout, chunk_bytes=1 << 20)
    assert list(enc._waves()) == [[(0, 0, 100), (1, 0, 7), (2, 0, 0)]]


def test_the_trainers_tensor_digests_go_into_the_manifest_as_given() -> None:
    """Given the trainer's digests, the encoder lists them and hashes nothing: a receiver
    checks its bytes against what the trainer wrote, so bytes that are not those (here, a
    digest that does not match ``cur``) are refused there, never passed on as its weights."""
    layout = Layout.pack([(f"w{i}", "bfloat16", (4096,)) for i in range(3)])
    rng = np.random.default_rng(1)
    ref = rng.integers(0, 256, layout.nbytes, dtype=np.uint8)
    cur = ref.copy()
    cur.view(np.uint16)[::40] += np.uint16(1)
    enc = DeltaEncoder(layout, chunk_bytes=8192)
    true = tensor_digests(layout, cur)
    given = [true[0], "f" * 32, true[2]]
    encoding = enc.encode(cur, ref, target_version=1, base_version=0, tensor_digests=given)
    chunks = list(encoding)
    assert encoding.manifest is not None
    assert [t.xxh3_128 for t in encoding.manifest.tensors] == given
    assert encoding.manifest.model_xxh3_128 == model_digest(given)
    target = ref.copy()
    apply = VersionApply(layout, target, target, base=0, version=1)
    for c in chunks:
        apply.apply(c.data)
    with pytest.raises(ChecksumMismatchError, match="w1"):
        apply.verify(encoding.manifest)
    with pytest.raises(ValueError, match="2 tensor digests for a layout of 3"):
        enc.encode(cur, ref, target_version=1, base_version=0, tensor_digests=true[:2])
