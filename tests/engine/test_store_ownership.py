"""A weight-store segment another user made, or may write, is refused (deltarl/ownership.py).

Otherwise a user who pre-creates ``/dev/shm/deltarl-<name>`` (or finds one left 0666) can
rewrite the active buffer under the trainer's and the rollout's feet, undetected. These run
as root (they chown to, or fork a child as, uid 65534 "nobody"); elsewhere they are skipped.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from deltarl.engine.layout import Layout
from deltarl.engine.segment import cleanup_stale
from deltarl.engine.weight_store import UnsafePathError, WeightStore
from deltarl.ownership import check_trusted_dirs

NOBODY = 65534
LAYOUT = Layout.pack([("w", "float32", (16, 16))])

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A world-writable sticky directory in shared memory, like /dev/shm itself, that
    another user can reach."""
    d = Path("/dev/shm") / f"deltarl-test-{secrets.token_hex(4)}"
    d.mkdir()
    d.chmod(0o1777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def as_nobody(action: object) -> None:
    """Run ``action()`` in a forked child with uid and gid 65534; fail if it fails."""
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        code = 1
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            action()  # type: ignore[operator]
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@as_root
def test_a_segment_pre_created_by_another_user_is_refused(shared_dir: Path) -> None:
    def squat() -> None:
        # Another user gets there first, with a valid segment of the expected layout.
        WeightStore.create("victim", LAYOUT, root=shared_dir, mode=0o644).close()

    as_nobody(squat)
    path = shared_dir / "deltarl-victim"
    assert path.stat().st_uid == NOBODY
    with pytest.raises(UnsafePathError, match=r"belongs to uid 65534, not to uid 0"):
        WeightStore.open("victim", root=shared_dir)
    with pytest.raises(UnsafePathError, match="belongs to uid 65534"):
        WeightStore.open("victim", root=shared_dir, readonly=True, layout=LAYOUT)
    # Trusted explicitly, it opens (a reader of a store another user writes, by choice).
    with WeightStore.open("victim", root=shared_dir, readonly=True, owner=NOBODY) as store:
        assert store.layout == LAYOUT
    # And creating over it neither uses nor removes it, though its creator is gone.
    with pytest.raises(FileExistsError, match="belongs to another user"):
        WeightStore.create("victim", LAYOUT, root=shared_dir)
    assert cleanup_stale(shared_dir) == []
    assert path.stat().st_uid == NOBODY


@as_root
def test_a_segment_handed_to_another_user_is_refused(tmp_path: Path) -> None:
    WeightStore.create("s", LAYOUT, root=tmp_path).close()
    os.chown(tmp_path / "deltarl-s", NOBODY, NOBODY)
    with pytest.raises(UnsafePathError, match="belongs to uid 65534"):
        WeightStore.open("s", root=tmp_path)


@pytest.mark.parametrize("mode", [0o666, 0o620, 0o602, 0o777])
def test_a_segment_others_may_write_is_refused(tmp_path: Path, mode: int) -> None:
    WeightStore.create("s", LAYOUT, root=tmp_path).close()
    (tmp_path / "deltarl-s").chmod(mode)
    with pytest.raises(UnsafePathError, match=f"has mode {mode:04o}; refused"):
        WeightStore.open("s", root=tmp_path)
    with pytest.raises(UnsafePathError, match=f"has mode {mode:04o}"):
        WeightStore.open("s", root=tmp_path, readonly=True)


def test_read_for_others_is_allowed_write_is_not(tmp_path: Path) -> None:
    with WeightStore.create("r", LAYOUT, root=tmp_path, mode=0o644):
        WeightStore.open("r", root=tmp_path).close()
    with pytest.raises(ValueError, match="mode 0666 lets group or others write it"):
        WeightStore.create("w", LAYOUT, root=tmp_path, mode=0o666)
    assert not (tmp_path / "deltarl-w").exists()


def test_a_segment_directory_others_may_rename_in_is_refused(tmp_path: Path) -> None:
    loose = tmp_path / "loose"
    loose.mkdir()
    WeightStore.create("s", LAYOUT, root=loose).close()
    loose.chmod(0o777)  # world-writable without the sticky bit: anyone may replace the file
    with pytest.raises(UnsafePathError, match="0777 \\(writable by group or others, not sticky"):
        WeightStore.open("s", root=loose)
    with pytest.raises(UnsafePathError, match="not sticky"):
        WeightStore.create("t", LAYOUT, root=loose)
    loose.chmod(0o1777)  # sticky, as /dev/shm: others cannot remove or rename our file
    WeightStore.open("s", root=loose).close()
    check_trusted_dirs("/dev/shm", "the default root")
