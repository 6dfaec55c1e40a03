"""The scheduler store's evaluation tables: held-out rounds and their one-sample groups.

Apart from ``prompts`` on purpose: an eval group is never pooled, shipped or trained, and must
not move the prompt cursor, the pool's capacity, the lag gate or any training counter. A round
is keyed by the step it was triggered at; each of its ``size`` held-out prompts is one row,
whose life mirrors a training group's up to the submit::

    queued --issue--> issued --submit, scored--> done (reward, token versions)
      ^                 |                   \\--> failed (samples malformed, reward failed)
      +---- requeue ----+  (lease ran out, instance gone or restarted, not held): attempt + 1

A requeued row is issued again (a new attempt; a late submit of the old one is refused), so a
round interrupted by a scheduler or rollout restart finishes once the rows come back. A failed
row is not retried (greedy decoding would fail the same way): its round ends ``partial``.
The round is finished, in the transaction that records its last row, when no row is queued or
issued. Every change is one transaction, like the rest of the store.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from deltarl.scheduler.blob_table import BlobTable

EVAL_SCHEMA = (
    """
    CREATE TABLE IF NOT EXISTS eval_rounds (
        step           INTEGER PRIMARY KEY,  -- the optimizer step it was triggered at (0: none)
        target_version INTEGER NOT NULL,     -- the trainer's version then: issued to engines at it
        size           INTEGER NOT NULL,     -- held-out prompts
        started_at     REAL    NOT NULL,
        finished_at    REAL                  -- no row queued or issued any more
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS eval_groups (
        step           INTEGER NOT NULL,
        idx            INTEGER NOT NULL,     -- the held-out prompt (task.eval_prompt(idx))
        state          TEXT    NOT NULL CHECK (state IN ('queued', 'issued', 'done', 'failed')),
        attempt        INTEGER NOT NULL DEFAULT 0,
        instance       TEXT,
        session        TEXT,
        weight_version INTEGER,              -- the instance's version when issued
        issued_at      REAL,
        lease_deadline REAL,
        reward         REAL,                 -- done: the task's reward of its one sample
        version_min    INTEGER,              -- done: its tokens' oldest and newest version
        version_max    INTEGER,
        note           TEXT,                 -- why it was last requeued, or why it failed
        PRIMARY KEY (step, idx)
    )
    """,
    "CREATE INDEX IF NOT EXISTS eval_groups_by_state ON eval_groups (state, step, idx)",
)

EVAL_PREFIX = "e"


def eval_group_id(step: int, idx: int, attempt: int) -> str:
    """``e<step>.<idx>.<attempt>``: never a training group id (``<prompt>.<attempt>``)."""
    return f"{EVAL_PREFIX}{step}.{idx}.{attempt}"


def parse_eval_group_id(text: str) -> tuple[int, int, int] | None:
    """(step, idx, attempt) of an eval group id; None if ``text`` is not one."""
    if not text.startswith(EVAL_PREFIX):
        return None
    parts = text[len(EVAL_PREFIX) :].split(".")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        return None
    step, idx, attempt = (int(p) for p in parts)
    return step, idx, attempt


@dataclass(frozen=True)
class EvalGroup:
    step: int
    idx: int
    state: str
    attempt: int
    instance: str | None
    session: str | None
    weight_version: int | None

    @property
    def group_id(self) -> str:
        return eval_group_id(self.step, self.idx, self.attempt)


@dataclass(frozen=True)
class EvalRound:
    step: int
    target_version: int
    size: int


_GROUP_COLUMNS = "step, idx, state, attempt, instance, session, weight_version"
_REQUEUE = (
    "UPDATE eval_groups SET state = 'queued', attempt = attempt + 1, instance = NULL,"
    " session = NULL, weight_version = NULL, issued_at = NULL, lease_deadline = NULL, note = ?"
    " WHERE step = ? AND idx = ?"
)


class EvalTables(BlobTable):
    """The evaluation methods of ``SchedulerStore`` (see the module docstring)."""

    @staticmethod
    def _count(conn: sqlite3.Connection, name: str, by: int = 1) -> None:
        conn.execute(
            "INSERT INTO counters VALUES (?, ?) ON CONFLICT (name) DO UPDATE SET value = value + ?",
            (name, by, by),
        )

    def open_eval_round(self, step: int, target_version: int, size: int) -> bool:
        """Start the round of ``step`` with ``size`` queued rows; False if it exists already
        (a replayed step, or a restart)."""
        with self._lock, self._write() as conn:
            created = conn.execute(
                "INSERT OR IGNORE INTO eval_rounds (step, target_version, size, started_at)"
                " VALUES (?, ?, ?, ?)",
                (step, target_version, size, self.clock()),
            ).rowcount
            if created:
                conn.executemany(
                    "INSERT INTO eval_groups (step, idx, state) VALUES (?, ?, 'queued')",
                    [(step, i) for i in range(size)],
                )
                self._count(conn, "eval.rounds")
            return bool(created)

    def eval_open(self) -> EvalRound | None:
        """The oldest round not finished yet."""
        with self._read() as conn:
            row = conn.execute(
                "SELECT step, target_version, size FROM eval_rounds WHERE finished_at IS NULL"
                " ORDER BY step LIMIT 1"
            ).fetchone()
        return None if row is None else EvalRound(*row)

    def eval_group(self, step: int, idx: int) -> EvalGroup | None:
        with self._read() as conn:
            row = conn.execute(
                f"SELECT {_GROUP_COLUMNS} FROM eval_groups WHERE step = ? AND idx = ?",  # noqa: S608 - constant columns
                (step, idx),
            ).fetchone()
        return None if row is None else EvalGroup(*row)

    def issue_eval(
        self,
        step: int,
        limit: int,
        *,
        instance: str,
        session: str,
        weight_version: int | None,
        lease_s: float,
    ) -> list[EvalGroup]:
        """Issue up to ``limit`` queued rows of round ``step`` (lowest index first)."""
        now = self.clock()
        with self._lock, self._write() as conn:
            rows = conn.execute(
                "SELECT idx FROM eval_groups WHERE step = ? AND state = 'queued'"
                " ORDER BY idx LIMIT ?",
                (step, limit),
            ).fetchall()
            conn.executemany(
                "UPDATE eval_groups SET state = 'issued', instance = ?, session = ?,"
                " weight_version = ?, issued_at = ?, lease_deadline = ?, note = NULL"
                " WHERE step = ? AND idx = ?",
                [(instance, session, weight_version, now, now + lease_s, step, i) for (i,) in rows],
            )
            if rows:
                self._count(conn, "eval.issued_groups", len(rows))
            return [
                EvalGroup(*r)
                for r in conn.execute(
                    f"SELECT {_GROUP_COLUMNS} FROM eval_groups WHERE step = ? AND idx IN"  # noqa: S608 - constant columns
                    f" ({', '.join('?' * len(rows))}) ORDER BY idx",
                    (step, *(i for (i,) in rows)),
                )
            ]

    def finish_eval(
        self,
        group: EvalGroup,
        *,
        reward: float | None,
        versions: tuple[int | None, int | None],
        failure: str | None = None,
        blob: str | None = None,
    ) -> tuple[bool, bool]:
        """Record the issued attempt ``group`` as done (``reward``, token ``versions``) or, with
        ``failure``, failed; its samples' ``blob`` is released (nothing trains on it). Returns
        (recorded: the attempt was still issued, finished: its round just ended)."""
        with self._lock, self._write() as conn:
            updated = conn.execute(
                "UPDATE eval_groups SET state = ?, reward = ?, version_min = ?, version_max = ?,"
                " lease_deadline = NULL, note = ?"
                " WHERE step = ? AND idx = ? AND attempt = ? AND state = 'issued'",
                (
                    "failed" if failure else "done",
                    reward,
                    versions[0],
                    versions[1],
                    failure,
                    group.step,
                    group.idx,
                    group.attempt,
                ),
            ).rowcount
            if blob is not None:
                self._release(conn, [blob])
            if not updated:
                return False, False
            self._count(conn, "eval.failed_groups" if failure else "eval.samples")
            left = conn.execute(
                "SELECT COUNT(*) FROM eval_groups WHERE step = ? AND state IN ('queued', 'issued')",
                (group.step,),
            ).fetchone()[0]
            if left:
                return True, False
            conn.execute(
                "UPDATE eval_rounds SET finished_at = ? WHERE step = ?", (self.clock(), group.step)
            )
            return True, True

    def _requeue_eval(self, conn: sqlite3.Connection, rows: list[Any], reason: str) -> int:
        for step, idx in rows:
            conn.execute(_REQUEUE, (reason, step, idx))
        if rows:
            self._count(conn, f"eval.requeued.{reason}", len(rows))
        return len(rows)

    def requeue_eval_instance(
        self, instance: str, reason: str, *, keep_session: str | None = None
    ) -> int:
        """Requeue the eval rows ``instance`` holds (but those of ``keep_session``)."""
        with self._lock, self._write() as conn:
            rows = conn.execute(
                "SELECT step, idx FROM eval_groups WHERE state = 'issued' AND instance = ?"
                " AND session IS NOT ?",
                (instance, keep_session),
            ).fetchall()
            return self._requeue_eval(conn, rows, reason)

    def requeue_eval_not_held(
        self, instance: str, session: str, held: Collection[str], issued_before: float
    ) -> int:
        """Requeue the eval rows issued to this session before ``issued_before`` that its
        heartbeat does not list in ``held``."""
        with self._lock, self._write() as conn:
            rows = conn.execute(
                "SELECT step, idx, attempt FROM eval_groups WHERE state = 'issued'"
                " AND instance = ? AND session = ? AND issued_at < ?",
                (instance, session, issued_before),
            ).fetchall()
            lost = [(s, i) for s, i, a in rows if eval_group_id(s, i, a) not in held]
            return self._requeue_eval(conn, lost, "not_held")

    def requeue_eval_expired(self) -> int:
        """Requeue the eval rows whose lease ran out."""
        with self._lock, self._write() as conn:
            rows = conn.execute(
                "SELECT step, idx FROM eval_groups WHERE state = 'issued' AND lease_deadline < ?",
                (self.clock(),),
            ).fetchall()
            return self._requeue_eval(conn, rows, "lease_expired")

    def eval_rounds(self) -> list[dict[str, Any]]:
        """Every round, oldest first: its step, target version, and what was measured.

        ``accuracy``: the share of scored samples whose reward is exactly 1.0 (None before
        any); ``version_min``/``version_max``: the oldest and newest token version of its
        samples, the weights it measured; ``partial``: some rows failed and are not counted.
        """
        with self._read() as conn:
            rows = conn.execute(
                "SELECT r.step, r.target_version, r.size, r.started_at, r.finished_at,"
                " SUM(g.state = 'done'), SUM(g.state = 'failed'),"
                " SUM(g.state = 'done' AND g.reward = 1.0), AVG(g.reward),"
                " MIN(g.version_min), MAX(g.version_max)"
                " FROM eval_rounds r JOIN eval_groups g ON g.step = r.step"
                " GROUP BY r.step ORDER BY r.step"
            ).fetchall()
        out = []
        for step, target, size, started, finished, done, failed, correct, mean, lo, hi in rows:
            out.append(
                {
                    "step": step,
                    "target_version": target,
                    "size": size,
                    "samples": int(done or 0),
                    "failed": int(failed or 0),
                    "accuracy": correct / done if done else None,
                    "reward_mean": mean,
                    "version_min": lo,
                    "version_max": hi,
                    "finished": finished is not None,
                    "partial": bool(failed),
                    "started_at": started,
                    "finished_at": finished,
                }
            )
        return out
