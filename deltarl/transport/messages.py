"""Typed control-plane messages and their wire codec (ZeroMQ multipart frames, orjson bodies).

Every message is a frozen dataclass with a ``TAG``; a decode table maps tags to classes, so
a peer can only ever build a type it listed. Nothing is pickled and nothing is dispatched by a
method name: the receiver looks the tag up, checks every field against the class's type
hints, and only then constructs the object.

Frames (all integers little-endian):

    request  DEALER -> ROUTER   [KIND_REQUEST, request_id u64, {"type", "timeout"?, "body"}]
    reply    ROUTER -> DEALER   [KIND_REPLY,   request_id u64, {"type", "body"}]
    event    PUB    -> SUB      [topic,        KIND_EVENT,     {"type", "body"}]

The first frame of a request or reply is a one-byte kind with its own decoder, as in vLLM's
engine core. An event starts with its topic instead because ZeroMQ's SUB filters on the
prefix of the first frame; the topic is the event's tag. The request id has a frame of its
own so that a server can echo it even when the body is garbage; the client then matches the
error to its request instead of timing out. ``timeout`` (seconds) tells the server how long
the client will wait, so a handler is not left running for nobody.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import struct
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar, TypeVar

import orjson

KIND_REQUEST = b"\x01"
KIND_REPLY = b"\x02"
KIND_EVENT = b"\x03"

# The largest request or reply a peer accepts (all frames together). Control messages are a
# few hundred bytes; a megabyte leaves room for a large status without letting a peer make
# the daemon parse arbitrary amounts of JSON.
MAX_MESSAGE_BYTES = 1 << 20

NO_REQUEST_ID = 0  # echoed when a request's id frame could not be read; clients never use 0
_ID = struct.Struct("<Q")


class ErrorCode(StrEnum):
    """Why a request failed; the ``code`` of an ``Error`` reply."""

    BAD_FRAMES = "bad_frames"  # wrong number of frames, wrong kind byte, unreadable id
    TOO_LARGE = "too_large"  # over the receiver's size limit
    BAD_JSON = "bad_json"  # the body is not a JSON object
    BAD_ENVELOPE = "bad_envelope"  # "type", "timeout" or "body" missing or of the wrong type
    UNKNOWN_TYPE = "unknown_type"  # a tag that is not in the receiver's decode table
    BAD_FIELDS = "bad_fields"  # missing, unexpected or mistyped fields of the message
    UNSUPPORTED = "unsupported"  # a known command that this daemon has no handler for
    HANDLER_FAILED = "handler_failed"  # the handler raised, or returned something unsendable
    TIMEOUT = "timeout"  # the handler ran past the request's timeout
    BUSY = "busy"  # too many requests in flight
    STOPPING = "stopping"  # the server is shutting down


class MessageError(ValueError):
    """A message that cannot be decoded; ``code`` and the text say what was wrong."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


# -- message classes ----------------------------------------------------------------------


@dataclass(frozen=True)
class Message:
    """Base of every wire message. Subclasses set ``TAG``, unique within their family."""

    TAG: ClassVar[str] = ""


@dataclass(frozen=True)
class Command(Message):
    """A request to a daemon's control socket."""


@dataclass(frozen=True)
class Reply(Message):
    """The answer to one command."""


@dataclass(frozen=True)
class Event(Message):
    """A notice a daemon publishes on its event socket; nobody answers it."""


# Commands every daemon understands (a daemon may still answer ``unsupported``).


@dataclass(frozen=True)
class GetStatus(Command):
    """Ask for a ``Status`` reply."""

    TAG: ClassVar[str] = "status"


@dataclass(frozen=True)
class Pause(Command):
    """Stop starting new work; in-flight work continues."""

    TAG: ClassVar[str] = "pause"


@dataclass(frozen=True)
class Resume(Command):
    """Undo ``Pause``."""

    TAG: ClassVar[str] = "resume"


@dataclass(frozen=True)
class Drain(Command):
    """Stop taking new work and finish what is in flight (before a planned stop)."""

    TAG: ClassVar[str] = "drain"


@dataclass(frozen=True)
class Resync(Command):
    """Ask for (or send) a full version instead of the next delta."""

    TAG: ClassVar[str] = "resync"


@dataclass(frozen=True)
class Rollback(Command):
    """Make an earlier version active again."""

    TAG: ClassVar[str] = "rollback"
    version: int | None = None  # None: the last good version the daemon kept


@dataclass(frozen=True)
class RestoreTo(Command):
    """The scheduler forgets every step after ``step`` and queues their prompts again, for a
    trainer restarted from its checkpoint of ``step`` (deltarl/scheduler/restore.py)."""

    TAG: ClassVar[str] = "restore"
    step: int


@dataclass(frozen=True)
class Shutdown(Command):
    """Stop the daemon cleanly (staged: stop accepting, drain, exit)."""

    TAG: ClassVar[str] = "shutdown"


# The export agent's operator commands (another daemon answers them ``unsupported``).


@dataclass(frozen=True)
class GetVersions(Command):
    """Ask the export agent for the versions its manifest store holds: a ``Versions`` reply."""

    TAG: ClassVar[str] = "versions"
    limit: int | None = None  # only the newest ``limit`` (at least 1); None: all of them


@dataclass(frozen=True)
class SetDeltas(Command):
    """Turn deltas off (every version the export agent sends afterwards is full) or back on.

    The setting is kept across restarts of the export agent until the next ``SetDeltas``."""

    TAG: ClassVar[str] = "deltas"
    enabled: bool


# Replies.


@dataclass(frozen=True)
class Ok(Reply):
    """The command was carried out."""

    TAG: ClassVar[str] = "ok"
    detail: str = ""  # a short human note, e.g. "already paused"


@dataclass(frozen=True)
class Error(Reply):
    """The command was refused or failed; ``code`` is an ``ErrorCode`` or a daemon's own."""

    TAG: ClassVar[str] = "error"
    code: str
    message: str


@dataclass(frozen=True)
class Status(Reply):
    """A daemon's state and whatever fields it reports (versions, queue depths, ...)."""

    TAG: ClassVar[str] = "status"
    daemon: str
    state: str  # e.g. "running", "paused", "draining"
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Versions(Reply):
    """The answer to ``GetVersions``: the manifest store's rows, oldest first (newest last).

    Each row has the fields of ``ManifestStore.history``'s records but the manifest itself:
    ``version``, ``base_version`` (-1 for a full version), ``kind`` ("delta" | "full"),
    ``state`` (pending, uploaded, verified, active, superseded, failed), ``created`` and
    ``updated`` (seconds since the epoch: recorded, last state change), ``wire_bytes``,
    ``changed`` (elements that differ from the base) and ``error`` (why it failed, else None).
    ``omitted``: older rows left out so that the reply stays under ``MAX_MESSAGE_BYTES``.
    """

    TAG: ClassVar[str] = "versions"
    versions: list[Any]
    omitted: int = 0


# Events. Tags are dotted so that a SUB prefix such as "version." selects a family.


@dataclass(frozen=True)
class VersionPublished(Event):
    """A new version left the export agent (or a full version was cut)."""

    TAG: ClassVar[str] = "version.published"
    version: int
    base: int | None = None  # None: a full version, not a delta
    nbytes: int = 0  # bytes on the wire


@dataclass(frozen=True)
class VersionApplied(Event):
    """A receiver verified a version and flipped its version pointer to it."""

    TAG: ClassVar[str] = "version.applied"
    version: int
    base: int | None = None
    seconds: float = 0.0  # from the first chunk to the flip


@dataclass(frozen=True)
class RefitFailed(Event):
    """A version was rejected; the previous one stays active."""

    TAG: ClassVar[str] = "refit.failed"
    version: int
    reason: str


M = TypeVar("M", bound=Message)


def decode_table(*classes: type[M]) -> dict[str, type[M]]:
    """Map each class's tag to the class; two classes with one tag are a programming error."""
    table: dict[str, type[M]] = {}
    for cls in classes:
        if not cls.TAG:
            raise ValueError(f"{cls.__name__} has no TAG")
        if cls.TAG in table:
            raise ValueError(
                f"tag {cls.TAG!r} used by {table[cls.TAG].__name__} and {cls.__name__}"
            )
        table[cls.TAG] = cls
    return table


COMMANDS: dict[str, type[Command]] = decode_table(
    GetStatus, Pause, Resume, Drain, Resync, Rollback, Shutdown, GetVersions, SetDeltas, RestoreTo
)
REPLIES: dict[str, type[Reply]] = decode_table(Ok, Error, Status, Versions)
EVENTS: dict[str, type[Event]] = decode_table(VersionPublished, VersionApplied, RefitFailed)


# -- field checking -----------------------------------------------------------------------


@functools.cache
def _hints(cls: type[Message]) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _matches(value: object, hint: Any) -> bool:  # noqa: ANN401 - a type hint is any object
    """Whether a decoded JSON value fits a field's type hint (top level, not element types)."""
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        return any(_matches(value, arg) for arg in typing.get_args(hint))
    if isinstance(value, bool):  # JSON true is not a number, whatever Python thinks
        return hint is bool
    if hint is float:
        return isinstance(value, int | float)
    return isinstance(value, origin or hint)


def from_body(cls: type[M], body: object) -> M:
    """Build ``cls`` from a decoded JSON body, naming every field that is missing or wrong."""
    if not isinstance(body, dict):
        raise MessageError(
            ErrorCode.BAD_ENVELOPE, f"{cls.TAG!r}: body must be an object, got {_kind(body)}"
        )
    hints = _hints(cls)
    problems = [f"unexpected field {_clip(name)}" for name in body if name not in hints]
    for f in dataclasses.fields(cls):
        if f.name not in body:
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            if required:
                problems.append(f"missing field {f.name!r}")
        elif not _matches(body[f.name], hints[f.name]):
            want = getattr(hints[f.name], "__name__", str(hints[f.name]))
            problems.append(f"field {f.name!r} must be {want}, got {_kind(body[f.name])}")
    if problems:
        raise MessageError(ErrorCode.BAD_FIELDS, f"{cls.TAG!r}: " + "; ".join(problems))
    return cls(**body)


def _kind(value: object) -> str:
    """A JSON-ish name for a value's type, for error messages."""
    if value is None:
        return "null"
    return {bool: "bool", dict: "object", list: "array", str: "string"}.get(
        type(value), type(value).__name__
    )


# -- envelopes ----------------------------------------------------------------------------


def encode_body(message: Message, **extra: object) -> bytes:
    """The JSON frame of a message: its tag, its fields, and envelope extras (``timeout``)."""
    # orjson serialises dataclasses field by field; ClassVars such as TAG are not fields.
    return orjson.dumps({"type": message.TAG, **extra, "body": message})


def _clip(value: object, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters: an error never echoes a whole field."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}... ({len(text)} characters)"


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        dup = sorted({k for k in keys if keys.count(k) > 1})
        raise MessageError(ErrorCode.BAD_JSON, f"duplicate keys {_clip(dup)}")
    return dict(pairs)


def _load_envelope(raw: bytes) -> dict[str, Any]:
    try:
        envelope = orjson.loads(raw)
        # orjson keeps the last of duplicate keys; a message such as {"type": "status", ...,
        # "type": "shutdown"} would then say one thing to a reader and do another. The
        # standard parser with a hook refuses them (control messages are small, so the
        # second parse costs microseconds).
        if isinstance(envelope, dict):
            json.loads(raw, object_pairs_hook=_no_duplicates)
    except (orjson.JSONDecodeError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise MessageError(ErrorCode.BAD_JSON, f"body is not valid JSON: {e}") from None
    if not isinstance(envelope, dict):
        raise MessageError(ErrorCode.BAD_JSON, f"body must be a JSON object, got {_kind(envelope)}")
    tag = envelope.get("type")
    if not isinstance(tag, str):
        raise MessageError(ErrorCode.BAD_ENVELOPE, "body has no string 'type' tag")
    return envelope


def decode_body(raw: bytes, table: Mapping[str, type[M]]) -> M:
    """Decode one JSON frame (``{"type", "body"}``) into a message of ``table``."""
    return _decode_envelope(_load_envelope(raw), table)


def _decode_envelope(
    envelope: dict[str, Any], table: Mapping[str, type[M]], allowed: Sequence[str] = ()
) -> M:
    """The message an envelope holds; ``allowed`` names envelope keys besides the two."""
    extra = set(envelope) - {"type", "body", *allowed}
    if extra:
        raise MessageError(ErrorCode.BAD_ENVELOPE, f"unexpected envelope keys {sorted(extra)}")
    tag = envelope["type"]
    cls = table.get(tag)
    if cls is None:
        known = ", ".join(sorted(table))
        raise MessageError(
            ErrorCode.UNKNOWN_TYPE, f"unknown message type {_clip(tag)}; known: {known}"
        )
    return from_body(cls, envelope.get("body", {}))


def _check_size(frames: Sequence[bytes], max_bytes: int) -> None:
    size = sum(len(f) for f in frames)
    if size > max_bytes:
        raise MessageError(
            ErrorCode.TOO_LARGE, f"message is {size} bytes, over the limit of {max_bytes}"
        )


def _read_id(frame: bytes) -> int:
    if len(frame) != _ID.size:
        raise MessageError(
            ErrorCode.BAD_FRAMES, f"request id frame must be {_ID.size} bytes, got {len(frame)}"
        )
    return _ID.unpack(frame)[0]


def _check_frames(frames: Sequence[bytes], kind: bytes, what: str) -> None:
    if len(frames) != 3:
        raise MessageError(ErrorCode.BAD_FRAMES, f"{what} must have 3 frames, got {len(frames)}")
    if frames[0] != kind:
        raise MessageError(
            ErrorCode.BAD_FRAMES, f"{what} kind byte must be {kind!r}, got {frames[0][:8]!r}"
        )


# -- requests and replies -----------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    """A decoded request: the command, the id to echo, and how long the client will wait."""

    request_id: int
    command: Command
    timeout: float | None  # seconds; None when the client did not say


def encode_request(request_id: int, command: Command, timeout: float | None) -> list[bytes]:
    if not 0 < request_id < 1 << 64:
        raise ValueError(f"request id must be in 1..2**64-1, got {request_id}")
    extra = {} if timeout is None else {"timeout": timeout}
    return [KIND_REQUEST, _ID.pack(request_id), encode_body(command, **extra)]


def peek_request_id(frames: Sequence[bytes]) -> int:
    """The request id if frame 1 holds one, else ``NO_REQUEST_ID``: what an error reply echoes."""
    if len(frames) >= 2 and len(frames[1]) == _ID.size:
        return _ID.unpack(frames[1])[0]
    return NO_REQUEST_ID


def decode_request(
    frames: Sequence[bytes],
    commands: Mapping[str, type[Command]] = COMMANDS,
    max_bytes: int = MAX_MESSAGE_BYTES,
) -> Request:
    """Decode a request's frames (without the ROUTER's identity frame), or raise MessageError."""
    _check_size(frames, max_bytes)
    _check_frames(frames, KIND_REQUEST, "a request")
    request_id = _read_id(frames[1])
    envelope = _load_envelope(frames[2])
    command = _decode_envelope(envelope, commands, allowed=("timeout",))
    timeout = envelope.get("timeout")
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0
    ):
        raise MessageError(
            ErrorCode.BAD_ENVELOPE,
            f"'timeout' must be a positive number of seconds, got {timeout!r}",
        )
    return Request(request_id, command, None if timeout is None else float(timeout))


def encode_reply(request_id: int, reply: Reply) -> list[bytes]:
    return [KIND_REPLY, _ID.pack(request_id), encode_body(reply)]


def decode_reply(
    frames: Sequence[bytes],
    replies: Mapping[str, type[Reply]] = REPLIES,
    max_bytes: int = MAX_MESSAGE_BYTES,
) -> tuple[int, Reply]:
    """Decode a reply's frames into (request id, reply), or raise MessageError."""
    _check_size(frames, max_bytes)
    _check_frames(frames, KIND_REPLY, "a reply")
    return _read_id(frames[1]), decode_body(frames[2], replies)


# -- events -------------------------------------------------------------------------------


def encode_event(event: Event) -> list[bytes]:
    return [event.TAG.encode(), KIND_EVENT, encode_body(event)]


def decode_event(
    frames: Sequence[bytes],
    events: Mapping[str, type[Event]] = EVENTS,
    max_bytes: int = MAX_MESSAGE_BYTES,
) -> Event:
    """Decode an event's frames, checking that the topic frame agrees with the body's tag."""
    _check_size(frames, max_bytes)
    if len(frames) != 3 or frames[1] != KIND_EVENT:
        raise MessageError(ErrorCode.BAD_FRAMES, "an event must be [topic, kind, body]")
    event = decode_body(frames[2], events)
    if frames[0] != event.TAG.encode():
        raise MessageError(
            ErrorCode.BAD_ENVELOPE, f"topic {frames[0][:64]!r} does not match type {event.TAG!r}"
        )
    return event
