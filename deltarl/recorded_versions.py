"""Real consecutive weight versions on disk, for the codec work: recorded by ``deltarl up
--keep-versions N``, replayed by ``deltarl bench codec --versions DIR``.

A directory of them holds ``layout.json`` (``Layout.to_json()``, the trainer's published
layout) and one ``v<version>.bin`` per version: the published buffer's bytes exactly (bf16
tensors at their layout offsets), as the export agent diffs them. Only consecutive versions
are kept (a gap restarts the run of them), so every pair (v, v + 1) is one optimizer step's
real delta. Each file is written under a temporary name and renamed: a reader never sees
half a version.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from deltarl.atomic_file import write_atomic
from deltarl.engine.layout import Layout
from deltarl.engine.weight_store import WeightStore

LAYOUT = "layout.json"


class VersionRecorder:
    """Copies up to ``limit`` consecutive versions of a weight store into ``directory``."""

    def __init__(self, store: str, root: Path | None, directory: Path, limit: int) -> None:
        self.store_name, self.root = store, root
        self.directory = directory
        self.limit = limit
        self.kept: list[int] = []
        self._store: WeightStore | None = None

    @property
    def done(self) -> bool:
        return len(self.kept) >= self.limit

    def poll(self) -> None:
        """Record the store's active version if it extends the run; call it often (a version
        the trainer replaced before a poll is a gap, and the run starts again after it)."""
        if self.done:
            return
        if self._store is None:
            try:
                self._store = WeightStore.open(self.store_name, root=self.root, readonly=True)
            except FileNotFoundError:
                return  # the trainer has not made it yet
            self.directory.mkdir(parents=True, exist_ok=True)
            _write(self.directory / LAYOUT, self._store.layout.to_json())
        version = self._store.active_version
        if version is None or (self.kept and version == self.kept[-1]):
            return
        if self.kept and version != self.kept[-1] + 1:
            for v in self.kept:  # not consecutive: start the run again from this version
                (self.directory / f"v{v}.bin").unlink(missing_ok=True)
            self.kept = []
        with self._store.lease() as snap:
            _write(self.directory / f"v{snap.version}.bin", memoryview(snap.buffer).cast("B"))
            self.kept.append(snap.version)

    def close(self) -> None:
        if self._store is not None:
            self._store.close()


def _write(path: Path, data: bytes | memoryview) -> None:
    write_atomic(path, data)


def read_versions(directory: Path) -> tuple[Layout, list[tuple[int, np.ndarray]]]:
    """The layout and the longest run of consecutive versions in ``directory``, in order."""
    layout = Layout.from_json((directory / LAYOUT).read_bytes())
    found = sorted(int(p.stem[1:]) for p in directory.glob("v*.bin") if p.stem[1:].isdigit())
    run: list[int] = []
    for v in found:
        run = [*run, v] if run and v == run[-1] + 1 else [v]
    versions = []
    for v in run:
        buf = np.fromfile(directory / f"v{v}.bin", dtype=np.uint8)
        if buf.size != layout.nbytes:
            raise ValueError(f"{directory}/v{v}.bin holds {buf.size} bytes, not {layout.nbytes}")
        versions.append((v, buf))
    return layout, versions


def pairs(versions: list[tuple[int, np.ndarray]]) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """(target version, reference, current) for each consecutive pair."""
    for (_, ref), (v, cur) in itertools.pairwise(versions):
        yield v, ref, cur
