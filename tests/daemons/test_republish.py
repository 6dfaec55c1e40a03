"""A trainer restarted from a checkpoint publishes an older version again: the export agent
does not send it (the rollout side keeps its newer version), and the trainer's next newer
version still arrives bit-exact, as a delta."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from deltarl.engine.weight_store import WeightStore
from deltarl.refit.manifest_store import ManifestStore
from deltarl.transport.control import request_sync
from deltarl.transport.messages import Ok, Resume
from tests.daemons.pipeline import Pipeline, assert_bit_exact


def test_an_older_version_published_again_is_not_sent(tmp_path: Path) -> None:
    pipe = Pipeline(tmp_path, "shm")
    try:
        for daemon in ("apply", "export", "trainer"):
            pipe.start(daemon)
        pipe.wait("3 versions applied", lambda: pipe.status("apply")["applied"] >= 3)
        held = pipe.quiesce()
        applied = pipe.status("apply")["applied"]
        # What a restarted trainer does: publish its checkpoint's (older) version again.
        with WeightStore.open("pub", root=tmp_path) as pub:
            with pub.lease() as snap:
                current = np.array(snap.buffer)
            with pub.begin_write() as txn:
                np.copyto(txn.buffer, current)
                txn.commit(held - 2, allow_older=True)
        pipe.wait("the export agent saw it", lambda: pipe.status("export")["republished"] == 1)
        assert pipe.status("apply")["active_version"] == held
        assert pipe.status("apply")["applied"] == applied
        # The trainer's next version (newer than what the receiver holds) flows as a delta.
        with WeightStore.open("pub", root=tmp_path) as pub, pub.begin_write() as txn:
            np.copyto(txn.buffer, current)
            txn.commit(held, allow_older=True)  # the synthetic trainer's own, again
        assert request_sync(pipe.endpoint("trainer"), Resume(), 2.0) == Ok("resumed")
        pipe.wait("a newer version active", lambda: pipe.status("apply")["active_version"] > held)
        version = pipe.quiesce()
        assert_bit_exact(tmp_path, version)
        with ManifestStore(tmp_path / "versions.sqlite", readonly=True) as ms:
            record = ms.get(held + 1)
            assert record is not None
            assert record.kind == "delta", record
        codes = pipe.stop_all()
        assert codes == {"apply": 0, "export": 0, "trainer": 0}, pipe.logs()
    finally:
        for p in pipe.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)
