"""How old the trained tokens are, per step, and the newest token of each pooled group.

A group that lives through a refit goes on under the new weights: every token keeps the
version that sampled it (``Sample.token_versions``), and the trainer's importance ratio is
taken per token against that version's log-probability. So a group's tokens can span several
versions, and the lag rule (``SchedulerConfig.lag_rule``) decides which of them the bound is
measured from:

    oldest_token   trainer version - the group's oldest token (``prompts.min_version``): every
                   trained token is within the bound; a group that outlives the bound is
                   stopped or dropped, and its tokens are wasted (``token_waste``)
    partial        trainer version - the group's newest token: a partial rollout continued
                   under new weights is trained, old tokens and all; only a group whose
                   instance fell behind is dropped

Either way the cost in staleness is recorded per step, over the step's completion tokens:

    token_lag_mean         the mean of (trainer version - the token's version)
    over_bound_tokens      the tokens more than the bound behind (0 under ``oldest_token``)
    counted_tokens         the tokens these are taken over (groups pooled by an older
                           deltarl have no versions noted and are not counted)

Each pooled group's tokens per version are noted when it is pooled (``group_versions``, until
it is shipped or dropped), in the pool's transaction; ``record`` takes them in the ship's.
Tables of their own, created on open in a store an older deltarl wrote (as ``token_waste``).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, get_args

import numpy as np
import orjson

from deltarl.config.rl import LagRule
from deltarl.rl.samples import Sample

LAG_RULES: tuple[LagRule, ...] = get_args(LagRule)

TOKEN_LAG_SCHEMA = (
    """
    CREATE TABLE IF NOT EXISTS group_versions (
        prompt_id INTEGER NOT NULL,
        attempt   INTEGER NOT NULL,
        versions  TEXT    NOT NULL,  -- JSON [[version, tokens], ...], oldest first
        PRIMARY KEY (prompt_id, attempt)
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS step_token_lag (
        step              INTEGER PRIMARY KEY,
        token_lag_mean    REAL,
        over_bound_tokens INTEGER NOT NULL,
        counted_tokens    INTEGER NOT NULL
    )
    """,
)


def versions_of(samples: Sequence[Sample]) -> dict[int, int]:
    """Completion tokens per weight version that sampled them, over a group's samples."""
    out: dict[int, int] = {}
    for s in samples:
        if not len(s.token_versions):
            continue
        values, counts = np.unique(np.asarray(s.token_versions), return_counts=True)
        for v, n in zip(values.tolist(), counts.tolist(), strict=True):
            out[int(v)] = out.get(int(v), 0) + int(n)
    return out


def note(
    conn: sqlite3.Connection, prompt_id: int, attempt: int, versions: Mapping[int, int]
) -> None:
    """A group was pooled with these tokens per version (inside ``pool``'s transaction)."""
    if not versions:
        return
    pairs = sorted((int(v), int(n)) for v, n in versions.items())
    conn.execute(
        "INSERT OR REPLACE INTO group_versions VALUES (?, ?, ?)",
        (prompt_id, attempt, orjson.dumps(pairs).decode()),
    )


def _noted(conn: sqlite3.Connection, prompt_id: int, attempt: int) -> list[tuple[int, int]]:
    row = conn.execute(
        "SELECT versions FROM group_versions WHERE prompt_id = ? AND attempt = ?",
        (prompt_id, attempt),
    ).fetchone()
    return [(int(v), int(n)) for v, n in orjson.loads(row[0])] if row is not None else []


def newest(conn: sqlite3.Connection, prompt_id: int, attempt: int) -> int | None:
    """The newest version that sampled a token of this pooled group; None if none is noted."""
    pairs = _noted(conn, prompt_id, attempt)
    return pairs[-1][0] if pairs else None


def discard(conn: sqlite3.Connection, groups: Iterable[tuple[int, int]]) -> None:
    """These (prompt id, attempt) groups left the pool without being trained."""
    conn.executemany("DELETE FROM group_versions WHERE prompt_id = ? AND attempt = ?", list(groups))


def record(
    conn: sqlite3.Connection,
    step: int,
    trainer_version: int,
    bound: int,
    groups: Iterable[tuple[int, int]],
) -> None:
    """A new step of these groups, trained from ``trainer_version``: its token lag figures
    (module docstring); their notes are deleted, so the table holds pooled groups only."""
    weighted = over = counted = 0
    taken = list(groups)
    for prompt_id, attempt in taken:
        for v, n in _noted(conn, prompt_id, attempt):
            lag = max(trainer_version - v, 0)
            weighted += lag * n
            counted += n
            over += n if lag > bound else 0
    discard(conn, taken)
    conn.execute(
        "INSERT OR REPLACE INTO step_token_lag VALUES (?, ?, ?, ?)",
        (step, weighted / counted if counted else None, over, counted),
    )


def attach(conn: sqlite3.Connection, rows: list[dict[str, Any]]) -> None:
    """Add each step row's ``token_lag_mean`` and ``over_bound_token_ratio`` (None where a
    step has no versions noted)."""
    if not rows:
        return
    found = {
        r[0]: r[1:]
        for r in conn.execute(
            "SELECT step, token_lag_mean, over_bound_tokens, counted_tokens FROM step_token_lag"
            " WHERE step BETWEEN ? AND ?",
            (rows[0]["step"], rows[-1]["step"]),
        )
    }
    for row in rows:
        mean, over, counted = found.get(row["step"], (None, None, None))
        row["token_lag_mean"] = mean
        row["over_bound_token_ratio"] = over / counted if counted else None


def prune(conn: sqlite3.Connection, through: int) -> None:
    """Retention: the figures go with their step's row."""
    conn.execute("DELETE FROM step_token_lag WHERE step <= ?", (through,))


def forget_after(conn: sqlite3.Connection, step: int) -> None:
    """A restore to ``step`` (deltarl/scheduler/restore.py): the records of later steps go."""
    conn.execute("DELETE FROM step_token_lag WHERE step > ?", (step,))
