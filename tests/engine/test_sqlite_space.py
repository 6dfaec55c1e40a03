"""File space of the sqlite stores (deltarl/engine/sqlite_store.py): a new store hands freed
pages back (incremental auto-vacuum); a file created without it is left as it is."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

from deltarl.engine.sqlite_store import SqliteStore


class Bag(SqliteStore):
    """A store of one table of blobs: enough to fill and empty a file."""

    KIND = "bag"
    SCHEMA = ("CREATE TABLE IF NOT EXISTS bag (id INTEGER PRIMARY KEY, data BLOB NOT NULL)",)

    def fill(self, n: int, size: int = 4000) -> None:
        with self._lock, self._write() as conn:
            conn.executemany("INSERT INTO bag (data) VALUES (?)", [(os.urandom(size),)] * n)

    def empty(self) -> None:
        with self._lock, self._write() as conn:
            conn.execute("DELETE FROM bag")

    def checkpoint(self) -> None:
        with self._lock:
            self._db().execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()


def test_a_new_store_gives_freed_pages_back_in_bounded_steps(tmp_path: Path) -> None:
    path = tmp_path / "bag.sqlite"
    with Bag(path) as bag:
        assert bag.incremental()
        bag.fill(2000)
        bag.checkpoint()
        full = path.stat().st_size
        bag.empty()
        free = bag.free_pages()
        assert free > 1500
        assert bag.reclaim(slack_pages=100, max_pages=500) == 500  # one bounded step
        while bag.reclaim(slack_pages=100, max_pages=500):
            pass
        assert bag.free_pages() == 100  # the slack stays for the next writes
        bag.checkpoint()
        assert path.stat().st_size < full // 4


def test_an_old_file_without_auto_vacuum_is_not_converted_but_stops_growing(
    tmp_path: Path,
) -> None:
    path = tmp_path / "bag.sqlite"
    with sqlite3.connect(path) as conn:  # as an older deltarl made it: no auto_vacuum
        conn.execute("CREATE TABLE bag (id INTEGER PRIMARY KEY, data BLOB NOT NULL)")
    conn.close()
    with Bag(path) as bag:
        assert not bag.incremental()
        bag.fill(1000)
        bag.checkpoint()
        size = path.stat().st_size
        for _ in range(3):  # retention's churn: delete, write as much again
            bag.empty()
            assert bag.reclaim(slack_pages=0) == 0
            bag.fill(1000)
            bag.checkpoint()
        assert path.stat().st_size <= size * 1.05  # the free pages were reused
