"""The element ranges one version's chunks have written, so that no chunk writes one twice.

The encoder gives every record of a version its own range (records are whole items, each in
one chunk), so two chunks of one send never cover the same element; a chunk id seen again is
a duplicate and skipped before this is asked (``VersionApply``). A record that reaches into a
range another chunk of the version already wrote is therefore a forged or corrupt frame, or a
sender's bug. Applied in place (the apply agent's target is its own reference), such a record
would decode against bytes already brought to the new version instead of the base, and the
version would only fail at its verify, as "tensors differ after apply". Checked here, before
the frame writes anything, it is refused as what it is, naming both chunks.

Kept: the ranges of every chunk applied to the version, per tensor, sorted by start and
disjoint (``check`` refuses what would overlap; only ``add`` grows them, after a chunk has
been written whole).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from deltarl.codecs.frame import FrameError, RecordHeader
from deltarl.engine.layout import Layout


class WrittenRanges:
    """Per tensor: the ranges written so far, as (start, end, chunk id), sorted by start."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self._ranges: dict[int, list[tuple[int, int, int]]] = {}

    def check(self, chunk_id: int, version: int, records: Sequence[RecordHeader]) -> None:
        """Raise FrameError if a record reaches into a range already written. The records
        of one frame are already known to be disjoint and ascending (frame_checks)."""
        for i, r in enumerate(records):
            ranges = self._ranges.get(r.tensor_id, [])
            end = r.start + r.length
            # the last range starting before this record's end is the only one that can
            # overlap it: ranges are disjoint, so any earlier one ends before that one starts
            j = bisect.bisect_left(ranges, end, key=lambda w: w[0]) - 1
            if j >= 0 and ranges[j][1] > r.start:
                name = self.layout.tensors[r.tensor_id].name
                lo, hi, first = ranges[j]
                raise FrameError(
                    f"chunk {chunk_id} of version {version}: record {i} ({name!r}) writes "
                    f"elements [{r.start}, {end}), but chunk {first} "
                    f"of this version already wrote [{lo}, {hi}): the records of one version "
                    "never overlap, so this frame is forged, corrupt or sent in error"
                )

    def add(self, chunk_id: int, records: Sequence[RecordHeader]) -> None:
        """Record a chunk's ranges as written (after ``check`` passed and it was applied)."""
        for r in records:
            bisect.insort(
                self._ranges.setdefault(r.tensor_id, []), (r.start, r.start + r.length, chunk_id)
            )
