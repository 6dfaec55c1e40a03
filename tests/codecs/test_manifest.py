"""RefitManifest: JSON round trip and every way a manifest can be malformed."""

from __future__ import annotations

import dataclasses

import orjson
import pytest

from deltarl.codecs.manifest import (
    MAX_MANIFEST_BYTES,
    ChunkEntry,
    ManifestError,
    RefitManifest,
    TensorEntry,
)


def manifest(**changes: object) -> RefitManifest:
    m = RefitManifest(
        version=12,
        base_version=11,
        kind="delta",
        time=1_700_000_000.25,
        tensors=[
            TensorEntry("w", "bfloat16", [4, 8], "rice", 3, 40, "a" * 32),
            TensorEntry("b", "int64", [], "unchanged", 0, 0, "b" * 32),
            TensorEntry("e", "float32", [3, 0], "unchanged", 0, 0, "c" * 32),
        ],
        chunks=[ChunkEntry(0, 100, 2**64 - 1), ChunkEntry(1, 64, 0)],
        model_xxh3_128="d" * 32,
    )
    return dataclasses.replace(m, **changes)  # type: ignore[arg-type]


def as_dict(m: RefitManifest) -> dict:
    return orjson.loads(m.to_json())


@pytest.mark.parametrize(
    "m",
    [
        manifest(),
        manifest(kind="full", base_version=-1, version=0),
        manifest(tensors=[], chunks=[ChunkEntry(0, 64, 5)]),
    ],
    ids=["delta", "full", "empty"],
)
def test_json_round_trip(m: RefitManifest) -> None:
    again = RefitManifest.from_json(m.to_json())
    assert again == m
    assert RefitManifest.from_json(m.to_json().decode()) == m  # str is accepted too


def test_totals() -> None:
    m = manifest()
    assert m.wire_bytes == 164
    assert m.changed == 3


def _without(key: str) -> bytes:
    d = as_dict(manifest())
    del d[key]
    return orjson.dumps(d)


def _tensor_without(key: str) -> bytes:
    d = as_dict(manifest())
    del d["tensors"][0][key]
    return orjson.dumps(d)


def _with(**changes: object) -> bytes:
    d = as_dict(manifest())
    d.update(changes)
    return orjson.dumps(d)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"", r"malformed manifest: JSONDecodeError"),
        (b"{not json", r"malformed manifest: JSONDecodeError"),
        (b"[]", r"malformed manifest: TypeError"),
        (b"null", r"malformed manifest: TypeError"),
        (_without("version"), r"malformed manifest: KeyError\('version'\)"),
        (_without("model_xxh3_128"), r"KeyError\('model_xxh3_128'\)"),
        (_tensor_without("xxh3_128"), r"KeyError\('xxh3_128'\)"),
        (_with(version="twelve"), r"malformed manifest: ValueError"),
        (_with(time=None), r"malformed manifest: TypeError"),
        (
            _with(
                tensors=[
                    {
                        "name": "w",
                        "dtype": "f",
                        "shape": ["x"],
                        "coding": "rice",
                        "changed": 0,
                        "wire_bytes": 0,
                        "xxh3_128": "",
                    }
                ]
            ),
            r"ValueError",
        ),
        (_with(chunks=[{"id": 0, "size": 1}]), r"KeyError\('xxh3_64'\)"),
        (_with(chunks=5), r"malformed manifest: TypeError"),
        (_with(kind="partial"), r"manifest kind 'partial' is neither delta nor full"),
        (_with(kind="full"), r"a full manifest cannot have base version 11"),
        (_with(base_version=-1), r"a delta manifest cannot have base version -1"),
        (
            # a version sent again numbers its chunks from elsewhere, but never with a gap
            _with(chunks=[{"id": 4, "size": 1, "xxh3_64": 0}, {"id": 6, "size": 1, "xxh3_64": 0}]),
            r"chunk ids are not consecutive",
        ),
        (
            _with(chunks=[{"id": 0, "size": 1, "xxh3_64": 0}, {"id": 0, "size": 1, "xxh3_64": 0}]),
            r"chunk ids are not consecutive and in order",
        ),
        (
            _with(chunks=[{"id": 1, "size": 1, "xxh3_64": 0}, {"id": 0, "size": 1, "xxh3_64": 0}]),
            r"chunk ids are not consecutive and in order",
        ),
    ],
    ids=lambda x: None,
)
def test_malformed_manifests_are_refused(data: bytes, match: str) -> None:
    with pytest.raises(ManifestError, match=match):
        RefitManifest.from_json(data)


# -- bounds: a manifest comes off the network ---------------------------------------------------


def _tensor(**changes: object) -> bytes:
    d = as_dict(manifest())
    d["tensors"][0].update(changes)
    return orjson.dumps(d)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b" " * (MAX_MANIFEST_BYTES + 1), r"manifest of 67108865 bytes, over the 67108864-byte"),
        (_with(version=2**63), r"manifest versions 11->9223372036854775808 out of range"),
        (_with(version=-3), r"manifest versions 11->-3 out of range"),
        (_with(base_version=-2), r"manifest versions -2->12 out of range"),
        (  # orjson reads an integer over 64 bits as a float
            _with(version=7).replace(b'"version":7', b'"version":18446744073709551617'),
            r"manifest versions 11->18446744073709551616 out of range",
        ),
        (b'{"version": 1e400}', r"malformed manifest: JSONDecodeError"),  # infinity
        (_tensor(shape=[1] * 65), r"tensor 0 \('w'\): shape \[1, .*\] out of range"),
        (_tensor(shape=[4, -1]), r"tensor 0 \('w'\): shape \[4, -1\] out of range"),
        (_tensor(changed=-1), r"tensor 0 \('w'\): changed or wire_bytes out of range"),
        (_tensor(wire_bytes=2**63), r"changed or wire_bytes out of range"),
        (_tensor(name="n" * 4097), r"tensor 0: a text field is over 4096 characters"),
        (_with(chunks=[{"id": 0, "size": -5, "xxh3_64": 0}]), r"chunk 0: size or checksum out"),
        (_with(model_xxh3_128="d" * 5000), r"the model checksum is over 4096 characters"),
    ],
    ids=lambda x: None,
)
def test_out_of_bounds_manifests_are_refused(data: bytes, match: str) -> None:
    with pytest.raises(ManifestError, match=match):
        RefitManifest.from_json(data)


def test_running_out_of_memory_while_parsing_is_a_manifest_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def loads(data: bytes | str) -> object:
        raise MemoryError

    monkeypatch.setattr(orjson, "loads", loads)
    with pytest.raises(ManifestError, match=r"parsing it ran out of room \(MemoryError\(\)\)"):
        RefitManifest.from_json(manifest().to_json())
