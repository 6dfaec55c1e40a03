"""VersionPointer: the pointer word's encoding and the per-buffer state words."""

from __future__ import annotations

import numpy as np
import pytest

from deltarl.engine.version_pointer import META_WORDS, POINTER_WORD, BufferState, VersionPointer


def test_fresh_words_mean_nothing_active() -> None:
    pointer = VersionPointer(np.zeros(512, np.uint64))
    assert pointer.load() == 0
    assert VersionPointer.active_index(0) is None
    assert pointer.active_version() is None
    assert pointer.state(0) is BufferState.EMPTY
    assert pointer.ready_version(1) is None


def test_flip_bumps_the_generation_every_time() -> None:
    words = np.zeros(512, np.uint64)
    pointer = VersionPointer(words)
    pointer.mark(0, BufferState.READY, 3)
    assert pointer.flip(0) == (1 << 1 | 0)
    pointer.mark(1, BufferState.READY, 4)
    assert pointer.flip(1) == (2 << 1 | 1)
    assert pointer.flip(0) == (3 << 1 | 0)  # back to buffer 0, yet a different word (no ABA)
    assert int(words[POINTER_WORD]) == 6
    assert pointer.active_version() == 3


def test_mark_writes_state_and_version_words() -> None:
    words = np.zeros(512, np.uint64)
    pointer = VersionPointer(words)
    pointer.mark(1, BufferState.READY, 2**63 - 1)
    assert int(words[META_WORDS[1]]) == BufferState.READY
    assert pointer.ready_version(1) == 2**63 - 1
    pointer.mark(1, BufferState.WRITING)
    assert pointer.version(1) == 2**63 - 1  # the stale word stays, but is not READY
    assert pointer.ready_version(1) is None


def test_words_must_be_aligned_uint64() -> None:
    raw = np.zeros(4104, np.uint8)
    with pytest.raises(ValueError, match="aligned native uint64"):
        VersionPointer(raw[1:4097].view(np.uint64))
    with pytest.raises(ValueError, match="aligned native uint64"):
        VersionPointer(np.zeros(512, np.int64))
