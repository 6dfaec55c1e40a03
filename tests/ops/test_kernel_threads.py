"""The codec kernels' OpenMP threads sleep after a kernel (deltarl/ops/kernel_threads.py).

Each case runs in a fresh interpreter: libgomp reads its wait policy once, when it loads."""

import os
import subprocess
import sys

import pytest

from deltarl.ops.kernel_threads import QUIET, WAIT_POLICY_ENV, libgomp_loaded

# Runs a parallel kernel and then sleeps 10 ms, twenty times: the CPU the process spends
# asleep is its kernel threads spinning after the kernel. Prints the policy in effect, then
# that CPU time per sleep, in ms (measured here: 3.6 with libgomp's default, 0.02 passive, all
# of the 10 ms active).
PROBE = """
import time
import numpy as np
from numba import njit, prange
from deltarl.ops.kernel_threads import quiet_kernel_threads, libgomp_loaded
@njit(parallel=True)
def total(a):
    s = 0.0
    for i in prange(a.shape[0]):
        s += a[i]
    return s
if {kernel_first}:
    total(np.ones(1 << 16))
policy = quiet_kernel_threads()
total(np.ones(1 << 20))
assert libgomp_loaded(), "numba did not run the kernel on OpenMP"
spun = 0.0
for _ in range(20):
    total(np.ones(1 << 16))
    t = time.process_time()
    time.sleep(0.01)
    spun += time.process_time() - t
print(policy, spun / 20 * 1e3)
"""


def _probe(env_policy: str | None, *, kernel_first: bool = False) -> tuple[str, float, str]:
    env = {k: v for k, v in os.environ.items() if k != WAIT_POLICY_ENV}
    env["NUMBA_NUM_THREADS"] = "2"  # one worker thread besides the caller
    env["NUMBA_THREADING_LAYER"] = "omp"  # the layer whose threads spin; absent: an error
    if env_policy is not None:
        env[WAIT_POLICY_ENV] = env_policy
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(kernel_first=kernel_first)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=True,
    )
    policy, cpu = out.stdout.split()
    return policy, float(cpu), out.stderr


needs_two_cpus = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2,
    reason="libgomp spins only briefly when it has more threads than CPUs: one CPU cannot "
    "show the spinning this guards against",
)


@needs_two_cpus
def test_kernel_threads_sleep_after_a_kernel():
    policy, ms, err = _probe(None)
    assert policy == QUIET
    # asleep after each kernel, the process spent next to no CPU: its worker did not spin
    # (libgomp's default spends about 3.6 ms a kernel here)
    assert ms < 1.0, (ms, err)
    assert "loaded already" not in err


@needs_two_cpus
def test_an_operators_own_policy_is_kept_and_spins():
    # the check above can fail: with ACTIVE the worker spins through the whole sleep
    policy, ms, _ = _probe("ACTIVE")
    assert policy == "ACTIVE"
    assert ms > 2.0, ms


def test_too_late_is_said():
    # a kernel ran before the call: libgomp has read its environment already
    policy, _, err = _probe(None, kernel_first=True)
    assert policy == QUIET
    assert "loaded already" in err


def test_libgomp_loaded_reads_the_maps(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(
        "7f0-7f1 r-xp 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
        "7f2-7f3 rw-p 00000000 00:00 0 \n"
    )
    assert not libgomp_loaded(maps)
    torch_gomp = "7f4-7f5 r-xp 0 08:01 2 /x/torch.libs/libgomp-a34b3233.so.1\n"
    maps.write_text(maps.read_text() + torch_gomp)
    assert libgomp_loaded(maps)
    assert not libgomp_loaded(tmp_path / "absent")


def test_bench_codec_loads_openmp_only_after_setting_it():
    # its simulation runs on torch, which loads the OpenMP runtime the kernels share: the
    # command and its module must load neither before its main has set the policy
    probe = (
        "import sys, deltarl.cli, deltarl.bench.codec; "
        "from deltarl.ops.kernel_threads import libgomp_loaded; "
        "print('torch' in sys.modules, libgomp_loaded())"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=True
    )
    assert out.stdout.split() == ["False", "False"], out.stderr


def test_the_agents_that_set_it_load_no_torch():
    # torch would share the policy (its libgomp has the same soname) and run its small ops far
    # slower with it: only processes without torch may set it (deltarl/ops/kernel_threads.py)
    probe = (
        "import sys, deltarl.daemons.apply, deltarl.daemons.export; print('torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=True
    )
    assert out.stdout.strip() == "False", out.stderr
