"""Which CPUs a daemon runs on: ``cpus = "0-3"`` in its table.

On a host that runs the trainer beside rollout engines, every daemon otherwise floats over
every core, and a training step run beside busy engines can take many times as long as alone
(measured here: 0.25 s alone, 1.9-3.6 s beside two engines on two shared cores). Pinning
gives each role its own cores, as separate machines or GPUs would.

The list is Linux's cpu-list syntax (``cpuset(7)``): ``"0"``, ``"0-3"``, ``"0,2,4-7"``. It is
applied once, when the daemon starts (``pin_at_start``): the process pins itself and then
executes itself again, so that the new image starts on its CPUs. That matters: an OpenMP
runtime sizes its thread pool when it loads, and one loaded with the process (vLLM puts
torch's libgomp in ``LD_PRELOAD`` for the processes it starts, and children inherit it) would
otherwise keep one thread per CPU the process had before pinning, several spinning threads on
one core (measured: a tiny-model step 4.5 s instead of 0.5). Threads and processes started
later (torch's, a vLLM engine and its workers) inherit the CPUs, and vLLM-CPU binds its
threads within them (``deltarl.rollout.engine.cpu_rank_cores``).
A CPU the process may not use (another cgroup's, or one the host does not have) is refused at
start with the list of those it may use, never silently dropped.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable

MAX_CPU = 1 << 16
"""Above any CPU number Linux gives (its limit is 8192): a typo, not a CPU."""


def parse_cpu_list(text: str) -> frozenset[int]:
    """The CPUs of a cpu list (``"0,2,4-7"``); ValueError saying what is wrong."""
    cpus: set[int] = set()
    for part in text.split(","):
        item = part.strip()
        lo, sep, hi = item.partition("-")
        try:
            first = int(lo)
            last = int(hi) if sep else first
        except ValueError:
            raise ValueError(f"cpus {text!r}: {item!r} is not a CPU or a range like 0-3") from None
        if first < 0 or last < first or last >= MAX_CPU:
            raise ValueError(f"cpus {text!r}: {item!r} is not an ascending range of CPUs")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def format_cpu_list(cpus: Iterable[int]) -> str:
    """The shortest cpu list of ``cpus`` (``{0, 1, 2, 5}`` -> ``"0-2,5"``)."""
    parts: list[str] = []
    run: list[int] = []
    for c in sorted(set(cpus)):
        if run and c != run[-1] + 1:
            parts.append(_span(run))
            run = []
        run.append(c)
    if run:
        parts.append(_span(run))
    return ",".join(parts)


def halves(cpus: Iterable[int], *, lower_larger: bool) -> tuple[str, str] | None:
    """(the lower half of ``cpus``, the upper half) as cpu lists, for two roles that each
    want cores of their own; with an odd number, the lower half is the larger one if
    ``lower_larger``, else the upper. None with fewer than two CPUs: nothing to split."""
    ordered = sorted(cpus)
    if len(ordered) < 2:
        return None
    cut = (len(ordered) + (1 if lower_larger else 0)) // 2
    return format_cpu_list(ordered[:cut]), format_cpu_list(ordered[cut:])


def _span(run: list[int]) -> str:
    return str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}"


PINNED_ENV = "DELTARL_PINNED_CPUS"
"""Set by ``pin_at_start`` before it executes the process again: the CPUs it pinned, so that
the new image knows it started pinned and does not execute itself once more."""


def pin_at_start(text: str) -> frozenset[int]:
    """Pin this process to the CPUs of ``text`` from its start: pin, then execute the same
    command again (same pid, same open files) unless this image already started pinned; in
    the image that did, pin every thread (``pin``) and return the CPUs. ValueError as ``pin``.
    Call it before the process starts threads whose work should survive: the exec ends them.
    """
    wanted = parse_cpu_list(text)
    mark = format_cpu_list(wanted)
    if os.environ.get(PINNED_ENV) != mark:
        _check_allowed(text, wanted)
        os.sched_setaffinity(0, wanted)
        os.environ.setdefault("OMP_NUM_THREADS", str(len(wanted)))
        os.environ[PINNED_ENV] = mark
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])  # noqa: S606 - ourselves
    return pin(text)


def _check_allowed(text: str, wanted: frozenset[int]) -> None:
    allowed = os.sched_getaffinity(0)
    if not wanted <= allowed:
        raise ValueError(
            f"cpus {text!r}: CPU {format_cpu_list(wanted - allowed)} is not one this process "
            f"may use (it may use {format_cpu_list(allowed)})"
        )


def pin(text: str) -> frozenset[int]:
    """Run this process, every thread of it, on the CPUs of ``text``; the CPUs.

    ValueError when a CPU is not one this process may use. Torch's intra-op threads follow:
    ``OMP_NUM_THREADS`` is set to the number of CPUs unless the operator set it, and a torch
    already imported is told directly (a daemon's own ``threads`` setting still overrides).
    """
    wanted = parse_cpu_list(text)
    _check_allowed(text, wanted)
    # sched_setaffinity(0) sets the calling thread's alone; threads already running (an
    # import may have started some) are set one by one.
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), wanted)
        except ProcessLookupError:  # a thread that ended meanwhile
            continue
    os.environ.setdefault("OMP_NUM_THREADS", str(len(wanted)))
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    return wanted
