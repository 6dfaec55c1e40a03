"""The /metrics server (deltarl/ops/exposition.py) on real sockets, and the ``metrics`` key of
every daemon table; then a real daemon process serving its runtime's series."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import pytest

from deltarl.config import ConfigError, load, write_toml
from deltarl.config.reward import RewardConfig
from deltarl.ops import metrics
from deltarl.ops.exposition import MAX_REQUEST_BYTES, MetricsServer, parse_address
from deltarl.transport.ports import free_port


def test_parse_address() -> None:
    assert parse_address("127.0.0.1:9400") == ("127.0.0.1", 9400)
    assert parse_address("[::1]:0") == ("::1", 0)
    assert parse_address("unix:/run/deltarl/x.metrics") == Path("/run/deltarl/x.metrics")
    for bad in ("9400", ":9400", "host:port", "host:70000", "unix:relative/path", ""):
        with pytest.raises(ValueError, match="metrics"):
            parse_address(bad)


async def _raw(
    connect: Coroutine[Any, Any, tuple[asyncio.StreamReader, asyncio.StreamWriter]],
    request: bytes,
) -> bytes:
    reader, writer = await connect
    writer.write(request)
    await writer.drain()
    data = await reader.read()
    writer.close()
    return data


async def _serve_and_ask(address: str, *requests: bytes) -> list[bytes]:
    server = MetricsServer(address)
    bound = await server.start()
    try:
        answers = []
        for request in requests:
            if bound.startswith("unix:"):
                connect = asyncio.open_unix_connection(bound[len("unix:") :])
            else:
                host, _, port = bound.rpartition(":")
                connect = asyncio.open_connection(host, int(port))
            answers.append(await _raw(connect, request))
        return answers
    finally:
        await server.stop()


def test_tcp_answers_get_metrics_and_refuses_the_rest() -> None:
    metrics.REFIT_VERSIONS.labels("delta").inc(0)  # a labelled family with a sample
    serving = metrics.register_daemon("apply")
    try:
        ok, missing, post, garbage = asyncio.run(
            _serve_and_ask(
                "127.0.0.1:0",
                b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n",
                b"GET / HTTP/1.1\r\n\r\n",
                b"POST /metrics HTTP/1.1\r\n\r\n",
                b"hello\r\n\r\n",
            )
        )
    finally:
        serving()
    head, _, body = ok.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK")
    assert b"text/plain; version=0.0.4" in head
    assert int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0]) == len(body)
    text = body.decode()
    assert "deltarl_process_open_fds " in text
    assert 'deltarl_refit_versions_total{kind="delta"}' in text
    assert "deltarl_trainer_version" not in text  # the scheduler's: not served by an apply agent
    # No series outside deltarl_* (no library globals such as python_gc_*).
    names = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}
    assert names
    assert all(n.startswith("deltarl_") for n in names), names
    assert missing.startswith(b"HTTP/1.1 404")
    assert post.startswith(b"HTTP/1.1 405")
    assert garbage.startswith(b"HTTP/1.1 400")


def test_an_oversized_request_gets_no_answer_and_the_server_lives_on() -> None:
    huge = b"GET /metrics HTTP/1.1\r\nX: " + b"a" * (2 * MAX_REQUEST_BYTES) + b"\r\n\r\n"
    dropped, ok = asyncio.run(_serve_and_ask("127.0.0.1:0", huge, b"GET /metrics HTTP/1.1\r\n\r\n"))
    assert dropped == b""
    assert ok.startswith(b"HTTP/1.1 200")


def test_unix_socket_replaces_a_stale_one_and_is_removed_at_stop(tmp_path: Path) -> None:
    path = tmp_path / "daemon.metrics"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))  # what a killed daemon leaves behind
    stale.close()

    async def check() -> bytes:
        server = MetricsServer(f"unix:{path}")
        await server.start()
        assert stat.S_IMODE(path.stat().st_mode) == 0o660
        reader, writer = await asyncio.open_unix_connection(str(path))
        writer.write(b"GET /metrics HTTP/1.1\r\n\r\n")
        data = await reader.read()
        writer.close()
        await server.stop()
        return data

    assert asyncio.run(check()).startswith(b"HTTP/1.1 200")
    assert not path.exists()


def test_a_silent_client_is_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("deltarl.ops.exposition.CLIENT_TIMEOUT_S", 0.2)

    async def check() -> bytes:
        server = MetricsServer("127.0.0.1:0")
        host, _, port = (await server.start()).rpartition(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"GET /metrics HTTP/1.1\r\n")  # never ends its head
        data = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        await server.stop()
        return data

    assert asyncio.run(check()) == b""


def test_the_metrics_key_is_checked_where_the_table_is_read(tmp_path: Path) -> None:
    config = tmp_path / "deltarl.toml"
    table = {"control": f"ipc://{tmp_path}/r.sock", "metrics": "nowhere"}
    write_toml(config, {"daemons": {"reward": table}})
    with pytest.raises(ConfigError, match=r"reward.*metrics"):
        load(RewardConfig, "reward", str(config))
    table["metrics"] = "127.0.0.1:9400"
    write_toml(config, {"daemons": {"reward": table}})
    assert load(RewardConfig, "reward", str(config)).metrics == "127.0.0.1:9400"


def _scrape(url: str, deadline_s: float) -> str:
    end = time.monotonic() + deadline_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                return r.read().decode()
        except (urllib.error.URLError, ConnectionError):
            if time.monotonic() > end:
                raise
            time.sleep(0.1)


def test_a_daemon_process_serves_its_runtime_and_a_busy_port_is_a_config_error(
    tmp_path: Path,
) -> None:
    """The reward daemon (the lightest one) as a real process: its runtime's series at
    scrape time; a second one on the same port exits 78 (EX_CONFIG) and says why."""
    port = free_port()
    config = tmp_path / "deltarl.toml"
    write_toml(
        config,
        {
            "daemons": {
                "reward": {"control": f"ipc://{tmp_path}/r.sock", "metrics": f"127.0.0.1:{port}"},
                "reward-2": {
                    "control": f"ipc://{tmp_path}/r2.sock",
                    "metrics": f"127.0.0.1:{port}",
                },
            }
        },
    )
    cmd = [sys.executable, "-m", "deltarl.cli", "reward", "--config", str(config)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    first = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        text = _scrape(f"http://127.0.0.1:{port}/metrics", 60)
        assert 'deltarl_daemon_info{daemon="reward",name="reward",version="' in text
        assert 'deltarl_daemon_state{state="running"} 1.0' in text
        assert 'deltarl_event_loop_lag_seconds{stat="max"}' in text
        assert 'deltarl_mailbox_depth{actor="reward:core"} 0.0' in text
        second = subprocess.run(
            [*cmd, "--name", "reward-2"],
            check=False,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode == 78, second.stderr
        assert f"metrics 127.0.0.1:{port}" in second.stderr
        # The refused second daemon released what it had made; the first serves on.
        assert not (tmp_path / "r2.sock").exists()
        assert "deltarl_daemon_info" in _scrape(f"http://127.0.0.1:{port}/metrics", 5)
    finally:
        first.terminate()
        first.wait(60)
    assert first.returncode == 0


def test_tensor_groups_are_bounded_and_ratios_are_per_group() -> None:
    assert metrics.tensor_group("model.layers.11.mlp.up_proj.weight") == (
        "model.layers.*.mlp.up_proj.weight"
    )
    assert metrics.tensor_group("lm_head.weight") == "lm_head.weight"
    metrics.observe_groups(
        [
            ("model.layers.0.mlp.up_proj.weight", 10, 100),
            ("model.layers.1.mlp.up_proj.weight", 30, 100),
            ("model.norm.weight", 0, 8),
        ]
    )
    served = metrics.catalogue()
    name = "deltarl_group_changed_ratio"
    assert served.get_sample_value(name, {"group": "model.layers.*.mlp.up_proj.weight"}) == 0.2
    assert served.get_sample_value(name, {"group": "model.norm.weight"}) == 0.0
