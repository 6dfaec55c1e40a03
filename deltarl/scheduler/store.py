"""The scheduler's durable state: the prompt cursor, every prompt's group, counters, run metadata.

One sqlite file in WAL mode, the same engine and discipline as ``deltarl.refit.manifest_store``:
every state change is one ``BEGIN IMMEDIATE`` transaction with ``synchronous=FULL``, so a crash
at any point, ``kill -9`` included, leaves the file as it was before or after the change, never
between. Readers in other processes (a test, an operator's sqlite3) may read while it writes.

Exactly once, per prompt. Every prompt id below ``cursor`` has exactly one row in ``prompts``,
and a row is never deleted but by retention, and then only once trained in a checkpointed step
(``deltarl.scheduler.retention``: S1-S3), so no prompt is ever skipped; the row's state says
where it is::

    (cursor) ──issue──► issued ──pool──► pooled ──ship(step)──► shipped ──checkpoint──► trained
                          │                │                       │
                          │ requeue        │ drop (lag, reward)    │ replay: the same step
                          ▼                ▼                       ▼ returns the same rows
                        queued ◄───────────┘
                          │ reissued (attempt + 1)      abandoned: failed too often

A row holds one *attempt* at a time; its group id is ``"<prompt_id>.<attempt>"``. Requeueing or
dropping bumps the attempt, so a late submission of an earlier attempt names a group that no
longer exists and is refused (and counted): two attempts of one prompt can never both reach the
pool. A refused submission of an attempt (dropped while it was scored, or arriving after its
requeue) is recorded in ``refusals``: a retry of it gets the same answer and is counted once.
A shipped row keeps its step, and only ``checkpoint`` moves it on, so a trainer that
restarts from its last checkpoint asks for the same steps again and gets the same groups.

A pooled row holds its samples by reference: ``samples_ref``, the digest of an encoded group
in the ``blobs`` table (``blob_table``: written when the samples socket received it, released
with the row's drop or checkpoint in the same transaction), and ``rewards``, one per sample.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Collection, Mapping, Sequence
from statistics import fmean
from typing import Any

import orjson

from deltarl.config.rl import LagRule
from deltarl.scheduler import (
    length_log,
    prefix_home,
    reward_stats,
    step_busy,
    token_lag,
    token_waste,
)
from deltarl.scheduler.eval_store import EvalTables
from deltarl.scheduler.restore import StepRestore
from deltarl.scheduler.retention import StepRetention
from deltarl.scheduler.rows import (
    COLUMNS,
    SCHEMA,
    SCHEMA_VERSION,
    Group,
    PromptState,
    SchedulerStoreError,
    ShipResult,
    group_from_row,
    group_id,
    parse_group_id,
    stats,
)

logger = logging.getLogger(__name__)


class SchedulerStore(EvalTables, StepRetention, StepRestore):
    """The scheduler's tables in one sqlite file; one writer process, any number of readers.

    Every method is one snapshot or one transaction, safe from several threads (one connection
    behind a lock). ``clock`` gives seconds since the epoch: leases outlive a restart, so they
    are wall-clock deadlines, not monotonic ones.
    """

    KIND = "scheduler store"
    SCHEMA = SCHEMA
    SCHEMA_VERSION = SCHEMA_VERSION
    Error = SchedulerStoreError

    def _init_schema(self, conn: sqlite3.Connection) -> None:
        conn.execute("INSERT OR IGNORE INTO meta VALUES ('cursor', '0')")

    # -- helpers inside a transaction ---------------------------------------------------------

    @staticmethod
    def _bump(conn: sqlite3.Connection, name: str, by: int = 1) -> None:
        conn.execute(
            "INSERT INTO counters VALUES (?, ?) ON CONFLICT (name) DO UPDATE SET value = value + ?",
            (name, by, by),
        )

    @staticmethod
    def _get(conn: sqlite3.Connection, prompt_id: int) -> Group | None:
        row = conn.execute(
            f"SELECT {COLUMNS} FROM prompts WHERE prompt_id = ?",  # noqa: S608 - constant columns
            (prompt_id,),
        ).fetchone()
        return None if row is None else group_from_row(row)

    @classmethod
    def _requeue(cls, conn: sqlite3.Connection, prompt_id: int, note: str) -> None:
        """Back to the queue as a new attempt: the old group id stops being accepted, and the
        old attempt's samples are released."""
        ref = conn.execute(
            "SELECT samples_ref FROM prompts WHERE prompt_id = ?", (prompt_id,)
        ).fetchone()
        prefix_home.remember(conn, prompt_id, note)  # before its instance and version go
        conn.execute(
            "UPDATE prompts SET state = 'queued', attempt = attempt + 1, instance = NULL,"
            " session = NULL, lease_deadline = NULL, weight_version = NULL, issued_at = NULL,"
            " pooled_at = NULL, samples_ref = NULL, rewards = NULL, min_version = NULL,"
            " step = NULL, lag = NULL, note = ? WHERE prompt_id = ?",
            (note, prompt_id),
        )
        cls._release(conn, [ref[0] if ref else None])

    # -- reads --------------------------------------------------------------------------------

    @property
    def cursor(self) -> int:
        with self._read() as conn:
            return int(conn.execute("SELECT value FROM meta WHERE key = 'cursor'").fetchone()[0])

    def meta(self, key: str) -> str | None:
        with self._read() as conn:
            row = conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
            return None if row is None else str(row[0])

    def group(self, prompt_id: int) -> Group | None:
        with self._read() as conn:
            return self._get(conn, prompt_id)

    def groups(
        self, state: PromptState | None = None, *, instance: str | None = None
    ) -> list[Group]:
        sql, args = f"SELECT {COLUMNS} FROM prompts WHERE 1 = 1", []  # noqa: S608 - constant columns
        if state is not None:
            sql += " AND state = ?"
            args.append(state.value)
        if instance is not None:
            sql += " AND instance = ?"
            args.append(instance)
        with self._read() as conn:
            return [group_from_row(r) for r in conn.execute(sql + " ORDER BY prompt_id", args)]

    def queued(self, limit: int) -> list[int]:
        """The oldest queued prompt ids (FIFO by prompt id)."""
        with self._read() as conn:
            rows = conn.execute(
                "SELECT prompt_id FROM prompts WHERE state = 'queued' ORDER BY prompt_id LIMIT ?",
                (limit,),
            )
            return [r[0] for r in rows]

    def prefix_homes(self, prompt_ids: Sequence[int]) -> dict[int, tuple[str, int]]:
        """``prefix_home.homes``: where each requeued prompt was prefilled, and under which
        weight version."""
        with self._read() as conn:
            return prefix_home.homes(conn, prompt_ids)

    def state_counts(self) -> dict[str, int]:
        with self._read() as conn:
            found = dict(conn.execute("SELECT state, COUNT(*) FROM prompts GROUP BY state"))
        return {s.value: int(found.get(s.value, 0)) for s in PromptState}

    def counters(self) -> dict[str, int]:
        with self._read() as conn:
            return dict(conn.execute("SELECT name, value FROM counters ORDER BY name"))

    def history(self, last: int = 0) -> list[dict[str, Any]]:
        """Per-step records, oldest first (only the last ``last`` if > 0)."""
        # LIMIT in sql: the service asks for the last step at every GetWork, and a whole
        # table read there would cost more with every step kept.
        limit = last if last > 0 else -1  # sqlite: a negative LIMIT is none
        with self._read() as conn:
            cur = conn.execute(
                "SELECT * FROM (SELECT * FROM steps ORDER BY step DESC LIMIT ?) ORDER BY step",
                (limit,),
            )
            names = [d[0] for d in cur.description]
            rows = [dict(zip(names, r, strict=True)) for r in cur]
            reward_stats.attach(conn, rows)
            token_waste.attach(conn, rows)
            token_lag.attach(conn, rows)
            length_log.attach(conn, rows)
            step_busy.attach(conn, rows)
        for row in rows:
            row["metrics"] = orjson.loads(row["metrics"]) if row["metrics"] else {}
            row["checkpointed"] = bool(row["checkpointed"])
        return rows

    def length_records(self) -> list[tuple[str, int, str, int, list[int]]]:
        """``length_log.records``: every pooled group's lengths, the planner's history."""
        with self._read() as conn:
            return length_log.records(conn)

    def planned_lengths(self) -> list[tuple[int, float, float]]:
        """``length_log.planned``: the online length correction's record."""
        with self._read() as conn:
            return length_log.planned(conn)

    def run_config(self) -> dict[str, Any]:
        """The configuration of the latest start (``record_run``)."""
        with self._read() as conn:
            row = conn.execute("SELECT config FROM runs ORDER BY rowid DESC LIMIT 1").fetchone()
        return {} if row is None else orjson.loads(row[0])

    def starts(self) -> int:
        with self._read() as conn:
            return int(conn.execute("SELECT COUNT(*) FROM runs").fetchone()[0])

    # -- writes -------------------------------------------------------------------------------

    def record_run(self, config: dict[str, Any]) -> None:
        """Record the configuration of this start (every restart adds one row)."""
        with self._lock, self._write() as conn:
            conn.execute("INSERT INTO runs VALUES (?, ?)", (self.clock(), orjson.dumps(config)))

    def set_meta(self, key: str, value: str) -> None:
        with self._lock, self._write() as conn:
            conn.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))

    def bump(self, name: str, by: int = 1) -> None:
        """A counter that goes with no state change (lag throttles, duplicate submits...)."""
        with self._lock, self._write() as conn:
            self._bump(conn, name, by)

    def issue(
        self,
        prompt_ids: Sequence[int],
        *,
        instance: str,
        session: str,
        weight_version: int | None,
        lease_s: float,
        dataset_size: int = 0,
    ) -> list[Group]:
        """Issue ``prompt_ids`` (queued ones, or fresh ones at or past the cursor) to an instance.

        Fresh ids the policy passed over (between the cursor and the largest fresh id chosen)
        get rows in state ``queued`` in the same transaction, so moving the cursor never skips
        a prompt. An id that is neither queued nor fresh any more is left out of the result.
        """
        now = self.clock()
        issued: list[Group] = []
        with self._lock, self._write() as conn:
            cursor = int(conn.execute("SELECT value FROM meta WHERE key = 'cursor'").fetchone()[0])
            chosen = set(prompt_ids)
            fresh = sorted(p for p in chosen if p >= cursor)
            if fresh and dataset_size and fresh[-1] >= dataset_size:
                raise SchedulerStoreError(f"prompt {fresh[-1]} is past the dataset's end")
            if fresh:
                passed = "passed over by the dispatch policy"
                conn.executemany(
                    "INSERT INTO prompts (prompt_id, state, attempt, note)"
                    " VALUES (?, 'queued', 0, ?)",
                    [(p, None if p in chosen else passed) for p in range(cursor, fresh[-1] + 1)],
                )
                conn.execute(
                    "UPDATE meta SET value = ? WHERE key = 'cursor'", (str(fresh[-1] + 1),)
                )
            for p in prompt_ids:
                updated = conn.execute(
                    "UPDATE prompts SET state = 'issued', instance = ?, session = ?,"
                    " lease_deadline = ?, weight_version = ?, issued_at = ?, note = NULL"
                    " WHERE prompt_id = ? AND state = 'queued'",
                    (instance, session, now + lease_s, weight_version, now, p),
                ).rowcount
                if updated:
                    group = self._get(conn, p)
                    assert group is not None  # just updated
                    issued.append(group)
            if issued:
                self._bump(conn, "issued_groups", len(issued))
                # Of the prompts with a home: went back to it (hit) or elsewhere (miss).
                homes = prefix_home.homes(conn, [g.prompt_id for g in issued])
                home_hits = sum(
                    1 for i, v in homes.values() if i == instance and v == weight_version
                )
                if homes:
                    self._bump(conn, "prefix_home.hit", home_hits)
                    self._bump(conn, "prefix_home.miss", len(homes) - home_hits)
                prefix_home.forget(conn, homes)  # only those that had one
        return issued

    def requeue_instance(
        self, instance: str, reason: str, *, keep_session: str | None = None
    ) -> int:
        """Requeue every group ``instance`` holds (but those of ``keep_session``): it is gone,
        or restarted. Counted as ``requeued.<reason>``."""
        with self._lock, self._write() as conn:
            rows = conn.execute(
                "SELECT prompt_id FROM prompts WHERE state = 'issued' AND instance = ?"
                " AND session IS NOT ?",
                (instance, keep_session),
            ).fetchall()
            for (p,) in rows:
                self._requeue(conn, p, reason)
            if rows:
                self._bump(conn, f"requeued.{reason}", len(rows))
            prefix_home.forget_instance(conn, instance)
            return len(rows)

    def requeue_not_held(
        self, instance: str, session: str, held: Collection[str], issued_before: float
    ) -> list[int]:
        """Requeue the groups issued to ``instance`` in ``session`` before ``issued_before``
        (wall clock) whose group ids are not in ``held``: the instance reported it does not
        hold them (its Work reply was lost). Counted as ``requeued.not_held``."""
        with self._lock, self._write() as conn:
            rows = conn.execute(
                "SELECT prompt_id, attempt FROM prompts WHERE state = 'issued' AND instance = ?"
                " AND session = ? AND issued_at < ?",
                (instance, session, issued_before),
            ).fetchall()
            lost = [p for p, a in rows if group_id(p, a) not in held]
            for p in lost:
                self._requeue(conn, p, "not_held")
            if lost:
                self._bump(conn, "requeued.not_held", len(lost))
            return lost

    def requeue_doomed(self, instance: str, session: str, doomed: Mapping[str, int]) -> list[str]:
        """Requeue these groups (group id -> tokens generated so far) issued to ``instance``
        in ``session``: they can no longer ship within the lag bound. Their tokens are wasted
        (``token_waste``, recorded with the next step), counted ``requeued.doomed``. The group
        ids requeued (an id not issued to that session now is left alone)."""
        done: list[str] = []
        wasted = 0
        with self._lock, self._write() as conn:
            for gid, tokens in doomed.items():
                ids = parse_group_id(gid)
                if ids is None:
                    continue
                found = conn.execute(
                    "SELECT 1 FROM prompts WHERE prompt_id = ? AND attempt = ?"
                    " AND state = 'issued' AND instance = ? AND session = ?",
                    (ids[0], ids[1], instance, session),
                ).fetchone()
                if found is None:
                    continue
                self._requeue(conn, ids[0], "doomed")
                wasted += max(int(tokens), 0)
                done.append(gid)
            if done:
                token_waste.wasted(conn, wasted, len(done))
                self._bump(conn, "requeued.doomed", len(done))
        return done

    def requeue_expired(self) -> list[int]:
        """Requeue issued groups whose lease ran out (no heartbeat kept it)."""
        with self._lock, self._write() as conn:
            rows = conn.execute(
                "SELECT prompt_id FROM prompts WHERE state = 'issued' AND lease_deadline < ?",
                (self.clock(),),
            ).fetchall()
            for (p,) in rows:
                self._requeue(conn, p, "lease_expired")
            if rows:
                self._bump(conn, "requeued.lease_expired", len(rows))
            return [p for (p,) in rows]

    def pool(
        self,
        prompt_id: int,
        attempt: int,
        blob: tuple[str, bytes],
        rewards: Sequence[float],
        min_version: int | None,
        tokens: int = 0,
        lengths: length_log.LengthNote | None = None,
        versions: Mapping[int, int] | None = None,
    ) -> bool:
        """Issued -> pooled, with its samples' blob (digest, bytes: kept again if it was swept
        meanwhile), their rewards and completion ``tokens`` (``token_waste``) and ``lengths``
        (``length_log``'s history) and tokens per ``versions`` (``token_lag``). False if this
        attempt is not issued now (requeued meanwhile): nothing is written, and the caller
        counts the drop."""
        digest, data = blob
        with self._lock, self._write() as conn:
            updated = conn.execute(
                "UPDATE prompts SET state = 'pooled', pooled_at = ?, samples_ref = ?,"
                " rewards = ?, min_version = ?, lease_deadline = NULL"
                " WHERE prompt_id = ? AND attempt = ? AND state = 'issued'",
                (
                    self.clock(),
                    digest,
                    orjson.dumps(list(rewards)),
                    min_version,
                    prompt_id,
                    attempt,
                ),
            ).rowcount
            if updated:
                kept = conn.execute("SELECT 1 FROM blobs WHERE digest = ?", (digest,)).fetchone()
                if kept is None:
                    self._put(conn, digest, data)
                token_waste.note(conn, prompt_id, attempt, tokens)
                token_lag.note(conn, prompt_id, attempt, versions or {})
                if lengths is not None:
                    length_log.note(conn, prompt_id, attempt, lengths, self.clock())
                self._bump(conn, "pooled_groups")
                self._bump(conn, "pooled_samples", len(rewards))
            return bool(updated)

    def drop(
        self,
        prompt_id: int,
        attempt: int,
        reason: str,
        samples: int,
        *,
        failure: bool = False,
        max_failures: int = 0,
        refusal: tuple[str, str] | None = None,
        blob: str | None = None,
    ) -> PromptState | None:
        """Drop this attempt's group (counted ``dropped_groups.<reason>`` and
        ``dropped_samples.<reason>``); the prompt goes back to the queue, or, if this was a
        ``failure`` (reward or bad samples) and the prompt's ``max_failures``-th (0: never), is
        abandoned (counted ``abandoned_prompts``). ``refusal`` (code, message): the answer to
        the submission, recorded for its retries (``refusal``). ``blob``: the refused
        submission's samples, removed with the drop. None if the attempt is not live any more:
        nothing is written."""
        with self._lock, self._write() as conn:
            group = self._get(conn, prompt_id)
            if (
                group is None
                or group.attempt != attempt
                or group.state
                not in (
                    PromptState.ISSUED,
                    PromptState.POOLED,
                )
            ):
                return None
            state = self._drop(conn, group, reason, samples, failure, max_failures)
            if refusal is not None:
                conn.execute(
                    "INSERT OR IGNORE INTO refusals VALUES (?, ?, ?, ?)",
                    (prompt_id, attempt, *refusal),
                )
            self._release(conn, [blob])
            return state

    def refusal(self, prompt_id: int, attempt: int) -> tuple[str, str] | None:
        """The recorded answer (code, message) to a refused submission of this attempt."""
        with self._read() as conn:
            row = conn.execute(
                "SELECT code, message FROM refusals WHERE prompt_id = ? AND attempt = ?",
                (prompt_id, attempt),
            ).fetchone()
            return None if row is None else (str(row[0]), str(row[1]))

    def refuse_stale(
        self, prompt_id: int, attempt: int, samples: int, code: str, message: str
    ) -> tuple[tuple[str, str], bool]:
        """Refuse a submission of an attempt that is not live any more: the first time it is
        counted (``dropped_groups.stale_submit``, ``dropped_samples.stale_submit``) and its
        answer recorded; a retry gets the recorded answer and counts nothing. Returns the
        answer and whether this was the first time."""
        with self._lock, self._write() as conn:
            row = conn.execute(
                "SELECT code, message FROM refusals WHERE prompt_id = ? AND attempt = ?",
                (prompt_id, attempt),
            ).fetchone()
            if row is not None:
                return (str(row[0]), str(row[1])), False
            self._bump(conn, "dropped_groups.stale_submit")
            self._bump(conn, "dropped_samples.stale_submit", samples)
            conn.execute(
                "INSERT INTO refusals VALUES (?, ?, ?, ?)", (prompt_id, attempt, code, message)
            )
            return (code, message), True

    def _drop(
        self,
        conn: sqlite3.Connection,
        group: Group,
        reason: str,
        samples: int,
        failure: bool,
        max_failures: int,
    ) -> PromptState:
        self._bump(conn, f"dropped_groups.{reason}")
        self._bump(conn, f"dropped_samples.{reason}", samples)
        self._requeue(conn, group.prompt_id, f"dropped: {reason}")
        if not failure:
            return PromptState.QUEUED
        failures = group.reward_failures + 1  # the column counts every failure, not only reward
        state = PromptState.QUEUED
        if max_failures and failures >= max_failures:
            state = PromptState.ABANDONED
            self._bump(conn, "abandoned_prompts")
            prefix_home.forget(conn, [group.prompt_id])
        conn.execute(
            "UPDATE prompts SET reward_failures = ?, state = ? WHERE prompt_id = ?",
            (failures, state.value, group.prompt_id),
        )
        return state

    def shipped(self, step: int) -> list[Group]:
        """The groups shipped to ``step`` (trained ones too), in the order they were shipped."""
        with self._read() as conn:
            rows = conn.execute(
                f"SELECT {COLUMNS} FROM prompts WHERE step = ? ORDER BY pooled_at, prompt_id",  # noqa: S608 - constant columns
                (step,),
            )
            return [group_from_row(r) for r in rows]

    def ship(
        self,
        step: int,
        groups: int,
        trainer_version: int,
        max_lag: int,
        reward: Mapping[str, Any] | None = None,
        throughput: Mapping[str, float] | None = None,
        lag_rule: LagRule = "oldest_token",
        max_token_lag: int | None = None,
        busy: Mapping[str, float] | None = None,
    ) -> ShipResult:
        """The groups of ``step``: the same ones again if it was shipped (exact replay), else
        the oldest ``groups`` pooled ones within the lag bound, all or none. ``reward``: the
        scoring figures since the last step (``reward_stats``), recorded with a new step, as
        are the live instances' ``throughput`` (tokens/s) and its groups' length prediction
        errors (``length_log``) and ``busy``, each live instance's busy seconds (``step_busy``:
        the step's skewness).

        Lag = ``trainer_version`` - the group's oldest token version (``lag_rule`` =
        ``oldest_token``) or its newest (``partial``: ``token_lag``; the oldest where an older
        deltarl noted no versions), measured now, so time in the pool counts. Under
        ``partial``, a group whose oldest token is more than ``max_token_lag`` behind counts
        as over the bound too. A pooled group over it can only get staler: it is dropped
        (``dropped_groups.lag_exceeded``) and its prompt queued again, in this transaction,
        whether or not the step can be filled.
        """
        now = self.clock()
        with self._lock, self._write() as conn:
            rows = conn.execute(
                f"SELECT {COLUMNS} FROM prompts WHERE step = ? ORDER BY pooled_at, prompt_id",  # noqa: S608 - constant columns
                (step,),
            ).fetchall()
            if rows:
                return ShipResult([group_from_row(r) for r in rows], True, [])
            pruned = conn.execute("SELECT value FROM meta WHERE key = 'pruned_through'").fetchone()
            if pruned is not None and step <= int(pruned[0]):
                # S3: its groups were trained and their rows pruned; new ones must not take
                # the old step's place.
                return ShipResult([], True, [], pruned=True)
            pooled = [
                group_from_row(r)
                for r in conn.execute(
                    f"SELECT {COLUMNS} FROM prompts WHERE state = 'pooled'"  # noqa: S608 - constant columns
                    " ORDER BY pooled_at, prompt_id"
                )
            ]
            fresh: list[tuple[Group, int]] = []
            stale: list[Group] = []
            for g in pooled:
                oldest = trainer_version - (g.min_version if g.min_version is not None else 0)
                lag, over = oldest, oldest > max_lag
                if lag_rule == "partial":
                    newest = token_lag.newest(conn, g.prompt_id, g.attempt)
                    lag = trainer_version - newest if newest is not None else oldest
                    over = lag > max_lag or (max_token_lag is not None and oldest > max_token_lag)
                if over:
                    stale.append(g)
                    self._drop(conn, g, "lag_exceeded", g.samples, failure=False, max_failures=0)
                else:
                    fresh.append((g, max(lag, 0)))
            stale_tokens = token_waste.take(conn, ((g.prompt_id, g.attempt) for g in stale))
            token_waste.wasted(conn, stale_tokens, len(stale))
            token_lag.discard(conn, ((g.prompt_id, g.attempt) for g in stale))
            if len(fresh) < groups:
                return ShipResult([], False, stale)
            taken = fresh[:groups]
            for g, lag in taken:
                conn.execute(
                    "UPDATE prompts SET state = 'shipped', step = ?, lag = ? WHERE prompt_id = ?",
                    (step, lag, g.prompt_id),
                )
            rewards = [float(r) for g, _ in taken for r in g.rewards or []]
            lags = [lag for _, lag in taken]
            gen = [g.pooled_at - g.issued_at for g, _ in taken if g.pooled_at and g.issued_at]
            queue = [now - g.pooled_at for g, _ in taken if g.pooled_at]
            r_mean, r_std, r_min, r_max = stats(rewards)
            conn.execute(
                "INSERT INTO steps (step, trainer_version, groups, samples, reward_mean,"
                " reward_std, reward_min, reward_max, lag_min, lag_mean, lag_max, gen_s_mean,"
                " queue_s_mean, shipped_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    step,
                    trainer_version,
                    len(taken),
                    len(rewards),
                    r_mean,
                    r_std,
                    r_min,
                    r_max,
                    min(lags),
                    fmean(lags),
                    max(lags),
                    fmean(gen) if gen else None,
                    fmean(queue) if queue else None,
                    now,
                ),
            )
            if reward is not None:
                reward_stats.insert(conn, step, reward)
            token_waste.record(
                conn, step, token_waste.take(conn, ((g.prompt_id, g.attempt) for g, _ in taken))
            )
            ids = [(g.prompt_id, g.attempt) for g, _ in taken]
            length_log.record(conn, step, ids, throughput or {})
            if busy is not None:
                step_busy.record(conn, step, busy)
            token_lag.record(conn, step, trainer_version, max_lag, ids)
            self._bump(conn, "shipped_groups", len(taken))
            self._bump(conn, "shipped_samples", len(rewards))
            conn.execute(
                "INSERT OR REPLACE INTO meta VALUES ('trainer_version', ?)", (str(trainer_version),)
            )
            shipped = [
                group_from_row(r)
                for r in conn.execute(
                    f"SELECT {COLUMNS} FROM prompts WHERE step = ? ORDER BY pooled_at, prompt_id",  # noqa: S608 - constant columns
                    (step,),
                )
            ]
            return ShipResult(shipped, False, stale)

    def step_done(self, step: int, version: int, metrics: dict[str, Any]) -> bool:
        """Record that ``step`` was trained and published as ``version`` (again, after a
        replay: the latest record wins). False if ``step`` was never shipped."""
        with self._lock, self._write() as conn:
            updated = conn.execute(
                "UPDATE steps SET done_at = ?, version = ?, metrics = ? WHERE step = ?",
                (self.clock(), version, orjson.dumps(metrics), step),
            ).rowcount
            if updated:
                current = conn.execute(
                    "SELECT value FROM meta WHERE key = 'trainer_version'"
                ).fetchone()
                if current is None or int(current[0]) < version:
                    conn.execute(
                        "INSERT OR REPLACE INTO meta VALUES ('trainer_version', ?)", (str(version),)
                    )
            return bool(updated)

    def checkpoint(self, step: int) -> int:
        """Every group shipped to a step <= ``step`` is trained for good; returns how many."""
        with self._lock, self._write() as conn:
            refs = conn.execute(
                "SELECT samples_ref FROM prompts WHERE state = 'shipped' AND step <= ?", (step,)
            ).fetchall()
            n = conn.execute(
                "UPDATE prompts SET state = 'trained', samples_ref = NULL, rewards = NULL"
                " WHERE state = 'shipped' AND step <= ?",
                (step,),
            ).rowcount
            self._release(conn, [r[0] for r in refs])
            conn.execute("UPDATE steps SET checkpointed = 1 WHERE step <= ?", (step,))
            current = conn.execute("SELECT value FROM meta WHERE key = 'checkpointed'").fetchone()
            if current is None or int(current[0]) < step:
                conn.execute("INSERT OR REPLACE INTO meta VALUES ('checkpointed', ?)", (str(step),))
            self._bump(conn, "trained_groups", n)
            return n
