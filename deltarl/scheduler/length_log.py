"""Output lengths as generated, and how far their predictions were: tables of the scheduler store.

``length_history``: one row per pooled group, written in ``pool``'s transaction: the task, the
prompt (its key, text and tokens), each sample's completion tokens, what the dispatch had
predicted for it (``predicted``, after the online correction, and ``planned``, the plan's own
figure; both NULL without a plan), its bucket and instance. It is the history ``deltarl plan``
learns from (``length_predictor.load_history``). It does not follow step retention, which
would leave a planner nothing; the newest ``HISTORY_ROWS`` are kept instead.

``step_lengths``: with each new step (``ship``'s transaction), the prediction error of its
groups, ``|actual - predicted| / actual`` of each group's completion tokens, averaged (as
dispatched, and the plan's alone: the gap is what the online correction earned), and each live
instance's measured throughput then. Pruned with its step.

Tables of their own (``CREATE TABLE IF NOT EXISTS``), as ``token_waste``'s, so a store written
by an older deltarl gains them without a migration.
"""

from __future__ import annotations

import sqlite3
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

HISTORY_ROWS = 200_000

LENGTH_SCHEMA = (
    """
    CREATE TABLE IF NOT EXISTS length_history (
        id            INTEGER PRIMARY KEY AUTOINCREMENT,
        task          TEXT NOT NULL,
        prompt_key    INTEGER NOT NULL,
        prompt_text   TEXT NOT NULL,
        prompt_tokens INTEGER NOT NULL,
        outputs       TEXT NOT NULL,
        predicted     REAL,
        planned       REAL,
        bucket        INTEGER,
        instance      TEXT,
        prompt_id     INTEGER NOT NULL,
        attempt       INTEGER NOT NULL,
        at            REAL NOT NULL
    )
    """,
    "CREATE INDEX IF NOT EXISTS length_history_group ON length_history (prompt_id, attempt)",
    """
    CREATE TABLE IF NOT EXISTS step_lengths (
        step              INTEGER PRIMARY KEY,
        predicted_groups  INTEGER NOT NULL,
        length_error      REAL,
        length_error_plan REAL,
        throughput        TEXT NOT NULL
    )
    """,
)

FIELDS = ("predicted_groups", "length_error", "length_error_plan")


@dataclass(frozen=True)
class LengthNote:
    """What the scheduler knows of one group's lengths when it pools it."""

    task: str
    prompt_key: int
    prompt_text: str
    prompt_tokens: int
    outputs: tuple[int, ...]
    predicted: float | None = None
    """Completion tokens per sample the dispatch predicted (corrected online)."""
    planned: float | None = None
    """The plan's own prediction, per sample."""
    bucket: int | None = None
    instance: str | None = None


def note(conn: sqlite3.Connection, prompt_id: int, attempt: int, n: LengthNote, at: float) -> None:
    conn.execute(
        "INSERT INTO length_history (task, prompt_key, prompt_text, prompt_tokens, outputs,"
        " predicted, planned, bucket, instance, prompt_id, attempt, at)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (
            n.task,
            n.prompt_key,
            n.prompt_text,
            n.prompt_tokens,
            orjson.dumps(list(n.outputs)).decode(),
            n.predicted,
            n.planned,
            n.bucket,
            n.instance,
            prompt_id,
            attempt,
            at,
        ),
    )


def _error(actual: float, predicted: float) -> float:
    return abs(actual - predicted) / max(actual, 1.0)


def record(
    conn: sqlite3.Connection,
    step: int,
    groups: Sequence[tuple[int, int]],
    throughput: Mapping[str, float],
) -> None:
    """A new step of these (prompt id, attempt) groups: their prediction errors."""
    errors: list[float] = []
    plan_errors: list[float] = []
    for prompt_id, attempt in groups:
        row = conn.execute(
            "SELECT outputs, predicted, planned FROM length_history"
            " WHERE prompt_id = ? AND attempt = ? ORDER BY id DESC LIMIT 1",
            (prompt_id, attempt),
        ).fetchone()
        if row is None or row[1] is None:
            continue
        outputs = orjson.loads(row[0])
        actual = statistics.fmean(outputs) if outputs else 0.0
        errors.append(_error(actual, float(row[1])))
        if row[2] is not None:
            plan_errors.append(_error(actual, float(row[2])))
    conn.execute(
        "INSERT OR REPLACE INTO step_lengths VALUES (?, ?, ?, ?, ?)",
        (
            step,
            len(errors),
            statistics.fmean(errors) if errors else None,
            statistics.fmean(plan_errors) if plan_errors else None,
            orjson.dumps(dict(throughput)).decode(),
        ),
    )


def attach(conn: sqlite3.Connection, rows: list[dict[str, Any]]) -> None:
    """Add each step row's length figures, its instances' throughput (``instance_tokens_per_s``)
    and ``sorting_wait``: the mean time its groups waited in the pool for the step over the
    mean time they took to generate (seed 000's third bubble, per step)."""
    if not rows:
        return
    found = {
        r[0]: r[1:]
        for r in conn.execute(
            f"SELECT step, {', '.join(FIELDS)}, throughput FROM step_lengths"  # noqa: S608 - constant
            " WHERE step BETWEEN ? AND ?",
            (rows[0]["step"], rows[-1]["step"]),
        )
    }
    for row in rows:
        values = found.get(row["step"])
        row.update(zip(FIELDS, values[:-1] if values else (None,) * len(FIELDS), strict=True))
        row["instance_tokens_per_s"] = orjson.loads(values[-1]) if values else None
        gen, queue = row.get("gen_s_mean"), row.get("queue_s_mean")
        row["sorting_wait"] = queue / gen if gen and queue is not None else None


def records(conn: sqlite3.Connection) -> list[tuple[str, int, str, int, list[int]]]:
    """Every row, oldest first: (task, prompt key, prompt text, prompt tokens, each sample's
    completion tokens). Empty for a store written before this table existed."""
    found = conn.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'length_history'"
    ).fetchone()
    if found is None:
        return []
    rows = conn.execute(
        "SELECT task, prompt_key, prompt_text, prompt_tokens, outputs FROM length_history"
        " ORDER BY id"
    )
    return [(str(t), int(k), str(x), int(p), orjson.loads(o)) for t, k, x, p, o in rows]


def planned(conn: sqlite3.Connection) -> list[tuple[int, float, float]]:
    """(bucket, planned, actual mean) of every group dispatched on a plan, oldest first: what
    the online correction is rebuilt from at a start."""
    rows = conn.execute(
        "SELECT bucket, planned, outputs FROM length_history"
        " WHERE planned IS NOT NULL AND bucket IS NOT NULL ORDER BY id"
    )
    out = []
    for bucket, plan, outputs in rows:
        lengths = orjson.loads(outputs)
        if lengths:
            out.append((int(bucket), float(plan), statistics.fmean(lengths)))
    return out


def prune(conn: sqlite3.Connection, through: int) -> None:
    """Retention: a step's figures go with its row; the history keeps its newest rows."""
    conn.execute("DELETE FROM step_lengths WHERE step <= ?", (through,))
    conn.execute(
        "DELETE FROM length_history WHERE id <= (SELECT MAX(id) FROM length_history) - ?",
        (HISTORY_ROWS,),
    )


def forget_after(conn: sqlite3.Connection, step: int) -> None:
    """A restore to ``step`` (deltarl/scheduler/restore.py): the records of later steps go."""
    conn.execute("DELETE FROM step_lengths WHERE step > ?", (step,))
