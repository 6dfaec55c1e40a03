"""The samples data path: put and get by digest, missing digests named, oversize refused, a
server restart survived by the client, CURVE on tcp://, and the derived samples endpoint."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from deltarl.transport.blobs import (
    BlobClient,
    BlobMissingError,
    BlobServer,
    BlobTimeoutError,
    BlobTooLargeError,
    MemoryBlobs,
    blob_digest,
    samples_endpoint,
)
from deltarl.transport.curve import CurveKeys, make_keys


def _endpoint(tmp_path: Path) -> str:
    return f"ipc://{tmp_path}/s.sock.samples"


def test_put_then_get_by_digest(tmp_path: Path) -> None:
    async def go() -> None:
        store = MemoryBlobs()
        async with BlobServer(_endpoint(tmp_path), store) as srv, BlobClient(srv.endpoint) as c:
            a, b = b"\x00" * 100_000, bytes(range(256)) * 7
            da = await c.put(a)
            assert da == blob_digest(a)
            assert len(da) == 32
            assert await c.put(a) == da  # a repeated put is harmless
            db = await c.put(b)
            assert set(store.blobs) == {da, db}
            assert await c.get([db, da, db]) == [b, a, b]
            assert await c.get([]) == []
            assert await c.put(b"") == blob_digest(b"")

    asyncio.run(go())


def test_a_missing_digest_is_named(tmp_path: Path) -> None:
    async def go() -> None:
        async with BlobServer(_endpoint(tmp_path)) as srv, BlobClient(srv.endpoint) as c:
            known = await c.put(b"known")
            absent = blob_digest(b"absent")
            with pytest.raises(BlobMissingError, match=absent) as err:
                await c.get([known, absent])
            assert err.value.digest == absent
            with pytest.raises(BlobMissingError):
                await c.get(["not-a-digest"])
            assert await c.get([known]) == [b"known"]  # the socket still serves

    asyncio.run(go())


def test_oversize_blobs_are_refused_with_a_clear_error(tmp_path: Path) -> None:
    async def go() -> None:
        async with BlobServer(_endpoint(tmp_path), max_frame_bytes=1000) as srv:
            async with BlobClient(srv.endpoint, max_frame_bytes=1000) as small:
                with pytest.raises(BlobTooLargeError, match="client's bound of 1000"):
                    await small.put(b"x" * 1001)
                assert await small.put(b"x" * 1000) == blob_digest(b"x" * 1000)
            async with BlobClient(srv.endpoint, max_frame_bytes=10_000) as big:
                with pytest.raises(BlobTooLargeError, match="bound of 1000") as err:
                    await big.put(b"y" * 1500)  # the server reads it and says why
                assert err.value.code == "too_large"
                assert await big.put(b"y" * 10) == blob_digest(b"y" * 10)

    asyncio.run(go())


def test_the_client_survives_a_server_restart(tmp_path: Path) -> None:
    async def go() -> None:
        store = MemoryBlobs()  # what the scheduler's sqlite store is across its restarts
        endpoint = _endpoint(tmp_path)
        async with BlobClient(endpoint) as c:
            async with BlobServer(endpoint, store):
                digest = await c.put(b"before")
            with pytest.raises(BlobTimeoutError, match="samples endpoint"):
                await c.get([digest], timeout=0.3)  # nobody there
            async with BlobServer(endpoint, store):
                assert await c.get([digest]) == [b"before"]
                assert await c.put(b"after") == blob_digest(b"after")

    asyncio.run(go())


def test_tcp_samples_sockets_speak_curve(tmp_path: Path) -> None:
    keys = CurveKeys.load(make_keys(tmp_path / "keys"))

    async def go() -> None:
        async with BlobServer("tcp://127.0.0.1:*", curve=keys) as srv:
            async with BlobClient(srv.endpoint, curve=keys) as member:
                assert await member.put(b"ok") == blob_digest(b"ok")
            async with BlobClient(srv.endpoint, curve=None) as stranger:
                with pytest.raises(BlobTimeoutError):
                    await stranger.put(b"forged", timeout=0.5)
            assert list(srv.store.blobs.values()) == [b"ok"]  # type: ignore[attr-defined]

    asyncio.run(go())


def test_samples_endpoint_is_derived_from_the_control_endpoint() -> None:
    assert samples_endpoint("ipc:///run/deltarl/scheduler.sock") == (
        "ipc:///run/deltarl/scheduler.sock.samples"
    )
    assert samples_endpoint("tcp://10.0.0.5:7100") == "tcp://10.0.0.5:7101"
    assert samples_endpoint("tcp://[::1]:7100") == "tcp://[::1]:7101"
    with pytest.raises(ValueError, match="set the samples endpoint"):
        samples_endpoint("tcp://127.0.0.1:*")
    with pytest.raises(ValueError, match="bad control endpoint"):
        samples_endpoint("http://x")
