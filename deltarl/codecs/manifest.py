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

from deltarl.codecs.frame import KIND_NAMES, NO_BASE


class ManifestError(ValueError):
    """A manifest that is malformed or does not match the layout it claims to describe."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: list[int]
    coding: str  # "rice" | "bitmap" | "dense" | "raw" | "unchanged"
    changed: int  # elements whose bits differ from the base (all of them for a full version)
    wire_bytes: int  # bytes on the wire attributed to this tensor (shared zstd streams pro rata)
    xxh3_128: str  # of the tensor's bytes after apply


@dataclass(frozen=True)
class ChunkEntry:
    id: int
    size: int  # wire bytes, header included
    xxh3_64: int


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

    def to_json(self) -> bytes:
        return orjson.dumps(asdict(self))

    @classmethod
    def from_json(cls, data: bytes | str) -> RefitManifest:
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
                    ChunkEntry(id=int(c["id"]), size=int(c["size"]), xxh3_64=int(c["xxh3_64"]))
                    for c in obj["chunks"]
                ],
                model_xxh3_128=str(obj["model_xxh3_128"]),
            )
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ManifestError(f"malformed manifest: {exc!r}") from exc
        if m.kind not in KIND_NAMES.values():
            raise ManifestError(f"manifest kind {m.kind!r} is neither delta nor full")
        if (m.kind == "full") != (m.base_version == NO_BASE):
            raise ManifestError(f"a {m.kind} manifest cannot have base version {m.base_version}")
        first = m.chunks[0].id if m.chunks else 0
        if [c.id for c in m.chunks] != list(range(first, first + len(m.chunks))):
            raise ManifestError("manifest chunk ids are not consecutive and in order")
        return m
