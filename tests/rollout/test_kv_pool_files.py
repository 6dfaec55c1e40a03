"""The KV pool's file layout (deltarl/rollout/kv_pool_files.py) without an engine: a prompt's
blocks appear whole or not at all, a second writer of the same key loses cleanly, and old
versions and dead writers' leftovers expire while the kept versions stay."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from deltarl.rollout import kv_pool_files as files


def write_layers(path: str, layers: int = 3) -> None:
    os.makedirs(path, exist_ok=True)
    for i in range(layers):
        Path(path, f"layer{i}.safetensors").write_bytes(b"x" * 16)


def test_a_key_appears_only_once_every_layer_is_written(tmp_path: Path) -> None:
    final = files.key_dir(tmp_path, "deltarl-v3", "abc")
    staged = files.staging_dir(tmp_path, "deltarl-v3", "abc", 1)
    write_layers(staged, 2)
    assert not os.path.exists(final)  # a lookup misses while layers are still written
    write_layers(staged, 3)
    assert files.publish(staged, final)
    assert sorted(os.listdir(final)) == [f"layer{i}.safetensors" for i in range(3)]
    assert not os.path.exists(staged)


def test_a_second_writer_of_the_same_key_leaves_the_first_ones_blocks(tmp_path: Path) -> None:
    final = files.key_dir(tmp_path, "deltarl-v3", "abc")
    first = files.staging_dir(tmp_path, "deltarl-v3", "abc", 1)
    second = files.staging_dir(tmp_path, "deltarl-v3", "abc", 2)
    write_layers(first)
    Path(first, "mark").write_text("first")
    write_layers(second)
    assert files.publish(first, final)
    assert not files.publish(second, final)
    assert Path(final, "mark").read_text() == "first"
    assert not os.path.exists(second)


def test_prune_expires_versions_older_than_kept_and_only_those(tmp_path: Path) -> None:
    for v in (0, 3, 4, 5, 6):
        write_layers(files.key_dir(tmp_path, f"deltarl-v{v}", "k"))
    (tmp_path / "not-a-version").mkdir()
    trash = files.prune(tmp_path, "deltarl-v6", keep=3)  # keeps 4, 5, 6
    names = sorted(p.name for p in tmp_path.iterdir())
    assert [n for n in names if not n.startswith(files.TRASH)] == [
        "deltarl-v4",
        "deltarl-v5",
        "deltarl-v6",
        "not-a-version",
    ]
    assert len(trash) == 2  # v0 and v3, renamed away before anything is removed
    assert all(p.name.startswith(files.TRASH) for p in trash)
    files.remove(trash)
    assert not any(p.name.startswith(files.TRASH) for p in tmp_path.iterdir())
    assert files.prune(tmp_path, "deltarl-v6", keep=3) == []  # nothing more to expire


def test_prune_takes_dead_writers_leftovers_and_a_crashed_prunes_trash(tmp_path: Path) -> None:
    live = files.staging_dir(tmp_path, "deltarl-v2", "a", 1)
    dead = files.staging_dir(tmp_path, "deltarl-v2", "b", 2)
    old = time.time() - files.STALE_STAGING_S - 5
    os.utime(dead, (old, old))
    left = tmp_path / f"{files.TRASH}deltarl-v0-x"
    left.mkdir()
    trash = files.prune(tmp_path, "deltarl-v2", keep=2)
    assert sorted(str(p) for p in trash) == sorted([dead, str(left)])
    files.remove(trash)
    assert os.path.isdir(live)
    assert not os.path.exists(dead)


def test_a_warm_up_left_by_a_dead_engine_is_pruned_and_is_no_version(tmp_path: Path) -> None:
    # fault: an engine died during its start's warm-up, its blocks published under the
    # warm-up's namespace; the next prune takes them, and no lookup of a version finds them
    ns = files.warm_up_namespace()
    assert ns != files.warm_up_namespace()  # one per warm-up: engines never share one
    assert files.version_of(ns) is None
    staged = files.staging_dir(tmp_path, ns, "k", 1)
    write_layers(staged)
    assert files.publish(staged, files.key_dir(tmp_path, ns, "k"))
    trash = files.prune(tmp_path, "deltarl-v0", keep=1)
    assert trash == [tmp_path / ns]
    files.remove(trash)
    assert list(tmp_path.iterdir()) == []


def test_prune_refuses_nonsense_and_ignores_foreign_namespaces(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keep"):
        files.prune(tmp_path, "deltarl-v1", keep=0)
    write_layers(files.key_dir(tmp_path, "deltarl-v0", "k"))
    assert files.prune(tmp_path, "someone-else", keep=1) == []  # not a version: keep all
    assert files.prune(tmp_path / "absent", "deltarl-v9", keep=1) == []
    assert files.version_of("deltarl-v12") == 12
    assert files.version_of("deltarl-v") is None
