"""One compiled variant of the decode kernel per element width, whatever buffers it is given.

numba types a read-only array apart from a writable one and compiles a kernel once per type
of its arguments: a frame received into a bytearray (the UCX link) or a writable reference
made a fresh install's apply agent compile a second variant at its first such delta (113 s
on a busy 2-core host, a test's whole timeout), one the install's warm-up had not made. The
decoder passes the kernels' read-only inputs read-only always (decoder._read_only); each case
runs in a fresh interpreter, so the variants counted are this process's own."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import numpy as np
from deltarl.codecs import kernels
from deltarl.codecs.decoder import VersionApply
from deltarl.codecs.encoder import DeltaEncoder
from deltarl.engine.layout import Layout

layout = Layout.pack([("w", "bfloat16", (4096,)), ("b", "bfloat16", (512,))])
rng = np.random.default_rng(1)
ref = rng.integers(0, 256, layout.nbytes, dtype=np.uint8)
cur = ref.copy()
cur[::41] ^= 1
encoding = DeltaEncoder(layout).encode(cur, ref, target_version=1, base_version=0)
chunks = [c.data for c in encoding]
frozen = ref.copy()
frozen.flags.writeable = False
for wrap in (bytes, bytearray, lambda d: np.frombuffer(bytearray(d), np.uint8)):
    for reference in (ref, frozen):  # the apply agent's active buffer, or a writable copy
        target = ref.copy()
        apply = VersionApply(layout, target, reference, base=0, version=1)
        for data in chunks:
            apply.apply(wrap(data))
        apply.verify(encoding.manifest)
        assert np.array_equal(target, cur)
print(len(kernels.decode_sparse.signatures))
"""


def test_the_decode_kernel_has_one_variant_per_width_whatever_the_buffers() -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=600, check=True
    )
    assert out.stdout.split() == ["1"], out.stderr[-2000:]
