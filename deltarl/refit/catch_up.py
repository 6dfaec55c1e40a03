"""Keeping the inactive buffer current with the delta it missed, instead of copying the model.

The store keeps two buffers. When version v becomes active, the other buffer still holds v-1.
The next delta, v -> v+1, is written into that buffer, so it must first hold v. Copying the
whole active buffer does that at memory speed, on the refit's path. The delta v-1 -> v, which
this agent applied moments ago, does it by touching only the elements that changed.

The agent keeps the last delta it committed, decoded as it was applied (``KeptDelta``: each
changed element's position and coded value, 16 bytes a change as decoded: 40 MB for 2.5M
changes; none is kept over ``catch_up_max_bytes``), and uses it in one of two ways
(``catch_up`` in ``[daemons.apply]``):

- ``eager`` (the default): right after v is committed and announced, the other buffer is
  brought from v-1 to v and *settled* (READY as v, never flipped to: ``WriteTxn.settle``).
  The next delta's target already holds its base, so its apply touches only the elements it
  changes; the catch-up is off the refit's path. The one-flip rollback to v-1 is then gone
  (both buffers hold v), so the catch-up keeps an undo (``Undo``: every element it wrote, as
  the XOR of old and new bits) and v-1's manifest: a rollback writes the undo back into the
  other buffer, verifies every tensor against v-1's manifest, and flips (a sparse write and a
  verify instead of a flip alone).
- ``on_open``: the same writes are made when the next delta opens, on its path: what is
  saved is a copy, at the price of the scatter (measured by ``deltarl bench refit
  --compare-copy``: at a few percent of elements changed, a scatter touches nearly every cache
  line, so it costs about what the copy does). The one-flip rollback stays.
- ``off``: always copy (the baseline the bench compares with).

Anything that breaks the chain (a full version, a rollback, a restart, a failed catch-up)
falls back to the copy. Nothing is trusted that is not checked: a buffer is only ever made
active by a commit after the new version's verify has hashed every tensor, or by a rollback
whose undo was verified against its manifest, so a catch-up that went wrong fails a version
(which the export agent resends), never activates bad bytes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from deltarl.codecs.decoder import DecodedChunk, apply_chunk, apply_chunk_flips
from deltarl.codecs.frame import VAL_XOR
from deltarl.codecs.manifest import RefitManifest
from deltarl.engine.layout import Layout

BYTES_PER_CHANGE = 16
"""What a kept change costs as decoded: its position (int64) and coded value (uint64)."""


@dataclass
class KeptDelta:
    """The chunks of one delta ``base -> version``, decoded, as they were applied (each once)."""

    version: int
    base: int
    chunks: list[DecodedChunk] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """Memory held: positions and coded values."""
        return sum(b.positions.nbytes + b.zval.nbytes for c in self.chunks for b in c.sparse) + sum(
            coded.nbytes for c in self.chunks for _, coded in c.dense
        )

    def brings(self, holds: int | None, active: int | None) -> bool:
        """Whether applying it to a buffer that ``holds`` a version yields ``active``."""
        return holds is not None and holds == self.base and active == self.version

    def catch_up(self, layout: Layout, target: np.ndarray) -> None:
        """Make the kept writes to ``target`` (holding ``base``) in place: afterwards it holds
        ``version``. The coded values read the reference, which is the target itself: each
        element is read before it is written."""
        _rewrite(self.chunks, layout, target)

    def catch_up_with_undo(self, layout: Layout, target: np.ndarray) -> list[DecodedChunk]:
        """``catch_up``, returning what undoes it: the same positions, each with the XOR of
        its old and new bits (chunks ``apply_chunk`` writes back). The scatter records the
        XORs as it writes (``apply_chunk_flips``): gathering the changed elements before and
        after took 23 of the 36 ms this took for the 1.3M changes of a simulated 98M delta."""
        undo = []
        for chunk in self.chunks:
            dense_before = [_dense(layout, target, h).copy() for h, _ in chunk.dense]
            flips = apply_chunk_flips(chunk, layout, target)
            sparse = [
                dataclasses.replace(b, codings=np.full_like(b.codings, VAL_XOR), zval=flipped)
                for b, flipped in zip(chunk.sparse, flips, strict=True)
            ]
            dense = [
                (dataclasses.replace(h, val_coding=VAL_XOR), old ^ _dense(layout, target, h))
                for (h, _), old in zip(chunk.dense, dense_before, strict=True)
            ]
            undo.append(DecodedChunk(chunk.header, list(chunk.records), sparse, dense, 0))
        return undo


def _dense(layout: Layout, target: np.ndarray, h: object) -> np.ndarray:
    t = layout.view(target, h.tensor_id)  # type: ignore[attr-defined]
    return t[h.start : h.start + h.length]  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Undo:
    """What brings the settled inactive buffer from ``holds`` back to ``restores``, and the
    manifest it is verified against before a rollback flips to it."""

    holds: int
    restores: int
    chunks: list[DecodedChunk]
    manifest: RefitManifest

    def apply(self, layout: Layout, target: np.ndarray) -> None:
        _rewrite(self.chunks, layout, target)


def _rewrite(chunks: list[DecodedChunk], layout: Layout, target: np.ndarray) -> None:
    """Make decoded chunks' writes to ``target`` in place (each element read, then written)."""
    for chunk in chunks:
        apply_chunk(chunk, layout, target, target)
