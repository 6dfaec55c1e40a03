"""Link directories and ipc sockets another user made, or may reach, are refused
(deltarl/ownership.py): an shm link directory must be this user's and 0700, chunk files
must be this user's and written by nobody else, an ipc socket file is 0600 whatever the
umask, and it is never bound in a directory others may write (even a sticky one, like /tmp).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from deltarl.config.errors import ConfigError
from deltarl.ownership import UnsafePathError
from deltarl.transport.base import ReceivedChunk
from deltarl.transport.control import ControlServer
from deltarl.transport.events import EventPublisher
from deltarl.transport.link_config import ShmLinkConfig
from deltarl.transport.router import bind_endpoint
from deltarl.transport.shm_link import ShmReceiver, ShmSender
from tests.transport.linkdata import run

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown to another user")


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


@pytest.fixture
def umask_000() -> Iterator[None]:
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def start_receiver(config: ShmLinkConfig) -> None:
    async def main() -> None:
        receiver = ShmReceiver(config)
        try:
            await receiver.start()
        finally:
            await receiver.close()

    run(main())


def start_sender(config: ShmLinkConfig) -> None:
    async def main() -> None:
        sender = ShmSender(config)
        try:
            await sender.start()
        finally:
            await sender.close()

    run(main())


@pytest.mark.parametrize("mode", [0o777, 0o755, 0o770, 0o701])
def test_a_link_directory_others_may_reach_is_refused(tmp_path: Path, mode: int) -> None:
    config = ShmLinkConfig(name="pre", root=tmp_path)
    config.directory.mkdir()
    config.directory.chmod(mode)
    for start in (start_receiver, start_sender):
        with pytest.raises(UnsafePathError, match=f"has mode {mode:04o}; refused: it must be 0700"):
            start(config)
    assert not (config.directory / "notify.sock").exists()


@as_root
def test_a_link_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    config = ShmLinkConfig(name="pre", root=tmp_path)
    config.directory.mkdir(mode=0o700)
    os.chown(config.directory, NOBODY, NOBODY)
    for start in (start_receiver, start_sender):
        with pytest.raises(ConfigError, match="belongs to uid 65534, not to this process"):
            start(config)


def test_a_link_directory_that_is_a_symlink_is_refused(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    config = ShmLinkConfig(name="sym", root=tmp_path)
    config.directory.symlink_to(elsewhere)
    with pytest.raises(UnsafePathError, match="is not a directory \\(a symbolic link\\?\\)"):
        start_receiver(config)


def test_a_link_root_others_may_rename_in_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    root.chmod(0o777)  # not sticky: anyone could rename our directory away and put theirs
    with pytest.raises(UnsafePathError, match="not sticky"):
        start_receiver(ShmLinkConfig(name="x", root=root))


@as_root
def test_a_chunk_file_of_another_user_is_refused(tmp_path: Path, caplog) -> None:
    config = ShmLinkConfig(name="files", root=tmp_path)

    async def main() -> None:
        async with ShmReceiver(config) as receiver, ShmSender(config) as sender:
            await sender.send_chunk(1, 0, b"ok")
            first = await anext(receiver)
            assert isinstance(first, ReceivedChunk)
            first.release()
            # A file swapped in under a chunk's name, as another user could if the directory
            # were not private: the receiver refuses it rather than map it.
            real_write = sender._write

            def write_then_give_away(name: str, data: bytes | memoryview) -> tuple[int, int]:
                out = real_write(name, data)
                os.chown(config.directory / name, NOBODY, NOBODY)
                return out

            sender._write = write_then_give_away  # type: ignore[method-assign]
            await sender.send_chunk(1, 1, b"theirs")
            sender._write = real_write  # type: ignore[method-assign]
            await sender.send_chunk(1, 2, b"ours")
            item = await anext(receiver)
            assert isinstance(item, ReceivedChunk)
            assert item.chunk_id == 2
            item.release()

    run(main())
    assert "chunk file" in caplog.text
    assert "belongs to uid 65534" in caplog.text


def test_the_link_directory_and_socket_are_owner_only_under_umask_000(
    tmp_path: Path, umask_000: None
) -> None:
    config = ShmLinkConfig(name="u", root=tmp_path)

    async def main() -> None:
        async with ShmReceiver(config) as receiver, ShmSender(config) as sender:
            await sender.send_chunk(3, 0, b"chunk")
            chunk_files = [p for p in config.directory.iterdir() if p.suffix == ".bin"]
            assert [mode_of(p) for p in chunk_files] == [0o600]
            item = await anext(receiver)
            assert isinstance(item, ReceivedChunk)
            item.release()
            assert mode_of(config.directory) == 0o700
            assert mode_of(config.directory / "notify.sock") == 0o600

    run(main())


def test_a_bound_ipc_socket_is_0600_under_umask_000(tmp_path: Path, umask_000: None) -> None:
    sock = zmq.asyncio.Context.instance().socket(zmq.PULL)
    try:
        bind_endpoint(sock, f"ipc://{tmp_path}/plain.sock")
        assert mode_of(tmp_path / "plain.sock") == 0o600
    finally:
        sock.close(linger=0)
    assert os.umask(0) == 0  # the umask is the caller's again

    async def main() -> None:
        async with ControlServer(f"ipc://{tmp_path}/control.sock", {}, name="t"):
            assert mode_of(tmp_path / "control.sock") == 0o600
        events = EventPublisher(f"ipc://{tmp_path}/events.sock")
        events.bind()
        try:
            assert mode_of(tmp_path / "events.sock") == 0o600
        finally:
            events.close()

    run(main())


@pytest.mark.parametrize("mode", [0o1777, 0o777, 0o775])
def test_an_ipc_socket_is_never_bound_where_others_may_write(tmp_path: Path, mode: int) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(mode)  # 1777: /tmp itself. Another user could bind the name first.
    sock = zmq.asyncio.Context.instance().socket(zmq.PULL)
    try:
        with pytest.raises(UnsafePathError, match="another user could take the socket's name"):
            bind_endpoint(sock, f"ipc://{shared}/x.sock")
    finally:
        sock.close(linger=0)
    assert not (shared / "x.sock").exists()
    with pytest.raises(UnsafePathError, match="take the socket's name"):
        start_receiver(ShmLinkConfig(name="e", root=tmp_path, endpoint=f"ipc://{shared}/n.sock"))


def test_the_example_config_keeps_its_sockets_out_of_tmp() -> None:
    example = Path(__file__).parents[2] / "examples" / "refit-local.toml"
    assert "ipc:///tmp" not in example.read_text()


def test_group_access_is_opt_in_and_others_never_get_any(
    tmp_path: Path, umask_000: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DELTARL_IPC_MODE", "0660")
    sock = zmq.asyncio.Context.instance().socket(zmq.PULL)
    try:
        bind_endpoint(sock, f"ipc://{tmp_path}/group.sock")
        assert mode_of(tmp_path / "group.sock") == 0o660
        monkeypatch.setenv("DELTARL_IPC_MODE", "0666")
        with pytest.raises(ConfigError, match="never open to others"):
            bind_endpoint(sock, f"ipc://{tmp_path}/world.sock")
    finally:
        sock.close(linger=0)
    assert not (tmp_path / "world.sock").exists()
    # The systemd units opt in: operators of the group deltarl use `deltarl ctl` on them.
    units = sorted((Path(__file__).parents[2] / "systemd").glob("deltarl-*.service"))
    assert len(units) == 6  # export, apply, trainer, scheduler, rollout@, reward
    for unit in units:
        assert "\nEnvironment=DELTARL_IPC_MODE=0660\n" in unit.read_text(), unit.name
