"""The model digest committed with a version: read under the reader's own lease, never stale."""

from __future__ import annotations

from pathlib import Path

import pytest

from deltarl.codecs.checksum import model_digest, tensor_digests
from deltarl.engine.layout import Layout
from deltarl.engine.version_pointer import BufferState
from deltarl.engine.weight_store import WeightStore, WriteTxn

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


# -- the writer's tensor digests ---------------------------------------------------------------

TWO = Layout.pack([("a", "bfloat16", (64,)), ("b", "float32", (3, 5))])


def _write(txn: WriteTxn, fill: int) -> list[str]:
    txn.buffer[:] = fill
    return tensor_digests(TWO, txn.buffer)


def test_a_reader_gets_the_tensor_digests_committed_with_its_version(tmp_path: Path) -> None:
    with WeightStore.create("w", TWO, root=tmp_path) as store:
        with store.begin_write() as txn:
            first = _write(txn, 1)
            txn.commit(1, tensor_digests=first)
        other = WeightStore.open("w", root=tmp_path, readonly=True)
        with other, other.lease() as snap:
            assert snap.tensor_digests == first == tensor_digests(TWO, snap.buffer)
            assert snap.digest == model_digest(first)  # the model digest is theirs
        with store.begin_write() as txn:
            second = _write(txn, 2)
            txn.commit(2, tensor_digests=second)
        # Version 3 goes into version 1's buffer without digests: version 1's must not stand
        # for its bytes.
        with store.begin_write() as txn:
            _write(txn, 3)
            txn.commit(3)
        with store.lease() as snap:
            assert (snap.version, snap.tensor_digests, snap.digest) == (3, None, None)
        store.rollback(5.0)  # back to the buffer that kept version 2, and its digests
        with store.lease() as snap:
            assert (snap.version, snap.tensor_digests) == (2, second)
        with store.begin_write() as txn:  # a settled buffer keeps no writer's digests
            _write(txn, 3)
            txn.settle(2)
        with store.lease() as snap:
            assert (snap.version, snap.tensor_digests) == (2, second)
        snap = store.lease()
        snap.release()
        with pytest.raises(RuntimeError, match="released"):
            _ = snap.tensor_digests


def test_digests_of_an_earlier_version_never_stand_for_an_older_writers_commit(
    tmp_path: Path,
) -> None:
    """A writer of an older deltarl commits without touching the tensor digest word: the
    table still holds an earlier version's digests, which must not be read as its own."""
    with WeightStore.create("w", TWO, root=tmp_path) as store:
        with store.begin_write() as txn:
            txn.commit(1, tensor_digests=_write(txn, 1))
        with store.begin_write() as txn:
            txn.commit(2, tensor_digests=_write(txn, 2))
        with store.begin_write() as txn:  # buffer 0 again, as an older writer leaves it
            _write(txn, 3)
            pointer = txn._pointer
            pointer.mark(txn.index, BufferState.READY, 3)
            pointer.flip(txn.index)
            txn._close_fd()
        with store.lease() as snap:
            assert (snap.version, snap.tensor_digests) == (3, None)


@pytest.mark.parametrize(
    ("given", "digest", "match"),
    [
        (["0" * 32], None, "1 tensor digests for a layout of 2"),
        (["0" * 32, "g" * 32], None, "not a hex digit"),
        (["0" * 32, "0" * 31], None, "tensor digest 1 is not"),
        (["0" * 32, "1" * 32], "f" * 32, "is not the one of the tensor digests"),
    ],
)
def test_malformed_tensor_digests_are_refused_and_nothing_changes(
    tmp_path: Path, given: list[str], digest: str | None, match: str
) -> None:
    with WeightStore.create("w", TWO, root=tmp_path) as store:
        with store.begin_write() as txn:
            good = _write(txn, 1)
            txn.commit(1, tensor_digests=good)
        with store.begin_write() as txn:
            _write(txn, 2)
            with pytest.raises(ValueError, match=match):
                txn.commit(2, digest=digest, tensor_digests=given)
            assert not txn.done  # refused before anything changed: still open
        with store.lease() as snap:
            assert (snap.version, snap.tensor_digests) == (1, good)


def test_a_segment_without_tables_commits_the_model_digest_alone(tmp_path: Path) -> None:
    """A segment made by an older deltarl has no tables (bytes 120-135 zero): the model digest
    of the tensor digests is still committed, and readers get no tensor digests."""
    with WeightStore.create("w", TWO, root=tmp_path) as store:
        path, end = store.path, store.header.digests_offset
    with path.open("r+b") as f:  # as an older deltarl made it: the file ends after buffer 1
        f.seek(112)
        f.write(end.to_bytes(8, "little") + bytes(16))  # file_nbytes, then no tables
        f.truncate(end)
    with WeightStore.open("w", root=tmp_path) as store:
        with store.begin_write() as txn:
            digests = _write(txn, 1)
            txn.commit(1, tensor_digests=digests)
        with store.lease() as snap:
            assert (snap.tensor_digests, snap.digest) == (None, model_digest(digests))
