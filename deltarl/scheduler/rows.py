"""The scheduler store's tables and rows: the schema, a prompt's states, its group as read.

``deltarl.scheduler.store`` keeps the transactions over these; see its docstring for the life
of a row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from statistics import fmean, pstdev

import orjson

from deltarl.scheduler.blob_table import BLOB_SCHEMA
from deltarl.scheduler.eval_store import EVAL_SCHEMA
from deltarl.scheduler.length_log import LENGTH_SCHEMA
from deltarl.scheduler.prefix_home import HOME_SCHEMA
from deltarl.scheduler.reward_stats import STEP_REWARDS_SCHEMA
from deltarl.scheduler.step_busy import BUSY_SCHEMA
from deltarl.scheduler.token_lag import TOKEN_LAG_SCHEMA
from deltarl.scheduler.token_waste import TOKENS_SCHEMA

SCHEMA_VERSION = 2
"""2: samples are blobs (``blob_table``) referenced by ``samples_ref``, no longer JSON inline."""


class PromptState(StrEnum):
    QUEUED = "queued"  # waiting to be (re)issued: requeued, dropped, or skipped by the policy
    ISSUED = "issued"  # an instance holds it under a lease
    POOLED = "pooled"  # completions scored, in the sample pool
    SHIPPED = "shipped"  # in a batch for ``step``; final only once checkpointed
    TRAINED = "trained"  # a checkpoint holds it: final
    ABANDONED = "abandoned"  # its group failed too often: final, counted, never silent


STATES = ", ".join(f"'{s}'" for s in PromptState)

SCHEMA = (
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    f"""
    CREATE TABLE IF NOT EXISTS prompts (
        prompt_id       INTEGER PRIMARY KEY CHECK (prompt_id >= 0),
        state           TEXT    NOT NULL CHECK (state IN ({STATES})),
        attempt         INTEGER NOT NULL,
        reward_failures INTEGER NOT NULL DEFAULT 0,  -- failed groups: reward or bad samples
        instance        TEXT,     -- issued: who holds it
        session         TEXT,
        lease_deadline  REAL,     -- issued: seconds since the epoch (durable across restarts)
        weight_version  INTEGER,  -- the instance's version when issued
        issued_at       REAL,
        pooled_at       REAL,
        samples_ref     TEXT,     -- pooled and later: the digest of its blob (blob_table)
        rewards         TEXT,     -- pooled and later: one reward per sample (JSON floats)
        min_version     INTEGER,  -- pooled and later: the oldest token version of the group
        step            INTEGER,  -- shipped and later
        lag             INTEGER,
        note            TEXT,     -- why it was last queued or abandoned
        CHECK ((state IN ('shipped', 'trained')) = (step IS NOT NULL))
    )
    """,
    "CREATE INDEX IF NOT EXISTS prompts_by_state ON prompts (state, prompt_id)",
    "CREATE INDEX IF NOT EXISTS prompts_by_step ON prompts (step)",
    "CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL)",
    """
    CREATE TABLE IF NOT EXISTS steps (
        step            INTEGER PRIMARY KEY,
        trainer_version INTEGER NOT NULL,  -- the version the trainer held when it took it
        groups          INTEGER NOT NULL,
        samples         INTEGER NOT NULL,
        reward_mean     REAL, reward_std REAL, reward_min REAL, reward_max REAL,
        lag_min         INTEGER, lag_mean REAL, lag_max INTEGER,
        gen_s_mean      REAL,  -- issued -> pooled: generation and scoring
        queue_s_mean    REAL,  -- pooled -> shipped: time in the pool
        shipped_at      REAL NOT NULL,
        done_at         REAL,
        version         INTEGER,  -- published by the trainer after this step
        metrics         TEXT,     -- StepDone.metrics (JSON)
        checkpointed    INTEGER NOT NULL DEFAULT 0
    )
    """,
    "CREATE TABLE IF NOT EXISTS runs (started_at REAL NOT NULL, config TEXT NOT NULL)",
    # Why an attempt's submission was refused (a drop or a stale submit), so a retried submit
    # gets the same answer and is not counted again. New in a schema-1 file: created on open.
    """
    CREATE TABLE IF NOT EXISTS refusals (
        prompt_id INTEGER NOT NULL,
        attempt   INTEGER NOT NULL,
        code      TEXT    NOT NULL,
        message   TEXT    NOT NULL,
        PRIMARY KEY (prompt_id, attempt)
    )
    """,
    *BLOB_SCHEMA,
    # Reward latency and errors per step (reward_stats). New in an older file: created on open.
    STEP_REWARDS_SCHEMA,
    # Held-out evaluation (deltarl.scheduler.eval_store); created on open in an older file.
    *EVAL_SCHEMA,
    # Tokens trained and wasted per step (token_waste); created on open in an older file.
    *TOKENS_SCHEMA,
    # Trained tokens' versions per step (token_lag); created on open in an older file.
    *TOKEN_LAG_SCHEMA,
    *LENGTH_SCHEMA,
    # Instances' busy seconds per step (step_busy); created on open in an older file.
    *BUSY_SCHEMA,
    # Where requeued prompts were prefilled (prefix_home); created on open in an older file.
    *HOME_SCHEMA,
)


class SchedulerStoreError(Exception):
    """The store cannot do what was asked; the message says why."""


def group_id(prompt_id: int, attempt: int) -> str:
    return f"{prompt_id}.{attempt}"


def parse_group_id(text: str) -> tuple[int, int] | None:
    """(prompt_id, attempt) of a group id, or None if it is not one."""
    head, dot, tail = text.partition(".")
    if not dot or not head.isdigit() or not tail.isdigit():
        return None
    return int(head), int(tail)


@dataclass(frozen=True)
class Group:
    """One prompt's row, as read in one snapshot."""

    prompt_id: int
    state: PromptState
    attempt: int
    reward_failures: int
    instance: str | None
    session: str | None
    lease_deadline: float | None
    weight_version: int | None
    issued_at: float | None
    pooled_at: float | None
    samples_ref: str | None
    """The digest of its encoded samples (``deltarl.rl.samples``) in the blobs table."""
    rewards: list[float] | None
    """One reward per sample, in the blob's order."""
    min_version: int | None
    step: int | None
    lag: int | None
    note: str | None

    @property
    def group_id(self) -> str:
        return group_id(self.prompt_id, self.attempt)

    @property
    def samples(self) -> int:
        """How many samples it holds (0 before it is pooled)."""
        return len(self.rewards or [])


COLUMNS = (
    "prompt_id, state, attempt, reward_failures, instance, session, lease_deadline,"
    " weight_version, issued_at, pooled_at, samples_ref, rewards, min_version, step, lag, note"
)


def group_from_row(row: tuple) -> Group:
    values = list(row)
    values[1] = PromptState(values[1])
    values[11] = None if values[11] is None else orjson.loads(values[11])
    return Group(*values)


@dataclass(frozen=True)
class ShipResult:
    """What ``ship`` did: the step's groups (empty: not enough pooled), and the lag drops."""

    groups: list[Group]
    replayed: bool
    dropped_for_lag: list[Group]
    pruned: bool = False
    """The step was checkpointed and its records pruned (retention): refused, not refilled."""


def stats(
    values: Sequence[float],
) -> tuple[float | None, float | None, float | None, float | None]:
    if not values:
        return None, None, None, None
    return fmean(values), pstdev(values), min(values), max(values)
