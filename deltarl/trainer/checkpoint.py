"""Atomic training checkpoints: model, optimizer, RNG, step, version and data cursor in one file.

One file per checkpoint, ``step-<step>.ckpt`` in the checkpoint directory, so the trainer state
and the data cursor are saved together or not at all (docs/architecture.md, contract 5). Writing:

    1. ``torch.save`` into ``.step-<step>.ckpt.<pid>.<random>.tmp`` in the same directory,
       hashing the bytes as they are written, then a trailer: magic, payload length, xxh3-128
    2. flush + fsync the file
    3. rename it to its final name (atomic within one file system) and fsync the directory,
       so the rename itself survives a power cut
    4. delete all but the newest ``keep`` checkpoints

A crash before 3 leaves only a temp file: loading never looks at temp files, and the next
``Checkpointer`` of the directory deletes those of writers that are gone. Loading tries the
checkpoints newest first and skips (with a warning) any whose trailer or digest does not
check out, such as one truncated by a full disk or a torn write: the trailer is written last,
so a file cut short anywhere fails the check.

The data cursor: the scheduler replays a step's batch exactly when that step is asked for again,
so the cursor is the next step to ask for (``next_step = step + 1``). Resuming from a checkpoint
of step s asks for s + 1 and retrains exactly what followed it.

Format (``FORMAT``): a ``torch.save`` dict of plain types and tensors, loaded with
``weights_only=True`` (no pickled code runs): ``format``, ``step``, ``version``,
``next_step``, ``model`` (the fp32 state dict), ``optimizer`` (its state dict), ``rng``
(torch, python, numpy and, where present, CUDA states), ``extra`` (free-form metadata).
"""

from __future__ import annotations

import io
import logging
import os
import random
import re
import secrets
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash
from torch import nn

logger = logging.getLogger(__name__)

FORMAT = 1
MAGIC = b"DRLCKPT1"
_TRAILER = struct.Struct("<8sQ16s")  # magic, payload bytes, xxh3-128 of the payload
_NAME = re.compile(r"^step-(\d{12})\.ckpt$")
_TEMP = re.compile(r"^\.step-\d{12}\.ckpt\.(\d+)\.[0-9a-f]+\.tmp$")


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used; the message names the file and the fault."""


def capture_rng() -> dict[str, Any]:
    """Every RNG state the training may draw from, as plain types and tensors."""
    np_state = np.random.get_state(legacy=False)
    assert isinstance(np_state, dict)  # legacy=False always gives the dict form
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": [int(k) for k in np_state["state"]["key"]],
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    npst = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": npst["bit_generator"],
            "state": {"key": np.array(npst["key"], dtype=np.uint32), "pos": npst["pos"]},
            "has_gauss": npst["has_gauss"],
            "gauss": npst["gauss"],
        }
    )
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@dataclass(frozen=True)
class Checkpoint:
    """What a restore found: the step it holds, the version published for it, the cursor."""

    step: int
    version: int
    next_step: int
    path: Path
    extra: dict[str, Any]


class _HashingWriter:
    """A write-only file object for ``torch.save`` that hashes and counts what passes."""

    def __init__(self, f: io.BufferedWriter) -> None:
        self._f = f
        self.hasher = xxhash.xxh3_128()
        self.nbytes = 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        self.hasher.update(data)
        self.nbytes += len(data)
        return self._f.write(data)

    def flush(self) -> None:
        self._f.flush()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive
    return True


class Checkpointer:
    """The checkpoints of one trainer in ``directory``, keeping the newest ``keep``."""

    def __init__(self, directory: Path, keep: int = 3) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.directory = Path(directory)
        self.keep = keep
        self.directory.mkdir(parents=True, exist_ok=True)
        self._remove_dead_temps()

    def _remove_dead_temps(self) -> None:
        for entry in self.directory.iterdir():
            m = _TEMP.match(entry.name)
            if m and not _pid_alive(int(m.group(1))):
                logger.warning("removing %s, left by a checkpoint writer that died", entry)
                entry.unlink(missing_ok=True)

    def path_of(self, step: int) -> Path:
        return self.directory / f"step-{step:012d}.ckpt"

    def steps(self) -> list[int]:
        """Steps of the complete-looking checkpoint files, oldest first (not yet verified)."""
        found = (_NAME.match(e.name) for e in self.directory.iterdir())
        return sorted(int(m.group(1)) for m in found if m)

    # -- saving -----------------------------------------------------------------------------

    def save(
        self,
        *,
        step: int,
        version: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        extra: dict[str, Any] | None = None,
    ) -> Path:
        """Write the checkpoint of ``step`` atomically and durably; returns its path.

        Call it only between steps: it reads the parameters and optimizer state as they are.
        """
        state = {
            "format": FORMAT,
            "step": step,
            "version": version,
            "next_step": step + 1,
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "rng": capture_rng(),
            "extra": extra or {},
        }
        return self.write_state(step, state)

    def write_state(self, step: int, state: dict[str, Any]) -> Path:
        """Write a checkpoint's state (``save``'s dict) as the file of ``step``, atomically and
        durably; then keep the newest ``keep``."""
        final = self.path_of(step)
        tmp = self.directory / f".{final.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            with tmp.open("xb") as f:
                writer = _HashingWriter(f)
                torch.save(state, writer)
                f.write(_TRAILER.pack(MAGIC, writer.nbytes, writer.hasher.digest()))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        _fsync_dir(self.directory)
        self._prune()
        logger.info("checkpoint of step %d written to %s", step, final)
        return final

    def restore_to(self, step: int, above_version: int) -> tuple[int, list[Path]]:
        """Make the checkpoint of ``step`` the newest (an operator's restore): the newer ones
        move into ``discarded-<time>/`` beside them (kept, not deleted), and the checkpoint's
        version becomes one above every version the run published (``above_version``, and
        every checkpoint's), so the trainer publishes its weights under a new number: no
        version number ever names two different weights. Returns (that version, the files
        moved). CheckpointError if the checkpoint of ``step`` is missing or unsound.

        Crash-safe in order: the rewritten checkpoint first (a crash leaves the newer ones
        newest, as if nothing happened), then the moves (a crash between them: run it again;
        the version only goes up)."""
        path = self.path_of(step)
        if not path.exists():
            raise CheckpointError(f"no checkpoint of step {step} in {self.directory}")
        state = self.read(path)
        newest = max(
            [int(self.read(self.path_of(s))["version"]) for s in self.steps() if s >= step]
        )
        version = max(newest, above_version) + 1
        state["extra"] = {**state.get("extra", {}), "restored_from_version": state["version"]}
        state["version"] = version
        self.write_state(step, state)
        newer = [self.path_of(s) for s in self.steps() if s > step]
        moved = []
        if newer:
            aside = self.directory / f"discarded-{time.strftime('%Y%m%d-%H%M%S')}"
            aside.mkdir(exist_ok=True)
            for p in newer:
                os.replace(p, aside / p.name)
                moved.append(aside / p.name)
            _fsync_dir(self.directory)
        logger.warning(
            "checkpoint of step %d restored as version %d (%d newer checkpoints moved aside)",
            step,
            version,
            len(moved),
        )
        return version, moved

    def _prune(self) -> None:
        for step in self.steps()[: -self.keep]:
            self.path_of(step).unlink(missing_ok=True)

    # -- loading ----------------------------------------------------------------------------

    def read(self, path: Path) -> dict[str, Any]:
        """The verified contents of one checkpoint file; CheckpointError if it is not sound."""
        try:
            with path.open("rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < _TRAILER.size:
                    raise CheckpointError(f"{path}: {size} bytes, shorter than its trailer")
                f.seek(size - _TRAILER.size)
                magic, nbytes, digest = _TRAILER.unpack(f.read(_TRAILER.size))
                if magic != MAGIC:
                    raise CheckpointError(f"{path}: no checkpoint trailer (truncated or foreign)")
                if nbytes != size - _TRAILER.size:
                    raise CheckpointError(
                        f"{path}: trailer says {nbytes} payload bytes, the file holds "
                        f"{size - _TRAILER.size}"
                    )
                f.seek(0)
                payload = f.read(nbytes)
        except OSError as e:
            raise CheckpointError(f"{path}: cannot read: {e}") from None
        if xxhash.xxh3_128_digest(payload) != digest:
            raise CheckpointError(f"{path}: payload digest mismatch (corrupted)")
        try:
            state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unpickling failure means the same thing
            raise CheckpointError(f"{path}: cannot load: {type(e).__name__}: {e}") from None
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            raise CheckpointError(f"{path}: not a format-{FORMAT} training checkpoint")
        return state

    def newest(self) -> tuple[Path, dict[str, Any]] | None:
        """The newest checkpoint that verifies, skipping (and logging) broken newer ones."""
        for step in reversed(self.steps()):
            path = self.path_of(step)
            try:
                return path, self.read(path)
            except CheckpointError as e:
                logger.warning("skipping checkpoint of step %d: %s", step, e)
        return None

    def restore(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Checkpoint | None:
        """Load the newest sound checkpoint into ``model`` and ``optimizer`` and restore the
        RNG states; None (nothing touched) if there is none."""
        found = self.newest()
        if found is None:
            return None
        path, state = found
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        restore_rng(state["rng"])
        logger.info("resumed from %s (step %d)", path, state["step"])
        return Checkpoint(
            step=int(state["step"]),
            version=int(state["version"]),
            next_step=int(state["next_step"]),
            path=path,
            extra=dict(state["extra"]),
        )
