"""A seeded mutator for the fuzz tests: valid inputs, damaged the ways a network or an attacker
damages them.

Each mutant takes one to three edits: bit flips, random bytes, byte inserts and deletes,
truncation, a splice of two valid inputs, a repeated slice, and length-field inflation (a u32
or u64 at a field offset the caller names, or anywhere, set to a huge or multiplied value).
The same seed gives the same mutants, so a failure names the seed and index that reproduce it.
``bounded_memory`` caps the address space while a fuzz runs and checks the peak RSS after.
"""

from __future__ import annotations

import random
import resource
import struct
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import orjson

FUZZ_HEADROOM = 512 << 20  # bytes of address space and of peak RSS growth a fuzz run may use

# Values that lengths and counts are inflated to: limits, their neighbours, the top of each width.
HUGE_VALUES = (
    1 << 16,
    (1 << 31) - 1,
    1 << 31,
    (1 << 31) + 1,
    (1 << 32) - 1,
    1 << 32,
    1 << 40,
    (1 << 63) - 1,
    1 << 63,
    (1 << 64) - 1,
)


class Mutator:
    def __init__(self, seed: int, seeds: Sequence[bytes], fields: Sequence[int] = ()) -> None:
        """``seeds``: valid inputs; ``fields``: offsets of length and count fields in them."""
        self.rng = random.Random(seed)
        self.seeds = list(seeds)
        self.fields = list(fields)
        self._edits: list[Callable[[bytearray], bytearray]] = [
            self._flip,
            self._flip,
            self._set_byte,
            self._insert,
            self._delete,
            self._truncate,
            self._splice,
            self._repeat,
            self._inflate,
            self._inflate,
        ]

    def __call__(self) -> bytes:
        data = bytearray(self.rng.choice(self.seeds))
        for _ in range(self.rng.choice((1, 1, 1, 2, 3))):
            data = self.rng.choice(self._edits)(data)
        return bytes(data)

    def _at(self, data: bytearray) -> int:
        return self.rng.randrange(len(data)) if data else 0

    def _flip(self, data: bytearray) -> bytearray:
        for _ in range(self.rng.choice((1, 1, 2, 4))):
            if data:
                i = self._at(data)
                data[i] ^= 1 << self.rng.randrange(8)
        return data

    def _set_byte(self, data: bytearray) -> bytearray:
        if data:
            data[self._at(data)] = self.rng.choice((0, 0xFF, 0x7F, 0x80, self.rng.randrange(256)))
        return data

    def _insert(self, data: bytearray) -> bytearray:
        i = self._at(data)
        return (
            data[:i] + bytearray(self.rng.randbytes(self.rng.choice((1, 1, 2, 8, 64)))) + data[i:]
        )

    def _delete(self, data: bytearray) -> bytearray:
        i = self._at(data)
        return data[:i] + data[i + self.rng.choice((1, 1, 2, 8, 64)) :]

    def _truncate(self, data: bytearray) -> bytearray:
        return data[: self._at(data)]

    def _splice(self, data: bytearray) -> bytearray:
        other = self.rng.choice(self.seeds)
        return data[: self._at(data)] + bytearray(other[self.rng.randrange(len(other) + 1) :])

    def _repeat(self, data: bytearray) -> bytearray:
        i = self._at(data)
        n = self.rng.choice((1, 4, 8, 52))
        return data[: i + n] + data[i : i + n] * self.rng.choice((1, 2, 16)) + data[i + n :]

    def _inflate(self, data: bytearray) -> bytearray:
        width = self.rng.choice((4, 8))
        fields = [f for f in self.fields if f + width <= len(data)]
        if fields and self.rng.random() < 0.8:
            at = self.rng.choice(fields)
        elif len(data) >= width:
            at = self.rng.randrange(len(data) - width + 1)
        else:
            return data
        fmt = "<I" if width == 4 else "<Q"
        top = (1 << (8 * width)) - 1
        if self.rng.random() < 0.5:
            value = self.rng.choice(HUGE_VALUES)
        else:
            (old,) = struct.unpack_from(fmt, data, at)
            value = old * self.rng.choice((2, 3, 8, 1 << 20)) + self.rng.choice((0, 1, -1))
        struct.pack_into(fmt, data, at, max(0, min(top, value)))
        return data


# JSON-level mutations: replace one value of a document with something of another shape.
_ODD_VALUES: tuple[object, ...] = (
    None,
    True,
    -1,
    0,
    1 << 63,
    (1 << 64) - 1,
    -(1 << 63),
    1e308,
    -1e308,
    0.5,
    "",
    "x" * 5000,
    [],
    {},
    [[[[]]]],
    {"a": {"b": {}}},
)


def mutate_json(rng: random.Random, doc: bytes) -> bytes:
    """``doc`` with one value, anywhere in its tree, replaced, removed or duplicated."""
    tree = orjson.loads(doc)
    nodes: list[dict[str, object] | list[object]] = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            nodes.append(node)
            for child in node.values():
                walk(child)
        elif isinstance(node, list):
            nodes.append(node)
            for child in node:
                walk(child)

    walk(tree)
    parent = rng.choice(nodes)
    action = rng.random()
    if isinstance(parent, dict):
        if not parent:
            return orjson.dumps(rng.choice(_ODD_VALUES))
        key = rng.choice(list(parent))
        if action < 0.15:
            del parent[key]
        elif action < 0.25:
            parent[f"extra{rng.randrange(9)}"] = parent[key]
        else:
            parent[key] = rng.choice(_ODD_VALUES)
    else:
        if not parent:
            return orjson.dumps(rng.choice(_ODD_VALUES))
        i = rng.randrange(len(parent))
        if action < 0.15:
            del parent[i]
        elif action < 0.3:
            parent.extend([parent[i]] * rng.choice((1, 2, 100)))
        else:
            parent[i] = rng.choice(_ODD_VALUES)
    return orjson.dumps(tree)


# -- memory -------------------------------------------------------------------------------------


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        (line,) = [x for x in f if x.startswith("VmSize:")]
    return int(line.split()[1]) * 1024


def _maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


@contextmanager
def bounded_memory(headroom: int = FUZZ_HEADROOM) -> Iterator[None]:
    """Cap the address space at its present size plus ``headroom``; check the peak RSS after."""
    rss = _maxrss()
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = _vm_size() + headroom
    resource.setrlimit(
        resource.RLIMIT_AS, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard)
    )
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    assert _maxrss() - rss < headroom, f"the peak RSS grew by {_maxrss() - rss} bytes"
