"""DeltaEncoder: from a reference and a current version to chunks and a manifest.

The work is done in waves of whole items (ranges of a tensor) of about ``chunk_bytes``
model bytes, in layout order, so the first chunk can be sent while later items are still
being diffed. A wave may end inside a tensor: a model's first and last tensors are its
largest (the embedding and the output head: 1 GB each for a 128K vocabulary at 4096 wide in
bf16), and a wave of a whole one would hold the link idle while it is diffed, at the start,
and leave the receivers a large last chunk to apply after the last byte lands, at the end.

    1) diff, code and Rice-write every item (tensor range) in parallel (kernels.encode_sparse);
    2) choose each tensor's position coding from its changed ratio and exact coded sizes;
       with ``conditioned``, code each sparse float item against the reference's exponents
       too (conditioned.py) and keep that coding for the items where it is smaller;
    3) pack the wave's records into chunks of at most chunk_bytes before compression (at
       least one chunk per wave, so sending starts after the first wave), zstd the byte
       planes of dense records, checksum (and, with ``hash_chunks``, BLAKE2b-256), yield;
    4) after the last wave, hash every tensor (the manifest's xxh3-128) and make the manifest.

The reference must be exactly what the receivers hold (docs/architecture.md, "Why it pays:
the reference": the last transmitted version, never the trainer's previous step if it was not
delivered). The encoder does not
keep one; its caller owns the reference and advances it only once a version is delivered.
With ``advance=True`` the encoder brings the caller's reference to the current version as it
goes (each wave's changed elements are written into it as the wave is coded), so the caller
needs no second model-sized buffer and no copy of the whole model: the caller must then treat
the reference as gone until the version is delivered (deltarl/refit/export.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from deltarl.codecs import conditioned as cond
from deltarl.codecs import conditioned_huffman, conditioned_rice, kernels
from deltarl.codecs.checksum import chunk_hash, model_digest, tensor_digests
from deltarl.codecs.compression import DEFAULT_LEVEL, PlaneCompressor
from deltarl.codecs.frame import (
    KIND_DELTA,
    KIND_FULL,
    MAX_DECODED_ELEMS,
    NO_BASE,
    POS_BITMAP,
    POS_CONDITIONED,
    POS_DENSE,
    POS_NAMES,
    POS_RICE,
    VAL_CLASSED,
    VAL_ORDERED_DELTA,
    VAL_RAW,
    VAL_XOR,
    RecordHeader,
)
from deltarl.codecs.manifest import ChunkEntry, RefitManifest, TensorEntry
from deltarl.codecs.packing import (
    CLASS_TABLE_BYTES,
    Chunk,
    Record,
    SparseScratch,
    TensorTally,
    pack_chunk,
)
from deltarl.engine.layout import Layout, dtype_of

DEFAULT_CHUNK_BYTES = 64 << 20
# What a changed element costs the diff kernel, in unchanged elements scanned (measured on
# two threads: ~0.4 ns to scan an element, 15-19 ns to diff and code a change).
CHANGE_COST_ELEMS = 40
DEFAULT_DENSE_THRESHOLD = 0.30
# Items are the unit of parallel work and of a record; 1M elements keeps both cores busy on
# a large tensor and keeps a record well under the chunk size.
DEFAULT_ITEM_ELEMS = 1 << 20
# The conditioned coders by name: (the frame's model id, their module). Each module has
# encode_conditioned and work with the same arguments.
CONDITIONED_CODERS = {
    "range": (cond.MODEL_EXPONENT, cond),
    "rice": (conditioned_rice.MODEL_EXPONENT_RICE, conditioned_rice),
    "huffman": (conditioned_huffman.MODEL, conditioned_huffman),
}
# The export agent's ``delta_coding`` settings: (conditioned, conditioned_coder).
DELTA_CODINGS = {
    "rice": (False, "range"),
    "conditioned": (True, "range"),
    "conditioned_rice": (True, "rice"),
    "conditioned_huffman": (True, "huffman"),
}


def delta_coding_options(delta_coding: str) -> tuple[bool, str]:
    """(``conditioned``, ``conditioned_coder``) for a ``delta_coding`` setting."""
    try:
        return DELTA_CODINGS[delta_coding]
    except KeyError:
        raise ValueError(
            f"unknown delta_coding {delta_coding!r}; known: {sorted(DELTA_CODINGS)}"
        ) from None


Piece = tuple[int, int, int]
"""Part of a tensor a wave encodes: (tensor id, first element, end element), whole items."""


@dataclass
class EncodeTimings:
    """Seconds spent in each stage of one version's encoding (for benchmarks and logs)."""

    checksum_s: float = 0.0
    diff_code_s: float = 0.0
    pack_s: float = 0.0


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
        hash_chunks: bool = False,
        conditioned: bool = False,
        conditioned_coder: str = "range",
        value_classes: bool = True,
    ) -> None:
        """``hash_chunks``: list a BLAKE2b-256 hash of each chunk in the manifest (needed to
        seal it, deltarl/codecs/manifest_seal.py); it costs a hash of the wire bytes.
        ``conditioned``: also code sparse float ranges against the reference's exponents
        and send that where it is smaller (measured: 0.63-0.70x the bytes on simulated AdamW
        deltas, 0.23-0.43x on real GRPO deltas, for a pass over every element of a changed
        range on both sides and a range coder: several times slower).
        ``conditioned_coder``: how conditioned ranges are coded: ``range``, an adaptive range
        coder with a model per exponent (conditioned.py, the smallest), or ``rice``, Rice
        codes with parameters per class of exponents (conditioned_rice.py: on simulated
        AdamW deltas 0.80x the default's bytes against the range coder's 0.68-0.73x,
        encoding 1.4-1.5x and decoding 1.7-2x as fast as it), or ``huffman``, model 2 with
        a value code per exponent, Rice or Huffman, and dense exponents coded by their
        unchanged members (conditioned_huffman.py: about the range coder's bytes at the
        Rice coder's apply speed).
        ``value_classes``: Rice code the ordered-delta values of 16- and 32-bit floats with a
        parameter per class of the reference element (its exponent) where that is smaller
        (VAL_CLASSED); receivers older than it refuse such records by their coding's number,
        so a fleet upgrading its receivers last turns it off until they are done."""
        if chunk_bytes < 4096:
            raise ValueError(f"chunk_bytes must be at least 4096, got {chunk_bytes}")
        if not 0.0 <= dense_threshold <= 1.0:
            raise ValueError(f"dense_threshold must lie in [0, 1], got {dense_threshold}")
        if value_coding not in (VAL_ORDERED_DELTA, VAL_XOR):
            raise ValueError("deltas are coded against the reference (ordered-delta or xor)")
        if conditioned and value_coding != VAL_ORDERED_DELTA:
            raise ValueError("conditioned coding codes ordered-delta values only")
        if conditioned_coder not in CONDITIONED_CODERS:
            raise ValueError(
                f"conditioned_coder must be one of {sorted(CONDITIONED_CODERS)}, "
                f"got {conditioned_coder!r}"
            )
        self.conditioned = conditioned
        self.conditioned_coder = conditioned_coder
        self.value_classes = value_classes
        self.layout = layout
        self.chunk_bytes = chunk_bytes
        self.dense_threshold = dense_threshold
        self.value_coding = value_coding
        self.hash_chunks = hash_chunks
        self._compressor = PlaneCompressor(level)
        # A record's raw size is at most ~2.3x its model bytes (worst-case Rice); items of at
        # most a quarter chunk of 8-byte elements keep every record well inside one chunk.
        # Multiples of 64 elements keep item starts word-aligned for the kernels.
        self.item_elems = max(
            64, min(item_elems, chunk_bytes // 4 // 8, MAX_DECODED_ELEMS) // 64 * 64
        )
        self._scratch: dict[int, SparseScratch] = {}
        # Changed elements per item (tensor id, start) in the last version encoded: the
        # next version's best guess of where the work lies, for dealing items to threads.
        self._changed_before: dict[tuple[int, int], int] = {}

    # -- public -----------------------------------------------------------------------------

    def encode(
        self,
        cur: np.ndarray,
        ref: np.ndarray | None,
        *,
        target_version: int,
        base_version: int | None = None,
        first_chunk_id: int = 0,
        advance: bool = False,
        tensor_digests: Sequence[str] | None = None,
    ) -> VersionEncoding:
        """Encode ``cur`` as a delta against ``ref`` (base_version), or in full if ref is None.

        Both are flat uint8 buffers laid out by ``self.layout``; ``cur`` is never modified,
        ``ref`` only with ``advance``. Chunk ids run from ``first_chunk_id`` up: a version
        sent again starts elsewhere, so links that drop a chunk they delivered before (same
        version, id and bytes) deliver it.

        ``advance`` (a delta only): write each wave's changed elements into ``ref`` as the
        wave is coded, so that ``ref`` holds exactly ``cur``'s bytes (every tensor's) when the
        iteration is exhausted: a sparse write of what changed instead of a copy of the
        model. Stopped early, ``ref`` is part one version, part the other: unusable.

        ``tensor_digests``: the xxh3-128 of each of ``cur``'s tensors, in layout order, as the
        trainer committed them with the version (``Snapshot.tensor_digests``); the manifest
        lists them instead of the encoder's own hash of ``cur`` (a pass over the model on the
        refit's path). They are not checked here: every receiver checks its bytes against
        them, so a ``cur`` that is not what the trainer hashed is refused there, not sent on
        as the trainer's.
        """
        if not 0 <= first_chunk_id < 1 << 32:
            raise ValueError(f"first_chunk_id must lie in [0, 2**32), got {first_chunk_id}")
        self._check_buffer("current", cur)
        if ref is None:
            if base_version is not None:
                raise ValueError("a full version has no base version")
            if advance:
                raise ValueError("advance needs a reference (a full version has none)")
        else:
            self._check_buffer("reference", ref)
            if advance and not ref.flags.writeable:
                raise ValueError("advance writes into the reference: it must be writable")
            if base_version is None or not 0 <= base_version < target_version:
                raise ValueError(
                    f"a delta needs a base version below its target {target_version}, "
                    f"got {base_version}"
                )
        if tensor_digests is not None and len(tensor_digests) != len(self.layout):
            raise ValueError(
                f"{len(tensor_digests)} tensor digests for a layout of {len(self.layout)} tensors"
            )
        enc = VersionEncoding(iter(()))
        enc._chunks = self._run(
            enc,
            cur,
            ref,
            target_version,
            base_version,
            first_chunk_id,
            advance=advance,
            digests=None if tensor_digests is None else list(tensor_digests),
        )
        return enc

    # -- stages -----------------------------------------------------------------------------

    def _run(
        self,
        enc: VersionEncoding,
        cur: np.ndarray,
        ref: np.ndarray | None,
        target: int,
        base: int | None,
        first_id: int = 0,
        *,
        advance: bool = False,
        digests: list[str] | None = None,
    ) -> Iterator[Chunk]:
        kind = KIND_FULL if ref is None else KIND_DELTA
        tallies = [TensorTally() for _ in self.layout.tensors]
        entries: list[ChunkEntry] = []
        pending: list[Record] = []
        pending_bytes = 0
        pending_sparse = 0  # sparse elements: a chunk decodes at most MAX_DECODED_ELEMS

        def flush() -> Chunk:
            nonlocal pending, pending_bytes, pending_sparse
            t0 = time.perf_counter()
            chunk_id = first_id + len(entries)
            chunk = pack_chunk(self._compressor, kind, base, target, chunk_id, pending, tallies)
            strong = chunk_hash(chunk.data) if self.hash_chunks else ""
            enc.timings.pack_s += time.perf_counter() - t0
            entries.append(ChunkEntry(chunk.chunk_id, len(chunk.data), chunk.checksum, strong))
            pending, pending_bytes, pending_sparse = [], 0, 0
            return chunk

        for wave in self._waves():
            for record in self._encode_wave(enc, wave, cur, ref, tallies, advance=advance):
                sparse = 0 if record.header.pos_coding == POS_DENSE else record.header.changed
                if pending and (
                    pending_bytes + record.raw_bytes > self.chunk_bytes
                    or pending_sparse + sparse > MAX_DECODED_ELEMS
                ):
                    yield flush()
                pending.append(record)
                pending_bytes += record.raw_bytes
                pending_sparse += sparse
            # A chunk per wave at least: a delta is far smaller than chunk_bytes, and holding
            # its records back until the last wave would serialise encoding and sending.
            if pending:
                yield flush()
        if not entries:  # every version has at least one chunk: it names the version
            yield flush()
        # Every tensor's digest, the trainer's if it gave them; else in one call, once every
        # chunk has left: the hash (a pass over the model, 14 ms for 98M parameters on two
        # threads) holds no chunk back, and runs while the link drains the last chunks and
        # the receivers apply them. Only the manifest waits for it.
        t0 = time.perf_counter()
        if digests is None:
            digests = tensor_digests(self.layout, cur)
        for tally, digest in zip(tallies, digests, strict=True):
            tally.digest = digest
        enc.timings.checksum_s += time.perf_counter() - t0

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

    def _waves(self) -> Iterator[list[Piece]]:
        """Groups of whole items, in layout order: a wave closes once it holds
        ``chunk_bytes`` of model bytes, so it holds less than that plus one item. A tensor may
        span waves; each wave holds at most one piece of it.

        Tried and not kept (bench refit, 98M parameters, two cores): waves ramping up from an
        eighth of ``chunk_bytes`` at the start and down to it at the end. At 100 Mbit it did
        no better than these; at 1 Gbit, where the encoder and the apply agent share the
        cores, its medians were 222-240 ms against 201-206. Again with each agent on a core
        of its own, the first and last waves a quarter of ``chunk_bytes`` (three runs by
        turns at 1 Gbit, 8 refits each): each refit 1.06-1.25x its slowest stage against
        1.10-1.24x, medians 79-89 ms against 80-107: no better; the ends are not what
        the refits lose."""
        wave: list[Piece] = []
        size = 0
        for tid, spec in enumerate(self.layout.tensors):
            lo = 0
            for s in range(0, spec.numel, self.item_elems):
                end = min(spec.numel, s + self.item_elems)
                size += (end - s) * spec.itemsize
                if size >= self.chunk_bytes:
                    wave.append((tid, lo, end))
                    yield wave
                    wave, size, lo = [], 0, end
            if lo < spec.numel or spec.numel == 0:
                wave.append((tid, lo, spec.numel))
        if wave:
            yield wave

    def _encode_wave(
        self,
        enc: VersionEncoding,
        wave: list[Piece],
        cur: np.ndarray,
        ref: np.ndarray | None,
        tallies: list[TensorTally],
        *,
        advance: bool = False,
    ) -> list[Record]:
        t1 = time.perf_counter()
        records: list[Record] = []
        # One kernel call per (width, float or int): the ordered delta differs between them.
        by_size: dict[tuple[int, str], list[Piece]] = {}
        for piece in wave:
            spec = self.layout.tensors[piece[0]]
            if piece[2] > piece[1]:
                by_size.setdefault((spec.itemsize, dtype_of(spec.dtype).kind), []).append(piece)
        for (itemsize, _), pieces in by_size.items():
            if ref is None:
                records.extend(self._full_records(pieces, cur, tallies))
            else:
                records.extend(
                    self._delta_records(itemsize, pieces, cur, ref, tallies, advance=advance)
                )
        records.sort(key=lambda r: (r.header.tensor_id, r.header.start))
        enc.timings.diff_code_s += time.perf_counter() - t1
        return records

    def _items(self, pieces: list[Piece]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(tensor id, first element in the flat view, length, start within tensor) per item."""
        owner, starts, lengths, local = [], [], [], []
        for tid, lo, hi in pieces:
            spec = self.layout.tensors[tid]
            base = spec.offset // spec.itemsize
            for s in range(lo, hi, self.item_elems):
                owner.append(tid)
                starts.append(base + s)
                lengths.append(min(self.item_elems, hi - s))
                local.append(s)
        return (
            np.array(owner, np.int64),
            np.array(starts, np.int64),
            np.array(lengths, np.int64),
            np.array(local, np.int64),
        )

    def _full_records(
        self, pieces: list[Piece], cur: np.ndarray, tallies: list[TensorTally]
    ) -> Iterator[Record]:
        owner, starts, lengths, local = self._items(pieces)
        bits = dtype_of(self.layout.tensors[pieces[0][0]].dtype).bits
        flat = cur.view(bits)
        for tid, s, n, loc in zip(owner, starts, lengths, local, strict=True):
            t = tallies[tid]
            t.coding, t.changed = "raw", t.changed + int(n)
            header = RecordHeader(
                int(tid), POS_DENSE, VAL_RAW, bits.itemsize, 0, 0, int(loc), int(n), int(n), 0, 0
            )
            yield Record(header, planes=flat[s : s + n])

    def _scratch_for(self, itemsize: int, elems: int, items: int) -> SparseScratch:
        have = self._scratch.get(itemsize)
        if have is None or have.pos.shape[0] < elems or have.items < items:
            have = SparseScratch.sized(elems, itemsize, items)
            self._scratch[itemsize] = have
        return have

    def _delta_records(
        self,
        itemsize: int,
        pieces: list[Piece],
        cur: np.ndarray,
        ref: np.ndarray,
        tallies: list[TensorTally],
        *,
        advance: bool = False,
    ) -> list[Record]:
        owner, starts, lengths, local = self._items(pieces)
        n_items = len(starts)
        out_off = np.zeros(n_items, np.int64)
        np.cumsum(lengths[:-1], out=out_off[1:])
        sc = self._scratch_for(itemsize, int(lengths.sum()), n_items)
        pos_cap = out_off * 8
        val_cap = out_off * 2 * itemsize + np.arange(n_items) * CLASS_TABLE_BYTES
        counts, pos_k, val_k, pos_len, val_len = (np.zeros(n_items, np.int64) for _ in range(5))
        classed = np.zeros(n_items, np.bool_)
        bits = np.dtype(f"<u{itemsize}")
        # every tensor of one call has the same kind (_encode_wave groups by width and kind)
        is_float = dtype_of(self.layout.tensors[pieces[0][0]].dtype).kind == "float"
        by_class = (
            self.value_classes
            and self.value_coding == VAL_ORDERED_DELTA
            and is_float
            and itemsize in (2, 4)
        )
        keys = list(zip(owner.tolist(), local.tolist(), strict=True))
        before = np.array([self._changed_before.get(k, 0) for k in keys], np.int64)
        order, bounds = kernels.deal(lengths + CHANGE_COST_ELEMS * before)
        # Advancing the reference inside the diff, where each changed element was just read,
        # unless the conditioned coder still reads the reference after it (then a pass of
        # its own, below). Dense records take their values from the kernel's output, not
        # from the reference, so they do not mind.
        fused = advance and not self.conditioned
        ref_flat = ref.view(bits)
        kernels.encode_sparse(
            ref_flat,
            cur.view(bits),
            starts,
            lengths,
            out_off,
            sc.pos,
            sc.zval,
            self.value_coding,
            is_float,
            sc.pos_dst,
            pos_cap,
            sc.val_dst,
            val_cap,
            ref_flat if fused else None,  # None: a kernel compiled without the writes
            # Tallied by class for every 16- and 32-bit kind, used only where by_class: one
            # kernel per width, not two (each costs about a minute of compiling per variant)
            sc.cls if itemsize in (2, 4) else None,
            by_class,
            counts,
            pos_k,
            val_k,
            pos_len,
            val_len,
            classed,
            order,
            bounds,
        )
        self._changed_before.update(zip(keys, counts.tolist(), strict=True))

        # Position coding per piece of a tensor (a wave holds at most one piece of each):
        # dense past the threshold, else the smaller of Rice and a bitmap by exact size (Rice
        # wins for scattered changes, bitmaps for long runs). A tensor in several waves is
        # named in the manifest by the coding of its first piece that changed, or
        # "conditioned" if any of its items was coded against the reference (below).
        coding: dict[int, int] = {}
        for tid, lo, hi in pieces:
            mask = owner == tid
            changed = int(counts[mask].sum())
            tallies[tid].changed += changed
            if changed == 0:
                continue
            if changed > self.dense_threshold * (hi - lo):
                coding[tid] = POS_DENSE
            elif int(pos_len[mask].sum()) > int(((lengths[mask] + 7) // 8).sum()):
                coding[tid] = POS_BITMAP
            else:
                coding[tid] = POS_RICE
            if tallies[tid].coding == "unchanged":
                tallies[tid].coding = POS_NAMES[coding[tid]]

        coded = (
            self._conditioned_streams(
                owner, starts, lengths, out_off, (counts, pos_len, val_len), coding, sc, ref
            )
            if self.conditioned
            else {}
        )
        records: list[Record] = []
        for i in range(n_items):
            tid, n, c = int(owner[i]), int(lengths[i]), int(counts[i])
            pc = coding.get(tid)
            if pc is None or (c == 0 and pc != POS_DENSE):
                continue  # an absent record means an unchanged range
            o = int(out_off[i])
            head = {
                "tensor_id": tid,
                "pos_coding": pc,
                "val_coding": self.value_coding,
                "itemsize": itemsize,
                "start": int(local[i]),
                "length": n,
                "changed": c,
            }
            if pc == POS_DENSE:
                # The coded value of every element: the kernel's where it changed, zero (the
                # code of "unchanged", in both codings) elsewhere.
                values = np.zeros(n, bits)
                values[sc.pos[o : o + c]] = sc.zval[o : o + c]
                header = RecordHeader(**head, pos_k=0, val_k=0, pos_len=0, val_len=0)
                records.append(Record(header, planes=values))
                continue
            if i in coded:
                stream = coded[i]
                header = RecordHeader(
                    **{**head, "pos_coding": POS_CONDITIONED},
                    pos_k=CONDITIONED_CODERS[self.conditioned_coder][0],
                    val_k=0,
                    pos_len=len(stream),
                    val_len=0,
                )
                records.append(Record(header, pos=stream))
                tallies[tid].coding = POS_NAMES[POS_CONDITIONED]
                continue
            # Copies, not views: the next wave reuses the scratch while these records wait
            # in a chunk that is not yet full.
            vals = sc.val_dst[val_cap[i] : val_cap[i] + val_len[i]].tobytes()
            if pc == POS_RICE:
                posb = sc.pos_dst[pos_cap[i] : pos_cap[i] + pos_len[i]].tobytes()
                k = int(pos_k[i])
            else:
                mask = np.zeros(n, np.bool_)
                mask[sc.pos[o : o + c]] = True
                posb, k = np.packbits(mask, bitorder="little").tobytes(), 0
            if classed[i]:
                head["val_coding"] = VAL_CLASSED
            header = RecordHeader(
                **head, pos_k=k, val_k=int(val_k[i]), pos_len=len(posb), val_len=len(vals)
            )
            records.append(Record(header, pos=posb, vals=vals))
        if advance and not fused:
            # After the conditioned streams, which read the reference: the decoder's own
            # scatter, each recorded change's code decoded against the reference in place.
            # The kernel recorded every element whose bits differ, whatever coding its record
            # got, so this leaves the items' reference bytes equal to cur's.
            kernels.scatter_sparse(
                ref_flat,
                ref_flat,
                starts,
                counts,
                out_off,
                sc.pos,
                sc.zval,
                self.value_coding,
                is_float,
                order,
                bounds,
            )
        return records

    def _conditioned_streams(
        self,
        owner: np.ndarray,
        starts: np.ndarray,
        lengths: np.ndarray,
        out_off: np.ndarray,
        sizes_today: tuple[np.ndarray, np.ndarray, np.ndarray],
        coding: dict[int, int],
        sc: SparseScratch,
        ref: np.ndarray,
    ) -> dict[int, bytes]:
        """Item index -> its conditioned stream, for the sparse float items where that
        stream is smaller than the Rice or bitmap coding already chosen (the per-range
        fallback: an item keeps today's coding unless the conditioned one wins)."""
        counts, pos_len, val_len = sizes_today
        # Today's bytes per item (streams only): Rice positions or a bitmap, plus values.
        bitmap = np.array([coding.get(int(t)) == POS_BITMAP for t in owner])
        today = val_len + np.where(bitmap, (lengths + 7) // 8, pos_len)
        out: dict[int, bytes] = {}
        layout = self.layout
        for dtype in cond.CODED_DTYPES:
            sel = np.array(
                [
                    i
                    for i in range(len(starts))
                    if layout.tensors[int(owner[i])].dtype == dtype
                    and coding.get(int(owner[i])) in (POS_RICE, POS_BITMAP)
                    and counts[i] > 0
                ],
                np.int64,
            )
            if not sel.size:
                continue
            itemsize = layout.tensors[int(owner[sel[0]])].itemsize
            # Room for one byte less than today's coding of the item: a stream that needs
            # more is not kept (the kernel stops writing at the room's end).
            cap = np.maximum(today[sel] - 1, 0)
            cap_off = np.zeros(sel.size, np.int64)
            np.cumsum(cap[:-1], out=cap_off[1:])
            dst = np.empty(int(cap.sum()) + 1, np.uint8)
            sizes = np.zeros(sel.size, np.int64)
            shift, mask = cond.exponent_field(dtype)
            coder = CONDITIONED_CODERS[self.conditioned_coder][1]
            coder.encode_conditioned(
                ref.view(np.dtype(f"<u{itemsize}")),
                starts[sel],
                lengths[sel],
                out_off[sel],
                counts[sel],
                sc.pos,
                sc.zval,
                shift,
                mask,
                dst,
                cap_off,
                cap,
                sizes,
                *kernels.deal(coder.work(lengths[sel], counts[sel])),
            )
            for j, i in enumerate(sel):
                if sizes[j] <= cap[j]:
                    out[int(i)] = dst[cap_off[j] : cap_off[j] + sizes[j]].tobytes()
        return out

    def _check_buffer(self, what: str, buf: np.ndarray) -> None:
        if buf.dtype != np.uint8 or buf.ndim != 1 or buf.shape[0] != self.layout.nbytes:
            raise ValueError(
                f"the {what} buffer must be flat uint8 of {self.layout.nbytes} bytes, "
                f"got {buf.dtype}{list(buf.shape)}"
            )
        if buf.ctypes.data % 8:
            # the diff reads 64-bit words; tensor offsets are aligned relative to the buffer
            raise ValueError(f"the {what} buffer must be 8-byte aligned")
