"""A write transaction on a weight store: fill the inactive buffer, then commit it in one flip.

``WeightStore.begin_write`` builds one after taking the writer lock and the EXCLUSIVE lock on
the target buffer; the transaction owns the fd that holds both, so ending it (or the process
dying) releases them. The protocol and its invariants are in weight_store.py.

States:

    OPEN ---- first writable view, or copy_from_active ----> DIRTY (target marked WRITING)
    OPEN | DIRTY ---- commit(version) ----> COMMITTED (target READY as version, pointer flipped)
    DIRTY --- settle(version) ----> SETTLED (target READY as version <= the active one, no flip)
    OPEN ---- abort ----> ABORTED (target untouched: it keeps its READY version)
    DIRTY --- abort ----> ABORTED (target EMPTY)
    DIRTY --- crash ----> target left WRITING; the next writer treats it as EMPTY

Aborting before the first write keeps the target's old version, so a refit refused early
(say, a delta whose base does not match) costs no rollback target.
"""

from __future__ import annotations

import logging
import operator
import os
import weakref
from collections.abc import Sequence
from types import TracebackType
from typing import Self

import numpy as np

from deltarl.codecs.checksum import model_digest
from deltarl.engine.layout import Layout
from deltarl.engine.tensor_digest_table import pack_digests, write_table
from deltarl.engine.version_pointer import BufferState, VersionPointer

logger = logging.getLogger(__name__)

MAX_VERSION = 2**63 - 1


class WriteTxn:
    """The one write transaction of a segment. Leaving a ``with`` block without commit aborts.

    Writable views (``buffer``, ``array``) must not be used after the transaction ends: after a
    commit they point into the active buffer, which readers then lease.
    """

    def __init__(
        self,
        *,
        name: str,
        layout: Layout,
        pointer: VersionPointer,
        target: np.ndarray,
        active: np.ndarray | None,
        index: int,
        active_index: int | None,
        base_version: int | None,
        fd: int,
        revoked: bool = False,
        digest_table: np.ndarray | None = None,
    ) -> None:
        self.name = name
        self.revoked = revoked
        """Whether the target's leases were revoked to start this transaction (I4)."""
        self.layout = layout
        self.index = index  # the target buffer
        self._pointer = pointer
        self._target = target
        self._table = digest_table  # the target's tensor digests; None: the segment has none
        self._active = active
        self._active_index = active_index
        self._base_version = base_version
        self._dirty = False
        self._close_fd = weakref.finalize(self, os.close, fd)  # closing drops both locks

    @property
    def done(self) -> bool:
        """Whether the transaction was committed or aborted."""
        return not self._close_fd.alive

    @property
    def base_version(self) -> int | None:
        """The complete version the target buffer holds; None while its contents are unknown."""
        return self._base_version

    @property
    def active_version(self) -> int | None:
        """The active version (stable: only this transaction may change the pointer)."""
        return None if self._active_index is None else self._pointer.version(self._active_index)

    @property
    def active(self) -> np.ndarray | None:
        """The active buffer as read-only uint8, or None before the first commit."""
        return self._active

    @property
    def buffer(self) -> np.ndarray:
        """The target buffer as writable uint8."""
        self._touch()
        return self._target

    def array(self, name_or_id: str | int) -> np.ndarray:
        """One tensor's writable bit view in the target buffer."""
        return self.layout.view(self.buffer, name_or_id)

    def copy_from_active(self) -> None:
        """Copy the whole active buffer into the target, which then holds the active version."""
        if self._active is None:
            raise RuntimeError(f"weight store {self.name!r} has no active version to copy")
        np.copyto(self.buffer, self._active)
        self._base_version = self.active_version

    def brought_to(self, version: int) -> None:
        """The caller wrote the target up to ``version`` from the version it held (a sparse
        catch-up: deltarl/refit/catch_up.py), unverified until the next commit's caller
        verifies the whole buffer."""
        self._touch()
        self._base_version = version

    def commit(
        self,
        version: int,
        *,
        allow_older: bool = False,
        digest: str | None = None,
        tensor_digests: Sequence[str] | None = None,
    ) -> None:
        """Mark the target READY as ``version`` and make it active, all at once for readers.

        ``version`` must exceed the active version unless ``allow_older`` (a deliberate
        downgrade, e.g. a full resync to an older checkpoint). ``digest``: the model digest
        of the manifest these bytes were verified against (``Snapshot.digest`` for readers),
        so a reader proves what it loaded under its own lease, asking nobody.
        ``tensor_digests``: the writer's xxh3-128 of each tensor it wrote, in layout order
        (``Snapshot.tensor_digests``: the export agent sends them instead of hashing the
        model again); the model digest is then theirs, and a ``digest`` given too must equal
        it. Both are checked before anything changes.
        """
        self._check_live()
        try:
            version = operator.index(version)
        except TypeError:
            raise TypeError(f"version must be an int, got {version!r}") from None
        if not 0 <= version <= MAX_VERSION:
            raise ValueError(f"version must lie in [0, 2**63), got {version}")
        current = self.active_version
        if current is not None and version <= current and not allow_older:
            raise ValueError(
                f"version {version} does not increase over the active version {current}; "
                f"pass allow_older=True to make it active anyway"
            )
        self._record_digests(version, digest, tensor_digests)  # with the bytes, before READY
        self._pointer.mark(self.index, BufferState.READY, version)  # I1: READY before the flip
        self._pointer.flip(self.index)
        self._close_fd()  # unlock only after the last store (see "Memory ordering")
        logger.debug(
            "weight store %s: version %d active in buffer %d", self.name, version, self.index
        )

    def settle(self, version: int, *, digest: str | None = None) -> None:
        """Mark the target READY as ``version`` without making it active: the inactive buffer
        now holds that version too (the apply agent's eager catch-up, deltarl/refit/
        catch_up.py). ``version`` may not exceed the active version: nothing newer may wait
        in the inactive buffer, unverified, to be flipped to."""
        self._check_live()
        current = self.active_version
        if current is None or version > current:
            raise ValueError(
                f"cannot settle version {version} in the inactive buffer: the active version "
                f"is {current}"
            )
        self._record_digests(version, digest, None)
        self._pointer.mark(self.index, BufferState.READY, version)  # I1: never flipped to here
        self._close_fd()

    def _record_digests(
        self, version: int, digest: str | None, tensor_digests: Sequence[str] | None
    ) -> None:
        """The target's digest words and tensor digest table, for the version it now holds.
        Everything is checked before the first word changes: a refused commit leaves the
        transaction open and the target's words as they were."""
        packed = None
        if tensor_digests is not None:
            if len(tensor_digests) != len(self.layout):
                raise ValueError(
                    f"{len(tensor_digests)} tensor digests for a layout of "
                    f"{len(self.layout)} tensors"
                )
            packed = pack_digests(tensor_digests)
            whole = model_digest(tensor_digests)
            if digest is not None and digest != whole:
                raise ValueError(
                    f"model digest {digest} is not the one of the tensor digests given ({whole})"
                )
            digest = whole
        self._pointer.set_digest(self.index, digest)
        if packed is not None and self._table is not None:
            write_table(self._table, packed)
            self._pointer.set_tensor_digests(self.index, version)
        else:
            self._pointer.set_tensor_digests(self.index, None)

    def abort(self) -> None:
        """End without committing; the active version stays as it was. Idempotent."""
        if self.done:
            return
        if self._dirty:
            self._pointer.mark(self.index, BufferState.EMPTY)
        self._close_fd()

    def _touch(self) -> None:
        self._check_live()
        if not self._dirty:
            # Before any byte can change: a crash from here on leaves WRITING behind.
            self._pointer.mark(self.index, BufferState.WRITING)
            self._dirty = True
            self._base_version = None

    def _check_live(self) -> None:
        if self.done:
            raise RuntimeError(
                f"weight store {self.name!r}: this write transaction was already committed "
                f"or aborted"
            )

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.abort()
