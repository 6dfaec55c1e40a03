"""Reward latency and errors per step: measured by the scheduler, kept with the step's row.

Between two shipped steps the service notes how long each group took to score (from the
start of its scoring to its rewards: retries, backoff, rate-limit and concurrency waits
included, as a rollout's submit experiences it) and every failed attempt (a timeout, an
error, a bad reply, a refusal by the open circuit breaker). When ``ship`` records a new step
the window's figures go into ``step_rewards`` in the same transaction, and the window starts
again; ``history`` (``GetHistory``) returns them with the step's row as

    reward_calls     groups scored (successfully) in the window
    reward_p50_s     median seconds to score a group; None when no group was scored
    reward_p99_s     99th percentile (nearest rank), the tail an operator alerts on
    reward_errors    failed scoring attempts in the window (``ERROR_COUNTERS``)

A table of its own rather than columns of ``steps``: ``CREATE TABLE IF NOT EXISTS`` adds it to
a store written by an older deltarl, where new columns would need a migration. The window is
memory only: a scheduler restart starts it again (the next step's figures cover less time).
"""

from __future__ import annotations

import math
import sqlite3
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

ERROR_COUNTERS = frozenset(
    {"reward.timeouts", "reward.errors", "reward.bad_replies", "reward.circuit_open"}
)
"""The counters (``store.bump`` names) that are failed attempts."""

FIELDS = ("reward_calls", "reward_p50_s", "reward_p99_s", "reward_errors")

STEP_REWARDS_SCHEMA = """
    CREATE TABLE IF NOT EXISTS step_rewards (
        step          INTEGER PRIMARY KEY,
        reward_calls  INTEGER NOT NULL,
        reward_p50_s  REAL,
        reward_p99_s  REAL,
        reward_errors INTEGER NOT NULL
    )
"""


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0 < q <= 100) by nearest rank; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


@dataclass
class RewardWindow:
    """What happened to scoring since the last step was shipped (one event loop uses it)."""

    seconds: list[float] = field(default_factory=list)
    errors: int = 0

    def observe(self, seconds: float) -> None:
        self.seconds.append(seconds)

    def note(self, counter: str) -> None:
        if counter in ERROR_COUNTERS:
            self.errors += 1

    def figures(self) -> dict[str, Any]:
        p50, p99 = percentile(self.seconds, 50), percentile(self.seconds, 99)
        return {
            "reward_calls": len(self.seconds),
            "reward_p50_s": None if p50 is None else round(p50, 6),
            "reward_p99_s": None if p99 is None else round(p99, 6),
            "reward_errors": self.errors,
        }

    def reset(self) -> None:
        self.seconds.clear()
        self.errors = 0


def insert(conn: sqlite3.Connection, step: int, figures: Mapping[str, Any]) -> None:
    """Record a new step's figures (inside ``ship``'s transaction)."""
    conn.execute(
        "INSERT OR REPLACE INTO step_rewards VALUES (?, ?, ?, ?, ?)",
        (step, *(figures.get(k) if k.endswith("_s") else int(figures.get(k, 0)) for k in FIELDS)),
    )


def attach(conn: sqlite3.Connection, rows: list[dict[str, Any]]) -> None:
    """Add each step row's figures (None where a step has none: shipped before this table,
    or replayed from a store without them)."""
    if not rows:
        return
    first, last = rows[0]["step"], rows[-1]["step"]
    found = {
        r[0]: r[1:]
        for r in conn.execute(
            f"SELECT step, {', '.join(FIELDS)} FROM step_rewards WHERE step BETWEEN ? AND ?",  # noqa: S608 - constant
            (first, last),
        )
    }
    for row in rows:
        values = found.get(row["step"], (None,) * len(FIELDS))
        row.update(zip(FIELDS, values, strict=True))


def prune(conn: sqlite3.Connection, through: int) -> None:
    """Retention: the figures go with their step's row."""
    conn.execute("DELETE FROM step_rewards WHERE step <= ?", (through,))


def forget_after(conn: sqlite3.Connection, step: int) -> None:
    """A restore to ``step`` (deltarl/scheduler/restore.py): the records of later steps go."""
    conn.execute("DELETE FROM step_rewards WHERE step > ?", (step,))
