"""Bringing the inactive buffer up to date with the delta it missed, instead of a full copy.

The store keeps two buffers. When version v becomes active, the other buffer still holds v-1
(the rollback target). The next delta, v -> v+1, is written into that buffer, so it must
first hold v. Copying the whole active buffer does that at memory speed for the whole model
(30-40 ms for 98M bf16 parameters here, before the first chunk can land); applying the delta
v-1 -> v again, which this agent received and applied moments ago and which is sparse, touches
only the elements that changed.

So the agent keeps the chunks of the last delta it committed (``KeptDelta``: their bytes, a
few MB at RL learning rates) and, when a new delta's target buffer holds exactly that delta's
base and the active version is that delta's version, applies them to the target in place
(``catch_up``). Anything else (a full version in between, a rollback, a restart, a failed
version, a chain with a gap) falls back to the copy. Nothing is trusted that is not checked:
the new version's verify hashes every tensor of the target before the flip, so a catch-up that
went wrong fails that version (and the export agent resends it), never activates bad bytes.
The rollback target is untouched until a new version is written, as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from deltarl.codecs.decoder import VersionApply
from deltarl.engine.layout import Layout


@dataclass
class KeptDelta:
    """The chunks of one delta ``base -> version`` as they were applied (each once)."""

    version: int
    base: int
    chunks: list[bytes] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(len(c) for c in self.chunks)

    def brings(self, holds: int | None, active: int | None) -> bool:
        """Whether applying it to a buffer that ``holds`` a version yields ``active``."""
        return holds is not None and holds == self.base and active == self.version

    def catch_up(self, layout: Layout, target: np.ndarray) -> None:
        """Apply the kept chunks to ``target`` (holding ``base``) in place: afterwards it holds
        ``version``. Raises what the decoder raises (FrameError, ValueError) on a bad chunk."""
        apply = VersionApply(layout, target, target, base=self.base, version=self.version)
        for chunk in self.chunks:
            apply.apply(chunk)
