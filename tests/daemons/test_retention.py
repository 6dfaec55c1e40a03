"""The export agent applies its manifest store's retention (``keep_versions``) as it runs."""

from __future__ import annotations

from pathlib import Path

from deltarl.refit.manifest_store import ManifestStore
from tests.daemons.pipeline import Pipeline, refit_tables, shm_link
from tests.refit.test_manifest_store import check_invariants


def test_the_export_agent_keeps_its_last_versions(tmp_path: Path) -> None:
    tables = refit_tables(
        tmp_path,
        export_link=shm_link(tmp_path),
        trainer={"interval_s": 0.1},
        export={"keep_versions": 2, "full_resync_every": 3},
    )
    pipe = Pipeline(tmp_path, tables)
    try:
        for daemon in ("trainer", "apply", "export"):
            pipe.start(daemon)
        pipe.wait("version 20 active", lambda: (pipe.status("apply")["active_version"] or 0) >= 20)
        version = pipe.quiesce()
        pipe.wait("the export agent idle", lambda: pipe.status("export")["detail"] == "idle")
    finally:
        pipe.kill_all()
    rows = check_invariants(tmp_path / "versions.sqlite")
    # the newest 2, and the chain of the active one back to its full version (<= 3 deltas)
    assert version in rows
    assert len(rows) <= 2 + 4, sorted(rows)
    assert min(rows) >= version - 5, sorted(rows)
    with ManifestStore(tmp_path / "versions.sqlite", readonly=True) as store:
        active = store.active()
        assert active is not None
        assert active.version == version
