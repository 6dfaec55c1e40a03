"""Weight layouts: which tensors a weight set holds, and where each one lives in a flat buffer.

A layout is the contract shared by every party that touches a weight set: the trainer that
publishes it, the export agent that diffs it, the frames that name tensors by id (the index
in ``Layout.tensors``), the shared-memory store that holds two copies of it, and the apply
agent that writes into it. It is serialised with orjson so two processes agree on it by value.

Invariants kept here:
- every tensor's offset is a multiple of ``ALIGN`` (64 bytes), so word-wise (uint64) views of
  a tensor's bytes are aligned and cache lines are never shared between tensors;
- tensors never overlap and appear in offset order; ``nbytes`` is the padded total.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

ALIGN = 64


@dataclass(frozen=True)
class DType:
    """An element type by name, with the unsigned integer type that carries its bits.

    numpy has no bfloat16, so every codec works on the bit pattern (``bits``); ``kind`` says
    how the bits are ordered: ``float`` (sign-magnitude IEEE) or ``int`` (two's complement
    or unsigned, ordered by wrapping arithmetic).
    """

    name: str
    itemsize: int
    kind: str  # "float" | "int"

    @property
    def bits(self) -> np.dtype[Any]:
        return np.dtype(f"<u{self.itemsize}")


DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        DType("bfloat16", 2, "float"),
        DType("float16", 2, "float"),
        DType("float32", 4, "float"),
        DType("float64", 8, "float"),
        DType("int8", 1, "int"),
        DType("uint8", 1, "int"),
        DType("int16", 2, "int"),
        DType("int32", 4, "int"),
        DType("int64", 8, "int"),
        DType("bool", 1, "int"),
    )
}


def dtype_of(name: str) -> DType:
    """The DType called ``name`` (torch spelling, e.g. ``bfloat16``); a clear error otherwise."""
    try:
        return DTYPES[name]
    except KeyError:
        known = ", ".join(sorted(DTYPES))
        raise ValueError(f"unsupported dtype {name!r}; supported: {known}") from None


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a layout: its name, element type, shape and byte offset in the buffer."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return dtype_of(self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(frozen=True)
class Layout:
    """An ordered, aligned set of tensors packed into one flat buffer of ``nbytes`` bytes."""

    tensors: tuple[TensorSpec, ...]
    nbytes: int

    @classmethod
    def pack(cls, entries: Iterable[tuple[str, str, Sequence[int]]]) -> Layout:
        """Lay out ``(name, dtype, shape)`` entries in order, each at an ALIGN-byte boundary."""
        specs: list[TensorSpec] = []
        seen: set[str] = set()
        offset = 0
        for name, dtype, shape in entries:
            if name in seen:
                raise ValueError(f"tensor {name!r} appears twice in the layout")
            seen.add(name)
            dims = tuple(int(d) for d in shape)
            if any(d < 0 for d in dims):
                raise ValueError(f"tensor {name!r} has a negative dimension: {dims}")
            spec = TensorSpec(name, dtype_of(dtype).name, dims, offset)
            specs.append(spec)
            offset = _align(offset + spec.nbytes)
        return cls(tuple(specs), offset)

    def __post_init__(self) -> None:
        end = 0
        for spec in self.tensors:
            dtype_of(spec.dtype)
            if spec.offset % ALIGN or spec.offset < end:
                raise ValueError(f"tensor {spec.name!r} is misaligned or overlaps its predecessor")
            end = spec.offset + spec.nbytes
        if end > self.nbytes:
            raise ValueError(f"layout of {self.nbytes} bytes is too small for its tensors ({end})")
        object.__setattr__(self, "_index", {s.name: i for i, s in enumerate(self.tensors)})

    def __len__(self) -> int:
        return len(self.tensors)

    def __contains__(self, name: object) -> bool:
        return name in self._index  # type: ignore[attr-defined]

    def index(self, name: str) -> int:
        """The tensor id of ``name``: its position in the layout, as frames carry it."""
        try:
            return self._index[name]  # type: ignore[attr-defined,no-any-return]
        except KeyError:
            raise KeyError(f"no tensor named {name!r} in this layout") from None

    def spec(self, name: str) -> TensorSpec:
        return self.tensors[self.index(name)]

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.tensors)

    @property
    def payload_nbytes(self) -> int:
        """Bytes of tensor data, without alignment padding."""
        return sum(s.nbytes for s in self.tensors)

    def view(self, buf: np.ndarray, name_or_id: str | int) -> np.ndarray:
        """The flat bit-pattern view (unsigned ints) of one tensor inside ``buf`` (uint8)."""
        spec = self.tensors[name_or_id] if isinstance(name_or_id, int) else self.spec(name_or_id)
        raw = buf[spec.offset : spec.offset + spec.nbytes]
        return raw.view(dtype_of(spec.dtype).bits)

    def to_json(self) -> bytes:
        return orjson.dumps(
            {
                "nbytes": self.nbytes,
                "tensors": [[s.name, s.dtype, list(s.shape), s.offset] for s in self.tensors],
            }
        )

    @classmethod
    def from_json(cls, data: bytes | str) -> Layout:
        try:
            obj = orjson.loads(data)
            specs = tuple(
                TensorSpec(str(n), str(d), tuple(int(x) for x in shape), int(off))
                for n, d, shape, off in obj["tensors"]
            )
            return cls(specs, int(obj["nbytes"]))
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed layout description: {exc}") from exc


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN
