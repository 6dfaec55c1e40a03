"""`deltarl ctl` against a demo daemon running in its own process."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from deltarl import ctl
from deltarl.config import files as config_files
from deltarl.transport.messages import Status

# A stand-in daemon: status, pause and shutdown handlers, nothing else (so "rollback" is
# answered "unsupported"). It prints its bound endpoint once it is serving.
DEMO_DAEMON = """
import asyncio, sys
from deltarl.transport.control import ControlServer
from deltarl.transport.messages import GetStatus, Ok, Pause, Shutdown, Status

async def main(endpoint):
    state = {"state": "running"}

    async def status(_):
        return Status("demo", state["state"], {"version": 7, "queue": {"depth": 2}, "lag": None})

    async def pause(_):
        state["state"] = "paused"
        return Ok("paused")

    async def shutdown(_):
        server.stop()
        return Ok("stopping")

    server = ControlServer(endpoint, {GetStatus: status, Pause: pause, Shutdown: shutdown},
                           name="demo")
    print(server.bind(), flush=True)
    await server.serve()

asyncio.run(main(sys.argv[1]))
"""


def start_daemon(endpoint: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", DEMO_DAEMON, endpoint], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    bound = proc.stdout.readline().strip()
    assert bound, f"demo daemon died (rc {proc.poll()})"
    return proc, bound


@pytest.fixture(scope="module")
def daemon(tmp_path_factory) -> tuple[str, Path]:
    """(endpoint, TOML config naming it "demo") of a demo daemon shared by this module."""
    tmp = tmp_path_factory.mktemp("ctl")
    proc, endpoint = start_daemon(f"ipc://{tmp}/demo.sock")
    config = tmp / "deltarl.toml"
    config.write_text(
        f'[daemons.demo]\ncontrol = "{endpoint}"\n\n[daemons.export]\ncontrol = "tcp://10.0.0.1:5555"\n'
    )
    yield endpoint, config
    proc.kill()
    proc.wait()


def test_status_prints_aligned_lines(daemon, capsys):
    _, config = daemon
    assert ctl.main(["demo", "status", "--config", str(config)]) == ctl.EXIT_OK
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["daemon:", "demo"]
    assert lines[1].split()[0] == "state:"
    assert "queue.depth: 2" in " ".join(" ".join(line.split()) for line in lines)
    columns = {len(line) - len(line.split(maxsplit=1)[1]) for line in lines}
    assert len(columns) == 1  # every value starts in the same column


def test_status_json_is_exactly_one_object(daemon, capsys):
    endpoint, config = daemon
    assert ctl.main(["demo", "status", "--json", "--config", str(config)]) == ctl.EXIT_OK
    out = capsys.readouterr().out
    report = orjson.loads(out)  # fails if there is anything but one JSON document
    assert report["ok"] is True
    assert report["endpoint"] == endpoint
    assert report["reply"]["type"] == "status"
    assert report["reply"]["body"]["fields"]["version"] == 7


def test_endpoint_as_target_and_pause(daemon, capsys):
    endpoint, _ = daemon
    assert ctl.main([endpoint, "pause"]) == ctl.EXIT_OK
    assert capsys.readouterr().out.strip() == f"{endpoint}: pause: ok (paused)"


def test_error_reply_exits_1_and_names_the_problem(daemon, capsys):
    _, config = daemon
    assert ctl.main(["demo", "rollback", "--to", "3", "--config", str(config)]) == 1
    err = capsys.readouterr().err
    assert "rollback failed: unsupported" in err
    assert "demo does not handle 'rollback'" in err


def test_error_reply_with_json(daemon, capsys):
    _, config = daemon
    assert ctl.main(["demo", "resync", "--json", "--config", str(config)]) == 1
    report = orjson.loads(capsys.readouterr().out)
    assert report["ok"] is False
    assert report["error"]["code"] == "unsupported"


def test_unknown_target_exits_2_and_lists_the_known_ones(daemon, capsys):
    _, config = daemon
    assert ctl.main(["trainer", "status", "--config", str(config)]) == ctl.EXIT_USAGE
    err = capsys.readouterr().err
    assert "unknown target 'trainer'" in err
    assert "demo, export" in err


def test_unknown_target_without_config(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv(ctl.CONFIG_ENV, raising=False)
    monkeypatch.setattr(config_files, "DEFAULT_CONFIG", tmp_path / "absent.toml")
    assert ctl.main(["demo", "status", "--json"]) == ctl.EXIT_USAGE
    report = orjson.loads(capsys.readouterr().out)
    assert report["error"]["code"] == "unknown_target"
    assert "--config" in report["error"]["message"]


def test_unreachable_daemon_exits_3_naming_endpoint_and_command(tmp_path, capsys):
    endpoint = f"ipc://{tmp_path}/nobody.sock"
    start = time.monotonic()
    assert ctl.main([endpoint, "pause", "--timeout", "0.2"]) == ctl.EXIT_UNREACHABLE
    assert time.monotonic() - start < 2.0
    err = capsys.readouterr().err
    assert endpoint in err
    assert "'pause'" in err


def test_json_config_and_environment_variable(daemon, tmp_path, monkeypatch, capsys):
    endpoint, _ = daemon
    config = tmp_path / "deltarl.json"
    config.write_bytes(orjson.dumps({"daemons": {"apply": {"control": endpoint}}}))
    monkeypatch.setenv(ctl.CONFIG_ENV, str(config))
    assert ctl.main(["apply", "status", "--json"]) == ctl.EXIT_OK
    assert orjson.loads(capsys.readouterr().out)["target"] == "apply"


def test_ctl_in_a_subprocess(daemon):
    _, config = daemon
    code = "import sys; from deltarl.ctl import main; sys.exit(main(sys.argv[1:]))"
    result = subprocess.run(
        [sys.executable, "-c", code, "demo", "status", "--json", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert orjson.loads(result.stdout)["reply"]["body"]["daemon"] == "demo"


def test_shutdown_is_acknowledged_and_the_daemon_exits(tmp_path, capsys):
    proc, endpoint = start_daemon(f"ipc://{tmp_path}/down.sock")
    try:
        assert ctl.main([endpoint, "shutdown"]) == ctl.EXIT_OK
        assert "shutdown: ok (stopping)" in capsys.readouterr().out
        assert proc.wait(timeout=5) == 0
    finally:
        proc.kill()
        proc.wait()


# -- the pure parts ---------------------------------------------------------------------


def test_format_status_flattens_and_aligns():
    text = ctl.format_status(
        Status("apply", "paused", {"version": 3, "store": {"active": 1, "leases": []}, "ok": True})
    )
    assert text.splitlines() == [
        "daemon:       apply",
        "state:        paused",
        "version:      3",
        "store.active: 1",
        "store.leases: []",
        "ok:           true",
    ]


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("[daemons.demo]\ncontrol = 5\n", "has no 'control' endpoint"),
        ('[daemons.demo]\ncontrol = "http://x"\n', "bad control endpoint"),
        ("daemons = 3\n", "'daemons' must be a table"),
        ("[daemons.demo\n", "is not valid"),
    ],
)
def test_bad_configs_are_named(tmp_path, content, needle):
    config = tmp_path / "c.toml"
    config.write_text(content)
    with pytest.raises(ctl.TargetError, match="config") as e:
        ctl.resolve_target("demo", config)
    assert needle in str(e.value)


def test_missing_config_file(tmp_path):
    with pytest.raises(ctl.TargetError, match="cannot read config"):
        ctl.resolve_target("demo", tmp_path / "absent.toml")


def test_endpoint_targets_skip_the_config():
    assert ctl.resolve_target("tcp://127.0.0.1:5555", None) == "tcp://127.0.0.1:5555"
    with pytest.raises(ctl.TargetError, match="bad control endpoint"):
        ctl.resolve_target("udp://x:1", None)


def test_config_path_precedence(tmp_path, monkeypatch):
    monkeypatch.setattr(config_files, "DEFAULT_CONFIG", tmp_path / "absent.toml")
    assert ctl.config_path("a.toml", {ctl.CONFIG_ENV: "b.toml"}) == Path("a.toml")
    assert ctl.config_path(None, {ctl.CONFIG_ENV: "b.toml"}) == Path("b.toml")
    assert ctl.config_path(None, {}) is None


def test_to_is_only_for_rollback(capsys):
    assert ctl.main(["tcp://127.0.0.1:1", "pause", "--to", "3"]) == ctl.EXIT_USAGE
    assert "--to is only meaningful with rollback" in capsys.readouterr().err


def test_history_table_shows_reward_latency_and_held_out_rounds() -> None:
    from deltarl.rl.protocol import History  # noqa: PLC0415 - only this test needs it

    steps = [
        {
            "step": 1,
            "version": 1,
            "reward_mean": 0.25,
            "reward_p99_s": 0.0123,
            "token_lag_mean": 1.625,
            "over_bound_token_ratio": 0.375,
        },
        {"step": 5, "version": 5, "reward_mean": 0.5, "eval_accuracy": 0.0546875},
    ]
    evals = [
        {"step": 0, "accuracy": 0.0546875, "version_min": 0, "version_max": 0, "finished": True},
        {"step": 5, "accuracy": 0.0625, "version_min": 5, "version_max": 6, "finished": False},
    ]
    lines = ctl.format_history(History({}, steps, {}, evals)).splitlines()
    assert "reward p99 s" in lines[0]
    assert "eval acc" in lines[0]
    assert "0.0123" in lines[1]
    assert "tok lag" in lines[0]
    assert "over bound" in lines[0]
    assert "1.62" in lines[1].split()
    assert "0.375" in lines[1].split()
    assert "0.055" in lines[2]
    assert lines[3] == "held-out eval: step 0 0.055 (v0), step 5 0.062 (v5-6, running)"
    assert lines[4] == "drops: none"
