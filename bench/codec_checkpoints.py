"""``deltarl bench codec --checkpoints A B ...``: the codec on a user's own checkpoints.

Each argument is a Hugging Face checkpoint: a directory of ``*.safetensors`` files (sharded or
not) or one such file. Their tensors must agree (names, dtypes, shapes); they are packed in
name order into one layout, as the weight store packs a model, and step i encodes checkpoint
i against checkpoint i - 1. Besides the codec's figures, each step reports ``layers``: the
changed ratio per tensor group (the tensor name with its layer index as ``*``), what an
operator looks at before choosing deltas for a model: which parts move, and how much.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from deltarl.engine.layout import Layout
from deltarl.ops.metrics import tensor_group

_TORCH = {
    torch.bfloat16: ("bfloat16", torch.int16),
    torch.float16: ("float16", torch.int16),
    torch.float32: ("float32", torch.int32),
    torch.float64: ("float64", torch.int64),
    torch.int8: ("int8", torch.int8),
    torch.uint8: ("uint8", torch.uint8),
    torch.int16: ("int16", torch.int16),
    torch.int32: ("int32", torch.int32),
    torch.int64: ("int64", torch.int64),
    torch.bool: ("bool", torch.uint8),
}


def _files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    found = sorted(path.glob("*.safetensors"))
    if not found:
        raise ValueError(f"{path}: no *.safetensors file (a Hugging Face checkpoint directory)")
    return found


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in _files(path):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open is not a mapping
                if name in out:
                    raise ValueError(f"{path}: tensor {name!r} is in two files")
                out[name] = st.get_tensor(name)
    return out


def _spec(path: Path, name: str, t: torch.Tensor) -> tuple[str, str, tuple[int, ...]]:
    if t.dtype not in _TORCH:
        raise ValueError(
            f"{path}: tensor {name!r} has dtype {t.dtype}, which the codec does not carry"
        )
    return name, _TORCH[t.dtype][0], tuple(t.shape)


def read_checkpoints(paths: list[Path]) -> tuple[Layout, list[np.ndarray]]:
    """The layout the checkpoints share and each one packed into it (uint8 buffers)."""
    if len(paths) < 2:
        raise ValueError("--checkpoints needs at least two checkpoints")
    first = _tensors(paths[0])
    specs = [_spec(paths[0], n, first[n]) for n in sorted(first)]
    layout = Layout.pack(specs)
    buffers = []
    for path in paths:
        tensors = first if path == paths[0] else _tensors(path)
        mine = [_spec(path, n, tensors[n]) for n in sorted(tensors)]
        if mine != specs:
            theirs = {s[0]: s for s in mine}
            diff = next(
                (s for s in specs if theirs.get(s[0]) != s),
                next((s for s in mine if s not in specs), None),
            )
            raise ValueError(
                f"{path} does not match {paths[0]}: tensor {diff[0] if diff else '?'!r} differs "
                f"(here {theirs.get(diff[0]) if diff else None}, there {diff})"
            )
        buf = np.zeros(layout.nbytes, np.uint8)
        for i, spec in enumerate(layout.tensors):
            t = tensors[spec.name].contiguous().view(_TORCH[tensors[spec.name].dtype][1])
            layout.view(buf, i)[:] = t.reshape(-1).numpy().view(layout.view(buf, i).dtype)
        buffers.append(buf)
        del tensors
    return layout, buffers


def layer_changes(layout: Layout, ref: np.ndarray, cur: np.ndarray) -> dict[str, float]:
    """Changed ratio per tensor group (``tensor_group``: layer indices as ``*``)."""
    changed: dict[str, int] = {}
    total: dict[str, int] = {}
    for i, spec in enumerate(layout.tensors):
        group = tensor_group(spec.name)
        changed[group] = changed.get(group, 0) + int(
            np.count_nonzero(layout.view(ref, i) != layout.view(cur, i))
        )
        total[group] = total.get(group, 0) + spec.numel
    return {g: changed[g] / total[g] if total[g] else 0.0 for g in sorted(changed)}
