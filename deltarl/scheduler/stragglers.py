"""Stragglers: a rollout instance far slower than its peers is benched, its work requeued.

A silent instance is removed when its heartbeats stop (``heartbeat_timeout_s``); a slow one
still beats, and every group it holds finishes late: the step waits for it or the group goes
stale. The judge compares each instance's decode rate per running group (its tokens/s over its
running groups, from its heartbeats: throughput grows with the batch, so the whole rate would
blame an instance for holding less work) with the median of its peers' while both are busy.
Below ``straggler_ratio`` of it for ``straggler_window_s`` in a row, the instance is benched:
the scheduler requeues everything it holds (``requeued.straggler``), gives it no new work for
``straggler_cooldown_s`` (``Work([], reason="straggler: ...")``), then takes it back and judges
it again. Counted ``stragglers.benched``. ``straggler_ratio = 0`` (the default): never.

Judged only with at least one busy peer: a lone instance has nobody to be slower than.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass
class StragglerJudge:
    ratio: float
    window_s: float
    cooldown_s: float
    _slow_since: dict[str, float] = field(default_factory=dict)
    _benched_until: dict[str, float] = field(default_factory=dict)

    def benched_for(self, name: str, now: float) -> float | None:
        """Seconds until ``name`` may take work again; None if it is not benched."""
        until = self._benched_until.get(name)
        if until is None:
            return None
        if now >= until:
            del self._benched_until[name]  # back on probation: judged again from now
            return None
        return until - now

    def observe(self, name: str, rates: dict[str, float], now: float) -> bool:
        """``rates``: every busy instance's tokens/s per running group, ``name``'s included
        if it is busy. Whether ``name`` is benched now (its work is to be requeued)."""
        if self.ratio <= 0 or self.benched_for(name, now) is not None:
            return False
        mine = rates.get(name)
        peers = [r for n, r in rates.items() if n != name and self.benched_for(n, now) is None]
        if mine is None or not peers:
            self._slow_since.pop(name, None)
            return False
        if mine >= self.ratio * statistics.median(peers):
            self._slow_since.pop(name, None)
            return False
        since = self._slow_since.setdefault(name, now)
        if now - since < self.window_s:
            return False
        del self._slow_since[name]
        self._benched_until[name] = now + self.cooldown_s
        return True

    def forget(self, name: str) -> None:
        """An instance that left (missed heartbeats)."""
        self._slow_since.pop(name, None)
        self._benched_until.pop(name, None)
