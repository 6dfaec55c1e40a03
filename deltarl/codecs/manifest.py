"""The refit manifest: what a version is, how it was coded, and how to prove it arrived.

One manifest per version, written by the export agent after its last chunk and read by
every receiver before it flips. It is the unit of trust: a receiver activates a version
only when every chunk the manifest lists has arrived with the listed checksum and every
tensor, after apply, hashes to the listed xxh3-128.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import orjson

from deltarl.codecs.checksum import CHUNK_HASH_HEX
from deltarl.codecs.frame import KIND_NAMES, NO_BASE

# What a receiver reads before parsing (a manifest comes off the network): a 1 TB model sent in
# 1 MiB chunks lists a million chunks, about 60 MB of JSON. Parsed, a manifest costs a small
# multiple of its bytes, so bounding the bytes bounds the memory.
MAX_MANIFEST_BYTES = 64 << 20
MAX_NDIM = 64  # numpy's own limit on dimensions
MAX_TEXT = 4096  # characters of a tensor's name, dtype, coding or checksum
MAX_INT = (1 << 63) - 1  # versions, counts and sizes are i64 / u64 on the wire


class ManifestError(ValueError):
    """A manifest that is malformed or does not match the layout it claims to describe."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: list[int]
    coding: str  # "rice" | "bitmap" | "conditioned" | "dense" | "raw" | "unchanged"
    changed: int  # elements whose bits differ from the base (all of them for a full version)
    wire_bytes: int  # bytes on the wire attributed to this tensor (shared zstd streams pro rata)
    xxh3_128: str  # of the tensor's bytes after apply


@dataclass(frozen=True)
class ChunkEntry:
    id: int
    size: int  # wire bytes, header included
    xxh3_64: int
    blake2b: str = ""  # BLAKE2b-256 hex of the wire bytes where the manifest is sealed, else ""


@dataclass(frozen=True)
class RefitManifest:
    version: int
    base_version: int  # NO_BASE (-1) for a full version
    kind: str  # "delta" | "full"
    time: float  # seconds since the epoch when encoding finished
    tensors: list[TensorEntry]
    chunks: list[ChunkEntry]
    model_xxh3_128: str

    @property
    def wire_bytes(self) -> int:
        return sum(c.size for c in self.chunks)

    @property
    def changed(self) -> int:
        return sum(t.changed for t in self.tensors)

    @property
    def tensor_digests(self) -> list[str]:
        """Each tensor's xxh3-128, in layout order (what ``WriteTxn.commit`` keeps)."""
        return [t.xxh3_128 for t in self.tensors]

    def to_json(self) -> bytes:
        return orjson.dumps(asdict(self))

    @classmethod
    def from_json(cls, data: bytes | str) -> RefitManifest:
        if len(data) > MAX_MANIFEST_BYTES:
            raise ManifestError(
                f"manifest of {len(data)} bytes, over the {MAX_MANIFEST_BYTES}-byte limit"
            )
        try:
            obj: dict[str, Any] = orjson.loads(data)
            m = cls(
                version=int(obj["version"]),
                base_version=int(obj["base_version"]),
                kind=str(obj["kind"]),
                time=float(obj["time"]),
                tensors=[
                    TensorEntry(
                        name=str(t["name"]),
                        dtype=str(t["dtype"]),
                        shape=[int(d) for d in t["shape"]],
                        coding=str(t["coding"]),
                        changed=int(t["changed"]),
                        wire_bytes=int(t["wire_bytes"]),
                        xxh3_128=str(t["xxh3_128"]),
                    )
                    for t in obj["tensors"]
                ],
                chunks=[
                    ChunkEntry(
                        id=int(c["id"]),
                        size=int(c["size"]),
                        xxh3_64=int(c["xxh3_64"]),
                        blake2b=str(c.get("blake2b", "")),
                    )
                    for c in obj["chunks"]
                ],
                model_xxh3_128=str(obj["model_xxh3_128"]),
            )
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, OverflowError) as exc:
            raise ManifestError(f"malformed manifest: {exc!r}") from exc
        except (MemoryError, RecursionError) as exc:
            raise ManifestError(f"manifest refused: parsing it ran out of room ({exc!r})") from exc
        if m.kind not in KIND_NAMES.values():
            raise ManifestError(f"manifest kind {m.kind!r} is neither delta nor full")
        if (m.kind == "full") != (m.base_version == NO_BASE):
            raise ManifestError(f"a {m.kind} manifest cannot have base version {m.base_version}")
        first = m.chunks[0].id if m.chunks else 0
        if [c.id for c in m.chunks] != list(range(first, first + len(m.chunks))):
            raise ManifestError("manifest chunk ids are not consecutive and in order")
        _check_bounds(m)
        return m


def _check_bounds(m: RefitManifest) -> None:
    """Every number in range for its field, every text and shape of a sane size."""
    if not NO_BASE <= m.base_version <= MAX_INT or not 0 <= m.version <= MAX_INT:
        raise ManifestError(f"manifest versions {m.base_version}->{m.version} out of range")
    for i, t in enumerate(m.tensors):
        texts = (t.name, t.dtype, t.coding, t.xxh3_128)
        if any(len(x) > MAX_TEXT for x in texts):
            raise ManifestError(f"tensor {i}: a text field is over {MAX_TEXT} characters")
        if len(t.shape) > MAX_NDIM or not all(0 <= d <= MAX_INT for d in t.shape):
            raise ManifestError(f"tensor {i} ({t.name!r}): shape {t.shape[:MAX_NDIM]} out of range")
        if not (0 <= t.changed <= MAX_INT and 0 <= t.wire_bytes <= MAX_INT):
            raise ManifestError(f"tensor {i} ({t.name!r}): changed or wire_bytes out of range")
    for c in m.chunks:
        if not 0 <= c.id < 1 << 32:
            raise ManifestError(f"chunk id {c.id} out of range")
        if not (0 <= c.size <= MAX_INT and 0 <= c.xxh3_64 < 1 << 64):
            raise ManifestError(f"chunk {c.id}: size or checksum out of range")
        if c.blake2b and (len(c.blake2b) != CHUNK_HASH_HEX or not _is_hex(c.blake2b)):
            raise ManifestError(f"chunk {c.id}: blake2b is not {CHUNK_HASH_HEX} hex digits")
    if len(m.model_xxh3_128) > MAX_TEXT:
        raise ManifestError(f"the model checksum is over {MAX_TEXT} characters")


def _is_hex(text: str) -> bool:
    return all(ch in "0123456789abcdef" for ch in text)
