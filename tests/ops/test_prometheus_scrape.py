"""A real Prometheus (Debian's ``prometheus``) scraping a running ``deltarl up`` pipeline.

The five daemons serve ``deltarl_*`` on loopback ports (``deltarl up --metrics-port``); the
test's own Prometheus scrapes them every half second. Mid-run the trainer is paused, and once
the apply agent has gone quiet the refit histogram's count and the versions counters must equal
what the apply agent itself reports in its status (versions applied); the bubbles, tokens,
training and rollout series must have arrived from their daemons. Then training resumes and
the run must finish as usual.

Skips, saying why, only where the ``prometheus`` binary is absent (scripts/install.sh --test
installs Debian's package) or vLLM is.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from deltarl.transport.ports import free_port_block
from tests.installed import require_vllm
from tests.ops.helpers import ctl_json

require_vllm()

PROMETHEUS = shutil.which("prometheus")
if PROMETHEUS is None:
    pytest.skip(
        "the prometheus server is not installed (Debian package prometheus;"
        " scripts/install.sh --test installs it where apt-get can)",
        allow_module_level=True,
    )

pytestmark = pytest.mark.timeout(900)

DAEMONS = ("scheduler", "trainer", "export", "apply", "rollout")
SCRAPE_S = 0.5


class Prom:
    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"

    def query(self, expr: str) -> list[dict[str, Any]]:
        q = urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(f"{self.url}/api/v1/query?{q}", timeout=5) as r:
            body = orjson.loads(r.read())
        assert body["status"] == "success", body
        return list(body["data"]["result"])

    def value(self, expr: str) -> float | None:
        result = self.query(expr)
        return None if not result else float(result[0]["value"][1])

    def wait(self, expr: str, ok: Callable[[float], bool], timeout_s: float, what: str) -> float:
        end = time.monotonic() + timeout_s
        while True:
            try:
                value = self.value(expr)
            except OSError:
                value = None
            if value is not None and ok(value):
                return value
            if time.monotonic() > end:
                raise AssertionError(f"{what}: {expr} = {value} after {timeout_s:.0f} s")
            time.sleep(0.5)


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[tuple[Prom, int]]:
    base = free_port_block(len(DAEMONS) + 1)
    targets = [f"127.0.0.1:{base + i}" for i in range(len(DAEMONS))]
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n"
        f"  scrape_interval: {int(SCRAPE_S * 1000)}ms\n"
        f"  scrape_timeout: {int(SCRAPE_S * 1000)}ms\n"
        "scrape_configs:\n"
        "  - job_name: deltarl\n"
        f"    static_configs:\n      - targets: {orjson.dumps(targets).decode()}\n"
    )
    port = base + len(DAEMONS)
    log = (tmp_path / "prometheus.log").open("wb")
    assert PROMETHEUS is not None
    proc = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    prom = Prom(port)
    try:
        end = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{prom.url}/-/ready", timeout=2):
                    break
            except OSError:
                assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()[-3000:]
                assert time.monotonic() < end, "prometheus not ready in 60 s"
                time.sleep(0.2)
        yield prom, base
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def _ctl(config: Path, *args: str) -> dict[str, Any]:
    code, out = ctl_json(config, *args)
    assert code == 0, out
    return out


def _applied_when_quiet(config: Path, quiet_s: float = 4.0, timeout_s: float = 180) -> int:
    """The apply agent's count of applied versions once it has not moved for ``quiet_s``."""
    end = time.monotonic() + timeout_s
    last, since = None, time.monotonic()
    while time.monotonic() < end:
        fields = _ctl(config, "apply", "status")["reply"]["body"]["fields"]
        now = (fields["applied"], fields["applying"])
        if now != last:
            last, since = now, time.monotonic()
        elif now[1] is None and time.monotonic() - since >= quiet_s:
            return int(now[0])
        time.sleep(0.5)
    raise AssertionError(f"the apply agent never went quiet: {last}")


def test_prometheus_scrapes_a_running_pipeline(
    prometheus: tuple[Prom, int], tmp_path: Path
) -> None:
    prom, base = prometheus
    home, workdir = tmp_path / "home", tmp_path / "run"
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "deltarl.cli",
            "up",
            "--json",
            "--steps",
            "10",
            "--workdir",
            str(workdir),
            "--metrics-port",
            str(base),
        ],
        env={**os.environ, "DELTARL_HOME": str(home)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    config = workdir / "deltarl.toml"
    try:
        prom.wait('count(up{job="deltarl"} == 1)', lambda v: v == len(DAEMONS), 600, "targets up")
        prom.wait("sum(deltarl_refit_versions_total)", lambda v: v >= 3, 600, "refits applied")
        assert "paused" in _ctl(config, "trainer", "pause")["reply"]["body"]["detail"]
        applied = _applied_when_quiet(config)
        time.sleep(4 * SCRAPE_S)  # two scrapes after the last change
        assert prom.value('deltarl_refit_stage_seconds_count{stage="total"}') == applied
        assert prom.value("sum(deltarl_refit_versions_total)") == applied
        assert prom.value('deltarl_refit_versions_total{kind="full"}') == 1  # the first only
        assert prom.value("sum(deltarl_export_versions_total)") == applied
        assert prom.value("deltarl_active_version") == prom.value("deltarl_acked_version")
        assert prom.value("deltarl_checksum_failures_total") == 0
        assert prom.value("deltarl_refit_wire_bytes_total") == prom.value(
            "sum(deltarl_export_wire_bytes_total)"
        )
        names = {r["metric"]["daemon"] for r in prom.query("deltarl_daemon_info")}
        assert names == set(DAEMONS)
        for series in (
            "deltarl_steps_total",
            'deltarl_tokens_total{fate="trained"}',
            "deltarl_samples_total",
            "deltarl_train_step_seconds_count",
            "deltarl_rollout_busy_seconds_total",
            "deltarl_rollout_stepping_round_seconds_total",
            'deltarl_rollout_tokens_total{kind="completion"}',
            "deltarl_reward_seconds_count",
            'deltarl_instance_healthy{rollout="rollout"}',
            "deltarl_changed_ratio",
            "count(deltarl_group_changed_ratio)",
        ):
            assert (prom.value(series) or 0) > 0, series
        assert prom.value("deltarl_policy_lag_bound") == 1
        for share in ("deltarl_train_clip_fraction", "deltarl_train_cap_fraction"):
            value = prom.value(share)  # set by every step
            assert value is not None, share
            assert 0.0 <= value <= 1.0, share
        assert prom.value("deltarl_train_clip_fraction") == 0.0  # the decoupled objective
        assert prom.value('deltarl_daemon_state{state="paused"}') == 1  # the trainer's
        _ctl(config, "trainer", "resume")
        out, err = up.communicate(timeout=600)
    finally:
        if up.poll() is None:
            up.terminate()
            up.communicate(timeout=120)
    assert up.returncode == 0, err[-4000:]
    result = orjson.loads(out.strip().splitlines()[-1])
    assert result["steps"] == 10
