"""``cpus`` in a daemon's table (deltarl/ops/placement.py): parsed, checked, and applied to a
real daemon process and every thread of it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deltarl.config import EX_CONFIG, ConfigError, load, write_toml
from deltarl.config.reward import RewardConfig
from deltarl.ops.placement import PINNED_ENV, format_cpu_list, parse_cpu_list
from tests.ops.helpers import ctl_json, running_daemon, start_daemon


@given(st.frozensets(st.integers(0, 300), min_size=1))
def test_a_cpu_list_reads_back_as_the_same_cpus(cpus: frozenset[int]) -> None:
    text = format_cpu_list(cpus)
    assert parse_cpu_list(text) == cpus
    runs = sum(1 for c in cpus if c - 1 not in cpus)  # runs of consecutive CPUs
    assert len(text.split(",")) == runs  # one item each: the shortest list


def test_cpu_lists_in_linux_syntax() -> None:
    assert parse_cpu_list("0") == {0}
    assert parse_cpu_list("0,2,4-7") == {0, 2, 4, 5, 6, 7}
    assert parse_cpu_list("1-2, 3") == {1, 2, 3}
    assert format_cpu_list([5, 0, 1, 2]) == "0-2,5"


@pytest.mark.parametrize("bad", ["", "a", "3-1", "-1", "1-", "0,,1", "99999"])
def test_a_bad_cpu_list_is_refused_when_the_table_loads(tmp_path: Path, bad: str) -> None:
    config = tmp_path / "deltarl.toml"
    write_toml(config, {"daemons": {"reward": {"control": "ipc:///tmp/x", "cpus": bad}}})
    with pytest.raises(ConfigError, match="cpus"):
        load(RewardConfig, "reward", str(config))


def _affinities(pid: int) -> dict[int, str]:
    """Each thread of ``pid``: its Cpus_allowed_list."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        line = next(x for x in status.splitlines() if x.startswith("Cpus_allowed_list:"))
        out[int(tid)] = line.split(":", 1)[1].strip()
    return out


def _reward(config: Path, cpus: str) -> Path:
    write_toml(
        config,
        {"daemons": {"reward": {"control": f"ipc://{config.parent}/r.sock", "cpus": cpus}}},
    )
    return config


def test_a_daemon_runs_on_its_cpus_every_thread_of_it(tmp_path: Path) -> None:
    config = tmp_path / "deltarl.toml"
    cpu = max(os.sched_getaffinity(0))  # one CPU this test may use: the daemon gets only it
    with running_daemon(_reward(config, str(cpu)), "reward") as proc:
        threads = _affinities(proc.pid)
        assert len(threads) > 1  # the runtime's threads too, not only the main one
        assert set(threads.values()) == {str(cpu)}
        assert ctl_json(config, "reward", "drain")[1]["ok"]
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert f"pinned to CPUs {cpu}" in err


def test_a_cpu_the_daemon_may_not_use_stops_it_at_start(tmp_path: Path) -> None:
    allowed = os.sched_getaffinity(0)
    outside = max(allowed) + 1  # not this process's: the host lacks it or the cgroup hides it
    proc = start_daemon(_reward(tmp_path / "deltarl.toml", f"{min(allowed)},{outside}"), "reward")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == EX_CONFIG
    assert f"CPU {outside} is not one this process may use" in err
    assert f"may use {format_cpu_list(allowed)}" in err


def test_pinning_moves_threads_already_running_and_torch_follows(tmp_path: Path) -> None:
    """In a process of its own (the test's must stay as it is): a thread started before
    ``pin`` ends up on the pinned CPUs too, and torch's intra-op threads match their count."""
    cpu = min(os.sched_getaffinity(0))
    script = f"""
import os, threading, time, torch
from deltarl.ops.placement import pin
torch.set_num_threads(4)
stop = threading.Event()
t = threading.Thread(target=stop.wait, daemon=True)
t.start()
pin("{cpu}")
assert os.sched_getaffinity(t.native_id) == {{{cpu}}}, os.sched_getaffinity(t.native_id)
assert os.sched_getaffinity(0) == {{{cpu}}}
print(torch.get_num_threads())
"""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1"]


_OPENMP = """
import ctypes, os, sys
from deltarl.ops.placement import {fn}
print("pid", os.getpid(), flush=True)
{fn}("{cpu}")
import torch
print("threads", torch.get_num_threads(), ctypes.CDLL("libgomp.so.1").omp_get_max_threads())
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to pin to one")
def test_a_daemon_starts_again_pinned_so_an_openmp_runtime_loaded_with_it_sees_one_cpu() -> None:
    """vLLM puts torch's libgomp in LD_PRELOAD for the processes it starts, and children
    inherit it: that runtime sizes its pool when the process starts. ``pin`` alone leaves it
    with a thread per CPU the process had (two spinning threads on one core: the control);
    ``pin_at_start`` pins and executes the process again, same pid, so it sees one."""
    import torch  # noqa: PLC0415 - only for where its libgomp is

    libgomp = sorted((Path(torch.__file__).parent / "lib").glob("libgomp*.so*"))
    if not libgomp:
        pytest.skip("this torch build ships no libgomp (another OpenMP runtime)")
    cpu = min(os.sched_getaffinity(0))
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", PINNED_ENV)}
    env["LD_PRELOAD"] = str(libgomp[0])
    out = {}
    for fn in ("pin", "pin_at_start"):
        proc = subprocess.run(
            [sys.executable, "-c", _OPENMP.format(fn=fn, cpu=cpu)],
            capture_output=True, text=True, env=env, check=False,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        out[fn] = proc.stdout.split("\n")
    cpus = len(os.sched_getaffinity(0))
    assert out["pin"][-2] == f"threads {cpus} {cpus}"
    pids = [line for line in out["pin_at_start"] if line.startswith("pid")]
    assert len(pids) == 2  # executed again once
    assert pids[0] == pids[1]  # the same process
    assert out["pin_at_start"][-2] == "threads 1 1"
