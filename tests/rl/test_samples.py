"""The samples' binary form: round trips, and every defect refused as SampleError, never else."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltarl.rl.samples import (
    MAGIC,
    Group,
    Sample,
    SampleError,
    decode_group,
    encode_group,
    sample_count,
)

HEADER = 24


@st.composite
def samples(draw: st.DrawFn) -> Sample:
    n = draw(st.integers(0, 12))
    return Sample(
        prompt_token_ids=draw(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=6)),
        token_ids=draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n)),
        logprobs=draw(
            st.lists(st.floats(-1e6, 0.0, allow_nan=False, width=32), min_size=n, max_size=n)
        ),
        token_versions=draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n)),
        text=draw(st.text(max_size=20)),
        finish_reason=draw(st.sampled_from(["stop", "length", "abort", ""])),
    )


@st.composite
def groups(draw: st.DrawFn) -> Group:
    return Group(
        group_id=draw(st.text(max_size=12)),
        prompt_id=draw(st.integers(0, 2**63 - 1)),
        samples=tuple(draw(st.lists(samples(), max_size=5))),
    )


def _group(**overrides: object) -> Group:
    fields: dict[str, object] = {
        "prompt_token_ids": [1, 2, 3],
        "token_ids": [4, 5],
        "logprobs": [-0.5, -1.5],
        "token_versions": [3, 4],
        "text": "héllo",
        "finish_reason": "length",
    }
    fields.update(overrides)
    return Group("7.0", 7, (Sample(**fields), Sample([9], [], [], [])))  # type: ignore[arg-type]


@given(groups())
def test_round_trip(group: Group) -> None:
    data = encode_group(group)
    again = decode_group(data)
    assert again == group
    assert encode_group(again) == data
    for s in again.samples:
        assert s.token_ids.dtype == np.int32
        assert s.logprobs.dtype == np.float32
        assert not s.token_ids.flags.writeable


def test_compact_size_and_accessors() -> None:
    tokens = 1000
    g = Group(
        "1.0",
        1,
        tuple(Sample([1] * 10, [2] * tokens, [-1.0] * tokens, [5] * tokens) for _ in range(4)),
    )
    data = encode_group(g)
    # 12 bytes a completion token, 4 a prompt token; the rest is counts and headers.
    assert len(data) < 4 * (12 * tokens + 4 * 10) + 200
    assert g.tokens == 4 * tokens
    assert g.oldest_version() == 5
    assert Group("x", 0, ()).oldest_version() is None


@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(groups(), st.data())
def test_any_truncation_raises_sample_error(group: Group, data: st.DataObject) -> None:
    raw = encode_group(group)
    cut = data.draw(st.integers(0, len(raw) - 1))
    with pytest.raises(SampleError):
        decode_group(raw[:cut])


@settings(max_examples=200)
@given(groups(), st.data())
def test_any_corruption_raises_sample_error(group: Group, data: st.DataObject) -> None:
    raw = bytearray(encode_group(group))
    at = data.draw(st.integers(0, len(raw) - 1))
    raw[at] ^= data.draw(st.integers(1, 255))
    with pytest.raises(SampleError):
        decode_group(bytes(raw))


def _resealed(body: bytes) -> bytes:
    """A header with a valid checksum around ``body``: what a buggy (not a noisy) peer sends."""
    return struct.pack("<4sHHQQ", MAGIC, 1, 0, len(body), xxhash.xxh3_64_intdigest(body)) + body


@settings(max_examples=200)
@given(groups(), st.data())
def test_corrupt_bodies_with_valid_checksums_raise_sample_error(
    group: Group, data: st.DataObject
) -> None:
    body = bytearray(encode_group(group)[HEADER:])
    if not body:
        return
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(body) - 1))
        body[at] = data.draw(st.integers(0, 255))
    try:
        decoded = decode_group(_resealed(bytes(body)))
    except SampleError:
        return
    # Some edits still make a valid group (a token id changed): it must then re-encode exactly.
    assert decode_group(encode_group(decoded)) == decoded


@given(st.binary(max_size=200))
def test_garbage_raises_sample_error(raw: bytes) -> None:
    with pytest.raises(SampleError):
        decode_group(raw)
    with pytest.raises(SampleError):
        decode_group(_resealed(raw))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"logprobs": [-0.5]}, "2 token_ids, 1 logprobs and 2 token_versions"),
        ({"token_versions": [1, 2, 3]}, "2 token_ids, 2 logprobs and 3 token_versions"),
        ({"logprobs": [-0.5, float("nan")]}, "finite"),
        ({"logprobs": [-0.5, float("-inf")]}, "finite"),
        ({"logprobs": [-0.5, 0.25]}, r"log-probabilities \(<= 0\)"),
        ({"token_versions": [1, -1]}, "token_versions must not be negative"),
        ({"token_ids": [1, -4]}, "token_ids must not be negative"),
        ({"prompt_token_ids": []}, "empty prompt_token_ids"),
    ],
)
def test_semantic_defects_are_named(overrides: dict[str, object], message: str) -> None:
    good = Sample([9], [1], [-1.0], [0])
    g = _group(**overrides)
    data = encode_group(Group(g.group_id, g.prompt_id, (good, *g.samples)))
    with pytest.raises(SampleError, match=message) as err:  # representable, refused on decode
        decode_group(data)
    assert str(err.value).startswith("sample 1: ")  # the sample is named
    assert sample_count(data) == 3  # framing sound: the refused group is counted whole


def test_sample_count_is_zero_for_unsound_framing() -> None:
    data = encode_group(_group())
    assert sample_count(data) == 2
    assert sample_count(data[:-1]) == 0
    assert sample_count(data[:-1] + b"\x00") == 0
    assert sample_count(b"") == 0


def test_framing_defects_are_named() -> None:
    data = encode_group(_group())
    with pytest.raises(SampleError, match="magic"):
        decode_group(b"XXXX" + data[4:])
    with pytest.raises(SampleError, match="format"):
        decode_group(data[:4] + b"\x09\x00" + data[6:])
    with pytest.raises(SampleError, match="truncated"):
        decode_group(data[:-1])
    with pytest.raises(SampleError, match="trailing bytes"):
        decode_group(data + b"\x00")
    with pytest.raises(SampleError, match="checksum"):
        decode_group(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(SampleError, match="over the bound"):
        decode_group(data, max_bytes=len(data) - 1)
    bad_utf8 = data.replace("héllo".encode(), b"h\xff\xfello")
    with pytest.raises(SampleError, match="utf-8"):
        decode_group(_resealed(bad_utf8[HEADER:]))


def test_unrepresentable_samples_are_refused_on_creation() -> None:
    with pytest.raises(SampleError, match="outside int32"):
        Sample([1], [2**31], [-1.0], [0])
    with pytest.raises(SampleError, match="integers"):
        Sample([1], [1.5], [-1.0], [0])
    with pytest.raises(SampleError, match="text must be a string"):
        Sample([1], [], [], [], text=None)  # type: ignore[arg-type]
