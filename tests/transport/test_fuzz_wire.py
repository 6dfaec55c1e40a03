"""Fuzzing the transport's network decoders: control messages (decode_request, decode_reply,
decode_event) and the stream link's wire (parse_header, decompress), fed seeded mutants of valid
inputs (tests/codecs/mutate.py).

Each mutant is decoded or refused with the module's own error (MessageError, WireError);
anything else fails the test, naming the seed and mutant that reproduce it. The address space
is capped meanwhile and the peak RSS may grow only a little. ``-m slow`` runs twenty times as
many.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import pytest

from deltarl.transport.messages import (
    Drain,
    Error,
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
    encode_event,
    encode_reply,
    encode_request,
)
from deltarl.transport.stream_wire import (
    MSG_ACK,
    MSG_CHUNK,
    MSG_HELD,
    MSG_MANIFEST,
    MSG_MANIFEST_ACK,
    MSG_QUERY,
    TO_RECEIVER,
    TO_SENDER,
    WireError,
    compress,
    decompress,
    pack_header,
    parse_header,
)
from tests.codecs.mutate import Mutator, bounded_memory, mutate_json

SLOW = 20  # times the default number of mutants in the -m slow run
MAX_PAYLOAD = 1 << 20

REQUESTS = [
    encode_request(1, GetStatus(), None),
    encode_request(2**64 - 1, Pause(), 5.0),
    encode_request(7, Resume(), 0.25),
    encode_request(8, Drain(), None),
    encode_request(9, Resync(), 30),
    encode_request(10, Rollback(version=41), None),
    encode_request(11, Rollback(), 1.0),
    encode_request(12, Shutdown(), None),
]
REPLIES = [
    encode_reply(1, Ok()),
    encode_reply(2, Ok(detail="already paused")),
    encode_reply(3, Error(code="busy", message="too many requests")),
    encode_reply(4, Status(daemon="apply", state="running", fields={"version": 12, "q": [1, 2]})),
]
EVENTS = [
    encode_event(VersionPublished(version=12, base=11, nbytes=4096)),
    encode_event(VersionPublished(version=0)),
    encode_event(VersionApplied(version=12, base=11, seconds=0.5)),
    encode_event(RefitFailed(version=13, reason="chunk 3: checksum mismatch")),
]


def fuzz_messages(
    decode: Callable[[Sequence[bytes]], object], seeds: list[list[bytes]], n: int, seed: int
) -> tuple[int, int]:
    """Decode n mutants of multipart ``seeds``; (accepted, refused).

    Mostly the JSON body is mutated (as bytes, or as a JSON tree); else another frame, or the
    number of frames.
    """
    rng = random.Random(seed)
    bodies = Mutator(seed, [s[2] for s in seeds])
    frames_of_any = Mutator(seed + 1, [f for s in seeds for f in s])
    accepted = refused = 0
    with bounded_memory():
        for i in range(n):
            frames = list(rng.choice(seeds))
            r = rng.random()
            if r < 0.4:
                frames[2] = bodies()
            elif r < 0.75:
                frames[2] = mutate_json(rng, frames[2])
            elif r < 0.9:
                frames[rng.randrange(len(frames))] = frames_of_any()
            elif r < 0.95:
                del frames[rng.randrange(len(frames))]
            else:
                frames.insert(rng.randrange(len(frames) + 1), frames_of_any())
            try:
                decode(frames)
            except MessageError:
                refused += 1
            except BaseException as exc:
                exc.add_note(f"fuzz seed {seed}, mutant {i}: {[f[:256] for f in frames]!r}")
                raise
            else:
                accepted += 1
    return accepted, refused


@pytest.mark.parametrize(
    ("n", "seed"),
    [
        pytest.param(10_000, 11, id="default"),
        pytest.param(10_000 * SLOW, 12, marks=pytest.mark.slow),
    ],
)
def test_fuzz_requests(n: int, seed: int) -> None:
    accepted, refused = fuzz_messages(decode_request, REQUESTS, n, seed)
    assert accepted + refused == n
    assert refused > n // 2


@pytest.mark.parametrize(
    ("n", "seed"),
    [pytest.param(8_000, 13, id="default"), pytest.param(8_000 * SLOW, 14, marks=pytest.mark.slow)],
)
def test_fuzz_replies(n: int, seed: int) -> None:
    accepted, refused = fuzz_messages(decode_reply, REPLIES, n, seed)
    assert accepted + refused == n
    assert refused > n // 4


@pytest.mark.parametrize(
    ("n", "seed"),
    [pytest.param(7_000, 15, id="default"), pytest.param(7_000 * SLOW, 16, marks=pytest.mark.slow)],
)
def test_fuzz_events(n: int, seed: int) -> None:
    accepted, refused = fuzz_messages(decode_event, EVENTS, n, seed)
    assert accepted + refused == n
    assert refused > n // 2


HEADERS = [
    pack_header(MSG_CHUNK, 12, 3, 4096),
    pack_header(MSG_CHUNK, 2**63 - 1, 2**32 - 1, MAX_PAYLOAD, compressed=True),
    pack_header(MSG_MANIFEST, 12, 0, 900, compressed=True),
    pack_header(MSG_QUERY, 12),
    pack_header(MSG_ACK, 12, 3),
    pack_header(MSG_MANIFEST_ACK, 12),
    pack_header(MSG_HELD, 12, 0, 4 * 1000),
]


@pytest.mark.parametrize(
    ("n", "seed"),
    [
        pytest.param(10_000, 17, id="default"),
        pytest.param(10_000 * SLOW, 18, marks=pytest.mark.slow),
    ],
)
def test_fuzz_stream_headers(n: int, seed: int) -> None:
    mutate = Mutator(seed, HEADERS, [1, 9, 13])  # version, chunk_id, length
    accepted = refused = 0
    with bounded_memory():
        for i in range(n):
            raw = mutate()
            for allowed in (TO_RECEIVER, TO_SENDER):
                try:
                    header = parse_header(raw, allowed, MAX_PAYLOAD)
                except WireError:
                    refused += 1
                    continue
                except BaseException as exc:
                    exc.add_note(f"fuzz seed {seed}, mutant {i}: {raw.hex()}")
                    raise
                accepted += 1
                assert header.length <= MAX_PAYLOAD
                assert header.kind in allowed
    assert accepted + refused == 2 * n
    assert accepted > 0


PAYLOADS = [
    compress(b'{"version": 12, "tensors": []}' * 30, 3)[1],
    compress(bytes(100_000), 3)[1],
    compress(bytes(range(256)) * 64, 19)[1],
    compress(random.Random(0).randbytes(2000) * 4, 1)[1],
]


@pytest.mark.parametrize(
    ("n", "seed"),
    [pytest.param(5_000, 19, id="default"), pytest.param(5_000 * SLOW, 20, marks=pytest.mark.slow)],
)
def test_fuzz_stream_payloads(n: int, seed: int) -> None:
    mutate = Mutator(seed, [bytes(p) for p in PAYLOADS], [5, 6])  # content size fields
    accepted = refused = 0
    with bounded_memory():
        for i in range(n):
            payload = mutate()
            try:
                raw = decompress(payload, MAX_PAYLOAD, "chunk")
            except WireError:
                refused += 1
                continue
            except BaseException as exc:
                exc.add_note(f"fuzz seed {seed}, mutant {i}: {payload[:256].hex()}")
                raise
            accepted += 1
            assert len(raw) <= MAX_PAYLOAD
    assert accepted + refused == n
    assert refused > n // 2
