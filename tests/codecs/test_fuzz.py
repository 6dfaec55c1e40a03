"""Fuzzing the codec's network decoders: chunk frames (VersionApply.apply) and manifests
(RefitManifest.from_json), fed seeded mutants of valid inputs (mutate.py).

Each mutant is either accepted or refused with the module's own error (FrameError,
ManifestError); anything else fails the test, naming the seed and mutant that reproduce it. A
refused frame has written nothing. Memory stays bounded: the address space is capped at what
the process holds plus FUZZ_HEADROOM, so an allocation a frame should not cause fails (the
decoder turns that into a FrameError saying it ran out of memory, which the test then refuses
too), and the peak RSS may not grow by more than the headroom.

Most frame mutants are resealed (their checksum recomputed), so that they reach the checks
behind the checksum. The default run takes a few seconds; ``-m slow`` runs twenty times as many.
"""

from __future__ import annotations

import dataclasses
import random
import struct

import numba
import numpy as np
import pytest
import zstandard

from deltarl.codecs.decoder import VersionApply
from deltarl.codecs.encoder import DeltaEncoder
from deltarl.codecs.frame import (
    COMP_NONE,
    COMP_ZSTD,
    HEADER,
    HEADER_SIZE,
    KIND_DELTA,
    KIND_FULL,
    NO_BASE,
    POS_BITMAP,
    POS_DENSE,
    POS_RICE,
    RECORD,
    STREAM,
    STREAM_BITMAP,
    STREAM_PLANE0,
    STREAM_RICE,
    STREAM_VALUES,
    VAL_ORDERED_DELTA,
    VAL_RAW,
    VAL_XOR,
    FrameError,
    RecordHeader,
)
from deltarl.codecs.manifest import ManifestError, RefitManifest
from deltarl.codecs.manifest_seal import open_sealed, seal
from deltarl.engine.layout import Layout
from tests.codecs.forge import build_frame, gaps, reseal, rice_write
from tests.codecs.mutate import Mutator, bounded_memory, mutate_json
from tests.codecs.sample_delta import BASE, ITEM, TARGET, Case

SLOW = 20  # times the default number of mutants in the -m slow run
BIG = 1 << 30  # elements of the tensor the fuzzed layout declares and never allocates


@pytest.fixture(scope="module")
def full_chunks(case: Case) -> list[bytes]:
    enc = DeltaEncoder(case.layout, chunk_bytes=4096, item_elems=ITEM)
    return [c.data for c in enc.encode(case.cur, None, target_version=TARGET)]


@dataclasses.dataclass(frozen=True)
class Big:
    """The case's layout with a 2**30-element tensor declared after it (never filled: its
    buffers are lazily mapped zeros), and frames that write into that tensor."""

    layout: Layout
    small: int  # bytes of the case's tensors, at the start of the buffer
    window: slice  # the bytes of the big tensor that the seeds write
    deltas: list[bytes]  # valid, and two that claim every element changed
    fulls: list[bytes]


@pytest.fixture(scope="module")
def big(case: Case) -> Big:
    specs = [(s.name, s.dtype, s.shape) for s in case.layout.tensors]
    layout = Layout.pack([*specs, ("big", "bfloat16", (BIG,))])
    tid = len(specs)
    at = layout.tensors[tid].offset
    start = 1000 * 64  # the seeds' records lie in elements [start, start + 1024)

    def record(
        pos: int, val: int, k: tuple[int, int], changed: int, lens: tuple[int, int]
    ) -> RecordHeader:
        return RecordHeader(tid, pos, val, 2, *k, start, 1024, changed, *lens)

    cctx = zstandard.ZstdCompressor(write_content_size=True)
    positions, _ = rice_write(gaps([3, 100, 1000]), 4, 32)
    values, _ = rice_write([0, 1, 0], 0, 16)
    bitmap = bytes([0xFF] * 12 + [0x0F] + [0] * 115)  # 100 elements
    bitmap_values, _ = rice_write([0] * 100, 0, 16)
    planes = [bytes([1]) * 1024, bytes(1024)]
    dense = [(STREAM_PLANE0 + p, COMP_ZSTD, 1024, cctx.compress(x)) for p, x in enumerate(planes)]
    every = b"\xff" * (BIG // 8)
    deltas = [
        build_frame(
            KIND_DELTA,
            BASE,
            TARGET,
            [record(POS_RICE, VAL_ORDERED_DELTA, (4, 0), 3, (len(positions), len(values)))],
            [
                (STREAM_RICE, COMP_NONE, len(positions), positions),
                (STREAM_VALUES, COMP_NONE, len(values), values),
            ],
        ),
        build_frame(
            KIND_DELTA,
            BASE,
            TARGET,
            [record(POS_BITMAP, VAL_XOR, (0, 0), 100, (128, len(bitmap_values)))],
            [
                (STREAM_BITMAP, COMP_ZSTD, 128, cctx.compress(bitmap)),
                (STREAM_VALUES, COMP_NONE, len(bitmap_values), bitmap_values),
            ],
        ),
        build_frame(
            KIND_DELTA,
            BASE,
            TARGET,
            [record(POS_DENSE, VAL_ORDERED_DELTA, (0, 0), 0, (0, 0))],
            dense,
        ),
        # every element changed: 8 bytes of Rice streams; a bitmap and values of 4 KB each
        build_frame(
            KIND_DELTA,
            BASE,
            TARGET,
            [RecordHeader(tid, POS_RICE, VAL_ORDERED_DELTA, 2, 0, 0, 0, BIG, BIG, 8, 8)],
            [(STREAM_RICE, COMP_NONE, 8, b"\xff" * 8), (STREAM_VALUES, COMP_NONE, 8, b"\xff" * 8)],
        ),
        build_frame(
            KIND_DELTA,
            BASE,
            TARGET,
            [RecordHeader(tid, POS_BITMAP, VAL_XOR, 2, 0, 0, 0, BIG, BIG, BIG // 8, BIG // 8)],
            [
                (STREAM_BITMAP, COMP_ZSTD, BIG // 8, cctx.compress(every)),
                (STREAM_VALUES, COMP_ZSTD, BIG // 8, cctx.compress(every)),
            ],
        ),
    ]
    fulls = [
        build_frame(
            KIND_FULL, NO_BASE, TARGET, [record(POS_DENSE, VAL_RAW, (0, 0), 0, (0, 0))], dense
        )
    ]
    return Big(
        layout, case.layout.nbytes, slice(at + 2 * start, at + 2 * (start + 1024)), deltas, fulls
    )


def _field_offsets(frames: list[bytes]) -> list[int]:
    """Offsets of the counts and lengths in these frames: header, records, stream table."""
    out = {24, 28, 32, 40, 48}  # chunk_id, n_records, n_streams, body_len, raw_len
    for f in frames:
        n_records, n_streams = HEADER.unpack_from(f)[7:9]
        for i in range(n_records):
            at = HEADER_SIZE + i * RECORD.size
            out.update(at + x for x in (0, 16, 24, 32, 40, 48))  # id, start .. val_len
        table = HEADER_SIZE + n_records * RECORD.size
        for j in range(n_streams):
            out.update(table + j * STREAM.size + x for x in (8, 16))  # raw_len, wire_len
    return sorted(out)


def fuzz_frames(
    case: Case, big: Big, seeds: list[bytes], base: int | None, n: int, seed: int
) -> tuple[int, int]:
    """Apply n mutants of ``seeds`` to the big layout's buffers; (accepted, refused)."""
    mutate = Mutator(seed, seeds, _field_offsets(seeds))
    # 2 GiB each, mapped lazily: only the pages a frame writes cost memory
    reference, target = (np.zeros(big.layout.nbytes, np.uint8) for _ in range(2))
    reference[: big.small] = target[: big.small] = case.cur if base is None else case.ref
    before = reference[: big.small].tobytes(), reference[big.window].tobytes()

    def written(buf: np.ndarray) -> bool:
        return (buf[: big.small].tobytes(), buf[big.window].tobytes()) != before

    accepted = refused = 0
    threads = numba.get_num_threads()
    # One kernel thread: the fuzz checks validation, and on a loaded machine every parallel
    # region of the few hundred elements here costs milliseconds of thread hand-offs.
    numba.set_num_threads(1)
    try:
        with bounded_memory():
            for i in range(n):
                data = mutate()
                if len(data) >= HEADER_SIZE and mutate.rng.random() < 0.9:
                    data = reseal(data)
                inplace = i % 8 == 0  # reference and target one buffer, as a relay applies
                into = reference if inplace else target
                apply = VersionApply(
                    big.layout,
                    into,
                    None if base is None else reference,
                    base=base,
                    version=TARGET,
                )
                try:
                    apply.apply(data)
                except FrameError as exc:
                    message = str(exc)
                except BaseException as exc:
                    exc.add_note(
                        f"fuzz seed {seed}, mutant {i} of {len(data)} bytes: {data[:256].hex()}"
                    )
                    raise
                else:
                    accepted += 1
                    into[: big.small] = np.frombuffer(before[0], np.uint8)
                    into[big.window] = np.frombuffer(before[1], np.uint8)
                    continue
                refused += 1
                assert "ran out of memory" not in message, f"seed {seed}, mutant {i}: {message}"
                assert not written(into), f"seed {seed}, mutant {i}: refused, yet written"
    finally:
        numba.set_num_threads(threads)
    return accepted, refused


@pytest.mark.parametrize(
    ("n", "seed"),
    [pytest.param(45_000, 1, id="default"), pytest.param(45_000 * SLOW, 2, marks=pytest.mark.slow)],
)
def test_fuzz_delta_frames(case: Case, big: Big, n: int, seed: int) -> None:
    seeds = [case.chunk, *case.chunks, *big.deltas]
    accepted, refused = fuzz_frames(case, big, seeds, BASE, n, seed)
    assert accepted + refused == n
    assert refused > n // 2  # most mutants are caught; some (a flipped value bit) are valid
    assert accepted > 0


@pytest.mark.parametrize(
    ("n", "seed"),
    [pytest.param(10_000, 3, id="default"), pytest.param(10_000 * SLOW, 4, marks=pytest.mark.slow)],
)
def test_fuzz_full_frames(
    case: Case, big: Big, full_chunks: list[bytes], n: int, seed: int
) -> None:
    accepted, refused = fuzz_frames(case, big, [*full_chunks, *big.fulls], None, n, seed)
    assert accepted + refused == n
    assert refused > n // 2


def test_the_big_seeds(case: Case, big: Big) -> None:
    """The valid seeds apply; the two claiming every element are refused."""
    for frame, ok in zip(big.deltas, [True, True, True, False, False], strict=True):
        target = np.zeros(big.layout.nbytes, np.uint8)
        reference = np.zeros(big.layout.nbytes, np.uint8)
        apply = VersionApply(big.layout, target, reference, base=BASE, version=TARGET)
        if ok:
            apply.apply(frame)
            assert target[big.window].any()
        else:
            with pytest.raises(FrameError, match=r"a bit stream ends|changed elements in all"):
                apply.apply(frame)
    target = np.zeros(big.layout.nbytes, np.uint8)
    VersionApply(big.layout, target, None, base=None, version=TARGET).apply(big.fulls[0])
    assert target[big.window][::2].all()


def fuzz_manifests(seeds: list[bytes], n: int, seed: int) -> tuple[int, int]:
    """Parse n mutants (half byte-level, half JSON-level) of ``seeds``; (accepted, refused)."""
    mutate = Mutator(seed, seeds, [])
    rng = random.Random(seed)
    accepted = refused = 0
    with bounded_memory():
        for i in range(n):
            data = mutate() if rng.random() < 0.5 else mutate_json(rng, rng.choice(seeds))
            try:
                RefitManifest.from_json(data)
            except ManifestError as exc:
                message = str(exc)
            except BaseException as exc:
                exc.add_note(f"fuzz seed {seed}, mutant {i}: {data[:1024]!r}")
                raise
            else:
                accepted += 1
                continue
            refused += 1
            assert "ran out of room" not in message, f"seed {seed}, mutant {i}: {message}"
    return accepted, refused


@pytest.mark.parametrize(
    ("n", "seed"),
    [pytest.param(20_000, 5, id="default"), pytest.param(20_000 * SLOW, 6, marks=pytest.mark.slow)],
)
def test_fuzz_manifests(case: Case, n: int, seed: int) -> None:
    seeds = [case.manifest.to_json(), case.chunks_manifest.to_json()]
    accepted, refused = fuzz_manifests(seeds, n, seed)
    assert accepted + refused == n
    assert refused > n // 4


def test_the_mutator_is_seeded(case: Case) -> None:
    """The same seed gives the same mutants: a failure's seed and index reproduce it."""
    one, two = (Mutator(7, [case.chunk], _field_offsets([case.chunk])) for _ in range(2))
    assert [one() for _ in range(50)] == [two() for _ in range(50)]
    rng_a, rng_b = random.Random(8), random.Random(8)
    doc = case.manifest.to_json()
    assert [mutate_json(rng_a, doc) for _ in range(20)] == [
        mutate_json(rng_b, doc) for _ in range(20)
    ]


def test_length_inflation_hits_the_fields(case: Case) -> None:
    """Inflation writes huge values where the frame's lengths and counts are."""
    fields = _field_offsets([case.chunk])
    mutate = Mutator(9, [case.chunk], fields)
    hits = 0
    for _ in range(200):
        data = bytearray(case.chunk)
        out = mutate._inflate(data)
        hits += any(
            struct.unpack_from("<I", out, f)[0] != struct.unpack_from("<I", case.chunk, f)[0]
            for f in fields
            if f + 4 <= len(out)
        )
    assert hits > 100


@pytest.mark.parametrize(
    ("n", "seed"),
    [pytest.param(10_000, 7, id="default"), pytest.param(10_000 * SLOW, 8, marks=pytest.mark.slow)],
)
def test_fuzz_sealed_manifests(case: Case, n: int, seed: int) -> None:
    # What a keyed apply agent does with a manifest off the wire: open the seal, then parse.
    # Only the clear error; and no mutant is accepted unless it is a seed, byte for byte.
    key = bytes(range(32))
    seeds = [seal(case.manifest.to_json(), key), seal(case.chunks_manifest.to_json(), key)]
    mutate = Mutator(seed, seeds, [])
    rng = random.Random(seed)
    accepted = 0
    with bounded_memory():
        for i in range(n):
            if rng.random() < 0.5:
                data = mutate()
            else:  # the JSON changed, the seal line kept (a forger does not hold the key)
                body, _, line = rng.choice(seeds).rpartition(b"\n")
                data = mutate_json(rng, body) + b"\n" + line
            try:
                RefitManifest.from_json(open_sealed(data, key))
            except ManifestError:
                continue
            except BaseException as exc:
                exc.add_note(f"fuzz seed {seed}, mutant {i}: {data[:1024]!r}")
                raise
            assert data in seeds, f"seed {seed}, mutant {i} passed the seal: {data[:200]!r}"
            accepted += 1
    assert accepted < n // 10
