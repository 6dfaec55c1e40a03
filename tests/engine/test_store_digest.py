"""The model digest committed with a version: read under the reader's own lease, never stale."""

from __future__ import annotations

from pathlib import Path

import pytest

from deltarl.engine.layout import Layout
from deltarl.engine.weight_store import WeightStore

LAYOUT = Layout.pack([("w", "bfloat16", (64,))])
D1, D2 = "0123456789abcdef" * 2, "f" * 32


def test_a_reader_gets_the_digest_committed_with_its_version(tmp_path: Path) -> None:
    with WeightStore.create("w", LAYOUT, root=tmp_path) as store:
        with store.begin_write() as txn:
            txn.commit(1, digest=D1)
        with store.begin_write() as txn:
            txn.commit(2, digest=D2)
        other = WeightStore.open("w", root=tmp_path, readonly=True)  # another reader's view
        with other, other.lease() as snap:
            assert (snap.version, snap.digest) == (2, D2)
        # Version 3 goes into version 1's buffer without a digest: D1 must not come back.
        with store.begin_write() as txn:
            txn.commit(3)
        with store.lease() as snap:
            assert (snap.version, snap.digest) == (3, None)
        # A rollback flips to the buffer that kept version 2, and its digest.
        store.rollback(5.0)
        with store.lease() as snap:
            assert (snap.version, snap.digest) == (2, D2)


@pytest.mark.parametrize("bad", ["", "abc", "g" * 32, "1" * 33])
def test_a_malformed_digest_is_refused_and_nothing_is_committed(tmp_path: Path, bad: str) -> None:
    with WeightStore.create("w", LAYOUT, root=tmp_path) as store:
        with store.begin_write() as txn:
            with pytest.raises(ValueError):
                txn.commit(1, digest=bad)
            txn.abort()
        assert store.active_version is None
