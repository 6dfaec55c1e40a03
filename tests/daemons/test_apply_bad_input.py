"""An apply agent fed a chunk whose frame header cannot be read fails that version at once
(reported in ``status`` and as needing a full version), instead of waiting silently until the
export agent's acknowledgement times out; and it keeps serving."""

from __future__ import annotations

import asyncio
from pathlib import Path

from deltarl.transport.base import make_sender
from deltarl.transport.link_config import ShmLinkConfig
from tests.daemons.pipeline import Pipeline


async def _send_garbage(tmp: Path, version: int) -> None:
    async with make_sender(ShmLinkConfig(name="t", root=tmp)) as sender:
        await sender.send_chunk(version, 0, b"\x00garbage, not a deltarl frame" * 8)


def test_unreadable_chunk_fails_its_version_at_once(tmp_path: Path) -> None:
    pipe = Pipeline(tmp_path, "shm")
    try:
        pipe.start("trainer")
        pipe.start("apply")
        pipe.wait("the apply agent serving", lambda: pipe.status("apply") is not None)
        asyncio.run(_send_garbage(tmp_path, 7))
        pipe.wait(
            "version 7 reported failed",
            lambda: (pipe.status("apply")["last_failed"] or {}).get("version") == 7,
            timeout=20,
        )
        status = pipe.status("apply")
        assert "unreadable" in status["last_failed"]["reason"]
        assert status["needs_full"] is True
        assert status["active_version"] is None  # nothing was applied
        codes = pipe.stop_all()
        assert codes == {"trainer": 0, "apply": 0}, pipe.logs()
    finally:
        for p in pipe.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)
