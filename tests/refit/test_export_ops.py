"""The export agent's operator tools: ``versions`` (the manifest store's rows) and the
``deltas off|on`` switch that forces full versions and survives a restart.

The core against a real apply core over a real shm link (``pair`` of test_export_core.py),
then the three refit daemons as real processes driven through ``deltarl ctl``'s main.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson
import pytest

from deltarl import ctl
from deltarl.codecs.frame import NO_BASE
from deltarl.engine.daemon import DaemonContext
from deltarl.refit.export import (
    DELTAS_OFF,
    ExportCore,
    deltas_switch_path,
    load_deltas_switch,
    save_deltas_switch,
    versions_reply,
)
from deltarl.refit.manifest_store import ManifestStore, State, VersionRecord
from deltarl.refit.receiver_state import StateFeed
from deltarl.transport.control import request_sync
from deltarl.transport.messages import (
    MAX_MESSAGE_BYTES,
    Error,
    GetVersions,
    Ok,
    Resume,
    SetDeltas,
    Versions,
    encode_reply,
)
from tests.daemons.pipeline import Pipeline, assert_bit_exact
from tests.refit.test_export_core import Pair, pair

ROW_FIELDS = {
    "version",
    "base_version",
    "kind",
    "state",
    "created",
    "updated",
    "wire_bytes",
    "changed",
    "error",
}


def store_rows(path: Path) -> list[dict[str, Any]]:
    """The store's history as ``Versions`` rows should carry it, oldest first."""
    with ManifestStore(path, readonly=True) as ms:
        return [
            {
                "version": r.version,
                "base_version": r.base_version,
                "kind": r.kind,
                "state": r.state.value,
                "created": r.created,
                "updated": r.updated,
                "wire_bytes": r.wire_bytes,
                "changed": r.changed,
                "error": r.error,
            }
            for r in reversed(ms.history(10_000))
        ]


def restarted(p: Pair) -> ExportCore:
    """A new export core on the same configuration and manifest store: what a restart makes."""
    return ExportCore(
        p.export.config,
        DaemonContext("export"),
        StateFeed(),
        lambda: None,  # type: ignore[arg-type,return-value] - never run
        ManifestStore(p.manifests),
    )


# -- the core -------------------------------------------------------------------------------


def test_versions_are_the_rows_the_store_holds(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with pair(tmp_path) as p:
            await p.active(0)
            for _ in range(3):
                await p.active(p.publish())
            reply = await p.export.on_versions(GetVersions())
            assert isinstance(reply, Versions)
            assert reply.omitted == 0
            assert reply.versions == store_rows(p.manifests)
            assert [r["version"] for r in reply.versions] == [0, 1, 2, 3]  # newest last
            assert set(reply.versions[0]) == ROW_FIELDS
            assert [(r["kind"], r["base_version"]) for r in reply.versions] == [
                ("full", NO_BASE),
                ("delta", 0),
                ("delta", 1),
                ("delta", 2),
            ]
            assert [r["state"] for r in reply.versions] == ["superseded"] * 3 + ["active"]
            newest = await p.export.on_versions(GetVersions(limit=2))
            assert isinstance(newest, Versions)
            assert [r["version"] for r in newest.versions] == [2, 3]
            refused = await p.export.on_versions(GetVersions(limit=0))
            assert isinstance(refused, Error)
            assert refused.code == "bad_fields"

    asyncio.run(scenario())


def test_deltas_off_sends_full_versions_until_on_and_survives_a_restart(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with pair(tmp_path) as p:
            await p.active(0)
            await p.active(p.publish())
            assert p.export.recent[-1].kind == "delta"
            assert p.export.status_fields()["deltas_enabled"] is True

            reply = await p.export.on_deltas(SetDeltas(enabled=False))
            assert isinstance(reply, Ok), reply
            assert p.export.status_fields()["deltas_enabled"] is False
            for _ in range(2):
                await p.active(p.publish())
                assert p.export.recent[-1].kind == "full"
                assert p.export.status_fields()["last_full_reason"] == DELTAS_OFF
            assert "(already)" in (await p.export.on_deltas(SetDeltas(enabled=False))).detail

            # a restart of the export core reads the switch back: still off
            again = restarted(p)
            assert again.deltas_enabled is False
            assert again.status_fields()["deltas_enabled"] is False
            await again.close()

            assert isinstance(await p.export.on_deltas(SetDeltas(enabled=True)), Ok)
            await p.active(p.publish())  # the reference was kept: a delta at once
            assert p.export.recent[-1].kind == "delta"
            assert p.export.status_fields()["last_full_reason"] is None
            with ManifestStore(p.manifests, readonly=True) as ms:
                kinds = [r.kind for r in reversed(ms.history())]
            assert kinds == ["full", "delta", "full", "full", "delta"]

            again = restarted(p)  # and on is read back as on
            assert again.deltas_enabled is True
            await again.close()

    asyncio.run(scenario())


def test_an_unreadable_switch_leaves_deltas_off(tmp_path: Path) -> None:
    path = deltas_switch_path(tmp_path / "versions.sqlite")
    assert path == tmp_path / "versions.sqlite.deltas.json"
    assert deltas_switch_path(Path(":memory:")) is None
    assert load_deltas_switch(None) is True
    assert load_deltas_switch(path) is True  # no file: deltas on
    save_deltas_switch(path, False)
    assert load_deltas_switch(path) is False
    save_deltas_switch(path, True)
    assert load_deltas_switch(path) is True
    for bad in (b"{", b"[]", b'{"deltas_enabled": "yes"}'):
        path.write_bytes(bad)
        assert load_deltas_switch(path) is False, bad


def test_a_versions_reply_leaves_the_oldest_rows_out_to_fit_one_message() -> None:
    records = [
        VersionRecord(v, NO_BASE, "full", State.FAILED, 1.0, 2.0, 10, 5, "{}", "x" * 4000)
        for v in range(400, 0, -1)  # newest first, as history returns them: 1.6 MB of errors
    ]
    reply = versions_reply(records)
    assert reply.omitted > 0
    assert len(reply.versions) + reply.omitted == 400
    assert reply.versions[-1]["version"] == 400  # the newest are kept, newest last
    assert sum(len(f) for f in encode_reply(1, reply)) <= MAX_MESSAGE_BYTES


# -- ctl's side, without a daemon ----------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["deltas", "maybe"], "deltas takes on or off, got 'maybe'"),
        (["deltas"], "deltas takes on or off, got nothing"),
        (["status", "off"], "status takes no argument"),
        (["versions", "--limit", "0"], "--limit must be at least 1"),
        (["status", "--limit", "3"], "--limit is only meaningful with versions"),
    ],
)
def test_bad_arguments_are_usage_errors(argv: list[str], needle: str, capsys) -> None:
    endpoint = "tcp://127.0.0.1:1"  # never asked: the usage error comes first
    assert ctl.main([endpoint, *argv]) == ctl.EXIT_USAGE
    assert needle in capsys.readouterr().err
    assert ctl.main([endpoint, *argv, "--json"]) == ctl.EXIT_USAGE
    report = orjson.loads(capsys.readouterr().out)
    assert report["ok"] is False
    assert report["error"]["code"] == "usage"
    assert needle in report["error"]["message"]


def test_versions_table_newest_last() -> None:
    rows = [
        {"version": 4, "base_version": -1, "kind": "full", "state": "superseded"},
        {"version": 5, "base_version": 4, "kind": "delta", "state": "failed", "error": "boom"},
    ]
    lines = ctl.format_versions(Versions(rows, omitted=3)).splitlines()
    assert lines[0].split()[:4] == ["version", "base", "kind", "state"]
    assert lines[1].split()[:4] == ["4", "-", "full", "superseded"]
    assert lines[2].split()[:4] == ["5", "4", "delta", "failed"]
    assert lines[2].endswith("  boom")
    assert lines[3] == "(3 older versions left out: use --limit)"


# -- the daemons, through `deltarl ctl` ----------------------------------------------------


def run_ctl(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = ctl.main(list(argv))
    out = capsys.readouterr().out
    return code, out


def test_ctl_versions_and_deltas_switch_against_the_daemons(tmp_path: Path, capsys) -> None:
    pipe = Pipeline(tmp_path)
    try:
        _daemons_scenario(pipe, capsys)
    finally:
        pipe.kill_all()


def _kinds_after(pipe: Pipeline, version: int) -> list[str]:
    return [r["kind"] for r in store_rows(pipe.tmp / "versions.sqlite") if r["version"] > version]


def _resume_and_quiesce(pipe: Pipeline, count: int) -> int:
    """Let the trainer publish ``count`` more versions; the version active afterwards."""
    start = int(pipe.status("apply")["active_version"])
    assert request_sync(pipe.endpoint("trainer"), Resume(), 2.0) == Ok("resumed")
    pipe.wait(
        f"{count} more versions", lambda: pipe.status("apply")["active_version"] >= start + count
    )
    version = pipe.quiesce()
    assert_bit_exact(pipe.tmp, version)
    return version


def _daemons_scenario(pipe: Pipeline, capsys: pytest.CaptureFixture[str]) -> None:
    config = str(pipe.tmp / "deltarl.toml")
    for daemon in ("apply", "export", "trainer"):
        pipe.start(daemon)
    pipe.wait("3 versions applied", lambda: pipe.status("apply")["applied"] >= 3)
    version = pipe.quiesce()

    # versions: exactly one JSON object, the store's rows, newest last
    code, out = run_ctl(capsys, "export", "versions", "--json", "--config", config)
    assert code == ctl.EXIT_OK
    report = orjson.loads(out)
    assert report["ok"] is True
    assert report["reply"]["type"] == "versions"
    assert report["versions"] == report["reply"]["body"]["versions"]
    assert report["omitted"] == 0
    assert report["versions"] == store_rows(pipe.tmp / "versions.sqlite")
    assert report["versions"][-1]["version"] == version
    assert report["versions"][-1]["state"] == "active"
    assert "delta" in {r["kind"] for r in report["versions"]}
    code, out = run_ctl(capsys, "export", "versions", "--limit", "2", "--config", config)
    assert code == ctl.EXIT_OK
    lines = out.splitlines()
    assert lines[0].split()[0] == "version"
    newest = [r["version"] for r in report["versions"][-2:]]  # a version may be skipped
    assert [int(line.split()[0]) for line in lines[1:]] == newest

    # another daemon does not answer it: a clean error, exit 1
    code, out = run_ctl(capsys, "apply", "versions", "--json", "--config", config)
    assert code == ctl.EXIT_ERROR_REPLY
    assert orjson.loads(out)["error"]["code"] == "unsupported"

    # deltas off: every version afterwards is full
    code, out = run_ctl(capsys, "export", "deltas", "off", "--config", config)
    assert code == ctl.EXIT_OK, out
    assert "deltas off" in out
    assert pipe.status("export")["deltas_enabled"] is False
    before = version
    version = _resume_and_quiesce(pipe, 5)  # more than full_resync_every (4) in a row
    assert set(_kinds_after(pipe, before)) == {"full"}, _kinds_after(pipe, before)
    assert pipe.status("export")["last_full_reason"] == DELTAS_OFF

    # a restart (kill -9) of the export agent: still off
    pipe.kill("export")
    pipe.start("export")
    pipe.wait("the export agent back", lambda: pipe.status("export") is not None)
    assert pipe.status("export")["deltas_enabled"] is False
    before = version
    version = _resume_and_quiesce(pipe, 3)
    assert set(_kinds_after(pipe, before)) == {"full"}, _kinds_after(pipe, before)
    assert pipe.status("export")["last_full_reason"] == DELTAS_OFF

    # deltas on: deltas again
    code, out = run_ctl(capsys, "export", "deltas", "on", "--json", "--config", config)
    assert code == ctl.EXIT_OK
    assert orjson.loads(out)["reply"] == {
        "type": "ok",
        "body": {"detail": "deltas on: versions go as deltas again"},
    }
    assert pipe.status("export")["deltas_enabled"] is True
    before = version
    _resume_and_quiesce(pipe, 3)
    assert "delta" in _kinds_after(pipe, before), _kinds_after(pipe, before)

    codes = pipe.stop_all()
    assert codes == {"apply": 0, "export": 0, "trainer": 0}, pipe.logs()
