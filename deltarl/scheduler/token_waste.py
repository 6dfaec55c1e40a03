"""Wasted tokens per step: generated, then thrown away because they went stale.

A group pooled over the lag bound is dropped at ship time and its prompt generated again
(``dropped_groups.lag_exceeded``): every token it generated was paid for and never trained.
Counting groups says how often; tokens say what it cost, since a long group costs more. Each
pooled group's completion tokens are noted when it is pooled (``group_tokens``, until it is
shipped or dropped); ``ship`` then records with each new step (``step_tokens``, in the same
transaction)

    trained_tokens   completion tokens of the step's groups
    wasted_tokens    completion tokens of the groups dropped over the lag bound since the
                     previous step (drops while a step could not be filled wait in
                     ``meta.waste_pending`` and go to the next step recorded)
    wasted_groups    how many groups those were
    wasted_ratio     wasted / (wasted + trained): the share of generated work thrown away

Tables of their own, not columns of ``prompts`` and ``steps``: ``CREATE TABLE IF NOT EXISTS``
adds them to a store written by an older deltarl, where new columns would need a migration.
A group pooled by an older deltarl has no tokens noted and counts 0.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable
from typing import Any

import orjson

FIELDS = ("trained_tokens", "wasted_tokens", "wasted_groups")

TOKENS_SCHEMA = (
    """
    CREATE TABLE IF NOT EXISTS group_tokens (
        prompt_id INTEGER NOT NULL,
        attempt   INTEGER NOT NULL,
        tokens    INTEGER NOT NULL CHECK (tokens >= 0),
        PRIMARY KEY (prompt_id, attempt)
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS step_tokens (
        step           INTEGER PRIMARY KEY,
        trained_tokens INTEGER NOT NULL,
        wasted_tokens  INTEGER NOT NULL,
        wasted_groups  INTEGER NOT NULL
    )
    """,
)

_PENDING = "waste_pending"


def note(conn: sqlite3.Connection, prompt_id: int, attempt: int, tokens: int) -> None:
    """A group was pooled with ``tokens`` completion tokens (inside ``pool``'s transaction)."""
    conn.execute(
        "INSERT OR REPLACE INTO group_tokens VALUES (?, ?, ?)", (prompt_id, attempt, tokens)
    )


def take(conn: sqlite3.Connection, groups: Iterable[tuple[int, int]]) -> int:
    """The tokens of these (prompt id, attempt) groups, which leave the pool now (shipped or
    dropped): their notes are deleted, so the table holds pooled groups only."""
    total = 0
    for prompt_id, attempt in groups:
        row = conn.execute(
            "SELECT tokens FROM group_tokens WHERE prompt_id = ? AND attempt = ?",
            (prompt_id, attempt),
        ).fetchone()
        if row is not None:
            total += int(row[0])
            conn.execute(
                "DELETE FROM group_tokens WHERE prompt_id = ? AND attempt = ?",
                (prompt_id, attempt),
            )
    return total


def wasted(conn: sqlite3.Connection, tokens: int, groups: int) -> None:
    """Groups dropped over the lag bound: added to what the next recorded step carries."""
    if not groups:
        return
    row = conn.execute("SELECT value FROM meta WHERE key = ?", (_PENDING,)).fetchone()
    before = orjson.loads(row[0]) if row is not None else [0, 0]
    conn.execute(
        "INSERT OR REPLACE INTO meta VALUES (?, ?)",
        (_PENDING, orjson.dumps([before[0] + tokens, before[1] + groups]).decode()),
    )


def record(conn: sqlite3.Connection, step: int, trained_tokens: int) -> None:
    """A new step: its trained tokens and the waste since the previous one (then cleared)."""
    row = conn.execute("SELECT value FROM meta WHERE key = ?", (_PENDING,)).fetchone()
    tokens, groups = orjson.loads(row[0]) if row is not None else [0, 0]
    conn.execute(
        "INSERT OR REPLACE INTO step_tokens VALUES (?, ?, ?, ?)",
        (step, trained_tokens, tokens, groups),
    )
    conn.execute("DELETE FROM meta WHERE key = ?", (_PENDING,))


def attach(conn: sqlite3.Connection, rows: list[dict[str, Any]]) -> None:
    """Add each step row's figures and ``wasted_ratio`` (None where a step has none)."""
    if not rows:
        return
    found = {
        r[0]: r[1:]
        for r in conn.execute(
            f"SELECT step, {', '.join(FIELDS)} FROM step_tokens WHERE step BETWEEN ? AND ?",  # noqa: S608 - constant
            (rows[0]["step"], rows[-1]["step"]),
        )
    }
    for row in rows:
        values = found.get(row["step"], (None,) * len(FIELDS))
        row.update(zip(FIELDS, values, strict=True))
        trained, lost = row["trained_tokens"], row["wasted_tokens"]
        row["wasted_ratio"] = (
            None if trained is None or lost is None or trained + lost == 0
            else lost / (trained + lost)
        )  # fmt: skip


def prune(conn: sqlite3.Connection, through: int) -> None:
    """Retention: the figures go with their step's row."""
    conn.execute("DELETE FROM step_tokens WHERE step <= ?", (through,))


def forget_after(conn: sqlite3.Connection, step: int) -> None:
    """A restore to ``step`` (deltarl/scheduler/restore.py): the records of later steps go."""
    conn.execute("DELETE FROM step_tokens WHERE step > ?", (step,))
