"""DeltaEncoder: from a reference and a current version to chunks and a manifest.

The work is done in waves of whole tensors of about ``chunk_bytes`` model bytes, so the
first chunk can be sent while later tensors are still being diffed:

    1) diff every item (tensor range) of the wave in parallel (kernels.diff_items);
    2) choose each tensor's position coding from its changed ratio and exact coded sizes;
    3) Rice-code the positions of sparse items in parallel; code values against the reference;
    4) pack records into chunks of at most chunk_bytes before compression, zstd the planes,
       checksum, yield.

The reference must be exactly what the receivers hold (DESIGN.md: the last transmitted
version, never the trainer's previous step if it was not delivered). The encoder does not
keep one; its caller owns the reference and advances it only once a version is delivered.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
import numpy as np

from deltarl.codecs import kernels
from deltarl.codecs.checksum import chunk_checksum, model_digest, tensor_digest
from deltarl.codecs.compression import DEFAULT_LEVEL, PlaneCompressor
from deltarl.codecs.frame import (
    HEADER_SIZE,
    KIND_DELTA,
    KIND_FULL,
    NO_BASE,
    POS_BITMAP,
    POS_DENSE,
    POS_NAMES,
    POS_RICE,
    RECORD,
    STREAM_BITMAP,
    STREAM_PLANE0,
    STREAM_RICE,
    VAL_ORDERED_DELTA,
    VAL_RAW,
    FrameHeader,
    RecordHeader,
    StreamHeader,
)
from deltarl.codecs.manifest import ChunkEntry, RefitManifest, TensorEntry
from deltarl.codecs.values import encode_values, to_planes
from deltarl.engine.layout import Layout, dtype_of

DEFAULT_CHUNK_BYTES = 64 << 20
DEFAULT_DENSE_THRESHOLD = 0.30
# Items are the unit of parallel work and of a record; 1M elements keeps both cores busy on
# a large tensor and keeps a record well under the chunk size.
DEFAULT_ITEM_ELEMS = 1 << 20


@dataclass(frozen=True)
class Chunk:
    """One encoded chunk, ready for the wire."""

    chunk_id: int
    data: bytes
    checksum: int
    n_records: int


@dataclass
class _Record:
    header: RecordHeader
    pos: bytes | memoryview  # Rice bytes or bitmap bytes (empty for dense)
    values: np.ndarray  # coded values, uintN

    @property
    def raw_bytes(self) -> int:
        return RECORD.size + len(self.pos) + self.values.nbytes


@dataclass
class _TensorTally:
    coding: str = "unchanged"
    changed: int = 0
    wire_bytes: float = 0.0
    digest: str = ""


@dataclass
class EncodeTimings:
    """Seconds spent in each stage of one version's encoding (for benchmarks and logs)."""

    diff_s: float = 0.0
    code_s: float = 0.0
    compress_s: float = 0.0
    checksum_s: float = 0.0


@dataclass
class VersionEncoding:
    """Iterate to get the chunks; ``manifest`` is set once the iteration is exhausted."""

    _chunks: Iterator[Chunk]
    manifest: RefitManifest | None = None
    timings: EncodeTimings = field(default_factory=EncodeTimings)

    def __iter__(self) -> Iterator[Chunk]:
        return self._chunks


class DeltaEncoder:
    """Encodes versions of one layout. Keeps scratch buffers between versions; one at a time."""

    def __init__(
        self,
        layout: Layout,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        dense_threshold: float = DEFAULT_DENSE_THRESHOLD,
        value_coding: int = VAL_ORDERED_DELTA,
        level: int = DEFAULT_LEVEL,
        item_elems: int = DEFAULT_ITEM_ELEMS,
    ) -> None:
        if chunk_bytes < 4096:
            raise ValueError(f"chunk_bytes must be at least 4096, got {chunk_bytes}")
        if not 0.0 <= dense_threshold <= 1.0:
            raise ValueError(f"dense_threshold must lie in [0, 1], got {dense_threshold}")
        if value_coding == VAL_RAW:
            raise ValueError("deltas are coded against the reference; raw is for full versions")
        self.layout = layout
        self.chunk_bytes = chunk_bytes
        self.dense_threshold = dense_threshold
        self.value_coding = value_coding
        self._compressor = PlaneCompressor(level)
        # An item's raw coded size is at most its model bytes plus a record header (see
        # _Record); items of at most a quarter chunk keep packing slack small.
        self.item_elems = max(64, min(item_elems, chunk_bytes // 4 // 8 // 8 * 8))
        self._scratch: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    # -- public -----------------------------------------------------------------------------

    def encode(
        self,
        cur: np.ndarray,
        ref: np.ndarray | None,
        *,
        target_version: int,
        base_version: int | None = None,
    ) -> VersionEncoding:
        """Encode ``cur`` as a delta against ``ref`` (base_version), or in full if ref is None.

        Both are flat uint8 buffers laid out by ``self.layout``; neither is modified.
        """
        self._check_buffer("current", cur)
        if ref is None:
            if base_version is not None:
                raise ValueError("a full version has no base version")
        else:
            self._check_buffer("reference", ref)
            if base_version is None or not 0 <= base_version < target_version:
                raise ValueError(
                    f"a delta needs a base version below its target {target_version}, "
                    f"got {base_version}"
                )
        enc = VersionEncoding(iter(()))
        enc._chunks = self._run(enc, cur, ref, target_version, base_version)
        return enc

    # -- stages -----------------------------------------------------------------------------

    def _run(
        self,
        enc: VersionEncoding,
        cur: np.ndarray,
        ref: np.ndarray | None,
        target: int,
        base: int | None,
    ) -> Iterator[Chunk]:
        kind = KIND_FULL if ref is None else KIND_DELTA
        tallies = [_TensorTally() for _ in self.layout.tensors]
        entries: list[ChunkEntry] = []
        pending: list[_Record] = []
        pending_bytes = 0
        next_id = 0

        def flush() -> Chunk:
            nonlocal pending, pending_bytes, next_id
            chunk = self._build_chunk(enc, kind, base, target, next_id, pending, tallies)
            entries.append(ChunkEntry(chunk.chunk_id, len(chunk.data), chunk.checksum))
            next_id += 1
            pending, pending_bytes = [], 0
            return chunk

        for wave in self._waves():
            for record in self._encode_wave(enc, wave, cur, ref, tallies):
                if pending and pending_bytes + record.raw_bytes > self.chunk_bytes:
                    yield flush()
                pending.append(record)
                pending_bytes += record.raw_bytes
        if pending or not entries:  # every version has at least one chunk: it names the version
            yield flush()

        tensors = [
            TensorEntry(
                name=spec.name,
                dtype=spec.dtype,
                shape=list(spec.shape),
                coding=t.coding,
                changed=t.changed,
                wire_bytes=round(t.wire_bytes),
                xxh3_128=t.digest,
            )
            for spec, t in zip(self.layout.tensors, tallies, strict=True)
        ]
        enc.manifest = RefitManifest(
            version=target,
            base_version=NO_BASE if base is None else base,
            kind="full" if kind == KIND_FULL else "delta",
            time=time.time(),
            tensors=tensors,
            chunks=entries,
            model_xxh3_128=model_digest(t.xxh3_128 for t in tensors),
        )

    def _waves(self) -> Iterator[list[int]]:
        """Groups of whole tensors of about chunk_bytes model bytes, in layout order."""
        wave: list[int] = []
        size = 0
        for tid, spec in enumerate(self.layout.tensors):
            wave.append(tid)
            size += spec.nbytes
            if size >= self.chunk_bytes:
                yield wave
                wave, size = [], 0
        if wave:
            yield wave

    def _encode_wave(
        self,
        enc: VersionEncoding,
        wave: list[int],
        cur: np.ndarray,
        ref: np.ndarray | None,
        tallies: list[_TensorTally],
    ) -> list[_Record]:
        t0 = time.perf_counter()
        for tid in wave:
            tallies[tid].digest = tensor_digest(self.layout.view(cur, tid))
        t1 = time.perf_counter()
        enc.timings.checksum_s += t1 - t0

        records: list[_Record] = []
        by_size: dict[int, list[int]] = {}
        for tid in wave:
            spec = self.layout.tensors[tid]
            if spec.numel:
                by_size.setdefault(spec.itemsize, []).append(tid)
        for itemsize, tids in by_size.items():
            if ref is None:
                records.extend(self._full_records(tids, cur, tallies))
            else:
                records.extend(self._delta_records(enc, itemsize, tids, cur, ref, tallies))
        enc.timings.code_s += time.perf_counter() - t1
        records.sort(key=lambda r: (r.header.tensor_id, r.header.start))
        return records

    def _items(self, tids: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(tensor id, first element in the flat view, length, start within tensor) per item."""
        owner, starts, lengths, local = [], [], [], []
        for tid in tids:
            spec = self.layout.tensors[tid]
            base = spec.offset // spec.itemsize
            for s in range(0, spec.numel, self.item_elems):
                owner.append(tid)
                starts.append(base + s)
                lengths.append(min(self.item_elems, spec.numel - s))
                local.append(s)
        return (
            np.array(owner, np.int64),
            np.array(starts, np.int64),
            np.array(lengths, np.int64),
            np.array(local, np.int64),
        )

    def _full_records(
        self, tids: list[int], cur: np.ndarray, tallies: list[_TensorTally]
    ) -> Iterator[_Record]:
        owner, starts, lengths, local = self._items(tids)
        bits = dtype_of(self.layout.tensors[tids[0]].dtype).bits
        flat = cur.view(bits)
        for tid, s, n, loc in zip(owner, starts, lengths, local, strict=True):
            t = tallies[tid]
            t.coding, t.changed = "raw", t.changed + int(n)
            yield _Record(
                RecordHeader(int(tid), POS_DENSE, VAL_RAW, bits.itemsize, 0, int(loc), int(n), int(n), 0),
                b"",
                flat[s : s + n],
            )

    def _scratch_for(self, itemsize: int, total: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Reusable output arrays of at least ``total`` entries (pages are touched lazily)."""
        have = self._scratch.get(itemsize)
        if have is None or have[0].shape[0] < total:
            bits = np.dtype(f"<u{itemsize}")
            have = (np.empty(total, np.uint32), np.empty(total, bits), np.empty(total, bits))
            self._scratch[itemsize] = have
        return have

    def _delta_records(
        self,
        enc: VersionEncoding,
        itemsize: int,
        tids: list[int],
        cur: np.ndarray,
        ref: np.ndarray,
        tallies: list[_TensorTally],
    ) -> list[_Record]:
        t0 = time.perf_counter()
        owner, starts, lengths, local = self._items(tids)
        out_off = np.zeros(len(starts), np.int64)
        np.cumsum(lengths[:-1], out=out_off[1:])
        total = int(lengths.sum())
        pos, new_vals, old_vals = self._scratch_for(itemsize, total)
        counts = np.zeros(len(starts), np.int64)
        bits = np.dtype(f"<u{itemsize}")
        kernels.diff_items(
            ref.view(bits), cur.view(bits), ref.view(np.uint64), cur.view(np.uint64),
            starts, lengths, out_off, pos, new_vals, old_vals, counts,
        )  # fmt: skip
        t1 = time.perf_counter()
        enc.timings.diff_s += t1 - t0
        enc.timings.code_s -= t1 - t0  # the caller times the whole wave; the diff is its own

        # Position coding per tensor: dense past the threshold, else the smaller of Rice and
        # a bitmap by exact size (Rice wins for scattered changes, bitmaps for long runs).
        ks = np.zeros(len(starts), np.int64)
        nbytes = np.zeros(len(starts), np.int64)
        kernels.rice_plan(pos, out_off, counts, ks, nbytes)
        coding: dict[int, int] = {}
        for tid in tids:
            mask = owner == tid
            changed = int(counts[mask].sum())
            spec = self.layout.tensors[tid]
            tallies[tid].changed = changed
            if changed == 0:
                continue
            if changed > self.dense_threshold * spec.numel:
                coding[tid] = POS_DENSE
            elif int(nbytes[mask].sum()) > int(((lengths[mask] + 7) // 8).sum()):
                coding[tid] = POS_BITMAP
            else:
                coding[tid] = POS_RICE
            tallies[tid].coding = POS_NAMES[coding[tid]]

        rice_off = np.zeros(len(starts), np.int64)
        np.cumsum(nbytes[:-1], out=rice_off[1:])
        rice = np.zeros(int(nbytes.sum()), np.uint8)
        kernels.rice_encode(pos, out_off, counts, ks, rice, rice_off)

        is_float = dtype_of(self.layout.tensors[tids[0]].dtype).kind == "float"
        cur_flat, ref_flat = cur.view(bits), ref.view(bits)
        records: list[_Record] = []
        for i in range(len(starts)):
            tid, n, c = int(owner[i]), int(lengths[i]), int(counts[i])
            pc = coding.get(tid)
            if pc is None or (c == 0 and pc != POS_DENSE):
                continue  # an absent record means an unchanged range
            s, o = int(starts[i]), int(out_off[i])
            if pc == POS_DENSE:
                new, old, posb = cur_flat[s : s + n], ref_flat[s : s + n], b""
            else:
                new, old = new_vals[o : o + c], old_vals[o : o + c]
                if pc == POS_RICE:
                    posb = rice[rice_off[i] : rice_off[i] + nbytes[i]].data
                else:
                    mask = np.zeros(n, np.bool_)
                    mask[pos[o : o + c]] = True
                    posb = np.packbits(mask, bitorder="little").tobytes()
            values = encode_values(new, old, self.value_coding, is_float)
            header = RecordHeader(
                tid, pc, self.value_coding, itemsize, int(ks[i]) if pc == POS_RICE else 0,
                int(local[i]), n, c, len(posb),
            )  # fmt: skip
            records.append(_Record(header, posb, values))
        return records

    def _build_chunk(
        self,
        enc: VersionEncoding,
        kind: int,
        base: int | None,
        target: int,
        chunk_id: int,
        records: list[_Record],
        tallies: list[_TensorTally],
    ) -> Chunk:
        t0 = time.perf_counter()
        table = b"".join(r.header.pack() for r in records)
        raw_streams: list[tuple[int, bytes | memoryview]] = []
        rice = [r.pos for r in records if r.header.pos_coding == POS_RICE]
        if rice:
            raw_streams.append((STREAM_RICE, b"".join(rice)))
        bitmaps = [r.pos for r in records if r.header.pos_coding == POS_BITMAP]
        if bitmaps:
            raw_streams.append((STREAM_BITMAP, b"".join(bitmaps)))
        planes = [to_planes(r.values) for r in records]
        widest = max((r.header.itemsize for r in records), default=0)
        for p in range(widest):
            parts = [pl[p] for pl, r in zip(planes, records, strict=True) if r.header.itemsize > p]
            raw_streams.append((STREAM_PLANE0 + p, b"".join(memoryview(x) for x in parts)))

        streams: list[tuple[StreamHeader, bytes | memoryview]] = []
        ratio: dict[int, float] = {}
        for skind, raw in raw_streams:
            comp, wire = self._compressor.compress(raw)
            streams.append((StreamHeader(skind, comp, len(raw), len(wire)), wire))
            ratio[skind] = len(wire) / max(1, len(raw))
        t1 = time.perf_counter()
        enc.timings.compress_s += t1 - t0

        stream_table = b"".join(h.pack() for h, _ in streams)
        body_parts: list[bytes | memoryview] = [table, stream_table, *(w for _, w in streams)]
        body_len = sum(len(p) for p in body_parts)
        raw_len = sum(h.raw_len for h, _ in streams)
        header = FrameHeader(
            kind, NO_BASE if base is None else base, target, chunk_id,
            len(records), len(streams), body_len, raw_len, 0,
        )  # fmt: skip
        prefix = header.pack_prefix()
        checksum = chunk_checksum([prefix, *body_parts])
        data = b"".join([prefix, checksum.to_bytes(8, "little"), *body_parts])
        assert len(data) == HEADER_SIZE + body_len

        # Attribute wire bytes to tensors: exact for Rice (stored raw), pro rata otherwise.
        overhead = (HEADER_SIZE + len(stream_table)) / max(1, len(records))
        for r in records:
            h = r.header
            pos_kind = STREAM_RICE if h.pos_coding == POS_RICE else STREAM_BITMAP
            share = RECORD.size + overhead + len(r.pos) * ratio.get(pos_kind, 1.0)
            share += sum(ratio[STREAM_PLANE0 + p] * r.values.size for p in range(h.itemsize))
            tallies[h.tensor_id].wire_bytes += share
        enc.timings.checksum_s += time.perf_counter() - t1
        return Chunk(chunk_id, data, checksum, len(records))

    def _check_buffer(self, what: str, buf: np.ndarray) -> None:
        if buf.dtype != np.uint8 or buf.ndim != 1 or buf.shape[0] != self.layout.nbytes:
            raise ValueError(
                f"the {what} buffer must be flat uint8 of {self.layout.nbytes} bytes, "
                f"got {buf.dtype}{list(buf.shape)}"
            )
        if buf.ctypes.data % 8:
            # the diff reads 64-bit words; tensor offsets are aligned relative to the buffer
            raise ValueError(f"the {what} buffer must be 8-byte aligned")

