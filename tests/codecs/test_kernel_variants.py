"""One compiled variant of the decode kernel per element width, whatever buffers it is given.

numba types a read-only array apart from a writable one and compiles a kernel once per type
of its arguments: a frame received into a bytearray (the UCX link) or a writable reference
made a fresh install's apply agent compile a second variant at its first such delta (113 s
on a busy 2-core host, a test's whole timeout), one the install's warm-up had not made. The
decoder passes the kernels' read-only inputs read-only always (decoder.read_only); each case
runs in a fresh interpreter, so the variants counted are this process's own.

And the warm-up an install runs compiles every variant the agents' paths then use."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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


COVERAGE_PROBE = """
import numpy as np
from numba.core.registry import CPUDispatcher
from deltarl.codecs import conditioned, kernels
from deltarl.codecs.decoder import VersionApply
from deltarl.codecs.encoder import DeltaEncoder
from deltarl.codecs.frame import POS_RICE, FrameError
from deltarl.codecs.warmup import _WIDTHS, _tiny_step, _weights, warm_up
from deltarl.engine.layout import Layout
from deltarl.refit.catch_up import KeptDelta, Undo
from tests.codecs.forge import Forged


def variants():
    return {
        f"{m.__name__}.{n}": {str(s) for s in getattr(m, n).signatures}
        for m in (kernels, conditioned)
        for n in dir(m)
        if isinstance(getattr(m, n), CPUDispatcher)
    }


def frozen(a):
    a = a.copy()
    a.flags.writeable = False
    return a


warm_up()
warmed = variants()
layout = Layout.pack(_WIDTHS)
ref = np.random.default_rng(3).integers(0, 256, layout.nbytes, dtype=np.uint8)
_weights(layout, ref)
flipped = ref.copy()
flipped[::89] ^= 1
small = _tiny_step(layout, ref)
for cur in (flipped, frozen(flipped), small, frozen(small)):
    for cond in (False, True):
        for advance in (False, True):  # the export agent: a store's mapping, or a copy
            encoding = DeltaEncoder(layout, conditioned=cond).encode(
                cur, ref.copy(), target_version=1, base_version=0, advance=advance
            )
            chunks = [c.data for c in encoding]
            # the apply agent: frames from every link, its active buffer or a copy as reference
            for wrap in (bytes, bytearray, memoryview):
                for reference in (ref, frozen(ref)):
                    kept = KeptDelta(1, 0)
                    target = ref.copy()
                    apply = VersionApply(
                        layout, target, reference, base=0, version=1, keep=kept.chunks
                    )
                    for data in chunks:
                        apply.apply(wrap(data))
                    apply.verify(encoding.manifest)
                    other = ref.copy()  # the catch-up, eager (with its undo) or on open
                    kept.catch_up(layout, other)
                    assert np.array_equal(other, cur)
                    undo = kept.catch_up_with_undo(layout, other := ref.copy())
                    Undo(1, 0, undo, encoding.manifest).apply(layout, other)
                    assert np.array_equal(other, ref)
            # the fault path: a frame refused after its other records were written (the
            # tiny step's conditioned deltas have no Rice record to forge)
            forged = Forged.parse(chunks[0])
            rice = [j for j, r in enumerate(forged.records) if r.pos_coding == POS_RICE]
            if rice:
                forged.edit(rice[-1], changed=forged.records[rice[-1]].changed - 1)
            for wrap in (bytes, bytearray) if rice else ():
                target = ref.copy()
                try:
                    VersionApply(layout, target, frozen(ref), base=0, version=1).apply(
                        wrap(forged.seal())
                    )
                except FrameError:
                    assert np.array_equal(target, ref)
                else:
                    raise AssertionError("the forged frame was applied")
for name, made in variants().items():
    for sig in sorted(made - warmed.get(name, set())):
        print("compiled after the warm-up:", name, sig)
print("checked")
"""


def test_the_warm_up_compiles_every_variant_the_agents_use() -> None:
    """A fresh install's agents must never compile at a refit (seconds to minutes on a busy
    host): after ``warm_up``, the export and apply agents' paths (encodes from a store's
    mapping or a copy, advancing or not, conditioned or not; applies of frames from every
    link against a read-only or writable reference; the catch-up, its undo and the fault
    path's undo) compile nothing. Without the warm-up's catch-up, the 1- and 8-byte scatters
    were compiled at a process's first catch-up."""
    out = subprocess.run(
        [sys.executable, "-c", COVERAGE_PROBE],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout == "checked\n", out.stdout[-3000:]
