"""Structured logs and the audit log (deltarl/ops/logs.py), on a real daemon process."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from types import TracebackType

import orjson
import pytest

from deltarl.config import ConfigError, load, write_toml
from deltarl.config.reward import RewardConfig
from deltarl.ops.logs import JsonFormatter
from tests.ops.helpers import ctl_json, running_daemon


def _failed() -> tuple[type[BaseException], BaseException, TracebackType | None]:
    try:
        raise RuntimeError("boom\nsecond line")  # noqa: TRY301 - a traceback to format
    except RuntimeError as e:
        return type(e), e, e.__traceback__


def test_a_record_is_one_json_line_with_its_context() -> None:
    formatter = JsonFormatter("apply", "apply-b")
    record = logging.LogRecord(
        "deltarl.refit.apply", logging.WARNING, __file__, 1, "version %d: %s", (7, "x"), _failed()
    )
    record.version = 7
    line = formatter.format(record)
    assert "\n" not in line
    out = orjson.loads(line)
    assert out["daemon"] == "apply"
    assert out["name"] == "apply-b"
    assert out["level"] == "WARNING"
    assert out["msg"] == "version 7: x"
    assert out["version"] == 7
    assert "RuntimeError: boom" in out["exc"]
    assert "step" not in out  # only the context a record carries


def test_an_unknown_log_format_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "deltarl.toml"
    write_toml(config, {"daemons": {"reward": {"control": "ipc:///tmp/x", "log_format": "xml"}}})
    with pytest.raises(ConfigError, match="log_format"):
        load(RewardConfig, "reward", str(config))


def _ctl(config: Path, *args: str) -> dict[str, object]:
    return ctl_json(config, *args)[1]


def test_a_daemon_logs_json_and_audits_operator_commands(tmp_path: Path) -> None:
    """The reward daemon, logging JSON, with an audit file: a status (not audited), a pause
    it cannot do (audited with its error), then a drain (audited, ok) that stops it."""
    config, audit = tmp_path / "deltarl.toml", tmp_path / "audit.jsonl"
    table = {
        "control": f"ipc://{tmp_path}/r.sock",
        "log_format": "json",
        "audit_log": str(audit),
    }
    write_toml(config, {"daemons": {"reward": table}})
    env = {k: v for k, v in os.environ.items() if k != "DELTARL_LOG_FORMAT"}
    with running_daemon(config, "reward", env) as proc:
        assert not _ctl(config, "reward", "pause")["ok"]  # the reward daemon has no pause
        assert _ctl(config, "reward", "drain")["ok"]
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    lines = [orjson.loads(line) for line in err.splitlines() if line.strip()]
    assert lines
    assert all(line["daemon"] == "reward" for line in lines)
    records = [orjson.loads(line) for line in audit.read_text().splitlines()]
    assert [(r["command"], r["result"]) for r in records] == [
        ("pause", "unsupported"),
        ("drain", "ok"),
    ]
    for r in records:
        assert r["peer"].startswith("a local peer (")
        assert isinstance(r["request_id"], int)
    assert "draining" in records[1]["reason"]
    # ... and the same records in the daemon's own log.
    assert [x["command"] for x in lines if x["logger"] == "deltarl.audit"] == ["pause", "drain"]
