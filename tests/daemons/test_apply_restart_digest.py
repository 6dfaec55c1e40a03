"""A restarted apply agent still reports the manifest digest of its active version (recomputed
from the verified buffer), so a rollout daemon that starts after it can prove its engine
without waiting for the trainer's next version."""

from __future__ import annotations

import signal
from pathlib import Path

from deltarl.refit.manifest_store import ManifestStore
from tests.daemons.pipeline import Pipeline


def test_restarted_apply_agent_reports_the_active_digest(tmp_path: Path) -> None:
    pipe = Pipeline(tmp_path, "shm")
    try:
        for daemon in ("apply", "export", "trainer"):
            pipe.start(daemon)
        pipe.wait("2 versions applied", lambda: pipe.status("apply")["applied"] >= 2)
        version = pipe.quiesce()
        with ManifestStore(tmp_path / "versions.sqlite", readonly=True) as ms:
            record = ms.get(version)
            assert record is not None
            want = record.manifest.model_xxh3_128
        assert pipe.status("apply")["digests"][str(version)] == want
        pipe.procs["apply"].send_signal(signal.SIGTERM)
        assert pipe.procs.pop("apply").wait(30) == 0
        pipe.start("apply")
        pipe.wait("the apply agent back", lambda: pipe.status("apply")["applied"] == 0)
        status = pipe.status("apply")
        assert status["active_version"] == version
        assert status["digests"] == {str(version): want}
    finally:
        for p in pipe.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)
