"""Where a requeued prompt's prefix is cached: a table of the scheduler store.

All samples of a prompt are one group, issued to one instance, so they share its prefix cache
by construction. A prompt that comes back to the queue because scoring failed
(``reward_timeout``, ``reward_error``: the instance did its part) was prefilled on that
instance under the weight version it was issued at. ``prefix_homes`` remembers the pair when
the prompt is requeued and forgets it when the prompt is issued again. Other requeues keep no
home: a straggler's or a silent instance's work should not go back to it, a lost reply never
reached it, a restarted engine has lost its cache (its homes are forgotten with it), and a
doomed or stale group's version is gone anyway.

The ``deltarl`` policy sends such a prompt back to its home while that instance still holds
the same version (engines drop their prefix caches at a weight update, so no block of old
weights serves new ones) and its predicted wait is not too long (``policy.AFFINITY_SLACK``).
Issuing it counts ``prefix_home.hit`` (it went home) or ``prefix_home.miss``.

A table of its own (``CREATE TABLE IF NOT EXISTS``) so a store written by an older deltarl
gains it without a migration; prompts requeued before then have no home.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Sequence

KEEPS_HOME = ("dropped: reward_",)
"""Requeue notes (``SchedulerStore._requeue``) after which the instance's cache is worth
going back to."""

HOME_SCHEMA = (
    """
    CREATE TABLE IF NOT EXISTS prefix_homes (
        prompt_id      INTEGER PRIMARY KEY,
        instance       TEXT    NOT NULL,
        weight_version INTEGER NOT NULL
    )
    """,
)


def remember(conn: sqlite3.Connection, prompt_id: int, note: str) -> None:
    """Called before the prompt's row is requeued (``note``: why): its instance and version,
    if it had both and the reason keeps a home; else any older home is forgotten."""
    if not note.startswith(KEEPS_HOME):
        forget(conn, [prompt_id])
        return
    conn.execute(
        "INSERT OR REPLACE INTO prefix_homes SELECT prompt_id, instance, weight_version"
        " FROM prompts WHERE prompt_id = ? AND instance IS NOT NULL"
        " AND weight_version IS NOT NULL",
        (prompt_id,),
    )


def forget(conn: sqlite3.Connection, prompt_ids: Iterable[int]) -> None:
    """Issued again (or gone): the old home no longer matters."""
    conn.executemany("DELETE FROM prefix_homes WHERE prompt_id = ?", [(p,) for p in prompt_ids])


def forget_instance(conn: sqlite3.Connection, instance: str) -> None:
    """The instance is gone or restarted: its engine's cache went with it."""
    conn.execute("DELETE FROM prefix_homes WHERE instance = ?", (instance,))


def homes(conn: sqlite3.Connection, prompt_ids: Sequence[int]) -> dict[int, tuple[str, int]]:
    """prompt id -> (instance, weight version) for those of ``prompt_ids`` that have one."""
    if not prompt_ids:
        return {}
    marks = ", ".join("?" * len(prompt_ids))
    rows = conn.execute(
        f"SELECT prompt_id, instance, weight_version FROM prefix_homes"  # noqa: S608 - marks only
        f" WHERE prompt_id IN ({marks})",
        list(prompt_ids),
    )
    return {int(p): (str(i), int(v)) for p, i, v in rows}
