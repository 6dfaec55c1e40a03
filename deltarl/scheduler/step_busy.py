"""Each rollout instance's busy seconds at each step, and the step's skewness: a table of the
scheduler store.

``step_busy``: with each new step (``ship``'s transaction), the busy seconds every live instance
had reported with its heartbeats (time inside engine steps, a counter each engine keeps from its
start). A step's skewness is seed 000's second bubble measured over that step alone: the busiest
instance's busy time since the previous recorded step over the mean, over the instances heard
from at both (a new or removed one has no interval; an engine that restarted, its counter lower
than before, has none either). ``attach`` adds it to the history's rows as ``skewness``, so
``deltarl ctl scheduler history``, the Prometheus gauge and a restarted scheduler all read the
same figure from the same rows.

A table of its own (``CREATE TABLE IF NOT EXISTS``), as ``token_waste``'s, so a store written by
an older deltarl gains it without a migration; its steps then have no skewness.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping
from statistics import fmean
from typing import Any

import orjson

BUSY_SCHEMA = (
    """
    CREATE TABLE IF NOT EXISTS step_busy (
        step INTEGER PRIMARY KEY,
        busy TEXT NOT NULL  -- JSON: instance -> busy seconds since its engine started
    )
    """,
)


def skewness(before: Mapping[str, float], after: Mapping[str, float]) -> float | None:
    """max / mean of the busy time each instance spent between two snapshots; None without two
    instances in both, or with no busy time at all."""
    spent = [after[n] - b for n, b in before.items() if n in after and after[n] >= b]
    if len(spent) < 2 or fmean(spent) <= 0:
        return None
    return max(spent) / fmean(spent)


def record(conn: sqlite3.Connection, step: int, busy: Mapping[str, float]) -> None:
    conn.execute(
        "INSERT OR REPLACE INTO step_busy VALUES (?, ?)",
        (step, orjson.dumps({str(k): float(v) for k, v in busy.items()}).decode()),
    )


def attach(conn: sqlite3.Connection, rows: list[dict[str, Any]]) -> None:
    """Add each step row's ``skewness`` (None where it or the step before has no snapshot)."""
    if not rows:
        return
    first, last = rows[0]["step"], rows[-1]["step"]
    base = conn.execute("SELECT MAX(step) FROM step_busy WHERE step < ?", (first,)).fetchone()[0]
    snaps = {
        int(s): orjson.loads(b)
        for s, b in conn.execute(
            "SELECT step, busy FROM step_busy WHERE step BETWEEN ? AND ?",
            (first if base is None else base, last),
        )
    }
    order = sorted(snaps)
    previous = {s: order[i - 1] for i, s in enumerate(order) if i > 0}
    for row in rows:
        step = row["step"]
        before = previous.get(step)
        row["skewness"] = (
            skewness(snaps[before], snaps[step]) if before is not None and step in snaps else None
        )


def prune(conn: sqlite3.Connection, through: int) -> None:
    """Retention: a step's snapshot goes with its row, except the newest pruned one, which the
    next step's skewness is measured from."""
    conn.execute("DELETE FROM step_busy WHERE step < ?", (through,))


def forget_after(conn: sqlite3.Connection, step: int) -> None:
    """A restore to ``step`` (deltarl/scheduler/restore.py): the records of later steps go."""
    conn.execute("DELETE FROM step_busy WHERE step > ?", (step,))
