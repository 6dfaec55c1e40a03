"""Retention of the scheduler store: the per-step records and trained prompts of old steps go.

Without it the store grows by a ``steps`` row and ``groups_per_step`` prompt rows every step,
for good. ``prune_steps`` deletes the oldest steps beyond the newest ``keep``, together with the
prompt rows trained in them and those prompts' recorded refusals. What exact replay and resume
need is never touched:

- S1: only steps at or below the checkpointed step go (``meta.checkpointed``). A trainer that
  restarts resumes from its newest checkpoint and asks for the steps after it again; their
  prompt rows (``shipped``, with their samples) and ``steps`` rows (which ``StepDone``
  updates) are all above it.
- S2: only ``trained`` prompt rows go, whose samples were released when they were checkpointed
  (``samples_ref`` is NULL); a queued, issued, pooled, shipped or abandoned row stays whatever
  its age, so no prompt is lost and every abandoned one stays on record.
- S3: ``meta.pruned_through`` records the newest step pruned. Every prompt id below the cursor
  has exactly one row, or was trained in a step at or below ``pruned_through``; a ``TakeBatch``
  of such a step is refused (``ShipResult.pruned``), never filled again with new groups.

Each call deletes at most ``batch`` steps in one transaction (``BEGIN IMMEDIATE``): a crash
between two calls, or inside one, leaves S1-S3 holding.
"""

from __future__ import annotations

import logging

from deltarl.scheduler import length_log, reward_stats, step_busy, token_lag, token_waste
from deltarl.scheduler.blob_table import BlobTable

logger = logging.getLogger(__name__)

PRUNE_BATCH_STEPS = 64
"""Steps one prune transaction deletes at most (with their prompts): it holds the write lock."""


class StepRetention(BlobTable):
    """The pruning of ``SchedulerStore`` (see the module docstring)."""

    def pruned_through(self) -> int | None:
        """The newest step whose records retention removed; None if none was."""
        with self._read() as conn:
            row = conn.execute("SELECT value FROM meta WHERE key = 'pruned_through'").fetchone()
            return None if row is None else int(row[0])

    def prune_steps(self, keep: int, batch: int = PRUNE_BATCH_STEPS) -> int:
        """Delete the oldest steps (at most ``batch``) beyond the newest ``keep`` that are
        checkpointed, with their trained prompts; returns how many steps. Call it again while
        it returns ``batch``."""
        if keep < 1 or batch < 1:
            raise ValueError(f"keep and batch must be at least 1, got {keep} and {batch}")
        with self._lock, self._write() as conn:
            found = conn.execute(
                "SELECT (SELECT value FROM meta WHERE key = 'checkpointed'),"
                " (SELECT MAX(step) FROM steps)"
            ).fetchone()
            if found[0] is None or found[1] is None:
                return 0
            cutoff = min(int(found[0]) + 1, int(found[1]) - keep + 1)  # S1: below it may go
            steps = [
                s
                for (s,) in conn.execute(
                    "SELECT step FROM steps WHERE step < ? ORDER BY step LIMIT ?", (cutoff, batch)
                )
            ]
            if not steps:
                return 0
            last = steps[-1]
            trained = "FROM prompts WHERE step <= ? AND state = 'trained'"  # S2
            refs = [r for (r,) in conn.execute(f"SELECT samples_ref {trained}", (last,))]
            conn.execute(
                f"DELETE FROM refusals WHERE prompt_id IN (SELECT prompt_id {trained})",  # noqa: S608 - constant
                (last,),
            )
            prompts = conn.execute(f"DELETE {trained}", (last,)).rowcount
            self._release(conn, refs)  # none: a checkpoint released them; kept as the rule
            conn.execute("DELETE FROM steps WHERE step <= ?", (last,))
            reward_stats.prune(conn, last)
            token_waste.prune(conn, last)
            token_lag.prune(conn, last)
            length_log.prune(conn, last)
            step_busy.prune(conn, last)
            conn.execute(
                "INSERT INTO meta VALUES ('pruned_through', ?)"
                " ON CONFLICT (key) DO UPDATE SET value = MAX(CAST(value AS INTEGER), ?)",
                (str(last), last),
            )
        logger.debug("retention: steps %d..%d pruned (%d prompt rows)", steps[0], last, prompts)
        return len(steps)
