"""The scheduler store's blobs: encoded groups (``deltarl.rl.samples``) keyed by their digest.

A rollout daemon puts a group's bytes on the samples socket (``deltarl.transport.blobs``): the
blob is committed here before its digest is answered. Its ``SubmitGroup`` then names the
digest, and pooling the group writes the reference into the prompt's row (``samples_ref``) in
the same transaction that changes its state, so a crash never leaves a pooled group without its
samples. A blob lives as long as a row refers to it:

- a group dropped (lag, reward, bad samples, requeue) or trained (checkpoint) releases its blob
  in the transaction that unreferences it (``_release``);
- a blob no row refers to, put more than ``grace_s`` ago (a submit that never came, or was
  refused), is removed by ``sweep_blobs``, which the scheduler runs every tick.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable

from deltarl.engine.sqlite_store import SqliteStore

BLOB_SCHEMA = (
    """
    CREATE TABLE IF NOT EXISTS blobs (
        digest TEXT    PRIMARY KEY,  -- xxh3-128 hex of data (deltarl.transport.blobs)
        data   BLOB    NOT NULL,     -- an encoded group (deltarl.rl.samples)
        size   INTEGER NOT NULL,
        put_at REAL    NOT NULL      -- the last put, seconds since the epoch
    )
    """,
    "CREATE INDEX IF NOT EXISTS prompts_by_ref ON prompts (samples_ref)",
)


class BlobTable(SqliteStore):
    """The blob methods of ``SchedulerStore`` (a ``deltarl.transport.blobs.BlobStore``)."""

    def put_blob(self, digest: str, data: bytes) -> None:
        """Keep ``data`` under ``digest`` (committed on return); a put again renews its grace."""
        with self._lock, self._write() as conn:
            self._put(conn, digest, data)

    def _put(self, conn: sqlite3.Connection, digest: str, data: bytes) -> None:
        conn.execute(
            "INSERT INTO blobs VALUES (?, ?, ?, ?)"
            " ON CONFLICT (digest) DO UPDATE SET put_at = excluded.put_at",
            (digest, data, len(data), self.clock()),
        )

    def get_blob(self, digest: str) -> bytes | None:
        with self._read() as conn:
            row = conn.execute("SELECT data FROM blobs WHERE digest = ?", (digest,)).fetchone()
            return None if row is None else bytes(row[0])

    def blob_stats(self) -> dict[str, int]:
        """How many blobs are kept, their bytes, and how many no row refers to."""
        with self._read() as conn:
            count, size = conn.execute(
                "SELECT COUNT(*), COALESCE(SUM(size), 0) FROM blobs"
            ).fetchone()
            loose = conn.execute(
                "SELECT COUNT(*) FROM blobs WHERE digest NOT IN"
                " (SELECT samples_ref FROM prompts WHERE samples_ref IS NOT NULL)"
            ).fetchone()[0]
        return {"blobs": int(count), "bytes": int(size), "unreferenced": int(loose)}

    def sweep_blobs(self, grace_s: float) -> int:
        """Remove the blobs no row refers to that were put more than ``grace_s`` ago."""
        with self._lock, self._write() as conn:
            return conn.execute(
                "DELETE FROM blobs WHERE put_at < ? AND digest NOT IN"
                " (SELECT samples_ref FROM prompts WHERE samples_ref IS NOT NULL)",
                (self.clock() - grace_s,),
            ).rowcount

    def release_blob(self, digest: str) -> None:
        """Remove ``digest`` now if no row refers to it (a refused submit's blob)."""
        with self._lock, self._write() as conn:
            self._release(conn, [digest])

    @staticmethod
    def _release(conn: sqlite3.Connection, digests: Iterable[str | None]) -> None:
        """Inside a transaction that unreferenced them: remove the blobs no row refers to."""
        for digest in {d for d in digests if d is not None}:
            conn.execute(
                "DELETE FROM blobs WHERE digest = ?"
                " AND NOT EXISTS (SELECT 1 FROM prompts WHERE samples_ref = ?)",
                (digest, digest),
            )
