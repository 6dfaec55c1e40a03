"""The same-host link: chunk files in a shared-memory directory, ZeroMQ notices over ipc."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
import xxhash
import zmq
import zmq.asyncio

from deltarl.transport.base import (
    LinkError,
    ReceivedChunk,
    ReceivedManifest,
    make_receiver,
    make_sender,
)
from deltarl.transport.link_config import ShmLinkConfig
from deltarl.transport.shm_link import (
    CHUNK_FILE,
    KIND_CHUNK,
    KIND_MANIFEST,
    NOTICE,
    VERSION,
    ShmReceiver,
    ShmSender,
    endpoint_of,
    remove_stale,
)
from tests.transport.linkdata import encoded_versions, run

REPO = str(Path(__file__).resolve().parents[2])


@pytest.fixture
def config(tmp_path: Path) -> ShmLinkConfig:
    return ShmLinkConfig(name="t", root=tmp_path)


def chunk_files(config: ShmLinkConfig) -> list[str]:
    return sorted(p.name for p in config.directory.iterdir() if CHUNK_FILE.fullmatch(p.name))


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()  # reaped: the pid names no process now
    return proc.pid


# -- delivery -----------------------------------------------------------------------------


def test_two_versions_arrive_complete_byte_exact_and_zero_copy(config: ShmLinkConfig) -> None:
    versions = encoded_versions(11)

    async def main() -> None:
        async with make_receiver(config) as receiver, make_sender(config) as sender:
            assert isinstance(receiver, ShmReceiver)
            for version, (chunks, manifest) in enumerate(versions, start=1):

                async def send(
                    version: int = version, chunks: list[bytes] = chunks, manifest: bytes = manifest
                ) -> None:
                    for i in reversed(range(len(chunks))):  # any order will do
                        await sender.send_chunk(version, i, chunks[i])
                    await sender.send_manifest(version, manifest)

                # More chunks than max_pending_chunks: the sender waits for the consumer.
                assert len(chunks) > config.max_pending_chunks or version == 2
                sending = asyncio.create_task(send())
                got: dict[int, bytes] = {}
                manifests = []
                while len(got) < len(chunks) or not manifests:
                    item = await anext(receiver)
                    if isinstance(item, ReceivedManifest):
                        manifests.append(item)
                        continue
                    assert isinstance(item, ReceivedChunk)
                    assert item.version == version
                    assert item.chunk_id not in got
                    assert isinstance(item.data, memoryview)  # a view of the mapped file
                    got[item.chunk_id] = bytes(item.data)
                    assert receiver.held == 1
                    item.release()
                    item.release()  # idempotent
                    assert receiver.held == 0
                await sending
                assert got == dict(enumerate(chunks))
                assert [(m.version, m.data) for m in manifests] == [(version, manifest)]
                assert chunk_files(config) == []  # every released file is gone

    run(main())


def test_a_duplicate_chunk_is_delivered_once_and_its_file_freed(config: ShmLinkConfig) -> None:
    async def main() -> None:
        async with make_receiver(config) as receiver, make_sender(config) as sender:
            for _ in range(2):
                await sender.send_chunk(3, 0, b"same chunk")
                await sender.send_manifest(3, b"{}")
            await sender.send_chunk(3, 1, b"next")
            items = [await anext(receiver) for _ in range(3)]
            assert [type(i).__name__ for i in items] == [
                "ReceivedChunk",
                "ReceivedManifest",
                "ReceivedChunk",
            ]
            assert isinstance(items[2], ReceivedChunk)
            assert bytes(items[2].data) == b"next"
            assert len(chunk_files(config)) == 2  # the two held chunks; the copy is gone
            assert receiver.held == 2

        assert chunk_files(config) == []  # close released the chunks nobody released

    run(main())


def test_a_sender_in_another_process_that_exits_at_once_is_still_heard(
    config: ShmLinkConfig,
) -> None:
    """The real shape of the link: two processes. The sender exits right after its last
    send; its notices still leave (LINGER) and its files stay readable after it is gone."""
    script = textwrap.dedent(
        f"""
        import asyncio
        from pathlib import Path
        from deltarl.transport.base import make_sender
        from deltarl.transport.link_config import ShmLinkConfig

        async def main():
            config = ShmLinkConfig(name={config.name!r}, root=Path({str(config.root)!r}))
            async with make_sender(config) as sender:
                for i in range(3):
                    await sender.send_chunk(9, i, bytes([i]) * 1000)
                await sender.send_manifest(9, b'{{"v": 9}}')

        asyncio.run(main())
        """
    )

    async def main() -> None:
        async with make_receiver(config) as receiver:
            env = {**os.environ, "PYTHONPATH": REPO}
            proc = await asyncio.create_subprocess_exec(sys.executable, "-c", script, env=env)
            assert await proc.wait() == 0
            got = {}
            while len(got) < 4:
                item = await anext(receiver)
                if isinstance(item, ReceivedChunk):
                    got[item.chunk_id] = bytes(item.data)
                    item.release()
                else:
                    got["manifest"] = item.data
        assert got == {
            0: bytes(1000),
            1: b"\x01" * 1000,
            2: b"\x02" * 1000,
            "manifest": b'{"v": 9}',
        }
        assert chunk_files(config) == []

    run(main())


def test_an_empty_chunk_needs_no_mapping(config: ShmLinkConfig) -> None:
    async def main() -> None:
        async with make_receiver(config) as receiver, make_sender(config) as sender:
            await sender.send_chunk(1, 0, b"")
            item = await anext(receiver)
            assert isinstance(item, ReceivedChunk)
            assert item.data == b""
            item.release()
        assert chunk_files(config) == []

    run(main())


def test_release_while_the_consumer_still_holds_a_view_still_frees_the_file(
    config: ShmLinkConfig,
) -> None:
    async def main() -> None:
        async with make_receiver(config) as receiver, make_sender(config) as sender:
            await sender.send_chunk(1, 0, bytes(range(256)) * 64)
            item = await anext(receiver)
            assert isinstance(item, ReceivedChunk)
            array = np.frombuffer(item.data, np.uint8)  # keeps the mapping exported
            item.release()
            assert chunk_files(config) == []
            assert int(array[255]) == 255  # the pages live as long as the view does

    run(main())


# -- partial files, stale files -------------------------------------------------------------


def test_a_partial_chunk_file_is_never_visible_under_its_public_name(
    config: ShmLinkConfig,
) -> None:
    """A watcher thread lists the directory while 4 MiB chunks are written: every chunk file it
    sees under a public name is already whole; only temporary names are ever partial."""
    size, n = 4 << 20, 12
    rng = np.random.default_rng(5)
    chunks = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(n)]
    seen_public: list[int] = []
    seen_tmp = 0
    stop = threading.Event()

    def watch() -> None:
        nonlocal seen_tmp
        while not stop.is_set():
            for entry in os.scandir(config.directory):
                try:
                    st_size = entry.stat().st_size
                except FileNotFoundError:
                    continue  # released or renamed meanwhile
                if CHUNK_FILE.fullmatch(entry.name):
                    seen_public.append(st_size)
                elif entry.name.endswith(".tmp"):
                    seen_tmp += 1

    async def main() -> None:
        async with make_receiver(config) as receiver, make_sender(config) as sender:
            watcher = threading.Thread(target=watch)
            watcher.start()
            try:
                for i, data in enumerate(chunks):
                    await sender.send_chunk(1, i, data)
                    item = await anext(receiver)
                    assert isinstance(item, ReceivedChunk)
                    assert bytes(item.data) == data
                    item.release()
            finally:
                stop.set()
                watcher.join()

    run(main())
    assert seen_public, "the watcher never saw a chunk file"
    assert set(seen_public) == {size}
    print(f"watcher saw {len(seen_public)} public and {seen_tmp} temporary file listings")


def test_stale_files_are_cleaned_on_start(config: ShmLinkConfig) -> None:
    directory = config.directory
    directory.mkdir(mode=0o700)  # as a link makes it: a laxer one is refused
    dead = dead_pid()
    stale = [
        "v4-c0.123-0.bin",  # a chunk file from before this receiver: its notice is gone
        f".v4-c1.{dead}-1.0badf00d.tmp",  # a dead writer's unfinished file
    ]
    kept = [
        f".v4-c2.{os.getpid()}-2.0badf00d.tmp",  # a live writer may be writing this one
        "README",  # not ours to judge
    ]
    for name in stale + kept:
        (directory / name).write_bytes(b"x")

    # A sender cleans only dead writers' temporary files: chunk files may still be notified.
    assert remove_stale(directory, chunk_files=False) == [stale[1]]
    (directory / stale[1]).write_bytes(b"x")

    async def main() -> None:
        receiver = ShmReceiver(config)
        await receiver.start()
        assert sorted(p.name for p in directory.iterdir()) == sorted([*kept, "notify.sock"])
        await receiver.close()

    run(main())


# -- bad notices and faults -----------------------------------------------------------------


def test_bad_notices_are_logged_and_skipped(config: ShmLinkConfig, caplog) -> None:
    directory = config.directory
    caplog.set_level(logging.INFO, "deltarl.transport.shm_link")  # a gone file is routine

    async def main() -> None:
        async with make_receiver(config) as receiver:
            push = zmq.asyncio.Context.instance().socket(zmq.PUSH)
            push.connect(endpoint_of(config))
            good = b"good chunk"
            (directory / "v1-c0.1-0.bin").write_bytes(good)
            (directory / "v1-c1.1-1.bin").write_bytes(b"tampered!!")
            (directory / "v1-c2.1-2.bin").write_bytes(b"short")
            (directory / ".v1-c3.1-3.0badf00d.tmp").write_bytes(b"half")
            checksum = xxhash.xxh3_64_intdigest(good)

            def notice(v: int, c: int, size: int, name: str) -> list[bytes]:
                return [KIND_CHUNK, NOTICE.pack(v, c, size, checksum), name.encode()]

            for frames in (
                [b"\x09", b"what"],  # an unknown kind
                notice(1, 3, 4, ".v1-c3.1-3.0badf00d.tmp"),  # a temporary (partial) file
                notice(1, 0, 10, "../../etc/passwd"),  # not a chunk file name
                notice(1, 9, 10, "v1-c0.1-0.bin"),  # a file of another chunk
                notice(1, 1, 10, "v1-c1.1-1.bin"),  # checksum mismatch
                notice(1, 2, 10, "v1-c2.1-2.bin"),  # size mismatch
                notice(1, 4, 10, "v1-c4.1-4.bin"),  # no such file
                notice(1, 0, 10, "v1-c0.1-0.bin"),  # the good one
            ):
                await push.send_multipart(frames)
            item = await anext(receiver)
            assert isinstance(item, ReceivedChunk)
            assert (item.version, item.chunk_id, bytes(item.data)) == (1, 0, good)
            item.release()
            push.close(linger=0)

    run(main())
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "dropped a bad notice (2 frames" in logged
    assert "names '.v1-c3.1-3.0badf00d.tmp', not its chunk file" in logged
    assert "names '../../etc/passwd'" in logged
    assert "does not match its notice's xxh3-64" in logged
    assert "holds 5 bytes, its notice says 10" in logged
    assert "is gone" in logged
    # refused files are removed; the temporary file named by a notice is not touched
    assert sorted(p.name for p in directory.iterdir()) == [".v1-c3.1-3.0badf00d.tmp", "notify.sock"]


def test_a_receiver_that_does_not_release_stops_the_sender_with_a_clear_error(
    tmp_path: Path,
) -> None:
    config = ShmLinkConfig(name="bp", root=tmp_path, max_pending_chunks=2, pending_timeout_s=0.3)

    async def main() -> None:
        async with make_receiver(config) as receiver, make_sender(config) as sender:
            await sender.send_chunk(1, 0, b"a")
            await sender.send_chunk(1, 1, b"b")
            with pytest.raises(LinkError, match=r"has not released 2 chunk files in 0\.3 s"):
                await sender.send_chunk(1, 2, b"c")
            item = await anext(receiver)  # consuming makes room again
            assert isinstance(item, ReceivedChunk)
            item.release()
            await sender.send_chunk(1, 2, b"c")

    run(main())


def test_no_receiver_is_a_clear_error(tmp_path: Path) -> None:
    config = ShmLinkConfig(name="none", root=tmp_path, connect_timeout_s=0.2)

    async def main() -> None:
        sender = ShmSender(config)
        with pytest.raises(LinkError, match=r"no receiver on ipc://.* within 0.2 s"):
            await sender.send_chunk(1, 0, b"x")
        await sender.close()
        assert chunk_files(config) == []  # nothing is written without a receiver
        with pytest.raises(LinkError, match="closed"):
            await sender.send_chunk(1, 0, b"x")

    run(main())


def test_a_withdrawn_send_never_reaches_the_consumer(config: ShmLinkConfig) -> None:
    """The fault: the sender gives up on version 1 (its receiver stalled) after the receiver
    took one of its chunks, and sends version 2. Withdrawn, version 1's other files are gone
    (another process's file of that version stays), its manifest is dropped, version 2
    arrives whole, and a later send of version 1 is delivered again."""
    (full, full_manifest), (delta, delta_manifest) = encoded_versions(5)

    async def main() -> None:
        receiver = ShmReceiver(config)
        await receiver.start()
        other = config.directory / f"v1-c99.{os.getpid() + 1}-0.bin"
        other.write_bytes(b"another sender's")
        other.chmod(0o600)
        async with make_sender(config) as sender:
            for i in range(4):
                await sender.send_chunk(1, i, full[i])
            await sender.send_manifest(1, full_manifest)
            first = await anext(receiver)  # taken (mapped) before the sender gives up
            assert isinstance(first, ReceivedChunk)
            assert (first.version, first.chunk_id) == (1, 0)
            # All four files: the one mapped too (its reader keeps the pages).
            assert await sender.withdraw(1) == 4
            assert await sender.withdraw(1) == 0
            assert bytes(first.data) == full[0]  # a mapped chunk stays readable
            first.release()
            assert chunk_files(config) == [other.name]

            async def send_delta() -> None:  # more chunks than max_pending_chunks: read along
                for i, chunk in enumerate(delta):
                    await sender.send_chunk(2, i, chunk)
                await sender.send_manifest(2, delta_manifest)

            sending = asyncio.create_task(send_delta())
            got = []
            for _ in range(len(delta) + 1):
                got.append(await anext(receiver))
                if isinstance(got[-1], ReceivedChunk):
                    got[-1].release()
            await sending
            assert [(type(g).__name__, g.version) for g in got] == [
                *[("ReceivedChunk", 2)] * len(delta),
                ("ReceivedManifest", 2),
            ]
            # Sent again after the withdrawal: its chunks and manifest arrive.
            await sender.send_chunk(1, 1000, full[0])
            await sender.send_manifest(1, b"{again}")
            again = [await anext(receiver) for _ in range(2)]
            assert isinstance(again[0], ReceivedChunk)
            assert again[0].chunk_id == 1000
            again[0].release()
            assert isinstance(again[1], ReceivedManifest)
            assert again[1].data == b"{again}"
        await receiver.close()
        assert chunk_files(config) == [other.name]  # never another process's

    run(main())


def test_the_manifest_of_a_send_with_a_refused_chunk_is_dropped(config: ShmLinkConfig) -> None:
    """A chunk file that fails its notice's checksum is refused; that send of the version
    cannot complete, so its manifest must not open the version on the receiver."""
    directory = config.directory

    async def main() -> None:
        async with make_receiver(config) as receiver:
            push = zmq.asyncio.Context.instance().socket(zmq.PUSH)
            push.connect(endpoint_of(config))
            (directory / "v4-c0.1-0.bin").write_bytes(b"tampered")
            (directory / "v4-c8.1-1.bin").write_bytes(b"again")
            good = xxhash.xxh3_64_intdigest(b"again")
            for frames in (
                [KIND_CHUNK, NOTICE.pack(4, 0, 8, good), b"v4-c0.1-0.bin"],
                [KIND_MANIFEST, VERSION.pack(4), b"{first}"],
                [KIND_CHUNK, NOTICE.pack(4, 8, 5, good), b"v4-c8.1-1.bin"],
                [KIND_MANIFEST, VERSION.pack(4), b"{again}"],
            ):
                await push.send_multipart(frames)
            chunk = await anext(receiver)
            assert isinstance(chunk, ReceivedChunk)
            assert (chunk.chunk_id, bytes(chunk.data)) == (8, b"again")
            chunk.release()
            manifest = await anext(receiver)
            assert isinstance(manifest, ReceivedManifest)
            assert manifest.data == b"{again}"  # the first send's was dropped
            push.close(linger=0)

    run(main())


def test_a_sender_that_never_started_has_nothing_to_withdraw(tmp_path: Path) -> None:
    config = ShmLinkConfig(name="never", root=tmp_path)
    assert run(ShmSender(config).withdraw(1)) == 0


def test_close_removes_files_of_notices_not_yet_read(config: ShmLinkConfig) -> None:
    async def main() -> None:
        receiver = ShmReceiver(config)
        await receiver.start()
        async with make_sender(config) as sender:
            for i in range(3):
                await sender.send_chunk(1, i, b"never read")
            assert len(chunk_files(config)) == 3
            await asyncio.sleep(0.05)  # let the notices reach the receiver's socket
            await receiver.close()
            assert chunk_files(config) == []
            with pytest.raises(StopAsyncIteration):
                await anext(receiver)

    run(main())


def test_closing_ends_a_waiting_iteration(config: ShmLinkConfig) -> None:
    async def main() -> None:
        receiver = ShmReceiver(config)
        await receiver.start()

        async def drain() -> list[object]:
            return [item async for item in receiver]

        reading = asyncio.create_task(drain())
        await asyncio.sleep(0.05)
        await receiver.close()
        assert await reading == []

    run(main())


def test_the_notice_socket_path_must_fit(tmp_path: Path) -> None:
    deep = ShmLinkConfig(name="x" * 120, root=tmp_path)
    with pytest.raises(ValueError, match="over 107 bytes"):
        endpoint_of(deep)
    assert endpoint_of(ShmLinkConfig(name="x" * 120, endpoint="ipc:///tmp/s")) == "ipc:///tmp/s"
