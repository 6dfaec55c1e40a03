"""The export agent's record of every version: its manifest, its state, what became of it.

This is seed 004's "manifest and version service": one row per version the export agent
built, with the manifest (as JSON), the numbers an operator asks for first (kind, base,
wire bytes, elements changed) and where the version is in its life. It answers "which
version is live", "what did receivers last get in full" and "is a full resync due".

Storage is one sqlite file in WAL mode (standard library only). WAL lets readers in other
processes (``deltarl ctl``, a status page, a test) read while the agent writes; every write
is one ``BEGIN IMMEDIATE`` transaction with ``synchronous=FULL``, so a crash at any point,
``kill -9`` included, leaves the file as it was before or after the whole transition.

The state machine (seed 004, step 4: pending -> uploaded -> verified -> active, or failed)::

    pending ──► uploaded ──► verified ──► active ◄──► superseded
       │           │            │                          │
       └───────────┴────────────┴──────► failed ◄──────────┘

- ``superseded`` is the state a version enters when another one is activated. It is a state
  of its own rather than a return to ``verified``: it records that the version *was* live
  (so ``history`` tells what receivers ran, and when). Activating it again is a rollback.
- ``active`` is left only by being superseded, never by failing: the live version is the
  receivers' base, so it cannot be declared bad without naming its replacement (activate a
  good version, then fail the superseded one).
- ``failed`` is final for that send. Failing a version also fails every not-yet-active delta
  built on it, transitively: a delta on a failed base is built on weights no receiver holds,
  the silent drift of a delta chain that is the most dangerous failure of the whole link. The
  export agent sends a failed version again (in full); that send is recorded in place of the
  failed row (``record(..., again=True)``), while the deltas failed with it stay failed.

Invariants, kept by the schema itself where sqlite can (CHECK constraints and a partial
unique index) and by the transactions below where it cannot:

- I1: at most one version is ``active`` (unique index ``versions_one_active``).
- I2: once any version has been active, exactly one is: activation demotes the old active
  version and promotes the new one in one transaction, and nothing else leaves ``active``.
- I3: a ``full`` version has base ``NO_BASE`` (-1) and a ``delta`` has a base below its own
  version (CHECK constraints); a delta is recorded only on a base that is recorded and not
  failed.
- I4: every state change follows ``TRANSITIONS``; anything else raises ``TransitionError``.

Retention (``prune``, run by the export agent after each version it finished): the newest
``keep`` versions stay, and so does every row something may still need, whatever its age:

- R1: the active version (the receivers' base: the next delta is built on it);
- R2: every version not yet live (pending, uploaded, verified): one in flight, or one left by a
  crash of the export agent mid-send (at most one per crash; kept, since this store cannot tell
  it from one in flight);
- R3: the newest full version that did not fail (``last_full``, the alignment point that
  ``versions_since_full`` counts from);
- R4: any version the caller names in ``protect`` (the export agent: its reference);
- R5: the base of every version kept, transitively, so I3 holds in the file (every delta's
  base is recorded) and each kept delta's chain back to its full version can be read. The
  export agent bounds every chain by ``full_resync_every``, so this keeps at most that many
  more rows per chain kept.

Only superseded and failed versions are ever deleted, at most ``batch`` per transaction, newest
first among those that may go: a version is deleted only after every version built on it, so
after any commit, and so after a crash between two batches, I1-I4 and R1-R5 hold.
"""

from __future__ import annotations

import json
import logging
import sqlite3
from collections.abc import Collection
from dataclasses import dataclass, field
from enum import StrEnum

from deltarl.codecs.frame import NO_BASE
from deltarl.codecs.manifest import RefitManifest
from deltarl.engine.sqlite_store import SqliteStore

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1  # PRAGMA user_version of a store this module wrote
PRUNE_BATCH = 256  # versions one prune transaction deletes at most: it holds the write lock


class State(StrEnum):
    PENDING = "pending"  # recorded: encoded (or encoding), not yet all on the wire
    UPLOADED = "uploaded"  # every chunk sent
    VERIFIED = "verified"  # receivers checked every chunk and tensor against the manifest
    ACTIVE = "active"  # the live version: receivers flipped their pointer to it
    SUPERSEDED = "superseded"  # was active; another version has been activated since
    FAILED = "failed"  # final: never to be activated, never a base


# I4: the legal moves. ACTIVE -> SUPERSEDED happens only inside an activation of another
# version, so it is not something ``mark`` accepts on its own (see ``_mark``).
TRANSITIONS: dict[State, frozenset[State]] = {
    State.PENDING: frozenset({State.UPLOADED, State.FAILED}),
    State.UPLOADED: frozenset({State.VERIFIED, State.FAILED}),
    State.VERIFIED: frozenset({State.ACTIVE, State.FAILED}),
    State.ACTIVE: frozenset(),
    State.SUPERSEDED: frozenset({State.ACTIVE, State.FAILED}),
    State.FAILED: frozenset(),
}

# Not yet live: what a failure cascades to (a superseded version has been live; it stays).
_NOT_YET_LIVE = (State.PENDING, State.UPLOADED, State.VERIFIED)

_SCHEMA = (
    f"""
    CREATE TABLE IF NOT EXISTS versions (
        version      INTEGER PRIMARY KEY CHECK (version >= 0),
        base_version INTEGER NOT NULL,
        kind         TEXT    NOT NULL CHECK (kind IN ('delta', 'full')),
        state        TEXT    NOT NULL CHECK (state IN ({", ".join(f"'{s}'" for s in State)})),
        created      REAL    NOT NULL,  -- seconds since the epoch, when recorded
        updated      REAL    NOT NULL,  -- seconds since the epoch, last state change
        wire_bytes   INTEGER NOT NULL,
        changed      INTEGER NOT NULL,
        manifest     TEXT    NOT NULL,  -- RefitManifest.to_json()
        error        TEXT,              -- why it failed: NULL unless state = 'failed'
        CHECK ((kind = 'full') = (base_version = {NO_BASE})),
        CHECK (kind = 'full' OR base_version < version)
    )
    """,
    # I1, kept by sqlite itself: a second active row cannot exist, even inside a transaction.
    "CREATE UNIQUE INDEX IF NOT EXISTS versions_one_active ON versions (state)"
    " WHERE state = 'active'",
    "CREATE INDEX IF NOT EXISTS versions_by_state ON versions (state, version)",
    "CREATE INDEX IF NOT EXISTS versions_by_base ON versions (base_version)",
)


class ManifestStoreError(Exception):
    """The manifest store cannot do what was asked; the message says why."""


class TransitionError(ManifestStoreError):
    """A state change the state machine does not allow."""

    def __init__(self, version: int, current: State, requested: State, why: str = "") -> None:
        if why:
            detail = why
        elif current == State.ACTIVE:
            detail = "the active version is left only by activating another one"
        elif not TRANSITIONS[current]:
            detail = f"{current} is final"
        else:
            detail = f"allowed from {current}: {', '.join(sorted(TRANSITIONS[current]))}"
        super().__init__(f"version {version}: cannot go from {current} to {requested} ({detail})")
        self.version = version
        self.current = current
        self.requested = requested


class UnknownVersionError(ManifestStoreError, KeyError):
    """A version the store has no record of."""

    def __str__(self) -> str:  # KeyError would print the message in quotes
        return str(self.args[0])


class DuplicateVersionError(ManifestStoreError):
    """A version recorded twice."""


@dataclass(frozen=True)
class VersionRecord:
    """One row of the store, as read in one consistent snapshot."""

    version: int
    base_version: int  # NO_BASE (-1) for a full version
    kind: str  # "delta" | "full"
    state: State
    created: float  # seconds since the epoch, when recorded
    updated: float  # seconds since the epoch, last state change
    wire_bytes: int
    changed: int
    manifest_json: str = field(repr=False)
    error: str | None  # set only when state is FAILED

    @property
    def manifest(self) -> RefitManifest:
        """The manifest as it was recorded (parsed and validated on each access)."""
        return RefitManifest.from_json(self.manifest_json)


def _row(row: tuple) -> VersionRecord:
    """A record from a ``SELECT *`` row (columns in the order of the CREATE TABLE above)."""
    v, base, kind, state, created, updated, wire, changed, manifest, error = row
    return VersionRecord(
        v, base, kind, State(state), created, updated, wire, changed, manifest, error
    )


class ManifestStore(SqliteStore):
    """The version table in one sqlite file; one writer process, any number of readers.

    ``readonly=True`` opens an existing store for reading only (another process may be writing
    it meanwhile); ``record`` and ``mark`` then raise. Every method is safe to call from several
    threads (one connection, serialized by a lock), e.g. from ``asyncio.to_thread``.
    """

    KIND = "manifest store"
    SCHEMA = _SCHEMA
    SCHEMA_VERSION = SCHEMA_VERSION
    Error = ManifestStoreError

    # -- writes --------------------------------------------------------------------------

    def record(self, manifest: RefitManifest, *, again: bool = False) -> VersionRecord:
        """Record a newly built version in state ``pending``.

        Raises ``DuplicateVersionError`` if the version is recorded already (with ``again``:
        unless its record is ``failed``, which the new send replaces), and
        ``ManifestStoreError`` if it is malformed or a delta on a base that is unknown or
        failed (I3): a receiver can only hold a base that was recorded and did not fail.
        """
        m = manifest
        if m.kind not in ("delta", "full"):
            raise ManifestStoreError(
                f"version {m.version}: kind {m.kind!r} is neither delta nor full"
            )
        if m.version < 0:
            raise ManifestStoreError(f"version {m.version}: versions are not negative")
        if m.kind == "full" and m.base_version != NO_BASE:
            raise ManifestStoreError(
                f"version {m.version}: a full version has no base (got base {m.base_version})"
            )
        if m.kind == "delta" and not 0 <= m.base_version < m.version:
            raise ManifestStoreError(
                f"version {m.version}: a delta's base must be an earlier version "
                f"(got base {m.base_version})"
            )
        now = self.clock()
        with self._lock, self._write() as conn:
            old = conn.execute(
                "SELECT state FROM versions WHERE version = ?", (m.version,)
            ).fetchone()
            if old is not None and not (again and old[0] == State.FAILED):
                raise DuplicateVersionError(f"version {m.version} is recorded already")
            if old is not None:
                conn.execute("DELETE FROM versions WHERE version = ?", (m.version,))
            if m.kind == "delta":
                base = conn.execute(
                    "SELECT state FROM versions WHERE version = ?", (m.base_version,)
                ).fetchone()
                if base is None:
                    raise ManifestStoreError(
                        f"version {m.version}: delta on base {m.base_version}, which this store "
                        "has no record of (send a full version)"
                    )
                if base[0] == State.FAILED:
                    raise ManifestStoreError(
                        f"version {m.version}: delta on base {m.base_version}, which failed "
                        "(no receiver holds it; send a full version)"
                    )
            conn.execute(
                "INSERT INTO versions (version, base_version, kind, state, created, updated,"
                " wire_bytes, changed, manifest, error) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, NULL)",
                (
                    m.version,
                    m.base_version,
                    m.kind,
                    State.PENDING.value,
                    now,
                    now,
                    m.wire_bytes,
                    m.changed,
                    m.to_json().decode(),
                ),
            )
            return self._get(conn, m.version)

    def mark(self, version: int, state: State | str, *, error: str | None = None) -> VersionRecord:
        """Move ``version`` to ``state`` (see the module's state machine); return its new record.

        - ``active``: the previously active version, if any, becomes ``superseded`` in the same
          transaction (I1, I2). Activating a superseded version is a rollback.
        - ``failed``: ``error`` says why; every not-yet-active delta built on this version,
          directly or not, fails with it.

        Raises ``UnknownVersionError`` for a version never recorded and ``TransitionError``
        (naming the version, its current state and the requested one) for an illegal move.
        """
        try:
            target = State(state)
        except ValueError:
            known = ", ".join(s.value for s in State)
            raise ManifestStoreError(
                f"version {version}: unknown state {state!r} (states: {known})"
            ) from None
        if error is not None and target != State.FAILED:
            raise ManifestStoreError(
                f"version {version}: an error text goes with state failed, not {target}"
            )
        with self._lock, self._write() as conn:
            return self._mark(conn, version, target, error)

    def _mark(
        self, conn: sqlite3.Connection, version: int, target: State, error: str | None
    ) -> VersionRecord:
        row = conn.execute("SELECT state FROM versions WHERE version = ?", (version,)).fetchone()
        if row is None:
            raise UnknownVersionError(f"version {version} is not recorded")
        current = State(row[0])
        if target == State.SUPERSEDED and current == State.ACTIVE:
            raise TransitionError(
                version, current, target, "a version is superseded by activating another one"
            )
        if target not in TRANSITIONS[current]:
            raise TransitionError(version, current, target)
        now = self.clock()
        if target == State.ACTIVE:
            # I2: demote and promote in this one transaction. Demote first: the unique index
            # (I1) refuses a second active row even inside a transaction.
            conn.execute(
                "UPDATE versions SET state = ?, updated = ? WHERE state = ?",
                (State.SUPERSEDED.value, now, State.ACTIVE.value),
            )
        conn.execute(
            "UPDATE versions SET state = ?, updated = ?, error = ? WHERE version = ?",
            (target.value, now, error, version),
        )
        if target == State.FAILED:
            self._fail_descendants(conn, version, error, now)
        logger.debug("manifest store: version %d %s -> %s", version, current, target)
        return self._get(conn, version)

    def _fail_descendants(
        self, conn: sqlite3.Connection, version: int, error: str | None, now: float
    ) -> None:
        """Fail every not-yet-live delta whose chain of bases reaches ``version``."""
        doomed = [
            v
            for (v,) in conn.execute(
                """
                WITH RECURSIVE doomed(v) AS (
                    SELECT version FROM versions
                        WHERE base_version = ? AND kind = 'delta' AND state IN (?, ?, ?)
                    UNION
                    SELECT versions.version FROM versions JOIN doomed
                        ON versions.base_version = doomed.v
                        WHERE versions.kind = 'delta' AND versions.state IN (?, ?, ?)
                )
                SELECT v FROM doomed ORDER BY v
                """,
                (version, *_NOT_YET_LIVE, *_NOT_YET_LIVE),
            )
        ]
        if not doomed:
            return
        why = f"base version {version} failed" + (f": {error}" if error else "")
        conn.executemany(
            "UPDATE versions SET state = ?, updated = ?, error = ? WHERE version = ?",
            [(State.FAILED.value, now, why, v) for v in doomed],
        )
        logger.warning(
            "manifest store: version %d failed; so do the deltas built on it: %s", version, doomed
        )

    def prune(self, keep: int, *, protect: Collection[int] = (), batch: int = PRUNE_BATCH) -> int:
        """Delete up to ``batch`` of the versions that retention lets go, newest first (module
        docstring: the newest ``keep`` and R1-R5 stay); returns how many. One transaction:
        call it again while it returns ``batch``."""
        if keep < 1 or batch < 1:
            raise ValueError(f"keep and batch must be at least 1, got {keep} and {batch}")
        with self._lock, self._write() as conn:
            doomed = [
                v
                for (v,) in conn.execute(
                    """
                    WITH RECURSIVE
                    newest(v) AS (SELECT version FROM versions ORDER BY version DESC
                                  LIMIT :keep),
                    kept(v) AS (
                        SELECT version FROM versions
                        WHERE state NOT IN (:superseded, :failed)                   -- R1, R2
                           OR version IN (SELECT v FROM newest)
                           OR version = (SELECT MAX(version) FROM versions          -- R3
                                         WHERE kind = 'full' AND state != :failed)
                           OR version IN (SELECT value FROM json_each(:protect))    -- R4
                        UNION
                        SELECT versions.base_version FROM versions JOIN kept        -- R5
                            ON versions.version = kept.v WHERE versions.kind = 'delta'
                    )
                    SELECT version FROM versions WHERE version NOT IN (SELECT v FROM kept)
                    ORDER BY version DESC LIMIT :batch
                    """,
                    {
                        "superseded": State.SUPERSEDED.value,
                        "failed": State.FAILED.value,
                        "keep": keep,
                        "protect": json.dumps(sorted({int(v) for v in protect})),
                        "batch": batch,
                    },
                )
            ]
            conn.executemany("DELETE FROM versions WHERE version = ?", [(v,) for v in doomed])
        if doomed:
            logger.debug("manifest store: pruned versions %d..%d", doomed[-1], doomed[0])
        return len(doomed)

    # -- reads (each one SELECT: one consistent snapshot, even while another process writes) --

    def _get(self, conn: sqlite3.Connection, version: int) -> VersionRecord:
        row = conn.execute("SELECT * FROM versions WHERE version = ?", (version,))
        return _row(row.fetchone())

    def _one(self, sql: str, params: tuple = ()) -> VersionRecord | None:
        with self._lock:
            row = self._db().execute(sql, params).fetchone()
        return None if row is None else _row(row)

    def get(self, version: int) -> VersionRecord | None:
        """The record of ``version``, or None if it was never recorded."""
        return self._one("SELECT * FROM versions WHERE version = ?", (version,))

    def latest(self, state: State | str | None = None) -> VersionRecord | None:
        """The highest recorded version (in ``state``, if given), or None."""
        if state is None:
            return self._one("SELECT * FROM versions ORDER BY version DESC LIMIT 1")
        return self._one(
            "SELECT * FROM versions WHERE state = ? ORDER BY version DESC LIMIT 1",
            (State(state).value,),
        )

    def active(self) -> VersionRecord | None:
        """The live version, or None if no version has been activated yet."""
        return self.latest(State.ACTIVE)

    def history(self, limit: int = 100) -> list[VersionRecord]:
        """The ``limit`` highest versions, newest first, whatever their state."""
        if limit < 0:
            raise ValueError(f"history limit must not be negative, got {limit}")
        with self._lock:
            rows = self._db().execute(
                "SELECT * FROM versions ORDER BY version DESC LIMIT ?", (limit,)
            )
            return [_row(r) for r in rows.fetchall()]

    def last_full(self) -> VersionRecord | None:
        """The newest full version that did not fail, or None: the last alignment point."""
        return self._one(
            "SELECT * FROM versions WHERE kind = 'full' AND state != ? "
            "ORDER BY version DESC LIMIT 1",
            (State.FAILED.value,),
        )

    def versions_since_full(self) -> int | None:
        """How many versions (failed ones not counted) came after ``last_full``.

        None if no full version has been recorded (or all failed): then a full one is due
        whatever the resync interval. The export agent sends a full version when this reaches
        its ``full_resync_every``, which bounds every delta chain (DESIGN contract 4).
        """
        with self._lock:
            full, count = (
                self._db()
                .execute(
                    """
                    WITH f AS (SELECT MAX(version) AS v FROM versions
                               WHERE kind = 'full' AND state != :failed)
                    SELECT f.v, (SELECT COUNT(*) FROM versions
                                 WHERE state != :failed AND version > f.v)
                    FROM f
                    """,
                    {"failed": State.FAILED.value},
                )
                .fetchone()
            )
        return None if full is None else int(count)
