"""The units under systemd/: `systemd-analyze verify` accepts them, and each says what it must.

verify wants ExecStart's binary to exist, so it checks copies whose ExecStart points at an
executable stub; nothing else in the copies differs from the shipped files. The rollout
daemon's unit is a template, which verify accepts only under an instance name: it is checked as
the copy deltarl-rollout@0.service.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from deltarl import ctl
from deltarl.engine.segment import segment_path
from deltarl.transport.blobs import samples_endpoint

SYSTEMD = Path(__file__).resolve().parent.parent / "systemd"
SERVICES = {
    "export": "deltarl-export.service",
    "apply": "deltarl-apply.service",
    "trainer": "deltarl-trainer.service",
    "scheduler": "deltarl-scheduler.service",
    "rollout": "deltarl-rollout@.service",
    "reward": "deltarl-reward.service",
}
# The template's instance that verify checks (verify needs an instance name).
INSTANCES = {"deltarl-rollout@.service": "deltarl-rollout@0.service"}
# Arguments after --config: each rollout instance reads its own [daemons.rollout-N] table.
EXTRA_ARGS = {"rollout": " --name rollout-%i"}
# The RL daemons' tables in deltarl.toml.example are commented out (see that file).
COMMENTED_TABLES = ("trainer", "scheduler", "rollout-0", "reward")
TARGET = "deltarl.target"
BINARY = "/usr/local/bin/deltarl"
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")

# What verify may say about the machine running the test rather than about the units: the
# service user does not exist here. Anything else it prints fails the test.
ENVIRONMENT_NOISE = (
    re.compile(r"Failed to resolve (user|group) ['\"]?deltarl['\"]?"),
    re.compile(r"(User|Group) ['\"]?deltarl['\"]? (does not exist|not found)"),
)

Unit = dict[str, list[tuple[str, str]]]


def parse_unit(text: str) -> Unit:
    """Sections of a unit file as (key, value) lists: keys may repeat (Environment=)."""
    sections: Unit = {}
    current: list[tuple[str, str]] | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        assert not line.endswith("\\"), f"continuation lines are not expected: {raw!r}"
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], [])
            continue
        assert current is not None, f"directive outside a section: {raw!r}"
        key, sep, value = line.partition("=")
        assert sep, f"not a directive: {raw!r}"
        current.append((key.strip(), value.strip()))
    return sections


def values(unit: Unit, section: str, key: str) -> list[str]:
    return [v for k, v in unit.get(section, []) if k == key]


def one(unit: Unit, section: str, key: str) -> str:
    found = values(unit, section, key)
    assert len(found) == 1, f"[{section}] {key}= should appear once, found {found}"
    return found[0]


def load(name: str) -> Unit:
    return parse_unit((SYSTEMD / name).read_text())


@pytest.mark.parametrize("daemon", sorted(SERVICES))
def test_service_has_every_required_directive(daemon: str) -> None:
    unit = load(SERVICES[daemon])
    expected = {
        "Type": "notify",
        "NotifyAccess": "main",
        "WatchdogSec": "30",
        "Restart": "on-failure",
        "KillMode": "mixed",
        "ExecStart": f"{BINARY} {daemon} --config /etc/deltarl/deltarl.toml"
        + EXTRA_ARGS.get(daemon, ""),
        "EnvironmentFile": "-/etc/deltarl/deltarl.env",
        "User": "deltarl",
        "RuntimeDirectory": "deltarl",
        # Shared by every deltarl unit on the host: one unit stopping must not delete it.
        "RuntimeDirectoryPreserve": "yes",
        "StateDirectory": "deltarl",
        "CacheDirectory": "deltarl",
        # 78 is EX_CONFIG: restarting cannot fix a bad configuration.
        "RestartPreventExitStatus": "78",
        "Group": "deltarl",
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
    }
    for key, value in expected.items():
        assert one(unit, "Service", key) == value, key
    assert set(one(unit, "Service", "ReadWritePaths").split()) == {
        "/dev/shm",
        "/var/lib/deltarl",
        "/run/deltarl",
    }
    assert float(one(unit, "Service", "RestartSec")) > 0
    assert float(one(unit, "Service", "TimeoutStopSec")) > 0
    assert one(unit, "Unit", "PartOf") == TARGET
    assert one(unit, "Install", "WantedBy") == TARGET
    # JIT compilers (numba, torch) need writable-executable memory; GPUs need /dev.
    for forbidden in ("MemoryDenyWriteExecute", "PrivateDevices", "ProtectClock"):
        assert not values(unit, "Service", forbidden), forbidden


def ordering(unit: Unit, key: str) -> set[str]:
    return {name for line in values(unit, "Unit", key) for name in line.split()}


def test_rl_units_say_what_each_daemon_needs() -> None:
    trainer = load(SERVICES["trainer"])
    assert "deltarl-export.service" in ordering(trainer, "Before")
    # SIGTERM makes the trainer write a checkpoint before it exits: room for it.
    assert float(one(trainer, "Service", "TimeoutStopSec")) >= 120
    rollout = load(SERVICES["rollout"])
    assert "deltarl-apply.service" in ordering(rollout, "After")
    assert float(one(rollout, "Service", "TimeoutStartSec")) >= 600  # model load
    assert one(rollout, "Service", "LimitMEMLOCK") == "infinity"
    caches = dict(
        setting.split("=", 1)
        for line in values(rollout, "Service", "Environment")
        for setting in line.split()
    )
    for variable in ("VLLM_CACHE_ROOT", "HF_HOME", "XDG_CACHE_HOME"):
        assert caches[variable].startswith("%C/deltarl"), variable  # the CacheDirectory


def test_no_unit_orders_against_a_template() -> None:
    # Before=/After= name units; a template (NAME@.service) is no unit any instance is, so
    # ordering against it orders nothing. The rollout template orders itself instead.
    for name in (*SERVICES.values(), TARGET):
        unit = load(name)
        for key in ("Before", "After", "Wants", "Requires"):
            for other in ordering(unit, key):
                assert "@." not in other, f"{name}: {key}={other}"


def test_target_is_installed_in_multi_user() -> None:
    unit = load(TARGET)
    assert one(unit, "Install", "WantedBy") == "multi-user.target"
    assert not unit.get("Service")


def stub_copies(tmp_path: Path) -> dict[str, Path]:
    """Copies of the units whose ExecStart runs an executable stub under tmp_path."""
    stub = tmp_path / "bin" / "deltarl"
    stub.parent.mkdir()
    stub.write_text("#!/bin/sh\nexit 0\n")
    stub.chmod(0o755)
    units = tmp_path / "units"
    units.mkdir()
    copies = {}
    for name in (*SERVICES.values(), TARGET):
        text = (SYSTEMD / name).read_text()
        stubbed = text.replace(f"ExecStart={BINARY} ", f"ExecStart={stub} ")
        assert (stubbed != text) == name.endswith(".service")  # only ExecStart= changed
        copies[name] = units / INSTANCES.get(name, name)
        copies[name].write_text(stubbed)
    return copies


def verify(*paths: Path) -> tuple[int, list[str]]:
    assert SYSTEMD_ANALYZE is not None
    done = subprocess.run(
        [SYSTEMD_ANALYZE, "verify", "--man=no", *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    lines = (done.stdout + done.stderr).splitlines()
    complaints = [
        line
        for line in lines
        if line.strip() and not any(p.search(line) for p in ENVIRONMENT_NOISE)
    ]
    return done.returncode, complaints


needs_verify = pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze not installed")


@needs_verify
@pytest.mark.parametrize("name", [*SERVICES.values(), TARGET])
def test_systemd_analyze_verify_accepts_the_unit(tmp_path: Path, name: str) -> None:
    copies = stub_copies(tmp_path)
    rc, complaints = verify(copies[name], copies[TARGET])
    assert complaints == []
    assert rc == 0


@needs_verify
def test_verify_check_catches_a_bad_unit(tmp_path: Path) -> None:
    """The check above can fail: a misspelt key and a missing binary are both reported."""
    copies = stub_copies(tmp_path)
    broken = copies[SERVICES["export"]]
    text = broken.read_text().replace("KillMode=mixed", "KilMode=mixed")
    broken.write_text(text.replace(str(tmp_path / "bin" / "deltarl"), "/nonexistent/deltarl"))
    rc, complaints = verify(broken, copies[TARGET])
    assert any("Unknown key" in line and "KilMode" in line for line in complaints)
    assert any("/nonexistent/deltarl" in line for line in complaints)
    assert rc != 0


def test_config_example_names_each_unit_daemon_and_its_stores() -> None:
    path = SYSTEMD / "deltarl.toml.example"
    config = tomllib.loads(path.read_text())
    for daemon in ("trainer", "export", "apply"):
        name = SERVICES[daemon]
        # `deltarl ctl export status` resolves through this very table.
        assert ctl.resolve_target(daemon, path) == f"ipc:///run/deltarl/{daemon}.sock"
        # The socket lives in the units' RuntimeDirectory.
        assert one(load(name), "Service", "RuntimeDirectory") == "deltarl"
    export, apply = config["daemons"]["export"], config["daemons"]["apply"]
    for store in (export["published_store"], apply["rollout_store"]):
        segment_path(store, None)  # a valid weight-store name, or ValueError
    assert export["manifest_store"].startswith("/var/lib/deltarl/")  # the StateDirectory
    assert isinstance(export["full_resync_every"], int)
    assert export["full_resync_every"] > 0


def commented_table(text: str, name: str) -> str:
    """The commented-out ``[daemons.NAME]`` table of the example, uncommented: its header line
    and the ``# key = value`` lines right after it."""
    lines = text.splitlines()
    start = lines.index(f"# [daemons.{name}]")
    table = []
    for line in lines[start:]:
        if not re.match(r"# \S", line):
            break
        table.append(line[2:])
    return "\n".join(table) + "\n"


@pytest.mark.parametrize("name", COMMENTED_TABLES)
def test_config_example_shows_each_rl_daemon_table(tmp_path: Path, name: str) -> None:
    text = (SYSTEMD / "deltarl.toml.example").read_text()
    table = tomllib.loads(commented_table(text, name))["daemons"][name]
    daemon = name.partition("-")[0]
    expected = {
        "trainer": {
            "control",
            "scheduler",
            "published_store",
            "model_dir",
            "checkpoint_dir",
            "checkpoint_every",
            "lr",
            "groups_per_step",
            "ranks",
            "device",
            "threads",
        },
        "scheduler": {
            "control",
            "db",
            "samples",
            "group_size",
            "groups_per_step",
            "pool_capacity",
            "max_policy_lag_steps",
            "on_lag_exceeded",
        },
        # apply_control is accepted but unused: the digest is in the rollout store
        "rollout": {"control", "scheduler", "rollout_store", "model_dir"},
        "reward": {"control", "task", "scorer", "max_concurrency"},
    }[daemon]
    assert set(table) == expected
    assert f"deltarl {daemon} --help" in text  # where the keys are described
    # Uncommented, `deltarl ctl NAME status` finds the socket in the units' RuntimeDirectory.
    uncommented = tmp_path / "deltarl.toml"
    uncommented.write_text(commented_table(text, name))
    assert ctl.resolve_target(name, uncommented) == f"ipc:///run/deltarl/{name}.sock"
    config = tomllib.loads(text)["daemons"]
    scheduler = tomllib.loads(commented_table(text, "scheduler"))["daemons"]["scheduler"]
    if "scheduler" in table:
        assert table["scheduler"] == scheduler["control"]
    if daemon == "trainer":
        assert table["published_store"] == config["export"]["published_store"]
        assert table["groups_per_step"] == scheduler["groups_per_step"]
        assert table["checkpoint_dir"].startswith("/var/lib/deltarl/")  # the StateDirectory
    if daemon == "scheduler":
        assert table["db"].startswith("/var/lib/deltarl/")  # the StateDirectory
        # Shown as what every daemon derives when it is not set.
        assert table["samples"] == samples_endpoint(table["control"])
    if daemon == "reward":
        client = tomllib.loads(commented_table(text, "scheduler.reward"))["daemons"]
        assert client["scheduler"]["reward"]["endpoint"] == table["control"]
        assert table["task"] == scheduler.get("task", "default")
        # Both tables are configurations the daemons accept.
        from deltarl.config.reward import RewardClientConfig, RewardConfig  # noqa: PLC0415
        from deltarl.config.tables import build  # noqa: PLC0415

        build(RewardConfig, "reward", table)
        build(RewardClientConfig, "scheduler.reward", client["scheduler"]["reward"])
    if daemon == "rollout":
        assert table["rollout_store"] == config["apply"]["rollout_store"]
        assert "apply_control" not in table  # unused: the digest is in the rollout store
        segment_path(table["rollout_store"], None)


def test_config_example_loads_for_every_daemon() -> None:
    # The example is what operators copy: every table must be a config the daemon accepts.
    from deltarl.config import load  # noqa: PLC0415
    from deltarl.config.refit import ApplyConfig, ExportConfig, TrainerConfig  # noqa: PLC0415

    path = str(SYSTEMD / "deltarl.toml.example")
    load(TrainerConfig, "trainer", path)
    export = load(ExportConfig, "export", path)
    apply = load(ApplyConfig, "apply", path)
    assert export.apply_control == apply.control
    assert export.apply_events == apply.events  # the acknowledgements arrive as events
    assert export.link.type == apply.link.type


def test_env_example_is_plain_key_value_lines() -> None:
    # systemd's EnvironmentFile= syntax: KEY=value, no `export`, comments start with '#'.
    assignment = re.compile(r"#?[A-Z_][A-Z0-9_]*=\S+")
    lines = (SYSTEMD / "deltarl.env.example").read_text().splitlines()
    settings = [line for line in lines if assignment.fullmatch(line)]
    assert settings, "the example should show some settings"
    for line in lines:
        assert not line or line.startswith("#") or assignment.fullmatch(line), line
