"""The codec kernels' threads sleep between kernels instead of spinning.

numba runs the parallel kernels (encode, decode, scatter) on GNU OpenMP's threads. By default
they spin after a kernel ends, waiting for the next one: up to 300,000 ``pause``
instructions, 3.6 ms of a core after each kernel here (the CPU a process spends asleep after
one: tests/ops/test_kernel_threads.py). In the export and apply
agents a kernel is followed by work of other threads, not by another kernel: the xxh3 hash
threads, the socket, and on a host that runs both agents (or an agent beside a trainer or a
rollout engine) the other processes. The spinning takes their cores. Measured on a 2-core
machine: the verify right after an apply's kernels took 10.9 ms with the default against 8.0
with ``OMP_WAIT_POLICY=PASSIVE``; and ``deltarl bench refit`` at 1 Gbit (98M parameters, both
agents on the same two cores, three runs alternating with the policy left at libgomp's
default) had median refits of 124-127 ms against 134-141, the slowest 128-143 ms against
150-162.

Only processes that run no torch may call this: torch's libgomp has the same soname, so it
would share the policy, and its small intra-op parallel regions ran 9x slower passive (tried
for every process once, README). The export and apply agents load no torch (a test keeps it
so); the trainer and the rollout engines keep libgomp's default. ``deltarl bench codec`` calls
it too, before it imports torch: there torch only simulates the optimizer steps, which are
not timed (1.5-2.8 s a step passive against 0.9-2.4 s, 98M parameters), and the kernels it
times must run as the agents run them.

The policy is only a default: an operator's own ``OMP_WAIT_POLICY`` is kept. libgomp reads it
once, when it is loaded, which numba does at the first parallel kernel; so this is called at
a process's start. Where libgomp is loaded already (an ``LD_PRELOAD``, or a kernel ran), a
warning says that the setting cannot take effect in this process.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

WAIT_POLICY_ENV = "OMP_WAIT_POLICY"
QUIET = "PASSIVE"

logger = logging.getLogger(__name__)


def libgomp_loaded(maps: Path = Path("/proc/self/maps")) -> bool:
    """Whether a GNU OpenMP runtime is mapped into this process (system's or torch's copy)."""
    try:
        text = maps.read_text()
    except OSError:  # not Linux: nothing to tell, and nothing spins that this would stop
        return False
    paths = (line.split()[-1] for line in text.splitlines() if "/" in line)
    return any(Path(p).name.startswith("libgomp") for p in paths)


def quiet_kernel_threads() -> str:
    """Default ``OMP_WAIT_POLICY`` to ``PASSIVE`` (module docstring); the policy in effect.
    Call before the first parallel kernel: where libgomp is loaded already and the operator
    set no policy, a warning says this one comes too late."""
    own = os.environ.get(WAIT_POLICY_ENV)
    if own is not None:
        return own
    os.environ[WAIT_POLICY_ENV] = QUIET
    if libgomp_loaded():
        logger.warning(
            "OpenMP (libgomp) is loaded already: %s=%s cannot reach this process's kernel "
            "threads, which spin after each kernel; set it in the environment that starts it",
            WAIT_POLICY_ENV,
            QUIET,
        )
    return QUIET
