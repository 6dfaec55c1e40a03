"""The control-plane codec: round trips, and every malformed input named by its error."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import orjson
import pytest

from deltarl.transport.messages import (
    COMMANDS,
    EVENTS,
    KIND_EVENT,
    KIND_REPLY,
    KIND_REQUEST,
    NO_REQUEST_ID,
    REPLIES,
    Command,
    Drain,
    Error,
    ErrorCode,
    GetStatus,
    MessageError,
    Ok,
    Pause,
    RefitFailed,
    Resume,
    Resync,
    Rollback,
    Shutdown,
    Status,
    VersionApplied,
    VersionPublished,
    decode_event,
    decode_reply,
    decode_request,
    decode_table,
    encode_event,
    encode_reply,
    encode_request,
    from_body,
    peek_request_id,
)

ID = (7).to_bytes(8, "little")


@dataclass(frozen=True)
class SetLagBound(Command):
    """A daemon-specific command, as a daemon would declare it."""

    TAG: ClassVar[str] = "set_lag_bound"
    max_lag: int
    reason: str = ""


@pytest.mark.parametrize(
    "command",
    [GetStatus(), Pause(), Resume(), Drain(), Resync(), Rollback(), Rollback(3), Shutdown()],
)
def test_request_round_trip(command):
    frames = encode_request(41, command, 2.5)
    assert frames[0] == KIND_REQUEST
    request = decode_request(frames)
    assert request.request_id == 41
    assert request.command == command
    assert request.timeout == 2.5


def test_request_without_timeout_and_integer_timeout():
    assert decode_request(encode_request(1, Pause(), None)).timeout is None
    frames = [KIND_REQUEST, ID, orjson.dumps({"type": "pause", "timeout": 5})]
    assert decode_request(frames).timeout == 5.0


@pytest.mark.parametrize(
    "reply",
    [
        Ok(),
        Ok("already paused"),
        Error(ErrorCode.BUSY, "try later"),
        Error("daemon_specific", "x"),
        Status("apply", "running", {"version": 12, "lag": {"max": 2, "now": None}, "ok": True}),
    ],
)
def test_reply_round_trip(reply):
    frames = encode_reply(99, reply)
    assert frames[0] == KIND_REPLY
    assert decode_reply(frames) == (99, reply)


@pytest.mark.parametrize(
    "event",
    [
        VersionPublished(5),
        VersionPublished(6, base=5, nbytes=1 << 40),
        VersionApplied(6, base=5, seconds=0.25),
        RefitFailed(7, "checksum mismatch in layers.0.q_proj"),
    ],
)
def test_event_round_trip(event):
    frames = encode_event(event)
    assert frames[0] == event.TAG.encode()
    assert frames[1] == KIND_EVENT
    assert decode_event(frames) == event


def test_int_is_a_float_but_bool_is_not_an_int():
    assert from_body(VersionApplied, {"version": 1, "seconds": 2}).seconds == 2
    with pytest.raises(MessageError, match="'version' must be int, got bool"):
        from_body(VersionApplied, {"version": True})


def test_daemon_specific_command_with_its_own_table():
    table = {**COMMANDS, **decode_table(SetLagBound)}
    request = decode_request(encode_request(3, SetLagBound(4, "slow trainer"), 1.0), table)
    assert request.command == SetLagBound(4, "slow trainer")
    # The standard table does not know it: the peer cannot make the daemon build it.
    with pytest.raises(MessageError, match="unknown message type 'set_lag_bound'") as e:
        decode_request(encode_request(3, SetLagBound(4), 1.0))
    assert e.value.code == ErrorCode.UNKNOWN_TYPE


def test_decode_table_refuses_duplicate_and_missing_tags():
    @dataclass(frozen=True)
    class Twin(Command):
        TAG: ClassVar[str] = "pause"

    with pytest.raises(ValueError, match="tag 'pause' used by Pause and Twin"):
        decode_table(Pause, Twin)
    with pytest.raises(ValueError, match="has no TAG"):
        decode_table(Command)


def body(obj: object) -> bytes:
    return orjson.dumps(obj)


@pytest.mark.parametrize(
    ("frames", "code", "needle"),
    [
        ([b"garbage"], ErrorCode.BAD_FRAMES, "3 frames, got 1"),
        ([KIND_REQUEST, ID], ErrorCode.BAD_FRAMES, "3 frames, got 2"),
        ([KIND_REQUEST, ID, body({"type": "pause"}), b""], ErrorCode.BAD_FRAMES, "got 4"),
        ([KIND_REPLY, ID, body({"type": "pause"})], ErrorCode.BAD_FRAMES, "kind byte"),
        ([KIND_REQUEST, b"abc", body({"type": "pause"})], ErrorCode.BAD_FRAMES, "8 bytes, got 3"),
        ([KIND_REQUEST, ID, b"\xff\x00{not json"], ErrorCode.BAD_JSON, "not valid JSON"),
        ([KIND_REQUEST, ID, body([1, 2])], ErrorCode.BAD_JSON, "JSON object, got array"),
        ([KIND_REQUEST, ID, body({"body": {}})], ErrorCode.BAD_ENVELOPE, "'type'"),
        ([KIND_REQUEST, ID, body({"type": 3})], ErrorCode.BAD_ENVELOPE, "'type'"),
        (
            [KIND_REQUEST, ID, body({"type": "pause", "extra": 1})],
            ErrorCode.BAD_ENVELOPE,
            "unexpected envelope keys ['extra']",
        ),
        ([KIND_REQUEST, ID, body({"type": "frobnicate"})], ErrorCode.UNKNOWN_TYPE, "'frobnicate'"),
        (
            [KIND_REQUEST, ID, body({"type": "status", "body": []})],
            ErrorCode.BAD_ENVELOPE,
            "body must be an object, got array",
        ),
        (
            [KIND_REQUEST, ID, body({"type": "rollback", "body": {"version": "3"}})],
            ErrorCode.BAD_FIELDS,
            "field 'version' must be int | None, got string",
        ),
        (
            [KIND_REQUEST, ID, body({"type": "rollback", "body": {"verison": 3}})],
            ErrorCode.BAD_FIELDS,
            "unexpected field 'verison'",
        ),
        (
            [KIND_REQUEST, ID, body({"type": "pause", "timeout": -1})],
            ErrorCode.BAD_ENVELOPE,
            "positive number",
        ),
        (
            [KIND_REQUEST, ID, body({"type": "pause", "timeout": "5"})],
            ErrorCode.BAD_ENVELOPE,
            "positive number",
        ),
        (
            [KIND_REQUEST, ID, body({"type": "pause", "timeout": True})],
            ErrorCode.BAD_ENVELOPE,
            "positive number",
        ),
    ],
)
def test_bad_requests_are_named(frames, code, needle):
    with pytest.raises(MessageError) as e:
        decode_request(frames)
    assert e.value.code == code
    assert needle in str(e.value)


def test_missing_fields_are_all_named():
    frames = [KIND_REPLY, ID, body({"type": "status", "body": {"fields": {}}})]
    with pytest.raises(MessageError, match="missing field 'daemon'; missing field 'state'"):
        decode_reply(frames, REPLIES)


def test_oversized_message_is_refused_before_parsing():
    frames = [KIND_REQUEST, ID, b"{" * 2000]
    with pytest.raises(MessageError, match="2009 bytes, over the limit of 1000") as e:
        decode_request(frames, max_bytes=1000)
    assert e.value.code == ErrorCode.TOO_LARGE


def test_peek_request_id():
    assert peek_request_id([KIND_REQUEST, ID, b""]) == 7
    assert peek_request_id([KIND_REQUEST, ID]) == 7
    assert peek_request_id([b"garbage"]) == NO_REQUEST_ID
    assert peek_request_id([KIND_REQUEST, b"short", b"{}"]) == NO_REQUEST_ID


def test_request_ids_exclude_zero():
    with pytest.raises(ValueError, match="request id"):
        encode_request(0, Pause(), 1.0)
    with pytest.raises(ValueError, match="request id"):
        encode_request(1 << 64, Pause(), 1.0)


def test_event_topic_must_match_its_type():
    frames = encode_event(RefitFailed(3, "bad"))
    with pytest.raises(MessageError, match=r"does not match type 'refit\.failed'"):
        decode_event([b"version.applied", *frames[1:]], EVENTS)
    with pytest.raises(MessageError, match="an event must be"):
        decode_event(frames[:2], EVENTS)
