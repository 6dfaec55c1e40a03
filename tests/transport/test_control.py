"""The control server, client and event channel over real ZeroMQ sockets (ipc and loopback tcp)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import orjson
import pytest
import uvloop
import zmq
import zmq.asyncio

from deltarl.transport.control import (
    ControlClient,
    ControlServer,
    ControlTimeoutError,
    check_endpoint,
    request_sync,
)
from deltarl.transport.events import EventPublisher, EventSubscriber
from deltarl.transport.messages import (
    COMMANDS,
    KIND_REQUEST,
    NO_REQUEST_ID,
    Command,
    Error,
    ErrorCode,
    Event,
    GetStatus,
    MessageError,
    Ok,
    Pause,
    RefitFailed,
    Reply,
    Rollback,
    Shutdown,
    Status,
    VersionApplied,
    decode_body,
    decode_reply,
    encode_request,
)

ID = (7).to_bytes(8, "little")


def run(coro: Awaitable[Any], limit: float = 10.0) -> Any:
    """Run a test coroutine with a hard limit, so a protocol bug fails instead of hanging."""

    async def bounded() -> Any:
        async with asyncio.timeout(limit):
            return await coro

    return asyncio.run(bounded())


@pytest.fixture(params=["ipc", "tcp"])
def endpoint(request, tmp_path) -> str:
    return f"ipc://{tmp_path}/control.sock" if request.param == "ipc" else "tcp://127.0.0.1:*"


@dataclass(frozen=True)
class SetLagBound(Command):
    TAG: ClassVar[str] = "set_lag_bound"
    max_lag: int


async def on_status(_: GetStatus) -> Reply:
    return Status("demo", "running", {"version": 3, "queue": {"depth": 0}})


async def on_pause(_: Pause) -> Reply:
    return Ok("paused")


async def on_lag(cmd: SetLagBound) -> Reply:
    return Ok(f"max lag {cmd.max_lag}")


HANDLERS: dict[type[Command], Callable[[Any], Awaitable[Reply]]] = {
    GetStatus: on_status,
    Pause: on_pause,
    SetLagBound: on_lag,
}


def test_commands_over_ipc_and_tcp(endpoint):
    async def scenario() -> None:
        async with ControlServer(endpoint, HANDLERS, name="demo") as server:
            assert "*" not in server.endpoint  # the real port once bound
            async with ControlClient(server.endpoint) as client:
                status = await client.request(GetStatus(), 2.0)
                assert status == Status("demo", "running", {"version": 3, "queue": {"depth": 0}})
                assert await client.request(Pause(), 2.0) == Ok("paused")
                assert await client.request(SetLagBound(2), 2.0) == Ok("max lag 2")
                unsupported = await client.request(Rollback(4), 2.0)
                assert isinstance(unsupported, Error)
                assert unsupported.code == ErrorCode.UNSUPPORTED
                assert "demo does not handle 'rollback'" in unsupported.message

    run(scenario())


def test_runs_on_uvloop(tmp_path):
    async def scenario() -> Reply:
        async with (
            ControlServer(f"ipc://{tmp_path}/c.sock", HANDLERS) as server,
            ControlClient(server.endpoint) as client,
        ):
            return await client.request(GetStatus(), 2.0)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        assert isinstance(runner.run(scenario()), Status)


def frames_json(obj: object) -> bytes:
    return orjson.dumps(obj)


# (frames a broken or hostile peer sends, the code of the error reply, words it must contain,
# the id the reply must echo)
BAD_REQUESTS = [
    ([b"\x00garbage\xff"], ErrorCode.BAD_FRAMES, "3 frames, got 1", NO_REQUEST_ID),
    ([KIND_REQUEST, ID], ErrorCode.BAD_FRAMES, "3 frames, got 2", 7),
    ([KIND_REQUEST, ID, frames_json({"type": "status"}), b"x"], ErrorCode.BAD_FRAMES, "got 4", 7),
    ([b"\x09", ID, frames_json({"type": "status"})], ErrorCode.BAD_FRAMES, "kind byte", 7),
    ([KIND_REQUEST, b"1234", frames_json({"type": "status"})], ErrorCode.BAD_FRAMES, "8 bytes", 0),
    ([KIND_REQUEST, ID, b"\x80\x81 not json"], ErrorCode.BAD_JSON, "not valid JSON", 7),
    ([KIND_REQUEST, ID, frames_json({"type": "reboot"})], ErrorCode.UNKNOWN_TYPE, "'reboot'", 7),
    (
        [KIND_REQUEST, ID, frames_json({"type": "set_lag_bound", "body": {}})],
        ErrorCode.BAD_FIELDS,
        "missing field 'max_lag'",
        7,
    ),
    (
        [KIND_REQUEST, ID, frames_json({"type": "set_lag_bound", "body": {"max_lag": "2"}})],
        ErrorCode.BAD_FIELDS,
        "'max_lag' must be int",
        7,
    ),
    ([KIND_REQUEST, ID, b" " * (2 << 20)], ErrorCode.TOO_LARGE, "over the limit", 7),
]


def test_malformed_requests_get_error_replies_and_the_server_keeps_serving(endpoint):
    async def scenario() -> None:
        async with ControlServer(endpoint, HANDLERS, name="demo") as server:
            peer = zmq.asyncio.Context.instance().socket(zmq.DEALER)
            peer.setsockopt(zmq.LINGER, 0)
            peer.connect(server.endpoint)
            try:
                for frames, code, needle, echoed in BAD_REQUESTS:
                    await peer.send_multipart(frames)
                    async with asyncio.timeout(2.0):
                        request_id, reply = decode_reply(await peer.recv_multipart())
                    assert isinstance(reply, Error), frames[:2]
                    assert (reply.code, request_id) == (code, echoed), reply
                    assert needle in reply.message, reply
                # ...and a well-formed request after all that is answered normally.
                await peer.send_multipart(encode_request(8, GetStatus(), 2.0))
                async with asyncio.timeout(2.0):
                    request_id, reply = decode_reply(await peer.recv_multipart())
                assert request_id == 8
                assert isinstance(reply, Status)
            finally:
                peer.close()

    run(scenario())


async def raw_request(endpoint: str, command: Command, server_timeout: float | None) -> Reply:
    """A request whose server-side timeout is independent of how long we wait for it."""
    peer = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.connect(endpoint)
    try:
        await peer.send_multipart(encode_request(5, command, server_timeout))
        async with asyncio.timeout(5.0):
            request_id, reply = decode_reply(await peer.recv_multipart())
        assert request_id == 5
        return reply
    finally:
        peer.close()


def test_handler_faults_become_error_replies(tmp_path):
    async def boom(_: Command) -> Reply:
        raise RuntimeError("boom")

    async def not_a_reply(_: Command) -> Any:
        return {"ok": True}

    async def unencodable(_: Command) -> Reply:
        return Status("demo", "running", {"handle": object()})

    async def own_timeout(_: Command) -> Reply:
        raise TimeoutError("upstream did not answer")

    async def slow(_: Command) -> Reply:
        await asyncio.sleep(30)
        return Ok()

    cases = [
        (boom, ErrorCode.HANDLER_FAILED, "'status' failed: RuntimeError: boom"),
        (not_a_reply, ErrorCode.HANDLER_FAILED, "returned dict, not a Reply"),
        (unencodable, ErrorCode.HANDLER_FAILED, "TypeError"),
        (own_timeout, ErrorCode.HANDLER_FAILED, "TimeoutError: upstream did not answer"),
        (slow, ErrorCode.TIMEOUT, "'status' did not finish within 0.2 s"),
    ]

    async def scenario() -> None:
        for handler, code, needle in cases:
            endpoint = f"ipc://{tmp_path}/{handler.__name__}.sock"
            async with ControlServer(endpoint, {GetStatus: handler}, name="demo") as server:
                reply = await raw_request(server.endpoint, GetStatus(), 0.2)
                assert isinstance(reply, Error)
                assert reply.code == code
                assert needle in reply.message
                # The server survived its handler's fault.
                async with ControlClient(server.endpoint) as client:
                    assert (await client.request(Pause(), 2.0)).code == ErrorCode.UNSUPPORTED

    run(scenario())


def test_server_default_timeout_applies_when_the_request_names_none(tmp_path):
    async def slow(_: Command) -> Reply:
        await asyncio.sleep(30)
        return Ok()

    async def scenario() -> Reply:
        endpoint = f"ipc://{tmp_path}/c.sock"
        async with ControlServer(endpoint, {GetStatus: slow}, default_timeout=0.1) as server:
            return await raw_request(server.endpoint, GetStatus(), None)

    reply = run(scenario())
    assert isinstance(reply, Error)
    assert reply.code == ErrorCode.TIMEOUT


def test_concurrent_requests_are_matched_by_id(endpoint):
    async def slow_status(_: GetStatus) -> Reply:
        await asyncio.sleep(0.3)
        return Status("demo", "running", {})

    async def scenario() -> None:
        handlers = {GetStatus: slow_status, Pause: on_pause}
        async with (
            ControlServer(endpoint, handlers) as server,
            ControlClient(server.endpoint) as client,
        ):
            done: list[str] = []

            async def ask(command: Command) -> Reply:
                reply = await client.request(command, 2.0)
                done.append(command.TAG)
                return reply

            status, paused = await asyncio.gather(ask(GetStatus()), ask(Pause()))
            assert isinstance(status, Status)
            assert paused == Ok("paused")
            assert done == ["pause", "status"]  # the fast one was not held behind the slow

    run(scenario())


def test_client_timeout_names_endpoint_and_command(tmp_path):
    endpoint = f"ipc://{tmp_path}/nobody-home.sock"
    start = time.monotonic()
    with pytest.raises(ControlTimeoutError) as e:
        request_sync(endpoint, Rollback(3), 0.2)
    assert time.monotonic() - start < 2.0
    assert endpoint in str(e.value)
    assert "'rollback'" in str(e.value)
    assert "within 0.2 s" in str(e.value)


def test_a_timed_out_request_is_never_delivered_later(tmp_path):
    """A daemon that comes back must not receive the request its client gave up on."""
    endpoint = f"ipc://{tmp_path}/late.sock"
    received: list[str] = []

    async def record(cmd: Command) -> Reply:
        received.append(cmd.TAG)
        return Ok()

    async def scenario() -> None:
        async with ControlClient(endpoint) as client:
            with pytest.raises(ControlTimeoutError):
                await client.request(Shutdown(), 0.1)  # nobody is bound yet
            async with ControlServer(endpoint, {Shutdown: record, GetStatus: record}):
                await asyncio.sleep(0.4)  # several reconnect intervals (100 ms)
                assert received == []
                # The client recovers: the next request goes over a fresh socket.
                assert await client.request(GetStatus(), 2.0) == Ok()
        assert received == ["status"]

    run(scenario())


def test_shutdown_handler_gets_its_reply_out_then_the_server_stops(tmp_path):
    async def scenario() -> None:
        server: ControlServer

        async def on_shutdown(_: Shutdown) -> Reply:
            server.stop()
            return Ok("stopping")

        server = ControlServer(f"ipc://{tmp_path}/c.sock", {Shutdown: on_shutdown})
        async with server, ControlClient(server.endpoint) as client:
            assert await client.request(Shutdown(), 2.0) == Ok("stopping")
            await asyncio.wait_for(server.wait_stopped(), 2.0)
            with pytest.raises(ControlTimeoutError):
                await client.request(GetStatus(), 0.2)

    run(scenario())


def test_flood_beyond_max_in_flight_is_answered_busy(tmp_path):
    release = asyncio.Event()

    async def blocked(_: GetStatus) -> Reply:
        await release.wait()
        return Status("demo", "running", {})

    async def scenario() -> None:
        endpoint = f"ipc://{tmp_path}/c.sock"
        async with (
            ControlServer(endpoint, {GetStatus: blocked}, max_in_flight=1) as server,
            ControlClient(server.endpoint) as client,
        ):
            first = asyncio.create_task(client.request(GetStatus(), 2.0))
            await asyncio.sleep(0.1)
            second = await client.request(GetStatus(), 2.0)
            assert isinstance(second, Error)
            assert second.code == ErrorCode.BUSY
            release.set()
            assert isinstance(await first, Status)

    run(scenario())


def test_stop_cancels_handlers_past_the_grace_and_says_so(tmp_path):
    async def stuck(_: GetStatus) -> Reply:
        await asyncio.sleep(30)
        return Ok()

    async def scenario() -> None:
        endpoint = f"ipc://{tmp_path}/c.sock"
        server = ControlServer(endpoint, {GetStatus: stuck}, grace=0.1)
        async with server:
            client = ControlClient(server.endpoint)
            pending = asyncio.create_task(client.request(GetStatus(), 5.0))
            await asyncio.sleep(0.1)
        reply = await pending  # the server has closed; the answer still came
        await client.close()
        assert isinstance(reply, Error)
        assert reply.code == ErrorCode.STOPPING

    run(scenario())


def test_bad_endpoints_are_refused():
    for bad in ("http://example.org", "ipc://", "/run/deltarl/apply.sock", "tcp:/x"):
        with pytest.raises(ValueError, match="bad control endpoint"):
            check_endpoint(bad)


@dataclass(frozen=True)
class FutureEvent(Event):
    """An event a newer publisher sends and this subscriber's table does not know."""

    TAG: ClassVar[str] = "version.future"
    version: int


def test_subscriber_gets_only_its_topics(endpoint):
    async def scenario() -> Event:
        publisher = EventPublisher(endpoint)
        publisher.bind()
        subscriber = EventSubscriber(publisher.endpoint, topics=["version."])
        try:
            # PUB/SUB slow joiner: events sent before the subscription reaches the publisher
            # are dropped, so publish until one arrives (bounded by run()'s limit).
            while True:
                await publisher.publish(RefitFailed(9, "filtered out by topic"))
                await publisher.publish(FutureEvent(9))  # unknown here: skipped, logged
                await publisher.publish(VersionApplied(9, base=8, seconds=0.5))
                try:
                    async with asyncio.timeout(0.05):
                        return await subscriber.receive()
                except TimeoutError:
                    continue
        finally:
            subscriber.close()
            publisher.close()

    assert run(scenario(), limit=5.0) == VersionApplied(9, base=8, seconds=0.5)


def test_duplicate_keys_are_refused_not_resolved_to_the_last() -> None:
    # {"type": "status", ..., "type": "shutdown"} must not shut a daemon down.
    raw = b'{"type": "status", "body": {}, "type": "shutdown"}'
    with pytest.raises(MessageError) as info:
        decode_body(raw, COMMANDS)
    assert info.value.code == ErrorCode.BAD_JSON
    assert "duplicate keys" in info.value.message
    nested = b'{"type": "status", "body": {"a": 1, "a": 2}}'
    with pytest.raises(MessageError, match="duplicate keys"):
        decode_body(nested, COMMANDS)


def test_an_unknown_type_is_not_echoed_whole() -> None:
    tag = "x" * 100_000
    with pytest.raises(MessageError) as info:
        decode_body(orjson.dumps({"type": tag, "body": {}}), COMMANDS)
    assert info.value.code == ErrorCode.UNKNOWN_TYPE
    assert len(info.value.message) < 1_000


def test_commands_that_change_a_daemon_are_logged_with_their_sender(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> None:
        endpoint = f"ipc://{tmp_path}/audit.sock"

        async def on_shutdown(_: Shutdown) -> Ok:
            return Ok("stopping")

        server = ControlServer(endpoint, {Shutdown: on_shutdown}, name="audited")
        async with server, ControlClient(endpoint) as client:
            assert await client.request(Shutdown(), 5.0) == Ok("stopping")

    with caplog.at_level(logging.INFO, logger="deltarl.transport.control"):
        asyncio.run(scenario())
    assert any(
        "audited: 'shutdown' asked by a local peer" in r.getMessage() for r in caplog.records
    )
