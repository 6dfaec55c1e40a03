"""The codec kernels of an agent, loaded or compiled when it starts, not at its first refit.

numba compiles a kernel variant the first time it is called with new argument types and keeps
it in a cache (``NUMBA_CACHE_DIR``, or beside the sources where that directory is writable).
The install's warm-up (``python -m deltarl.codecs.warmup``) fills the cache beside the
sources; an agent started elsewhere finds none of it there: the systemd units point numba at
``/var/cache/deltarl/numba``, empty on a fresh host, and numba ignores a cache beside sources
it may not write (a read-only install) and looks in the user's. Such an agent compiled every
kernel its first refit used, in that refit: minutes of a 2-core host's CPU, in the middle of
a version. Each export and apply agent now runs the warm-up in a thread as it starts: from a
warm cache it loads the variants in under a second; from a cold one it compiles them while the
agent already serves its control socket and waits for its first version. A version that comes
meanwhile waits for the warm-up to end before its first kernel (``KernelWarmth.wait``): the
compile it would have done itself, for the widths it uses, is being done.

What it did is in the agent's status (``kernels``: ``state`` warming / ready / failed, the
seconds, how many variants were loaded from the cache and how many compiled, where that cache
is) and in one log line. A warm-up that fails is logged with its traceback and leaves the
agent serving: its refits compile what they need, or fail and are resent, as before.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from numba.core.registry import CPUDispatcher

from deltarl.codecs import conditioned, conditioned_rice, kernels, warmup

log = logging.getLogger(__name__)


def dispatchers(modules: Iterable[ModuleType]) -> list[CPUDispatcher]:
    """The compiled functions (numba dispatchers) defined at the top of ``modules``."""
    return [f for m in modules for f in vars(m).values() if isinstance(f, CPUDispatcher)]


def _counts(of: Sequence[CPUDispatcher]) -> tuple[int, int]:
    """(variants loaded from the cache, variants compiled) by these dispatchers so far."""
    loaded = compiled = 0
    for d in of:
        loaded += sum(d.stats.cache_hits.values())
        compiled += sum(d.stats.cache_misses.values())
    return loaded, compiled


def _cache_path(of: Sequence[CPUDispatcher]) -> str | None:
    paths = {d.stats.cache_path for d in of if d.stats.cache_path}
    return ", ".join(sorted(paths)) or None


@dataclass
class KernelWarmth:
    """What the warm-up of an agent's kernels has done; ``fields()`` is its status."""

    started: float = 0.0  # time.monotonic()
    seconds: float | None = None
    loaded: int = 0
    compiled: int = 0
    cache: str | None = None
    error: str | None = None
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def state(self) -> str:
        if not self.done.is_set():
            return "warming"
        return "ready" if self.error is None else "failed"

    async def wait(self) -> None:
        """Return once the warm-up has ended, however it ended. The agents wait here before
        a version's first kernel, so that no kernel of theirs runs beside the warm-up's: two
        threads in parallel kernels at once abort the process under numba's workqueue
        threading layer (the fallback where no OpenMP runtime loads)."""
        if not self.done.is_set():
            await asyncio.to_thread(self.done.wait)

    def fields(self) -> dict[str, Any]:
        seconds = self.seconds
        if seconds is None:  # still warming: how long so far
            seconds = time.monotonic() - self.started
        return {
            "state": self.state,
            "seconds": round(seconds, 3),
            "loaded": self.loaded,
            "compiled": self.compiled,
            "cache": self.cache,
            "error": self.error,
        }


def start_warming(
    agent: str,
    work: Callable[[], None] | None = None,
    watched: Sequence[CPUDispatcher] | None = None,
) -> tuple[KernelWarmth, threading.Thread]:
    """Run ``work`` (the codec's ``warm_up``) in a thread; what it loaded and compiled is
    counted on ``watched`` (every kernel of the codec). Returns at once."""
    work = warmup.warm_up if work is None else work
    watched = dispatchers([kernels, conditioned, conditioned_rice]) if watched is None else watched
    warmth = KernelWarmth(started=time.monotonic())
    before = _counts(watched)

    def run() -> None:
        try:
            work()
        except Exception as e:  # reported, and the agent goes on serving
            warmth.error = f"{type(e).__name__}: {e}"
            log.exception("%s: the codec kernels' warm-up failed; refits compile as they go", agent)
        finally:
            loaded, compiled = _counts(watched)
            warmth.loaded, warmth.compiled = loaded - before[0], compiled - before[1]
            warmth.cache = _cache_path(watched)
            warmth.seconds = time.monotonic() - warmth.started
            warmth.done.set()
        if warmth.error is not None:
            return
        log.info(
            "%s: codec kernels ready in %.1f s: %d variants loaded from the cache, %d compiled%s",
            agent,
            warmth.seconds,
            warmth.loaded,
            warmth.compiled,
            f" (cache {warmth.cache})" if warmth.cache else "",
        )

    thread = threading.Thread(target=run, name="kernel-warm-up", daemon=True)
    thread.start()
    return warmth, thread
