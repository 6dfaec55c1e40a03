"""``deltarl ctl status``: the whole pipeline at a glance, against real daemon processes (the
synthetic trainer, the export and apply agents), with one daemon of the config down."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from deltarl import ctl
from deltarl.config import load_config, write_toml
from tests.daemons.pipeline import Pipeline


def _ctl(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = ctl.main(list(argv))
    return code, capsys.readouterr().out


def test_the_pipeline_at_a_glance(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pipe = Pipeline(tmp_path)
    try:
        for daemon in ("apply", "export", "trainer"):
            pipe.start(daemon)
        pipe.wait("3 versions applied", lambda: pipe.status("apply")["applied"] >= 3)
        version = pipe.quiesce()
        config = tmp_path / "deltarl.toml"

        code, out = _ctl(capsys, "status", "--json", "--config", str(config))
        assert code == ctl.EXIT_OK, out
        state = orjson.loads(out)
        assert state["ok"] is True
        assert {n: d["state"] for n, d in state["daemons"].items()} == {
            "apply": "running",
            "export": "running",
            "trainer": "paused",  # quiesce paused it
        }
        assert state["trainer_version"] == version
        assert state["active_per_apply_agent"] == {"apply": version}
        assert state["in_flight"] is None
        assert state["deltas_enabled"] is True
        assert state["last_refit"]["version"] == version
        assert state["last_refit"]["outcome"] == "active"
        assert state["last_refit"]["wire_bytes"] > 0

        code, out = _ctl(capsys, "status", "--config", str(config))
        assert code == ctl.EXIT_OK
        assert f"  trainer        {version}" in out
        assert f"last refit       version {version} (" in out

        # A daemon of the config that does not answer: shown down, exit 1, the rest shown.
        tables = load_config(config)
        tables["daemons"]["rollout-9"] = {"control": f"ipc://{tmp_path}/nobody.sock"}
        write_toml(config, tables)
        code, out = _ctl(capsys, "status", "--json", "--config", str(config), "--timeout", "0.5")
        assert code == ctl.EXIT_ERROR_REPLY
        state = orjson.loads(out)
        assert state["ok"] is False
        assert state["daemons"]["rollout-9"]["state"].startswith("down")
        assert state["trainer_version"] == version

        # Alerts from a Prometheus that is not there: said, not fatal.
        code, out = _ctl(
            capsys, "status", "--config", str(config), "--timeout", "0.5",
            "--prometheus", "http://127.0.0.1:9",
        )  # fmt: skip
        assert "alerts           not read from http://127.0.0.1:9" in out

        # ``deltarl ctl NAME status`` still asks one daemon.
        code, out = _ctl(capsys, "apply", "status", "--json", "--config", str(config))
        assert code == ctl.EXIT_OK
        assert orjson.loads(out)["reply"]["body"]["daemon"] == "apply"
    finally:
        pipe.kill_all()


def test_no_config_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("DELTARL_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)
    code, out = _ctl(capsys, "status", "--json", "--config", str(tmp_path / "none.toml"))
    assert code == ctl.EXIT_USAGE
    assert orjson.loads(out)["error"]["code"] == "config"
