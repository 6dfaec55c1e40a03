"""An apply agent fed chunks that are not frames (for versions it was never sent) counts and
refuses them and keeps serving; they change nothing it accepts later: the versions they name
are not failed in advance, and no full version is asked for. (A damaged chunk of the version
being applied fails that version at once: tests/refit/test_apply_core.py and the link faults
in test_faults.py.)"""

from __future__ import annotations

import asyncio
from pathlib import Path

from deltarl.transport.base import make_sender
from deltarl.transport.link_config import ShmLinkConfig
from tests.daemons.pipeline import Pipeline


async def _send_garbage(tmp: Path, version: int) -> None:
    async with make_sender(ShmLinkConfig(name="t", root=tmp)) as sender:
        await sender.send_chunk(version, 0, b"\x00garbage, not a deltarl frame" * 8)


def test_unreadable_chunks_are_refused_and_change_nothing(tmp_path: Path) -> None:
    pipe = Pipeline(tmp_path, "shm")
    try:
        pipe.start("trainer")
        pipe.start("apply")
        pipe.wait("the apply agent serving", lambda: pipe.status("apply") is not None)
        for version in (0, 1, 7):  # 0 and 1: the versions the trainer is about to send
            asyncio.run(_send_garbage(tmp_path, version))
        pipe.wait("3 chunks refused", lambda: pipe.status("apply")["refused_items"] == 3)
        status = pipe.status("apply")
        assert status["last_failed"] is None  # no version failed in advance
        assert status["applying"] is None  # no write transaction was opened for garbage
        assert status["active_version"] is None  # nothing was applied
        # ... and the real versions 0 and 1 still go through
        pipe.start("export")
        pipe.wait("version 1 applied", lambda: (pipe.status("apply")["active_version"] or 0) >= 1)
        codes = pipe.stop_all()
        assert codes == {"trainer": 0, "apply": 0, "export": 0}, pipe.logs()
    finally:
        pipe.kill_all()
