"""A full /dev/shm is a failed send (LinkError, the export agent sends again after a back-off),
never a crashed agent; once there is room again the link works. The test mounts a 1 MiB tmpfs
of its own (it needs root, as the namespace tests do)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from deltarl.transport.base import LinkError, ReceivedChunk, make_receiver, make_sender
from deltarl.transport.link_config import ShmLinkConfig


@pytest.fixture
def small_shm(tmp_path: Path) -> Iterator[Path]:
    root = tmp_path / "shm"
    root.mkdir(mode=0o700)
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(root)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield root
    finally:
        subprocess.run(["umount", "-l", str(root)], check=False)


def test_no_room_is_a_link_error_and_room_again_works(small_shm: Path) -> None:
    config = ShmLinkConfig(name="full", root=small_shm, connect_timeout_s=10)

    async def scenario() -> None:
        async with make_receiver(config) as receiver, make_sender(config) as sender:
            with pytest.raises(LinkError, match="cannot write chunk 0 of version 1"):
                await sender.send_chunk(1, 0, b"x" * (2 << 20))  # twice the tmpfs
            assert not [p for p in config.directory.iterdir() if p.suffix == ".tmp"]
            await sender.send_chunk(2, 0, b"y" * 1000)  # there is room for this one
            item = await asyncio.wait_for(receiver.__anext__(), 10)
            assert isinstance(item, ReceivedChunk)
            assert (item.version, bytes(item.data)) == (2, b"y" * 1000)
            item.release()

    asyncio.run(scenario())


def test_the_export_agent_sends_again_once_there_is_room(small_shm: Path, tmp_path: Path) -> None:
    from tests.refit.test_export_core import pair  # noqa: PLC0415 - the refit pair

    async def scenario() -> None:
        filler = small_shm / "filler"
        # Room for the link's directory and socket, not for a full version (about 290 kB) ...
        free = os.statvfs(small_shm).f_bavail * os.statvfs(small_shm).f_frsize
        filler.write_bytes(b"\0" * (free - (64 << 10)))
        async with pair(tmp_path, link_root=small_shm) as p:
            await asyncio.sleep(1.0)
            assert p.export.failed >= 1  # the first (full) version could not be written
            assert p.rollout.active_version is None
            filler.unlink()  # ... until space is freed: the same version goes again
            await p.active(0)

    asyncio.run(scenario())


def test_an_apply_agent_whose_store_does_not_fit_exits_78(small_shm: Path, tmp_path: Path) -> None:
    from deltarl.engine.layout import Layout  # noqa: PLC0415

    layout = tmp_path / "layout.json"
    layout.write_bytes(Layout.pack([("w", "bfloat16", (1 << 20,))]).to_json())  # 2 x 2 MiB
    config = tmp_path / "deltarl.toml"
    config.write_text(f"""
[daemons.apply]
control = "ipc://{tmp_path}/apply.sock"
rollout_store = "r"
store_root = "{small_shm}"
layout_file = "{layout}"
link = {{type = "shm", name = "n", root = "{tmp_path}"}}
""")
    done = subprocess.run(
        [sys.executable, "-m", "deltarl.cli", "apply", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 78, done.stderr  # EX_CONFIG: systemd does not loop on it
    assert "no room for weight store 'r'" in done.stderr
