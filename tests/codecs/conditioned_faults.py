"""Fault checks every conditioned coding must pass (test_conditioned.py for the range coder,
test_conditioned_rice.py for the Rice coder): a forged frame is refused before anything is
written, flipped stream bytes never verify, fuzzed frames are applied or refused cleanly."""

from __future__ import annotations

import numpy as np
import pytest

from deltarl.codecs.decoder import ChecksumMismatchError, VersionApply, verify_tensors
from deltarl.codecs.frame import HEADER_SIZE, POS_CONDITIONED, STREAM_CONDITIONED, FrameError
from deltarl.codecs.manifest import RefitManifest
from deltarl.engine.layout import Layout
from tests.codecs.forge import Forged, reseal
from tests.codecs.mutate import Mutator, bounded_memory


def assert_refused_unwritten(layout: Layout, frame: bytes, ref: np.ndarray, match: str) -> None:
    """``frame`` is refused (a FrameError matching ``match``) with nothing written, applied
    in place and into another buffer."""
    for in_place in (False, True):
        reference = ref.copy()
        target = reference if in_place else reference.copy()
        apply = VersionApply(layout, target, reference, base=0, version=1)
        with pytest.raises(FrameError, match=match):
            apply.apply(frame)
        assert np.array_equal(target, ref)
        assert np.array_equal(reference, ref)


def assert_flipped_bytes_never_verify(
    layout: Layout, chunk: bytes, manifest: RefitManifest, ref: np.ndarray, cur: np.ndarray
) -> None:
    """Bytes of the first bf16 conditioned record's stream, flipped in turn (with a valid
    checksum): the frame is refused, or it decodes to something the tensor checksums refuse,
    or to the exact weights ``cur``."""
    f0 = Forged.parse(chunk)
    i = f0.first(POS_CONDITIONED, 2)
    at, n = f0.part(i, STREAM_CONDITIONED)
    refused = 0
    for off in range(0, n, max(1, n // 97)):
        f = Forged.parse(chunk)
        s = f.stream(STREAM_CONDITIONED)
        s.raw = s.raw[: at + off] + bytes([s.raw[at + off] ^ 0x5A]) + s.raw[at + off + 1 :]
        target = ref.copy()
        apply = VersionApply(layout, target, ref, base=0, version=1)
        try:
            apply.apply(f.seal())
        except FrameError:
            refused += 1
            assert np.array_equal(target, ref)
            continue
        # The resealed chunk's own checksum is not the manifest's (verify refuses that too);
        # the point here is that wrong weights never hash like the real version. A flip in
        # a stream's last bytes may decode to the same weights: harmless, and exact.
        if np.array_equal(target, cur):
            continue
        with pytest.raises(ChecksumMismatchError):
            verify_tensors(layout, target, manifest)
    assert refused > 0


def assert_fuzzed_frames_applied_or_refused(
    layout: Layout, seed: int, frames: list[bytes], ref: np.ndarray, mutants: int
) -> None:
    """Seeded mutants of ``frames`` (most resealed, so they pass the checksum): each is
    applied or refused with a FrameError that wrote nothing, in bounded memory; a mutant's
    seed and index reproduce it (mutate.py). Most must be refused, some applied."""
    mutate = Mutator(seed, frames)
    reference, target = ref.copy(), ref.copy()
    accepted = refused = 0
    with bounded_memory():
        for i in range(mutants):
            data = mutate()
            if len(data) >= HEADER_SIZE and mutate.rng.random() < 0.9:
                data = reseal(data)
            into = reference if i % 8 == 0 else target  # in place, as a relay applies
            apply = VersionApply(layout, into, reference, base=0, version=1)
            try:
                apply.apply(data)
            except FrameError:
                refused += 1
                assert np.array_equal(into, ref), f"mutant {i}: refused, yet written"
            except BaseException as exc:
                exc.add_note(f"mutant {i} of {len(data)} bytes: {data[:256].hex()}")
                raise
            else:
                accepted += 1
                np.copyto(into, ref)
    assert refused > mutants // 2
    assert accepted > 0
