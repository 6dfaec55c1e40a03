"""Decoding and applying chunks: validate everything first, then write.

``decode_chunk`` checks the whole frame (checksum, versions, every length, count, index and
range) and decodes positions and coded values into private arrays; it never touches the
weights. ``apply_chunk`` then writes the decoded values into a target buffer. A frame that
fails any check raises FrameError naming what is wrong, and nothing has been written.

Values are reference-coded (docs/architecture.md: the receiver holds the reference, so a coder may
condition on it), and the new bits are written absolutely. Applying a chunk computes
``target[p] = decode(coded, reference[p])``: with the reference kept separate from the target
(the apply agent reads the active buffer and writes the inactive one), applying a chunk twice
writes the same bits twice and is harmless. When target and reference are the same buffer
(in place), a chunk must be applied at most once; VersionApply enforces that by chunk id.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from deltarl.codecs import conditioned, kernels
from deltarl.codecs.checksum import chunk_checksum, chunk_hash, model_digest, tensor_digests
from deltarl.codecs.frame import (
    CHECKSUM_OFFSET,
    HEADER_SIZE,
    NO_BASE,
    POS_CONDITIONED,
    POS_DENSE,
    POS_RICE,
    RECORD,
    STREAM,
    STREAM_BITMAP,
    STREAM_CONDITIONED,
    STREAM_PLANE0,
    STREAM_RICE,
    STREAM_VALUES,
    VAL_RAW,
    FrameError,
    FrameHeader,
    RecordHeader,
    StreamHeader,
)
from deltarl.codecs.frame_checks import check_records, check_versions, read_streams
from deltarl.codecs.manifest import RefitManifest
from deltarl.codecs.values import decode_values, from_planes
from deltarl.engine.layout import Layout, dtype_of


class DecodeScratch:
    """Output arrays for decoded positions and values, reused from one chunk to the next.

    A fresh 30 MB allocation per chunk costs more in page faults than decoding into memory
    that is already mapped. The arrays a decode returns are views into this scratch: they
    stay valid until the next decode that uses the same scratch. One per thread (the default
    is thread-local).

    Positions are 32-bit (relative to their record, whose range frame_checks.py bounds to
    2**32 elements) and coded values as wide as the element (a coded value never exceeds the
    width's mask): 6 bytes a bf16 change where int64 + uint64 took 16, written by the decode
    and read again by the scatter and by every catch-up of a kept delta. At 3.7% changed,
    98M parameters, that is 36 MB less to move per refit.
    """

    def __init__(self) -> None:
        self._positions = np.empty(0, np.uint32)
        self._zval: dict[int, np.ndarray] = {}  # itemsize -> coded values of that width
        self._used = 0

    def reset(self, total: int, itemsizes: Iterable[int]) -> None:
        """Make room for ``total`` decoded elements in all, of the element widths
        ``itemsizes`` (bytes), forgetting the previous chunk's."""
        if self._positions.shape[0] < total:
            self._positions = np.empty(total, np.uint32)
            self._zval = {}
        room = self._positions.shape[0]
        for size in itemsizes:
            if size not in self._zval:
                self._zval[size] = np.empty(room, np.dtype(f"<u{size}"))
        self._used = 0

    def take(self, n: int, itemsize: int) -> tuple[np.ndarray, np.ndarray]:
        """(positions, zval) views of n elements each, after those already taken; zval at
        ``itemsize`` bytes, one of the widths ``reset`` made room for."""
        a, b = self._used, self._used + n
        self._used = b
        return self._positions[a:b], self._zval[itemsize][a:b]


_thread_scratch = threading.local()


def _default_scratch() -> DecodeScratch:
    scratch = getattr(_thread_scratch, "scratch", None)
    if scratch is None:
        scratch = _thread_scratch.scratch = DecodeScratch()
    return scratch


@dataclass(frozen=True)
class SparseBatch:
    """The decoded sparse records of one element width, ready for one scatter call."""

    itemsize: int
    tensor_ids: np.ndarray  # int64[n]
    codings: np.ndarray  # int64[n]: each record's value coding
    starts: np.ndarray  # int64[n]: first element of each record's range within its tensor
    counts: np.ndarray  # int64[n]
    out_off: np.ndarray  # int64[n]: each record's region in positions / zval
    positions: np.ndarray  # uint32: ascending within a record, relative to its start
    zval: np.ndarray  # uintN (the element width): coded values

    def bases(self, layout: Layout) -> np.ndarray:
        """Each record's first element, as an index into the buffer viewed at this width."""
        offsets = np.array([layout.tensors[t].offset for t in self.tensor_ids], np.int64)
        return offsets // self.itemsize + self.starts


@dataclass(frozen=True)
class DecodedChunk:
    header: FrameHeader
    records: list[RecordHeader]
    sparse: list[SparseBatch]
    dense: list[tuple[RecordHeader, np.ndarray]]  # coded values (uintN) of whole ranges
    wire_bytes: int


def check_frame(data: bytes | bytearray | memoryview) -> FrameHeader:
    """The frame's header, once the frame is whole (its length is the header's) and its
    checksum holds; FrameError otherwise. Reads nothing else of the body."""
    buf = memoryview(data).cast("B")
    header = FrameHeader.parse(buf)
    if len(buf) != HEADER_SIZE + header.body_len:
        what = "truncated" if len(buf) < HEADER_SIZE + header.body_len else "oversized"
        raise FrameError(
            f"{what} frame: {len(buf)} bytes, header says {HEADER_SIZE + header.body_len}"
        )
    actual = chunk_checksum([buf[:CHECKSUM_OFFSET], buf[HEADER_SIZE:]])
    if actual != header.checksum:
        raise FrameError(
            f"chunk {header.chunk_id} of version {header.target}: checksum mismatch "
            f"(frame says {header.checksum:016x}, bytes hash to {actual:016x})"
        )
    return header


def decode_chunk(
    data: bytes | bytearray | memoryview,
    layout: Layout,
    *,
    base: int | None = None,
    target: int | None = None,
    scratch: DecodeScratch | None = None,
    reference: np.ndarray | None = None,
) -> DecodedChunk:
    """Validate and decode one chunk. ``base``/``target``, when given, must match the frame.

    ``base`` is the version the receiver holds (None: it holds nothing, so only a full
    version is acceptable). With a ``scratch``, the decoded arrays are views into it and
    last only until its next use (VersionApply decodes and applies chunk by chunk, so it
    uses this thread's scratch); without one they are freshly allocated. ``reference``: the
    base version's flat buffer, which conditioned records need to find their positions
    (their coding walks its exponents); a chunk that has some is refused without it.
    """
    try:
        return _decode_chunk(data, layout, base, target, scratch, reference)
    except MemoryError as exc:
        # Every allocation is bounded by the frame's bytes and MAX_RAW_BYTES before it is
        # made; a frame that still does not fit is refused like any other (nothing written).
        raise FrameError(f"frame refused: decoding it ran out of memory ({exc!r})") from exc


def _decode_chunk(
    data: bytes | bytearray | memoryview,
    layout: Layout,
    base: int | None,
    target: int | None,
    scratch: DecodeScratch | None,
    reference: np.ndarray | None,
) -> DecodedChunk:
    buf = memoryview(data).cast("B")
    header = check_frame(buf)
    body = buf[HEADER_SIZE:]
    check_versions(header, base, target)

    tables = header.n_records * RECORD.size + header.n_streams * STREAM.size
    if tables > len(body):
        raise FrameError(
            f"frame claims {header.n_records} records and {header.n_streams} streams, "
            f"which need {tables} bytes; the body has {len(body)}"
        )
    records = [RecordHeader.unpack_from(body, i * RECORD.size) for i in range(header.n_records)]
    off = header.n_records * RECORD.size
    streams = []
    for i in range(header.n_streams):
        kind, comp, r1, r2, raw_len, wire_len = STREAM.unpack_from(body, off + i * STREAM.size)
        if r1 or r2:
            raise FrameError(f"stream {i}: reserved fields are not zero")
        streams.append(StreamHeader(kind, comp, raw_len, wire_len))
    check_records(header, records, layout)
    raw = read_streams(header, records, streams, body[tables:])
    sparse = _decode_sparse(records, raw, layout, scratch or DecodeScratch(), reference)
    dense = _split_planes(records, raw)
    return DecodedChunk(header, records, sparse, dense, len(buf))


def owned(chunk: DecodedChunk) -> DecodedChunk:
    """A copy of a decoded chunk that owns its arrays (a decode's are views into a scratch
    that the next decode reuses): positions and coded values only, a few bytes a change."""
    return DecodedChunk(
        chunk.header,
        list(chunk.records),
        [
            dataclasses.replace(b, positions=b.positions.copy(), zval=b.zval.copy())
            for b in chunk.sparse
        ],
        [(h, coded.copy()) for h, coded in chunk.dense],
        chunk.wire_bytes,
    )


def apply_chunk(
    chunk: DecodedChunk, layout: Layout, target: np.ndarray, reference: np.ndarray | None
) -> None:
    """Write a decoded chunk into ``target``; reference-coded values read ``reference``.

    Both are flat uint8 buffers laid out by ``layout``; reference may be target (in place).
    """
    if reference is None:
        if any(r.val_coding != VAL_RAW for r in chunk.records):
            raise FrameError("the chunk is reference-coded and no reference was given")
        reference = target  # never read: every record carries raw values
    for batch in chunk.sparse:
        bits = np.dtype(f"<u{batch.itemsize}")
        bases = batch.bases(layout)
        is_float = np.array(
            [dtype_of(layout.tensors[t].dtype).kind == "float" for t in batch.tensor_ids]
        )
        # one scatter per (value coding, float or int): the kernel is specialised on both
        for coding in np.unique(batch.codings):
            for flag in (True, False):
                sel = (is_float == flag) & (batch.codings == coding)
                if not sel.any():
                    continue
                kernels.scatter_sparse(
                    target.view(bits),
                    reference.view(bits),
                    bases[sel],
                    batch.counts[sel],
                    batch.out_off[sel],
                    batch.positions,
                    batch.zval,
                    int(coding),
                    flag,
                    *kernels.deal(batch.counts[sel]),
                )
    for h, coded in chunk.dense:
        spec = layout.tensors[h.tensor_id]
        is_float = dtype_of(spec.dtype).kind == "float"
        where = slice(h.start, h.start + h.length)
        old = None if h.val_coding == VAL_RAW else layout.view(reference, h.tensor_id)[where]
        layout.view(target, h.tensor_id)[where] = decode_values(coded, old, h.val_coding, is_float)


class ChecksumMismatchError(ValueError):
    """Applied tensors that do not hash to what the manifest says. The version must not flip."""

    def __init__(self, version: int, names: list[str]) -> None:
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        super().__init__(f"version {version}: {len(names)} tensor(s) differ after apply: {shown}")
        self.version = version
        self.names = names


def verify_tensors(layout: Layout, buf: np.ndarray, manifest: RefitManifest) -> None:
    """Check every tensor of ``buf`` against the manifest's xxh3-128; raise on any mismatch."""
    if [(t.name, t.dtype, tuple(t.shape)) for t in manifest.tensors] != [
        (s.name, s.dtype, s.shape) for s in layout.tensors
    ]:
        raise ChecksumMismatchError(manifest.version, ["<manifest does not describe this layout>"])
    digests = tensor_digests(layout, buf)
    bad = [t.name for t, d in zip(manifest.tensors, digests, strict=True) if t.xxh3_128 != d]
    if not bad and model_digest(digests) != manifest.model_xxh3_128:
        bad = ["<whole-model checksum>"]
    if bad:
        raise ChecksumMismatchError(manifest.version, bad)


class VersionApply:
    """Applies the chunks of one version into a target buffer, then verifies it.

    Keeps: every chunk id is applied at most once (a repeated chunk with the same checksum is
    acknowledged and skipped; one with a different checksum is refused); chunks must be of
    this version and base; ``verify`` passes only when the manifest's chunks all arrived
    with their listed checksums and every tensor hashes right.
    """

    def __init__(
        self,
        layout: Layout,
        target: np.ndarray,
        reference: np.ndarray | None,
        *,
        base: int | None,
        version: int,
        hash_chunks: bool = False,
        keep: list[DecodedChunk] | None = None,
    ) -> None:
        """``hash_chunks``: hash each chunk applied (BLAKE2b-256), and let ``verify`` pass
        only if the manifest lists the same hash for every chunk: for sealed manifests.
        ``keep``: a list each chunk applied is appended to, decoded (``owned``), so the same
        writes can be made again without decoding (deltarl/refit/catch_up.py)."""
        self.keep = keep
        self.layout = layout
        self.target = target
        self.reference = reference
        self.base = base
        self.version = version
        self.hash_chunks = hash_chunks
        self.applied: dict[int, int] = {}  # chunk id -> checksum
        self.hashes: dict[int, str] = {}  # chunk id -> BLAKE2b-256, with hash_chunks

    def apply(self, data: bytes | bytearray | memoryview) -> bool:
        """Apply one chunk; False if it was a duplicate and changed nothing."""
        header = FrameHeader.parse(memoryview(data).cast("B"))
        seen = self.applied.get(header.chunk_id)
        if seen is not None and header.target == self.version:
            if seen != header.checksum:
                raise FrameError(
                    f"chunk {header.chunk_id} of version {self.version} arrived twice with "
                    f"different checksums ({seen:016x} then {header.checksum:016x})"
                )
            return False
        decoded = decode_chunk(
            data,
            self.layout,
            base=self.base,
            target=self.version,
            scratch=_default_scratch(),
            reference=self.reference,
        )
        try:
            apply_chunk(decoded, self.layout, self.target, self.reference)
        except MemoryError as exc:
            # Dense records may have been written: this version's apply is refused as a whole
            # (the caller fails it), so the half-written target is never activated.
            raise FrameError(
                f"chunk {header.chunk_id} of version {self.version}: ran out of memory while "
                f"writing it; the target is partly written ({exc!r})"
            ) from exc
        self.applied[header.chunk_id] = header.checksum
        if self.keep is not None:
            self.keep.append(owned(decoded))
        if self.hash_chunks:
            self.hashes[header.chunk_id] = chunk_hash(data)
        return True

    def verify(self, manifest: RefitManifest) -> None:
        if manifest.version != self.version or manifest.base_version != (
            NO_BASE if self.base is None else self.base
        ):
            raise FrameError(
                f"manifest is for {manifest.base_version}->{manifest.version}, "
                f"this apply is {self.base}->{self.version}"
            )
        missing = [c.id for c in manifest.chunks if c.id not in self.applied]
        if missing:
            raise FrameError(f"version {self.version}: chunks {missing[:10]} have not arrived")
        wrong = [c.id for c in manifest.chunks if self.applied[c.id] != c.xxh3_64]
        extra = sorted(set(self.applied) - {c.id for c in manifest.chunks})
        if wrong or extra:
            raise FrameError(
                f"version {self.version}: applied chunks disagree with the manifest "
                f"(checksum differs: {wrong[:10]}, not listed: {extra[:10]})"
            )
        if self.hash_chunks:
            forged = [c.id for c in manifest.chunks if self.hashes.get(c.id) != c.blake2b]
            if forged:
                raise FrameError(
                    f"version {self.version}: chunks {forged[:10]} do not match the manifest's "
                    f"BLAKE2b-256 (their xxh3-64 did): forged, or the manifest lists no hashes"
                )
        verify_tensors(self.layout, self.target, manifest)


def _decode_sparse(
    records: list[RecordHeader],
    raw: dict[int, np.ndarray],
    layout: Layout,
    scratch: DecodeScratch,
    reference: np.ndarray | None,
) -> list[SparseBatch]:
    """Decode every sparse record's positions and coded values, one kernel call per width
    (and one more per width for conditioned records)."""
    ids = [i for i, r in enumerate(records) if r.pos_coding != POS_DENSE]
    if not ids:
        return []
    empty = np.zeros(0, np.uint8)
    rice_src = raw.get(STREAM_RICE, empty)
    val_src = raw.get(STREAM_VALUES, empty)
    # Stream offsets run over all sparse records in record order, whatever their width.
    pos_off: dict[int, int] = {}
    val_off: dict[int, int] = {}
    cond_off: dict[int, int] = {}
    rice_at = bitmap_at = val_at = cond_at = 0
    bitmaps: dict[int, np.ndarray] = {}
    for i in ids:
        r = records[i]
        val_off[i] = val_at
        val_at += r.val_len
        if r.pos_coding == POS_CONDITIONED:
            cond_off[i] = cond_at
            cond_at += r.pos_len
        elif r.pos_coding == POS_RICE:
            pos_off[i] = rice_at
            rice_at += r.pos_len
        else:
            packed = raw[STREAM_BITMAP][bitmap_at : bitmap_at + r.pos_len]
            bitmap_at += r.pos_len
            bitmaps[i] = _bitmap_positions(i, r, packed)
            pos_off[i] = -1
    widths = sorted({records[i].itemsize for i in ids})
    scratch.reset(sum(records[i].changed for i in ids), widths)
    batches = []
    for itemsize in widths:
        group = [i for i in ids if records[i].itemsize == itemsize]
        rs = [records[i] for i in group]
        counts = np.array([r.changed for r in rs], np.int64)
        out_off = np.zeros(len(rs), np.int64)
        np.cumsum(counts[:-1], out=out_off[1:])
        positions, zval = scratch.take(int(counts.sum()), itemsize)
        for j, i in enumerate(group):
            if i in bitmaps:
                positions[out_off[j] : out_off[j] + counts[j]] = bitmaps[i]
        rice = np.array([i not in cond_off for i in group])
        sel = np.flatnonzero(rice)
        errors = np.zeros(len(sel), np.int64)
        kernels.decode_sparse(
            itemsize * 8,
            rice_src,
            np.array([pos_off[group[j]] for j in sel], np.int64),
            np.array([rs[j].pos_len for j in sel], np.int64),
            np.array([rs[j].pos_k for j in sel], np.int64),
            val_src,
            np.array([val_off[group[j]] for j in sel], np.int64),
            np.array([rs[j].val_len for j in sel], np.int64),
            np.array([rs[j].val_k for j in sel], np.int64),
            counts[sel],
            np.array([rs[j].length for j in sel], np.int64),
            out_off[sel],
            positions,
            zval,
            errors,
            *kernels.deal(counts[sel]),
        )
        _raise_first(errors, [group[j] for j in sel], [rs[j] for j in sel], layout, kernels.ERRORS)
        if not rice.all():
            cond = np.flatnonzero(~rice)
            _decode_conditioned(
                [group[j] for j in cond],
                [rs[j] for j in cond],
                out_off[cond],
                [cond_off[group[j]] for j in cond],
                raw.get(STREAM_CONDITIONED, empty),
                layout,
                reference,
                positions,
                zval,
            )
        batches.append(
            SparseBatch(
                itemsize,
                np.array([r.tensor_id for r in rs], np.int64),
                np.array([r.val_coding for r in rs], np.int64),
                np.array([r.start for r in rs], np.int64),
                counts,
                out_off,
                positions,
                zval,
            )
        )
    return batches


def _raise_first(
    errors: np.ndarray,
    ids: list[int],
    rs: list[RecordHeader],
    layout: Layout,
    messages: dict[int, str],
) -> None:
    """A FrameError naming the first record a kernel refused, if any."""
    bad = np.flatnonzero(errors)
    if bad.size:
        j = int(bad[0])
        name = layout.tensors[rs[j].tensor_id].name
        raise FrameError(f"record {ids[j]} ({name!r}): {messages[int(errors[j])]}")


def _decode_conditioned(
    ids: list[int],
    rs: list[RecordHeader],
    out_off: np.ndarray,
    src_off: list[int],
    src: np.ndarray,
    layout: Layout,
    reference: np.ndarray | None,
    positions: np.ndarray,
    zval: np.ndarray,
) -> None:
    """Decode conditioned records (one width) into their regions of positions / zval,
    walking the reference's exponents over each record's range: one call per float type."""
    if reference is None:
        raise FrameError(
            f"record {ids[0]}: coded against the reference (conditioned), and no reference "
            "was given to decode it with"
        )
    if reference.dtype != np.uint8 or reference.shape != (layout.nbytes,):
        # the kernel reads the reference unchecked: it must be the whole laid-out buffer
        raise ValueError(
            f"the reference must be flat uint8 of {layout.nbytes} bytes, "
            f"got {reference.dtype}{list(reference.shape)}"
        )
    itemsize = rs[0].itemsize
    view = reference.view(np.dtype(f"<u{itemsize}"))
    dtypes = [layout.tensors[r.tensor_id].dtype for r in rs]
    for dtype in sorted(set(dtypes)):
        sel = [j for j, d in enumerate(dtypes) if d == dtype]
        shift, mask = conditioned.exponent_field(dtype)
        errors = np.zeros(len(sel), np.int64)
        lengths = np.array([rs[j].length for j in sel], np.int64)
        changed = np.array([rs[j].changed for j in sel], np.int64)
        conditioned.decode_conditioned(
            view,
            np.array(
                [layout.tensors[rs[j].tensor_id].offset // itemsize + rs[j].start for j in sel],
                np.int64,
            ),
            lengths,
            src,
            np.array([src_off[j] for j in sel], np.int64),
            np.array([rs[j].pos_len for j in sel], np.int64),
            changed,
            out_off[sel],
            shift,
            mask,
            (1 << (8 * itemsize)) - 1,
            positions,
            zval,
            errors,
            *kernels.deal(conditioned.work(lengths, changed)),
        )
        _raise_first(
            errors, [ids[j] for j in sel], [rs[j] for j in sel], layout, conditioned.ERRORS
        )


def _bitmap_positions(i: int, r: RecordHeader, packed: np.ndarray) -> np.ndarray:
    """The positions a record's bitmap marks, ascending, checked against its header.

    One pass over the bitmap's bytes into room for the ``changed`` positions the header
    claims (which its raw value stream bounds): never a byte per element of the range.
    """
    tail = r.length % 8  # pos_len is ceil(length / 8) (check_records)
    if tail and int(packed[-1]) >> tail:
        raise FrameError(f"record {i}: bitmap padding bits are not zero")
    found = np.empty(r.changed, np.int64)
    marked = kernels.bitmap_positions(packed, found)
    if marked != r.changed:
        raise FrameError(f"record {i}: bitmap marks {marked} elements, header says {r.changed}")
    return found


def _split_planes(
    records: list[RecordHeader], raw: dict[int, np.ndarray]
) -> list[tuple[RecordHeader, np.ndarray]]:
    cursor = dict.fromkeys(raw, 0)
    out = []
    for r in records:
        if r.pos_coding != POS_DENSE:
            continue
        planes = np.empty((r.itemsize, r.length), np.uint8)
        for p in range(r.itemsize):
            kind = STREAM_PLANE0 + p
            planes[p] = raw[kind][cursor[kind] : cursor[kind] + r.length]
            cursor[kind] += r.length
        out.append((r, from_planes(planes, np.dtype(f"<u{r.itemsize}"))))
    return out
