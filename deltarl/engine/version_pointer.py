"""The live words of a weight-store segment: the version pointer and each buffer's state.

Each is one aligned 8-byte word of the segment's header page (indices below), read
and written through a native-endian numpy uint64 view: numpy's aligned scalar get and set are
single loads and stores, which x86-64 and aarch64 perform atomically. So a reader of a word sees
either the old value or the new one, never a mix.

The pointer word is ``generation << 1 | index``: ``index`` is the active buffer, ``generation``
counts flips since creation and is 0 while nothing is active. Invariant I3 (see weight_store.py):
the word changes only under the writer lock, and every change increases the generation, so two
equal reads of the word mean no flip happened between them.
"""

from __future__ import annotations

import enum

import numpy as np

# Word indices (8-byte words) in the segment's header page; segment.py keeps bytes 0-191 for the
# fixed header, and each live word gets a cache line of its own.
POINTER_WORD = 24  # byte 192
META_WORDS: tuple[int, int] = (32, 40)  # bytes 256 and 320: [state, version] of each buffer
DIGEST_OFFSET = 2  # then [digest high, digest low, digest set] on the same cache line
REVOKED_OFFSET = 5  # then the buffer's lease revocations (I4 in weight_store.py)
TENSOR_DIGESTS_OFFSET = 6  # then which version its tensor digest table holds, plus one


class BufferState(enum.IntEnum):
    """What a buffer holds. Only READY buffers have a meaningful version."""

    EMPTY = 0  # never written, or its last transaction was aborted: contents unknown
    WRITING = 1  # a writer is writing it, or died doing so: contents unknown
    READY = 2  # holds the whole of its version


class VersionPointer:
    """The pointer and per-buffer metadata words, over a uint64 view of the header page.

    Writes are for the holder of the writer lock only; see the invariants in weight_store.py.
    """

    def __init__(self, words: np.ndarray) -> None:
        if words.dtype != np.uint64 or words.ctypes.data % 8:
            raise ValueError("the live words need an aligned native uint64 view")
        self._words = words

    def load(self) -> int:
        """The raw pointer word (compare two loads to detect a flip)."""
        return int(self._words[POINTER_WORD])

    @staticmethod
    def active_index(word: int) -> int | None:
        """The active buffer named by a pointer word, or None before the first commit."""
        return word & 1 if word >> 1 else None

    def flip(self, index: int) -> int:
        """Make buffer ``index`` active under the next generation; returns the new word.

        Caller holds the writer lock (I3) and has made buffer ``index`` READY (I1).
        """
        word = ((self.load() >> 1) + 1) << 1 | index
        self._words[POINTER_WORD] = np.uint64(word)  # the one aligned store readers depend on
        return word

    def state(self, index: int) -> BufferState:
        return BufferState(int(self._words[META_WORDS[index]]))

    def version(self, index: int) -> int:
        """The version word of a buffer; meaningful only while it is READY."""
        return int(self._words[META_WORDS[index] + 1])

    def ready_version(self, index: int) -> int | None:
        return self.version(index) if self.state(index) is BufferState.READY else None

    def mark(self, index: int, state: BufferState, version: int | None = None) -> None:
        """Set a buffer's state (and version): the version first, so READY implies it is set.

        I2: caller holds the writer lock and the EXCLUSIVE lock on buffer ``index``.
        """
        if version is not None:
            self._words[META_WORDS[index] + 1] = np.uint64(version)
        self._words[META_WORDS[index]] = np.uint64(state)

    def set_digest(self, index: int, digest: str | None) -> None:
        """Record the model digest (xxh3-128, 32 hex digits) of what buffer ``index`` holds,
        or that none is known; before it is marked READY, under the same locks as ``mark``.

        A reader takes it under its lease on the buffer, so it belongs to the very bytes it
        leased (the words of a leased buffer cannot change: I2)."""
        at = META_WORDS[index] + DIGEST_OFFSET
        if digest is None:
            self._words[at + 2] = np.uint64(0)
            return
        value = int(digest, 16)
        if len(digest) != 32 or value >> 128:
            raise ValueError(f"a model digest is 32 hex digits, got {digest!r}")
        self._words[at] = np.uint64(value >> 64)
        self._words[at + 1] = np.uint64(value & (1 << 64) - 1)
        self._words[at + 2] = np.uint64(1)

    def digest(self, index: int) -> str | None:
        """The model digest recorded with buffer ``index``'s version, or None."""
        at = META_WORDS[index] + DIGEST_OFFSET
        if not int(self._words[at + 2]):
            return None
        return f"{int(self._words[at]) << 64 | int(self._words[at + 1]):032x}"

    def set_tensor_digests(self, index: int, version: int | None) -> None:
        """Record which version's digests buffer ``index``'s tensor digest table (segment.py)
        holds: ``version`` after the table is written, None for a version committed without
        them; before the buffer is marked READY, under the same locks as ``mark``.

        The word names the version (plus one; zero is "none") rather than a flag so that a
        writer of an older deltarl, which commits without touching it, cannot leave the
        digests of an earlier version standing for the bytes of its own."""
        at = META_WORDS[index] + TENSOR_DIGESTS_OFFSET
        self._words[at] = np.uint64(0 if version is None else version + 1)

    def has_tensor_digests(self, index: int) -> bool:
        """Whether buffer ``index``'s tensor digest table holds its version's digests (never
        in a segment of an older deltarl, whose word was unused)."""
        held = int(self._words[META_WORDS[index] + TENSOR_DIGESTS_OFFSET])
        return held == self.version(index) + 1

    def revocations(self, index: int) -> int:
        """How many times the writer revoked the leases on buffer ``index`` (zero in a segment
        of an older deltarl, whose word was unused)."""
        return int(self._words[META_WORDS[index] + REVOKED_OFFSET])

    def revoke(self, index: int) -> int:
        """Revoke every lease on buffer ``index`` (I4): readers holding one see the count
        change and discard what they read. Caller holds the writer lock; the new count."""
        count = self.revocations(index) + 1
        self._words[META_WORDS[index] + REVOKED_OFFSET] = np.uint64(count)
        return count

    def active_version(self) -> int | None:
        """The active version without any lock: a hint, consistent with one moment in time."""
        while True:
            word = self.load()
            index = self.active_index(word)
            if index is None:
                return None
            version = self.version(index)
            # I3: the word did not change, so no writer touched buffer ``index`` meanwhile (I1).
            if self.load() == word:
                return version
