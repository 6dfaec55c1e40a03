"""What every deltarl sqlite store does the same way: open, WAL, schema version, transactions.

The manifest store (refit/) and the scheduler's store (scheduler/) are one engine used twice
(run metadata lives in the same engine as the manifest store). A subclass names its
schema, its version and its error class; this base keeps the invariants:

- writers run in WAL mode with ``synchronous=FULL``: a committed transaction survives a
  process crash and power loss, and readers never block the writer nor see half of one;
- every write is one ``BEGIN IMMEDIATE`` transaction (``_write``): the write lock is taken
  before the reads that decide what to write, and a crash inside leaves nothing behind (the WAL
  frames of an uncommitted transaction are ignored at the next open);
- a read of several SELECTs sees one snapshot (``_read``);
- a store file of another schema version is refused with a message, never guessed at.

File space (retention, ``prune`` in each store): a store created by this code uses
``auto_vacuum=INCREMENTAL``, so the pages that pruning frees can be handed back to the file
system (``reclaim``) in bounded steps. The mode can only be chosen before the first table
exists; a file created before (``auto_vacuum=NONE``) is not converted, because that takes a
full ``VACUUM``: a rewrite of the whole file under the write lock, needing twice its disk
space, at a daemon's start where systemd's start timeout runs. Such a file still stops
growing under retention (sqlite reuses its free pages); it only does not shrink. An operator
converts it, with the daemon stopped: ``sqlite3 FILE 'PRAGMA auto_vacuum=INCREMENTAL; VACUUM'``.
The WAL file is truncated back to ``WAL_LIMIT_BYTES`` after each checkpoint, so one large
transaction does not leave it large for good.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import ClassVar, Self

WAL_LIMIT_BYTES = 8 << 20
"""What the WAL file is cut back to after a checkpoint (``PRAGMA journal_size_limit``)."""
RECLAIM_SLACK_PAGES = 256
"""Free pages ``reclaim`` leaves in the file: the next writes reuse them instead of growing
the file again right away (blobs come and go every step)."""
RECLAIM_MAX_PAGES = 2048
"""Pages one ``reclaim`` call hands back at most, so one call holds the write lock briefly."""


class SqliteStore:
    """Base of a sqlite-backed store; see the module docstring."""

    KIND: ClassVar[str] = "store"
    """How messages name it ("manifest store", "scheduler store")."""
    SCHEMA: ClassVar[tuple[str, ...]] = ()
    """CREATE statements, run one at a time in the schema transaction."""
    SCHEMA_VERSION: ClassVar[int] = 1
    """PRAGMA user_version of a store this class wrote."""
    Error: ClassVar[type[Exception]] = RuntimeError
    """What this store raises for its own failures."""

    def __init__(
        self,
        path: str | Path,
        *,
        readonly: bool = False,
        busy_timeout_s: float = 10.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = Path(path)
        self.readonly = readonly
        self.clock = clock
        self._lock = threading.Lock()
        if readonly:
            if not self.path.exists():
                raise FileNotFoundError(f"no {self.KIND} at {self.path}")
            target, uri = f"{self.path.resolve().as_uri()}?mode=ro", True
        else:
            target, uri = str(self.path), False
        # isolation_level=None: no implicit transactions; every write opens its own
        # BEGIN IMMEDIATE, so a read-check-write cannot interleave with another writer's.
        conn = sqlite3.connect(
            target, uri=uri, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False
        )
        self._conn: sqlite3.Connection | None = conn
        try:
            if readonly:
                self._check_schema()
            else:
                # Before WAL mode and the first table: later it is ignored (module docstring).
                conn.execute("PRAGMA auto_vacuum=INCREMENTAL")
                self._enable_wal(conn)
                self._create_schema()
        except BaseException:
            conn.close()
            self._conn = None
            raise

    # -- opening and closing ----------------------------------------------------------------

    def _enable_wal(self, conn: sqlite3.Connection) -> None:
        mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if mode != "wal":
            raise self.Error(f"{self.path}: cannot use WAL mode (got {mode})")
        # FULL: a committed transaction survives power loss, not only a process crash.
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute(f"PRAGMA journal_size_limit={WAL_LIMIT_BYTES}")

    def _create_schema(self) -> None:
        with self._write() as conn:
            found = conn.execute("PRAGMA user_version").fetchone()[0]
            if found not in (0, self.SCHEMA_VERSION):
                raise self.Error(
                    f"{self.path}: {self.KIND} schema {found}, this deltarl reads "
                    f"{self.SCHEMA_VERSION}"
                )
            # One statement at a time: executescript() would COMMIT this transaction first.
            for statement in self.SCHEMA:
                conn.execute(statement)
            self._init_schema(conn)
            conn.execute(f"PRAGMA user_version={self.SCHEMA_VERSION}")

    def _init_schema(self, conn: sqlite3.Connection) -> None:
        """Rows a new store starts with (inside the schema transaction); none by default."""

    def _check_schema(self) -> None:
        found = self._db().execute("PRAGMA user_version").fetchone()[0]
        if found != self.SCHEMA_VERSION:
            raise self.Error(
                f"{self.path}: not a {self.KIND} this deltarl reads "
                f"(schema {found}, expected {self.SCHEMA_VERSION})"
            )

    def close(self) -> None:
        """Close the connection; idempotent. Committed transactions are already on disk."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- file space -------------------------------------------------------------------------

    def incremental(self) -> bool:
        """Whether this file can hand free pages back (``auto_vacuum=INCREMENTAL``)."""
        with self._lock:
            return int(self._db().execute("PRAGMA auto_vacuum").fetchone()[0]) == 2

    def free_pages(self) -> int:
        with self._lock:
            return int(self._db().execute("PRAGMA freelist_count").fetchone()[0])

    def reclaim(
        self, slack_pages: int = RECLAIM_SLACK_PAGES, max_pages: int = RECLAIM_MAX_PAGES
    ) -> int:
        """Hand free pages beyond ``slack_pages`` back to the file system, ``max_pages`` at
        most; returns how many. 0 for a file without incremental auto-vacuum. The file itself
        shrinks when the WAL is next checkpointed into it."""
        if self.readonly or not self.incremental():
            return 0
        with self._lock:
            conn = self._db()
            before = int(conn.execute("PRAGMA freelist_count").fetchone()[0])
            pages = min(before - slack_pages, max_pages)
            if pages <= 0:
                return 0
            # executescript, not execute: the pragma frees one page per step of its statement,
            # and only sqlite3_exec (executescript) steps it to the end. Its own transaction:
            # a crash inside leaves the file as it was (the WAL frames are never committed).
            try:
                conn.executescript(f"BEGIN IMMEDIATE; PRAGMA incremental_vacuum({pages}); COMMIT;")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
            return before - int(conn.execute("PRAGMA freelist_count").fetchone()[0])

    # -- transactions -----------------------------------------------------------------------

    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            raise self.Error(f"{self.KIND} {self.path} is closed")
        return self._conn

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One atomic write transaction: committed whole on success, rolled back on error."""
        if self.readonly:
            raise self.Error(f"{self.KIND} {self.path} was opened read-only")
        conn = self._db()
        # IMMEDIATE takes the write lock now, before the reads that decide what to write.
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:  # not after a COMMIT that went through
                conn.execute("ROLLBACK")
            raise

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        """One consistent snapshot over several SELECTs."""
        with self._lock:
            conn = self._db()
            conn.execute("BEGIN")
            try:
                yield conn
            finally:
                conn.execute("ROLLBACK")
