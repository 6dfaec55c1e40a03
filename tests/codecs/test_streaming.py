"""Chunks leave the encoder while later tensors are still to be encoded."""

import numpy as np

from deltarl.codecs.decoder import VersionApply
from deltarl.codecs.encoder import DeltaEncoder
from deltarl.engine.layout import Layout


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
