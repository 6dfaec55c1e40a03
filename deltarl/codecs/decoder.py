"""Decoding and applying chunks: a frame that fails any check writes nothing.

``decode_chunk`` checks the whole frame (checksum, versions, every length, count, index and
range) and decodes positions and coded values into private arrays; it never touches the
weights. ``apply_chunk`` then writes the decoded values into a target buffer.
``decode_apply_chunk`` does both, writing the Rice-coded records (nearly every change of a
delta) as they decode, once every other check of the frame has passed: a record refused then
has its writes, and those of every record before it, put back (kernels.undo_sparse). Either
way a frame that fails any check raises FrameError naming what is wrong, and the target holds
what it held before.

Values are reference-coded (docs/architecture.md: the receiver holds the reference, so a coder may
condition on it), and the new bits are written absolutely. Applying a chunk computes
``target[p] = decode(coded, reference[p])``: with the reference kept separate from the target,
applying a chunk twice writes the same bits twice and is harmless. When target and reference
are the same buffer (in place: the apply agent's target, once it holds the base, and the
catch-up), a chunk must be applied at most once; VersionApply enforces that by chunk id.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from deltarl.codecs import conditioned, kernels
from deltarl.codecs.checksum import (
    PendingDigests,
    chunk_checksum,
    chunk_hash,
    model_digest,
    tensor_digests,
)
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
    VAL_CLASSED,
    VAL_RAW,
    FrameError,
    FrameHeader,
    RecordHeader,
    StreamHeader,
    value_arithmetic,
)
from deltarl.codecs.frame_checks import (
    CONDITIONED_MODELS,
    check_records,
    check_versions,
    read_streams,
)
from deltarl.codecs.manifest import RefitManifest
from deltarl.codecs.values import decode_values, from_planes
from deltarl.codecs.written_ranges import WrittenRanges
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
        self._prior: dict[int, np.ndarray] = {}  # itemsize -> bits a writing decode replaced
        self._used = 0

    def reset(self, total: int, itemsizes: Iterable[int]) -> None:
        """Make room for ``total`` decoded elements in all, of the element widths
        ``itemsizes`` (bytes), forgetting the previous chunk's."""
        if self._positions.shape[0] < total:
            self._positions = np.empty(total, np.uint32)
            self._zval = {}
            self._prior = {}
        room = self._positions.shape[0]
        for size in itemsizes:
            if size not in self._zval:
                self._zval[size] = np.empty(room, np.dtype(f"<u{size}"))
        self._used = 0

    def take(
        self, n: int, itemsize: int, *, writing: bool = False
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(positions, zval, prior) views of n elements each, after those already taken;
        zval at ``itemsize`` bytes, one of the widths ``reset`` made room for. ``prior``, slot
        for slot with zval, receives the bits a writing decode replaces; it is made on first
        use (only a decode that writes needs it) and empty when not ``writing``."""
        a, b = self._used, self._used + n
        self._used = b
        zval = self._zval[itemsize]
        if not writing:
            return self._positions[a:b], zval[a:b], zval[:0]
        if itemsize not in self._prior:
            self._prior[itemsize] = np.empty_like(zval)
        return self._positions[a:b], zval[a:b], self._prior[itemsize][a:b]


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
    rice: np.ndarray  # bool[n]: decoded by kernels.decode_sparse (Rice or bitmap positions)

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
    (their coding walks its exponents) and records with values coded by class their
    values' Rice parameters; a chunk that has either is refused without it.
    """
    try:
        return _decode_chunk(data, layout, base, target, scratch, reference, None)
    except MemoryError as exc:
        # Every allocation is bounded by the frame's bytes and MAX_RAW_BYTES before it is
        # made; a frame that still does not fit is refused like any other (nothing written).
        raise FrameError(f"frame refused: decoding it ran out of memory ({exc!r})") from exc


def decode_apply_chunk(
    data: bytes | bytearray | memoryview,
    layout: Layout,
    into: np.ndarray,
    reference: np.ndarray | None,
    *,
    base: int | None,
    target: int | None,
    scratch: DecodeScratch | None = None,
    claim: Callable[[Sequence[RecordHeader]], None] | None = None,
) -> DecodedChunk:
    """``decode_chunk`` and then ``apply_chunk(chunk, layout, into, reference)``, with the
    Rice-coded records written as they decode (kernels.decode_sparse). A frame refused
    leaves ``into`` as it was: everything else is checked before the first write, and a
    record the kernel refuses has the chunk's writes put back. Returns the decoded chunk
    (views into ``scratch``, as decode_chunk's), which applies the same writes again
    elsewhere with ``apply_chunk``.

    ``claim``: called with the frame's records once they are checked and before anything is
    written; a FrameError it raises refuses the frame (``VersionApply``: no range written
    twice in a version).

    Only a MemoryError while writing the conditioned and dense records, after the Rice
    records are written, leaves ``into`` partly written: it raises FrameError saying so.
    """
    try:
        chunk = _decode_chunk(data, layout, base, target, scratch, reference, into, claim)
    except MemoryError as exc:
        raise FrameError(f"frame refused: decoding it ran out of memory ({exc!r})") from exc
    try:
        # without a reference every record is raw (checked in _decode_chunk): never read
        _write(chunk, layout, into, into if reference is None else reference, rice_written=True)
    except MemoryError as exc:
        raise FrameError(
            f"chunk {chunk.header.chunk_id} of version {chunk.header.target}: ran out of memory "
            f"while writing it; the target is partly written ({exc!r})"
        ) from exc
    return chunk


def _decode_chunk(
    data: bytes | bytearray | memoryview,
    layout: Layout,
    base: int | None,
    target: int | None,
    scratch: DecodeScratch | None,
    reference: np.ndarray | None,
    into: np.ndarray | None,
    claim: Callable[[Sequence[RecordHeader]], None] | None = None,
) -> DecodedChunk:
    # read-only whatever the link handed over (bytes, a bytearray, a writable array): the
    # streams are views of it, and the kernels read them (read_only)
    buf = memoryview(data).toreadonly().cast("B")
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
    if into is not None and reference is None:
        _check_raw(records)  # before anything is written, as apply_chunk checks it
    if claim is not None:
        claim(records)  # before anything is written
    raw = read_streams(header, records, streams, body[tables:])
    # The dense records first: with ``into``, _decode_sparse's last step writes.
    dense = _split_planes(records, raw)
    sparse = _decode_sparse(records, raw, layout, scratch or DecodeScratch(), reference, into)
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
        _check_raw(chunk.records)
        reference = target  # never read: every record carries raw values
    _write(chunk, layout, target, reference, rice_written=False)


def apply_chunk_flips(chunk: DecodedChunk, layout: Layout, target: np.ndarray) -> list[np.ndarray]:
    """``apply_chunk`` in place (the reference is the target), returning for each sparse batch
    the XOR of every changed element's bits before and after, at its slot in the batch's
    ``zval`` (its dtype): what undoes the sparse writes, taken in the same pass."""
    flips = [np.zeros_like(b.zval) for b in chunk.sparse]
    _write(chunk, layout, target, target, rice_written=False, flips=flips)
    return flips


def _check_raw(records: list[RecordHeader]) -> None:
    """FrameError unless every record carries raw values (needs no reference)."""
    if any(r.val_coding != VAL_RAW for r in records):
        raise FrameError("the chunk is reference-coded and no reference was given")


def _write(
    chunk: DecodedChunk,
    layout: Layout,
    target: np.ndarray,
    reference: np.ndarray,
    *,
    rice_written: bool,
    flips: list[np.ndarray] | None = None,
) -> None:
    """apply_chunk's writes; with ``rice_written``, not those of the records
    decode_apply_chunk wrote as it decoded them; with ``flips`` (one per sparse batch), the
    XOR of each element's old and new bits written there (``apply_chunk_flips``)."""
    for n, batch in enumerate(chunk.sparse):
        left = ~batch.rice if rice_written else np.ones(len(batch.rice), bool)
        if not left.any():  # the common case after decode_apply_chunk: every record written
            continue
        bits = np.dtype(f"<u{batch.itemsize}")
        bases = batch.bases(layout)
        is_float = _floats(layout, batch.tensor_ids)
        # one scatter per (value coding, float or int): the kernel is specialised on both
        for coding in np.unique(batch.codings[left]):
            for flag in (True, False):
                sel = left & (is_float == flag) & (batch.codings == coding)
                if not sel.any():
                    continue
                args = (
                    target.view(bits),
                    read_only(reference.view(bits)),
                    bases[sel],
                    batch.counts[sel],
                    batch.out_off[sel],
                    batch.positions,
                    batch.zval,
                    int(coding),
                    flag,
                )
                if flips is None:
                    kernels.scatter_sparse(*args, *kernels.deal(batch.counts[sel]))
                else:
                    kernels.scatter_sparse_flips(*args, flips[n], *kernels.deal(batch.counts[sel]))
    for h, coded in chunk.dense:
        spec = layout.tensors[h.tensor_id]
        is_float = dtype_of(spec.dtype).kind == "float"
        where = slice(h.start, h.start + h.length)
        old = None if h.val_coding == VAL_RAW else layout.view(reference, h.tensor_id)[where]
        layout.view(target, h.tensor_id)[where] = decode_values(coded, old, h.val_coding, is_float)


def read_only(a: np.ndarray) -> np.ndarray:
    """A read-only view of ``a``, for a kernel input the kernel only reads. numba compiles a
    kernel once per type of its arguments, and a read-only array is a type apart from a
    writable one: a frame received into a bytearray (the UCX link) or a writable reference
    made the apply agent of a fresh install compile a second variant of the decode kernel
    at its first such delta, which the install's warm-up had not (113 s on a busy 2-core
    host). Passed read-only always, one variant serves every link and every caller."""
    view = a.view()
    view.flags.writeable = False
    return view


def _floats(layout: Layout, tensor_ids: np.ndarray) -> np.ndarray:
    """bool per record: its tensor holds floats (whose bits are ordered before coding)."""
    return np.array([dtype_of(layout.tensors[t].dtype).kind == "float" for t in tensor_ids], bool)


class ChecksumMismatchError(ValueError):
    """Applied tensors that do not hash to what the manifest says. The version must not flip."""

    def __init__(self, version: int, names: list[str]) -> None:
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        super().__init__(f"version {version}: {len(names)} tensor(s) differ after apply: {shown}")
        self.version = version
        self.names = names


def verify_tensors(
    layout: Layout,
    buf: np.ndarray,
    manifest: RefitManifest,
    known: dict[int, str] | None = None,
) -> None:
    """Check every tensor of ``buf`` against the manifest's xxh3-128; raise on any mismatch.

    ``known``: digests of some tensors of ``buf`` already taken, by tensor index, which the
    caller vouches are of the bytes ``buf`` holds now (``VersionApply`` hashes a tensor early
    only once no later chunk writes it); the other tensors are hashed here."""
    if [(t.name, t.dtype, tuple(t.shape)) for t in manifest.tensors] != [
        (s.name, s.dtype, s.shape) for s in layout.tensors
    ]:
        raise ChecksumMismatchError(manifest.version, ["<manifest does not describe this layout>"])
    known = known or {}
    rest = [i for i in range(len(layout)) if i not in known]
    fresh = dict(zip(rest, tensor_digests(layout, buf, rest), strict=True))
    digests = [known[i] if i in known else fresh[i] for i in range(len(layout))]
    bad = [t.name for t, d in zip(manifest.tensors, digests, strict=True) if t.xxh3_128 != d]
    if not bad and model_digest(digests) != manifest.model_xxh3_128:
        bad = ["<whole-model checksum>"]
    if bad:
        raise ChecksumMismatchError(manifest.version, bad)


class VersionApply:
    """Applies the chunks of one version into a target buffer, then verifies it.

    Keeps: every chunk id is applied at most once (a repeated chunk with the same checksum is
    acknowledged and skipped; one with a different checksum is refused); no element is
    written by two chunks (a chunk whose record reaches into a range another chunk of the
    version wrote is refused before it writes: written_ranges.py), so in place each change
    is decoded against the base; chunks must be of this version and base; ``verify`` passes
    only when the manifest's chunks all arrived with their listed checksums and every
    tensor hashes right.

    Verifying as chunks land: the encoder sends records in tensor order, so once a chunk
    whose first record is for tensor t is applied, the tensors before t are (in a send that
    arrives in order) written for good; ``apply`` hashes them then, while the next chunks are
    still on the wire, and ``verify`` hashes only the rest: the tail between the last chunk
    and the flip loses most of a whole-model hash. An early digest is used only if no chunk
    wrote its tensor after it was taken (``_writes``, counted per tensor): a chunk that comes
    out of order costs a hash again, never a stale one. That needs this apply to be the
    target's only writer while it is open, which the store's write lock makes so (its
    transaction is held from the job's start to its commit or abort).

    The early hashes run on the hash pool (``PendingDigests``) while the next chunk is
    decoded or still on the wire. A chunk that writes a tensor while it is hashed (a chunk
    out of order) raises the tensor's ``_writes`` count, and the digest is kept with the
    count at the hash's start, so a torn digest is never used. Once opened, an apply ends in
    ``verify`` or ``close`` (both wait for the hashes still running, ``verify`` even when it
    refuses): only then may another write its target, or the target go away.
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
        hash_early: bool = True,
    ) -> None:
        """``hash_chunks``: hash each chunk applied (BLAKE2b-256), and let ``verify`` pass
        only if the manifest lists the same hash for every chunk: for sealed manifests.
        ``hash_early``: hash tensors as chunks land (class docstring); without it ``verify``
        hashes every tensor, which also catches bytes changed by another writer after apply.
        ``keep``: a list each chunk applied is appended to, decoded (``owned``), so the same
        writes can be made again without decoding (deltarl/refit/catch_up.py)."""
        self.keep = keep
        self.layout = layout
        self.target = target
        self.reference = reference
        self.base = base
        self.version = version
        self.hash_chunks = hash_chunks
        self.hash_early = hash_early
        self.applied: dict[int, int] = {}  # chunk id -> checksum
        self._written = WrittenRanges(layout)  # the ranges those chunks wrote
        self.hashes: dict[int, str] = {}  # chunk id -> BLAKE2b-256, with hash_chunks
        self._writes = np.zeros(len(layout), np.int64)  # per tensor: chunks that wrote it
        self._early: dict[int, tuple[int, str]] = {}  # tensor -> (its _writes then, digest)
        # Early hashes not yet collected into _early: (tensors, their _writes then, hashes).
        self._hashing: list[tuple[list[int], list[int], PendingDigests]] = []
        self._hashed_below = 0  # tensors below this one were hashed early (class docstring)
        # Where ``apply``'s own time goes, summed over its calls (the agent reports them; a
        # stage that grows while these do not is waiting, not working):
        self.calls_s = 0.0
        """Wall seconds inside ``apply`` calls."""
        self.cpu_s = 0.0
        """CPU seconds of the calling thread inside them: well under ``calls_s`` means the
        thread was kept off its CPU (another thread or process ran there)."""
        self.decode_s = 0.0
        """Of ``calls_s``: decoding and writing the chunks (``decode_apply_chunk``)."""
        self.keep_s = 0.0
        """Of ``calls_s``: copying the decoded chunks for ``keep``."""
        self.early_hash_s = 0.0
        """Of ``calls_s``: hashing tensors early, or handing them to the pool to hash."""

    def apply(self, data: bytes | bytearray | memoryview) -> bool:
        """Apply one chunk; False if it was a duplicate and changed nothing."""
        t, cpu = time.perf_counter(), time.thread_time()
        try:
            return self._apply(data)
        finally:
            self.calls_s += time.perf_counter() - t
            self.cpu_s += time.thread_time() - cpu

    def _apply(self, data: bytes | bytearray | memoryview) -> bool:
        header = FrameHeader.parse(memoryview(data).cast("B"))
        seen = self.applied.get(header.chunk_id)
        if seen is not None and header.target == self.version:
            if seen != header.checksum:
                raise FrameError(
                    f"chunk {header.chunk_id} of version {self.version} arrived twice with "
                    f"different checksums ({seen:016x} then {header.checksum:016x})"
                )
            return False
        # A MemoryError while writing leaves the target partly written (FrameError saying
        # so): this version's apply is refused as a whole (the caller fails it), so the
        # half-written target is never activated.
        t = time.perf_counter()
        decoded = decode_apply_chunk(
            data,
            self.layout,
            self.target,
            self.reference,
            base=self.base,
            target=self.version,
            scratch=_default_scratch(),
            claim=lambda records: self._written.check(header.chunk_id, self.version, records),
        )
        decoded_at = time.perf_counter()
        self.decode_s += decoded_at - t
        self.applied[header.chunk_id] = header.checksum
        self._written.add(header.chunk_id, decoded.records)
        if self.keep is not None:
            self.keep.append(owned(decoded))
            self.keep_s += time.perf_counter() - decoded_at
        if self.hash_chunks:
            self.hashes[header.chunk_id] = chunk_hash(data)
        written = sorted({r.tensor_id for r in decoded.records})
        self._writes[written] += 1
        if written and self.hash_early:
            self._hash_before(written[0])
        return True

    def _hash_before(self, tensor: int) -> None:
        """Hash the tensors from the last one hashed early up to ``tensor`` (excluded)."""
        ids = list(range(self._hashed_below, tensor))
        if not ids:
            return
        t = time.perf_counter()
        writes = [int(self._writes[i]) for i in ids]
        self._hashing.append((ids, writes, PendingDigests(self.layout, self.target, ids)))
        self._hashed_below = tensor
        self.early_hash_s += time.perf_counter() - t

    def early_digests(self) -> dict[int, str]:
        """The digests taken early that still hold: no chunk wrote their tensor since (waits
        for the early hashes still running)."""
        for ids, writes, pending in self._hashing:
            self._early.update(zip(ids, zip(writes, pending.result(), strict=True), strict=True))
        self._hashing.clear()
        return {i: d for i, (w, d) in self._early.items() if w == self._writes[i]}

    def close(self) -> None:
        """End an apply that will not be verified (refused, failed, superseded): drop the
        early hashes not begun and wait for those running, so none reads the target after
        this returns. ``verify`` does the same; calling both is harmless."""
        for _, _, pending in self._hashing:  # all dropped first: none starts while we wait
            pending.cancel()
        for _, _, pending in self._hashing:
            pending.wait()
        self._hashing.clear()

    def verify(self, manifest: RefitManifest) -> None:
        try:
            self._verify(manifest)
        finally:
            self.close()  # nothing left running on a refusal either (class docstring)

    def _verify(self, manifest: RefitManifest) -> None:
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
        verify_tensors(self.layout, self.target, manifest, self.early_digests())


def _decode_sparse(
    records: list[RecordHeader],
    raw: dict[int, np.ndarray],
    layout: Layout,
    scratch: DecodeScratch,
    reference: np.ndarray | None,
    into: np.ndarray | None,
) -> list[SparseBatch]:
    """Decode every sparse record's positions and coded values: the conditioned records (one
    kernel call per float type and model), then the rest (one call per width).

    With ``into``, the second pass also writes its records into ``into`` (reading
    ``reference``): it comes after every other check of the chunk, and when it refuses a
    record, or fails any other way, what it wrote is put back before the error goes on.
    """
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
    rice_ids: list[list[int]] = []  # per width: the records its Rice pass decodes
    priors = []
    for itemsize in widths:
        group = [i for i in ids if records[i].itemsize == itemsize]
        rs = [records[i] for i in group]
        counts = np.array([r.changed for r in rs], np.int64)
        out_off = np.zeros(len(rs), np.int64)
        np.cumsum(counts[:-1], out=out_off[1:])
        positions, zval, prior = scratch.take(int(counts.sum()), itemsize, writing=into is not None)
        for j, i in enumerate(group):
            if i in bitmaps:
                positions[out_off[j] : out_off[j] + counts[j]] = bitmaps[i]
        rice = np.array([i not in cond_off for i in group])
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
                np.array([value_arithmetic(r.val_coding) for r in rs], np.int64),
                np.array([r.start for r in rs], np.int64),
                counts,
                out_off,
                positions,
                zval,
                rice,
            )
        )
        rice_ids.append([group[j] for j in np.flatnonzero(rice)])
        priors.append(prior)
    written: list[tuple[np.ndarray, ...]] = []  # undo_sparse's arguments, a call each
    try:
        for batch, rice_group, prior in zip(batches, rice_ids, priors, strict=True):
            _decode_rice(
                rice_group,
                batch,
                records,
                pos_off,
                val_off,
                rice_src,
                val_src,
                layout,
                into,
                reference,
                prior,
                written,
            )
    except BaseException:
        # Every argument was made before its kernel wrote: undoing allocates nothing of size
        # (which a frame refused for running out of memory could not count on).
        for args in written:
            kernels.undo_sparse(*args)
        raise
    return batches


def _decode_rice(
    ids: list[int],
    batch: SparseBatch,
    records: list[RecordHeader],
    pos_off: dict[int, int],
    val_off: dict[int, int],
    rice_src: np.ndarray,
    val_src: np.ndarray,
    layout: Layout,
    into: np.ndarray | None,
    reference: np.ndarray | None,
    prior: np.ndarray,
    written: list[tuple[np.ndarray, ...]],
) -> None:
    """Decode one width's Rice-coded and bitmap records into ``batch``'s arrays and, with
    ``into``, write them; a writing call appends undo_sparse's arguments to ``written``
    before it starts."""
    sel = np.flatnonzero(batch.rice)
    if not sel.size:
        return
    rs = [records[i] for i in ids]
    bits = np.dtype(f"<u{batch.itemsize}")
    write = into is not None
    errors = np.zeros(len(sel), np.int64)
    done = np.zeros(len(sel), np.int64)
    classed = np.array([r.val_coding == VAL_CLASSED for r in rs], np.bool_)
    if classed.any():
        # the kernel reads each changed element's reference bits to find its class
        j = int(np.flatnonzero(classed)[0])
        _check_reference(ids[j], "its values are coded by class", reference, layout)
    if write or classed.any():
        bases = batch.bases(layout)[sel]
        ref = read_only((into if reference is None else reference).view(bits))
    else:
        bases = np.zeros(0, np.int64)
        ref = np.zeros(0, bits)
    target = into.view(bits) if write else np.zeros(0, bits)
    order, bounds = kernels.deal(batch.counts[sel])
    out_off = batch.out_off[sel]
    if write:
        written.append((target, bases, done, out_off, batch.positions, prior, order, bounds))
    kernels.decode_sparse(
        batch.itemsize * 8,
        rice_src,
        np.array([pos_off[i] for i in ids], np.int64),
        np.array([r.pos_len for r in rs], np.int64),
        np.array([r.pos_k for r in rs], np.int64),
        val_src,
        np.array([val_off[i] for i in ids], np.int64),
        np.array([r.val_len for r in rs], np.int64),
        np.array([r.val_k for r in rs], np.int64),
        batch.counts[sel],
        np.array([r.length for r in rs], np.int64),
        out_off,
        batch.positions,
        batch.zval,
        errors,
        order,
        bounds,
        write,
        target,
        ref,
        bases,
        classed,
        batch.codings[sel],
        _floats(layout, batch.tensor_ids[sel]) if write else np.zeros(0, bool),
        prior,
        done,
    )
    _raise_first(errors, ids, rs, layout, kernels.ERRORS)


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
    walking the reference's exponents over each record's range: one call per float type
    and model (frame_checks has refused a model not in CONDITIONED_MODELS)."""
    _check_reference(ids[0], "coded against the reference (conditioned)", reference, layout)
    assert reference is not None
    itemsize = rs[0].itemsize
    view = read_only(reference.view(np.dtype(f"<u{itemsize}")))
    kinds = [(layout.tensors[r.tensor_id].dtype, r.pos_k) for r in rs]
    for dtype, model in sorted(set(kinds)):
        sel = [j for j, kind in enumerate(kinds) if kind == (dtype, model)]
        coder = CONDITIONED_MODELS[model]
        shift, mask = conditioned.exponent_field(dtype)
        errors = np.zeros(len(sel), np.int64)
        lengths = np.array([rs[j].length for j in sel], np.int64)
        changed = np.array([rs[j].changed for j in sel], np.int64)
        coder.decode_conditioned(
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
            *kernels.deal(coder.work(lengths, changed)),
        )
        _raise_first(errors, [ids[j] for j in sel], [rs[j] for j in sel], layout, coder.ERRORS)


def _check_reference(i: int, why: str, reference: np.ndarray | None, layout: Layout) -> None:
    """FrameError if record i needs the reference to decode (``why``) and none was given;
    ValueError if the one given is not the whole laid-out buffer (kernels read it unchecked)."""
    if reference is None:
        raise FrameError(f"record {i}: {why}, and no reference was given to decode it with")
    if reference.dtype != np.uint8 or reference.shape != (layout.nbytes,):
        raise ValueError(
            f"the reference must be flat uint8 of {layout.nbytes} bytes, "
            f"got {reference.dtype}{list(reference.shape)}"
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
