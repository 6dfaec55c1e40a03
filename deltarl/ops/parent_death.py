"""A child process that ends with the process that started it: Linux's parent-death signal.

The kernel sends the signal chosen with ``prctl(PR_SET_PDEATHSIG)`` when the thread that
forked this process exits, whatever the way (a SIGKILL included), so a harness killed
without its own cleanup leaves no children running. The setting survives ``execve`` (the
re-exec of ``placement.pin_at_start`` keeps it) and is not inherited by this process's own
children. Linux only; elsewhere nothing is set.
"""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
HARNESS_PID_ENV = "DELTARL_HARNESS_PID"
"""Set by ``launch.DaemonGroup`` for the daemons it starts: the harness's pid."""


def signal_on_parent_death(sig: int) -> bool:
    """Have the kernel send ``sig`` to this process when its parent thread exits; whether
    it could be set (False off Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def end_with_harness() -> None:
    """In a daemon a ``DaemonGroup`` started (its pid in ``HARNESS_PID_ENV``): SIGTERM this
    daemon when the harness dies, so it drains and exits instead of running on orphaned (a
    refit benchmark killed by a test's timeout left its trainer publishing and the agents
    refitting for as long as the machine ran). The variable is taken out of the environment,
    so nothing this daemon starts inherits it. If the harness is already gone the signal
    would never come: SystemExit. Started any other way (systemd), nothing changes."""
    harness = os.environ.pop(HARNESS_PID_ENV, None)
    if harness is None or not signal_on_parent_death(signal.SIGTERM):
        return
    if os.getppid() != int(harness):  # died between our start and the prctl
        raise SystemExit(f"the process that started this daemon (pid {harness}) has exited")
