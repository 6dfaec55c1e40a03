"""The KV pool's files (kv_pool.py): where a prompt's blocks live, how a set of them is
published whole, and how old weight versions expire. No vLLM here, so it is testable alone.

Layout under the pool's directory ``ROOT`` (shared by every engine of the pool)::

    ROOT/deltarl-v7/<key>/<layer>.safetensors   a prompt's KV blocks computed by version 7
    ROOT/deltarl-v7/.staging/<key>-<pid>-<n>/   blocks being written by one engine process
    ROOT/.trash-deltarl-v5-<uuid>/              an expired version, being removed
    ROOT/.trash-warm-up-<pid>-<uuid>/           an engine's warm-up request (``warm_up_namespace``)

Invariants, and where they are kept:

- A ``<key>`` directory is complete when it appears: an engine writes a prompt's layers into a
  staging directory and renames it into place once the whole forward pass has saved
  (``publish``, from the connector's ``wait_for_save``). A rename is atomic, so another engine
  that finds the key (a lookup is the directory's existence) finds every layer. Two engines
  that computed the same prompt: the first rename wins, the second's copy is removed.
- Blocks of version v are only under ``deltarl-v{v}``, so expiring a version is removing one
  directory (``prune``), first renamed out of the way so no lookup finds it half removed.
- An engine keeps ``keep`` versions, its own and the ``keep - 1`` before it: an engine that
  is further behind the newest one sharing the pool may find its blocks removed. The lag bound
  keeps engines within a version or two of each other; ``kv_pool_keep_versions`` must exceed
  it (the engine's config says so).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
import uuid
from pathlib import Path

STAGING = ".staging"
TRASH = ".trash-"
_VERSION = re.compile(r"^deltarl-v(\d+)$")
STALE_STAGING_S = 600.0
"""A staging directory this old belongs to a writer that died mid-save (a forward pass saves
in well under a second): ``prune`` removes it."""


def version_of(namespace: str) -> int | None:
    """The weight version of a namespace directory's name (``deltarl-v7`` -> 7), else None."""
    m = _VERSION.match(namespace)
    return int(m.group(1)) if m else None


def warm_up_namespace() -> str:
    """A namespace of its own for an engine's throw-away warm-up request (engine.py), so the
    pool never holds its blocks under a weight version. Named as trash: the engine removes it
    after the warm-up, and ``prune`` removes what an engine that died meanwhile left. Another
    engine's prune may remove it while the warm-up writes: the save is then lost (``publish``
    answers False), which costs a warm-up nothing."""
    return f"{TRASH}warm-up-{os.getpid()}-{uuid.uuid4().hex}"


def key_dir(root: str | os.PathLike[str], namespace: str, key: str) -> str:
    """Where a published prompt's blocks are (a lookup checks that it exists)."""
    return os.path.join(root, namespace, key)


def staging_dir(root: str | os.PathLike[str], namespace: str, key: str, serial: int) -> str:
    """A new staging directory for one prompt's blocks, made now, unique to this process."""
    path = os.path.join(root, namespace, STAGING, f"{key}-{os.getpid()}-{serial}")
    os.makedirs(path, exist_ok=True)
    return path


def publish(staged: str, final: str) -> bool:
    """Move a fully written staging directory into place; False (and the copy removed) if
    another engine published the same key first."""
    os.makedirs(os.path.dirname(final), exist_ok=True)
    try:
        os.rename(staged, final)
    except OSError:  # ENOTEMPTY / EEXIST: the key is there already, complete
        shutil.rmtree(staged, ignore_errors=True)
        return False
    return True


def prune(root: str | os.PathLike[str], current: str, keep: int) -> list[Path]:
    """Expire the versions more than ``keep - 1`` older than ``current`` (a namespace name),
    and dead writers' staging directories. Each expired version is renamed out of the way
    here (fast, atomic); the renamed directories are returned for the caller to remove
    (``remove``), off the refit path. Leftover trash of a crashed prune is returned too."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    now_version = version_of(current)
    base = Path(root)
    if now_version is None or not base.is_dir():
        return []
    trash: list[Path] = []
    for entry in base.iterdir():
        if entry.name.startswith(TRASH):
            trash.append(entry)
            continue
        v = version_of(entry.name)
        if v is None:
            continue
        if v <= now_version - keep:
            target = base / f"{TRASH}{entry.name}-{uuid.uuid4().hex}"
            try:
                entry.rename(target)
            except FileNotFoundError:  # another engine expired it first
                continue
            trash.append(target)
        else:
            trash += _stale_staging(entry / STAGING)
    return trash


def _stale_staging(staging: Path) -> list[Path]:
    out: list[Path] = []
    if not staging.is_dir():
        return out
    cutoff = time.time() - STALE_STAGING_S
    for d in staging.iterdir():
        with contextlib.suppress(FileNotFoundError):
            if d.stat().st_mtime < cutoff:
                out.append(d)
    return out


def remove(paths: list[Path]) -> None:
    for p in paths:
        shutil.rmtree(p, ignore_errors=True)
