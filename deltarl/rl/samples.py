"""A group of completions as one typed value and one compact binary form, validated once.

Rollout daemons build a ``Group`` from the engine's outputs, ``encode_group`` it and put the
bytes on the scheduler's samples socket (``deltarl.transport.blobs``); the scheduler decodes
them once on receipt (``decode_group`` is the validation: a blob it accepts is a group the
trainer can build a batch from), and the trainer decodes the same bytes, fetched by digest.

The form (all integers little-endian, every array raw, 8-byte fields first so the arrays of a
buffer that is 8-byte aligned are aligned too)::

    header  magic "DRLS" | format u16 | reserved u16 (0) | body_len u64 | xxh3_64(body) u64
    body    prompt_id i64 | samples u32 | group_id_len u32
            counts  u32[samples, 6]: prompt tokens, tokens, logprobs, versions, text bytes,
                                     finish_reason bytes
            token_versions i32[sum]  logprobs f32[sum]  token_ids i32[sum]
            prompt_token_ids i32[sum]
            group_id utf-8 | texts utf-8 | finish_reasons utf-8

Each array holds every sample's values one after the other, in sample order. The counts of
tokens, logprobs and versions are stored apart so that a sample whose lists disagree is
representable, and refused by ``decode_group`` with a message, like every other defect:
a bad magic, format or checksum, a truncated or padded buffer, a size over the bounds, an empty
prompt, a negative token id or version, a non-finite or positive log-probability, invalid
utf-8. Nothing else is raised for any input: ``SampleError`` is a ``ValueError``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import xxhash

MAGIC = b"DRLS"
FORMAT_VERSION = 1
MAX_GROUP_BYTES = 256 << 20
"""The largest encoded group ``decode_group`` accepts by default (the samples socket's bound)."""
MAX_SAMPLES = 65536
"""Samples a group may hold: far above any GRPO group, far below what exhausts memory."""

_HEADER = struct.Struct("<4sHHQQ")
_GROUP = struct.Struct("<qII")
_COUNTS = 6  # per sample: prompt tokens, tokens, logprobs, versions, text bytes, finish bytes
_I32 = np.dtype("<i4")
_F32 = np.dtype("<f4")
_U32 = np.dtype("<u4")

IntArray = npt.NDArray[np.int32]
FloatArray = npt.NDArray[np.float32]


class SampleError(ValueError):
    """A group that cannot be encoded, or bytes that are not a valid group; says what is wrong."""


def _array(values: object, dtype: np.dtype[Any], name: str) -> npt.NDArray[Any]:
    """``values`` as a read-only 1-D array of ``dtype`` (integers must fit it exactly)."""
    try:
        if isinstance(values, np.ndarray) and values.dtype == dtype and values.ndim == 1:
            array = values
        else:
            raw = np.asarray(values)
            if raw.size == 0:
                raw = raw.reshape(0)
            if raw.ndim != 1:
                raise SampleError(f"{name} must be a flat sequence, got shape {raw.shape}")
            if dtype.kind == "i" and raw.dtype.kind in "iub":
                info = np.iinfo(dtype)
                if raw.size and (raw.min() < info.min or raw.max() > info.max):
                    raise SampleError(f"{name} holds a value outside {dtype.name}")
            elif dtype.kind == "i" and raw.size:
                raise SampleError(f"{name} must hold integers, got {raw.dtype.name}")
            array = raw.astype(dtype)
    except (TypeError, ValueError, OverflowError) as e:
        if isinstance(e, SampleError):
            raise
        raise SampleError(f"{name}: {e}") from None
    if array.flags.writeable:
        array = array.copy()
        array.setflags(write=False)
    return array


@dataclass(frozen=True, eq=False)
class Sample:
    """One completion of a prompt. The arrays are read-only; lists are converted on creation.

    ``logprobs[k]`` is the engine's log-probability of ``token_ids[k]``, and
    ``token_versions[k]`` the weight version that produced it.
    """

    prompt_token_ids: IntArray
    token_ids: IntArray
    logprobs: FloatArray
    token_versions: IntArray
    text: str = ""
    finish_reason: str = "stop"

    def __post_init__(self) -> None:
        for name, dtype in (
            ("prompt_token_ids", _I32),
            ("token_ids", _I32),
            ("logprobs", _F32),
            ("token_versions", _I32),
        ):
            object.__setattr__(self, name, _array(getattr(self, name), dtype, name))
        for name in ("text", "finish_reason"):
            if not isinstance(getattr(self, name), str):
                raise SampleError(f"{name} must be a string, got {type(getattr(self, name))}")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sample):
            return NotImplemented
        return (
            self.text == other.text
            and self.finish_reason == other.finish_reason
            and np.array_equal(self.prompt_token_ids, other.prompt_token_ids)
            and np.array_equal(self.token_ids, other.token_ids)
            and np.array_equal(self.logprobs, other.logprobs, equal_nan=True)
            and np.array_equal(self.token_versions, other.token_versions)
        )

    __hash__ = None  # type: ignore[assignment]  # arrays: equal by value, not hashable


@dataclass(frozen=True)
class Group:
    """The completions of one issued group (``group_id``) of prompt ``prompt_id``."""

    group_id: str
    prompt_id: int
    samples: tuple[Sample, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        object.__setattr__(self, "samples", tuple(self.samples))

    @property
    def tokens(self) -> int:
        """Completion tokens of every sample."""
        return sum(len(s.token_ids) for s in self.samples)

    def oldest_version(self) -> int | None:
        """The oldest weight version that produced any token; None without tokens."""
        versions = [int(s.token_versions.min()) for s in self.samples if len(s.token_versions)]
        return min(versions) if versions else None


def encode_group(group: Group) -> bytes:
    """The binary form of ``group`` (module docstring); SampleError if it cannot be stored."""
    if len(group.samples) > MAX_SAMPLES:
        raise SampleError(f"{len(group.samples)} samples, over the bound of {MAX_SAMPLES}")
    try:
        gid = group.group_id.encode()
        texts = [s.text.encode() for s in group.samples]
        finishes = [s.finish_reason.encode() for s in group.samples]
        head = _GROUP.pack(group.prompt_id, len(group.samples), len(gid))
    except (UnicodeEncodeError, struct.error, AttributeError) as e:
        raise SampleError(f"group {group.group_id!r} cannot be encoded: {e}") from None
    counts = np.array(
        [
            (
                len(s.prompt_token_ids),
                len(s.token_ids),
                len(s.logprobs),
                len(s.token_versions),
                len(t),
                len(f),
            )
            for s, t, f in zip(group.samples, texts, finishes, strict=True)
        ],
        dtype=_U32,
    ).reshape(-1, _COUNTS)

    def joined(name: str, dtype: np.dtype[Any]) -> bytes:
        parts = [getattr(s, name) for s in group.samples]
        return np.concatenate(parts).astype(dtype, copy=False).tobytes() if parts else b""

    body = b"".join(
        (
            head,
            counts.tobytes(),
            joined("token_versions", _I32),
            joined("logprobs", _F32),
            joined("token_ids", _I32),
            joined("prompt_token_ids", _I32),
            gid,
            *texts,
            *finishes,
        )
    )
    header = _HEADER.pack(MAGIC, FORMAT_VERSION, 0, len(body), xxhash.xxh3_64_intdigest(body))
    return header + body


class _Reader:
    """Consecutive slices of a body whose total size was checked against its counts."""

    def __init__(self, body: memoryview) -> None:
        self.body = body
        self.at = 0

    def take(self, n: int) -> memoryview:
        piece = self.body[self.at : self.at + n]
        self.at += n
        return piece

    def array(self, dtype: np.dtype[Any], n: int) -> npt.NDArray[Any]:
        return np.frombuffer(self.take(n * dtype.itemsize), dtype=dtype)


def decode_group(
    data: bytes | bytearray | memoryview, *, max_bytes: int = MAX_GROUP_BYTES
) -> Group:
    """The group ``data`` encodes, validated (module docstring); SampleError if it is not one.

    The arrays of the result are read-only views of ``data`` (no copy)."""
    view = memoryview(data).cast("B")
    size = len(view)
    if size > max_bytes:
        raise SampleError(f"an encoded group of {size} bytes is over the bound of {max_bytes}")
    if size < _HEADER.size:
        raise SampleError(f"truncated: {size} bytes, a group header alone is {_HEADER.size}")
    magic, version, reserved, body_len, checksum = _HEADER.unpack_from(view)
    if magic != MAGIC:
        raise SampleError(f"not an encoded group: magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION or reserved:
        raise SampleError(f"group format {version}.{reserved}, this deltarl reads {FORMAT_VERSION}")
    if body_len != size - _HEADER.size:
        what = "truncated" if body_len > size - _HEADER.size else "trailing bytes"
        raise SampleError(
            f"{what}: the header gives a {body_len}-byte body, "
            f"{size - _HEADER.size} bytes follow it"
        )
    body = view[_HEADER.size :]
    if xxhash.xxh3_64_intdigest(body) != checksum:
        raise SampleError("checksum mismatch: the group's bytes were altered")
    return _decode_body(body)


def _decode_body(body: memoryview) -> Group:
    if len(body) < _GROUP.size:
        raise SampleError(f"truncated: a {len(body)}-byte body holds no group header")
    prompt_id, n, gid_len = _GROUP.unpack_from(body)
    if n > MAX_SAMPLES:
        raise SampleError(f"{n} samples, over the bound of {MAX_SAMPLES}")
    if prompt_id < 0:
        raise SampleError(f"prompt_id must not be negative, got {prompt_id}")
    r = _Reader(body)
    r.take(_GROUP.size)
    if len(body) < _GROUP.size + n * _COUNTS * 4:
        raise SampleError(f"truncated: no room for the counts of {n} samples")
    counts = r.array(_U32, n * _COUNTS).reshape(n, _COUNTS).astype(np.int64)
    totals = [int(x) for x in counts.sum(axis=0)] if n else [0] * _COUNTS
    expected = r.at + 4 * sum(totals[:4]) + gid_len + totals[4] + totals[5]
    if expected != len(body):
        raise SampleError(f"the counts give a {expected}-byte body, it is {len(body)} bytes")
    versions, logprobs = r.array(_I32, totals[3]), r.array(_F32, totals[2])
    tokens, prompts = r.array(_I32, totals[1]), r.array(_I32, totals[0])
    group_id = _text(r.take(gid_len), "group_id")
    offsets = np.zeros((n + 1, _COUNTS), dtype=np.int64)
    np.cumsum(counts, axis=0, out=offsets[1:])
    _check_values(offsets, tokens, prompts, versions, logprobs)
    texts, finishes = r.take(totals[4]), r.take(totals[5])
    samples = []
    for i in range(n):
        (p0, t0, l0, v0, x0, f0), (p1, t1, l1, v1, x1, f1) = offsets[i], offsets[i + 1]
        if not t1 - t0 == l1 - l0 == v1 - v0:
            raise SampleError(
                f"sample {i}: {t1 - t0} token_ids, {l1 - l0} logprobs and {v1 - v0} "
                f"token_versions; one of each per token is required"
            )
        if p1 == p0:
            raise SampleError(
                f"sample {i}: empty prompt_token_ids (the first completion "
                f"token needs a position to be predicted from)"
            )
        samples.append(
            Sample(
                prompts[p0:p1],
                tokens[t0:t1],
                logprobs[l0:l1],
                versions[v0:v1],
                _text(texts[x0:x1], f"sample {i}: text"),
                _text(finishes[f0:f1], f"sample {i}: finish_reason"),
            )
        )
    return Group(group_id, int(prompt_id), tuple(samples))


def _check_values(
    offsets: npt.NDArray[np.int64],
    tokens: IntArray,
    prompts: IntArray,
    versions: IntArray,
    logprobs: FloatArray,
) -> None:
    """Whole-group checks, one vectorised pass each; a failure names its sample."""

    def fail(column: int, flat: int, message: str) -> SampleError:
        sample = int(np.searchsorted(offsets[1:, column], flat, side="right"))
        return SampleError(f"sample {sample}: {message}")

    for column, name, values in (
        (1, "token_ids", tokens),
        (0, "prompt_token_ids", prompts),
        (3, "token_versions", versions),
    ):
        if values.size and int(values.min()) < 0:
            at = int(values.argmin())
            raise fail(column, at, f"{name} must not be negative, found {int(values[at])}")
    if logprobs.size:
        bad = ~np.isfinite(logprobs)
        if bool(bad.any()):
            raise fail(
                2,
                int(bad.argmax()),
                f"logprobs must be finite numbers, found {float(logprobs[int(bad.argmax())])}",
            )
        if float(logprobs.max()) > 0.0:
            at = int(logprobs.argmax())
            raise fail(2, at, f"logprobs must be log-probabilities (<= 0), found {logprobs[at]}")


def sample_count(data: bytes | bytearray | memoryview) -> int:
    """The samples an encoded group says it holds if its framing and checksum are sound, else
    0: what a refused group is counted as (its samples cannot be trusted, their number can)."""
    view = memoryview(data).cast("B")
    if len(view) < _HEADER.size + _GROUP.size:
        return 0
    magic, version, _, body_len, checksum = _HEADER.unpack_from(view)
    body = view[_HEADER.size :]
    if (magic, version, body_len) != (MAGIC, FORMAT_VERSION, len(body)):
        return 0
    if xxhash.xxh3_64_intdigest(body) != checksum:
        return 0
    return min(int(_GROUP.unpack_from(body)[1]), MAX_SAMPLES)


def _text(raw: memoryview, name: str) -> str:
    try:
        return bytes(raw).decode()
    except UnicodeDecodeError as e:
        raise SampleError(f"{name} is not valid utf-8: {e}") from None
