"""The placement map: where each trainer tensor's elements live in the inference engine's layout.

The trainer publishes weights under Hugging Face names and shapes, one full tensor per
parameter. vLLM holds them fused (q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``) and
sharded over ``tp`` tensor-parallel ranks. A delta is computed in trainer coordinates (flat
element indices into one trainer tensor); the apply agent writes in inference coordinates
(flat element indices into one tensor of one rank's layout). ``PlacementMap.translate`` turns
the first into the second with index arithmetic only, never materialising a full tensor.

A trainer tensor reaches the inference tensors through a few *blocks*: a rectangle of the
trainer tensor (rows x columns; a 1-D tensor is one column) copied to a rectangle of the same
size in one inference tensor of one rank. Fusing is a row offset, column-parallel sharding a
row range, row-parallel sharding a column range, replication the same rectangle on every rank.

Invariants, checked by ``_check_invariants`` whenever a map is built:
- every element of every inference tensor of every rank is fed by exactly one trainer element
  (the blocks landing in one inference tensor tile it, without overlap);
- every trainer element feeds at least one rank and at most one element per rank (the distinct
  source rectangles of a trainer tensor tile it; replicated norms and kv heads shared by
  several ranks send the same rectangle to each of them);
- a trainer tensor feeds each (rank, inference tensor) through at most one block, and a block
  keeps row-major order, so translated positions come out sorted without sorting.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from deltarl.engine.layout import Layout, dtype_of

# model_type -> whether q/k/v carry a bias. These families share the decoder's weight names;
# others (e.g. qwen3 with q_norm/k_norm, MoE models) need their own rules and are refused.
_FAMILIES: dict[str, bool] = {"llama": False, "mistral": False, "qwen2": True}

# vLLM's DEFAULT_VOCAB_PADDING_SIZE: embed_tokens and lm_head are padded to a multiple of it
# and the *padded* vocabulary is split evenly over the ranks (LoRA may pad further).
VLLM_VOCAB_PADDING = 64


@dataclass(frozen=True)
class ModelShape:
    """The shapes of a Llama/Qwen2-style decoder: everything the placement depends on."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_embeddings: bool
    """``lm_head`` shares ``embed_tokens``: neither side then holds an ``lm_head.weight``."""
    qkv_bias: bool
    """q/k/v projections carry a bias (Qwen2); o_proj never does here."""
    dtype: str = "bfloat16"
    """Element type of the published weights (the trainer publishes bf16)."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name in ("tie_embeddings", "qkv_bias"):
                if not isinstance(value, bool):
                    raise ValueError(f"model shape: {field.name} must be a bool, got {value!r}")
            elif field.name != "dtype" and (
                not isinstance(value, int) or isinstance(value, bool) or value <= 0
            ):
                raise ValueError(f"model shape: {field.name} must be a positive int, got {value!r}")
        dtype_of(self.dtype)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model shape: num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], dtype: str = "bfloat16") -> ModelShape:
        """Read a Hugging Face ``config.json`` (as a dict) of a Llama, Mistral or Qwen2 model.

        ``dtype`` is what the trainer publishes, not the checkpoint's ``torch_dtype``.
        """
        model_type = config.get("model_type", "llama")
        if model_type not in _FAMILIES:
            known = ", ".join(sorted(_FAMILIES))
            raise ValueError(f"unsupported model_type {model_type!r}; supported: {known}")
        if config.get("attention_bias"):
            # In Llama, attention_bias also gives o_proj a bias, which this map does not place.
            raise ValueError("attention_bias=true (biases on q/k/v and o_proj) is not supported")
        if config.get("mlp_bias"):
            raise ValueError("mlp_bias=true is not supported")
        missing = [
            key
            for key in (
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "vocab_size",
            )
            if key not in config
        ]
        if missing:
            raise ValueError(f"config is missing {', '.join(missing)}")
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        head_dim = config.get("head_dim")
        if head_dim is None:  # absent or null: transformers derives it the same way
            if hidden % heads:
                raise ValueError(f"hidden_size={hidden} is not a multiple of {heads} heads")
            head_dim = hidden // heads
        kv_heads = config.get("num_key_value_heads")
        return cls(
            hidden_size=hidden,
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=heads if kv_heads is None else kv_heads,
            head_dim=head_dim,
            vocab_size=config["vocab_size"],
            # LlamaConfig, MistralConfig and Qwen2Config all default to untied.
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=_FAMILIES[model_type],
            dtype=dtype,
        )


@dataclass(frozen=True, eq=False)
class Placed:
    """Part of a delta in inference coordinates: flat, strictly ascending element indices into
    tensor ``name`` of rank ``rank``'s layout, and their values.

    The arrays may be views of the arrays given to ``translate``; treat them as read-only.
    """

    rank: int
    name: str
    positions: np.ndarray
    values: np.ndarray


@dataclass(frozen=True, slots=True)
class _Block:
    """Rows [row0, row1) x columns [col0, col1) of a trainer tensor, copied to the same-sized
    rectangle at (dst_row0, dst_col0) of inference tensor ``dst`` (``dst_cols`` wide)."""

    rank: int
    dst: str
    row0: int
    row1: int
    col0: int
    col1: int
    dst_row0: int
    dst_col0: int
    dst_cols: int

    def src_rect(self) -> tuple[int, int, int, int]:
        return self.row0, self.row1, self.col0, self.col1

    def dst_rect(self) -> tuple[int, int, int, int]:
        rows, cols = self.row1 - self.row0, self.col1 - self.col0
        return self.dst_row0, self.dst_row0 + rows, self.dst_col0, self.dst_col0 + cols


class PlacementMap:
    """Trainer tensors (Hugging Face layout) to vLLM's fused, tensor-parallel layout."""

    def __init__(self, shape: ModelShape, tp: int) -> None:
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tensor-parallel degree must be a positive int, got {tp!r}")
        _check_divisible(shape, tp)
        self.shape = shape
        self.tp = tp
        self._trainer = Layout.pack(self._trainer_entries())
        # Shards are equal-sized (divisibility is required), so every rank has the same layout.
        self._inference = Layout.pack(self._inference_entries())
        blocks: dict[str, list[_Block]] = defaultdict(list)
        for name, block in self._build_blocks():
            blocks[name].append(block)
        # per trainer tensor, ordered by rank: translate's output order
        self._blocks = {
            name: tuple(sorted(bs, key=lambda b: b.rank)) for name, bs in blocks.items()
        }
        self._check_invariants()

    # -- public API -------------------------------------------------------------------------

    def trainer_layout(self) -> Layout:
        return self._trainer

    def inference_layout(self, rank: int) -> Layout:
        self._check_rank(rank)
        return self._inference

    def sources(self, rank: int, infer_name: str) -> tuple[str, ...]:
        """The trainer tensors that feed ``infer_name`` on ``rank``, in the order they appear."""
        self._check_rank(rank)
        self._inference.index(infer_name)  # a clear KeyError for an unknown name
        found = [
            (block.dst_row0, block.dst_col0, name)
            for name, blocks in self._blocks.items()
            for block in blocks
            if block.rank == rank and block.dst == infer_name
        ]
        return tuple(name for _, _, name in sorted(found))

    def translate(
        self, trainer_name: str, positions: np.ndarray, values: np.ndarray
    ) -> list[Placed]:
        """Map a sparse delta of one trainer tensor to inference coordinates, rank by rank.

        ``positions`` are strictly ascending flat element indices into the trainer tensor and
        ``values`` their new values (any dtype, same length). Returns one ``Placed`` per
        (rank, inference tensor) that receives at least one element, ordered by rank.
        """
        blocks = self._blocks_of(trainer_name)
        spec = self._trainer.spec(trainer_name)
        pos, vals = _check_delta(trainer_name, positions, values, spec.numel)
        cols = _matrix(spec.shape)[1]
        placed: list[Placed] = []
        for b in blocks:
            # positions are sorted, so the block's rows are one contiguous slice of them
            lo, hi = np.searchsorted(pos, (b.row0 * cols, b.row1 * cols))
            p, v = pos[lo:hi], vals[lo:hi]
            if b.col0 == 0 and b.col1 == cols and b.dst_cols == cols and b.dst_col0 == 0:
                # Whole rows into a tensor of the same width (fusing, sharding along dim 0,
                # replication): the flat index just shifts by whole rows.
                shift = (b.dst_row0 - b.row0) * cols
                dst = p + shift if shift else p
            else:  # a band of columns (row-parallel sharding)
                dst, v = _band(b, cols, p, v)
            if dst.size:
                placed.append(Placed(b.rank, b.dst, dst, v))
        return placed

    def translate_range(
        self, trainer_name: str, start: int, stop: int, values: np.ndarray
    ) -> list[Placed]:
        """``translate`` for the dense element range [start, stop) (the full-resync path)."""
        numel = self._trainer.spec(trainer_name).numel
        if not 0 <= start <= stop <= numel:
            raise ValueError(
                f"{trainer_name}: range [{start}, {stop}) is outside its {numel} elements"
            )
        return self.translate(trainer_name, np.arange(start, stop, dtype=np.int64), values)

    def assemble(
        self, rank: int, infer_name: str, trainer_tensor: Callable[[str], np.ndarray]
    ) -> np.ndarray:
        """Inference tensor ``infer_name`` of ``rank``, built from the trainer tensors.

        ``trainer_tensor(name)`` gives one trainer tensor (any shape of its elements: it is
        read as rows x columns); only the rectangles that feed this rank are read and copied,
        so no other rank's part is materialised. The result has the inference tensor's shape
        and the trainer tensors' dtype: what a rank holding it must hold, bit for bit.
        """
        self._check_rank(rank)
        spec = self._inference.spec(infer_name)
        out: np.ndarray | None = None
        for name in self.sources(rank, infer_name):
            src = trainer_tensor(name)
            rows, cols = _matrix(self._trainer.spec(name).shape)
            src2d = src.reshape(rows, cols)
            if out is None:
                out = np.empty(_matrix(spec.shape), dtype=src.dtype)
            for b in self._blocks[name]:
                if b.rank == rank and b.dst == infer_name:
                    r0, r1, c0, c1 = b.dst_rect()
                    out[r0:r1, c0:c1] = src2d[b.row0 : b.row1, b.col0 : b.col1]
        assert out is not None  # the invariants: every inference tensor is fed
        return out.reshape(spec.shape)

    def to_json(self) -> bytes:
        return orjson.dumps({"shape": dataclasses.asdict(self.shape), "tp": self.tp})

    @classmethod
    def from_json(cls, data: bytes | str) -> PlacementMap:
        try:
            obj = orjson.loads(data)
            shape, tp = ModelShape(**obj["shape"]), obj["tp"]
        except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"malformed placement map description: {exc}") from exc
        return cls(shape, tp)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PlacementMap):
            return NotImplemented
        return (self.shape, self.tp) == (other.shape, other.tp)

    def __hash__(self) -> int:
        return hash((self.shape, self.tp))

    def __repr__(self) -> str:
        return f"PlacementMap({self.shape!r}, tp={self.tp})"

    # -- construction ----------------------------------------------------------------------

    def _trainer_entries(self) -> Iterator[tuple[str, str, tuple[int, ...]]]:
        s, dt = self.shape, self.shape.dtype
        q_out, kv_out = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        yield "model.embed_tokens.weight", dt, (s.vocab_size, s.hidden_size)
        for i in range(s.num_layers):
            attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
            for proj, out in (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)):
                yield f"{attn}.{proj}.weight", dt, (out, s.hidden_size)
                if s.qkv_bias:
                    yield f"{attn}.{proj}.bias", dt, (out,)
            yield f"{attn}.o_proj.weight", dt, (s.hidden_size, q_out)
            yield f"{mlp}.gate_proj.weight", dt, (s.intermediate_size, s.hidden_size)
            yield f"{mlp}.up_proj.weight", dt, (s.intermediate_size, s.hidden_size)
            yield f"{mlp}.down_proj.weight", dt, (s.hidden_size, s.intermediate_size)
            yield f"model.layers.{i}.input_layernorm.weight", dt, (s.hidden_size,)
            yield f"model.layers.{i}.post_attention_layernorm.weight", dt, (s.hidden_size,)
        yield "model.norm.weight", dt, (s.hidden_size,)
        if not s.tie_embeddings:
            yield "lm_head.weight", dt, (s.vocab_size, s.hidden_size)

    def _inference_entries(self) -> Iterator[tuple[str, str, tuple[int, ...]]]:
        s, dt, tp = self.shape, self.shape.dtype, self.tp
        q_rank = s.num_heads // tp * s.head_dim
        qkv_rank = q_rank + 2 * self._kv_heads_per_rank() * s.head_dim
        yield "model.embed_tokens.weight", dt, (s.vocab_size // tp, s.hidden_size)
        for i in range(s.num_layers):
            attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
            yield f"{attn}.qkv_proj.weight", dt, (qkv_rank, s.hidden_size)
            if s.qkv_bias:
                yield f"{attn}.qkv_proj.bias", dt, (qkv_rank,)
            yield f"{attn}.o_proj.weight", dt, (s.hidden_size, q_rank)
            yield f"{mlp}.gate_up_proj.weight", dt, (2 * s.intermediate_size // tp, s.hidden_size)
            yield f"{mlp}.down_proj.weight", dt, (s.hidden_size, s.intermediate_size // tp)
            yield f"model.layers.{i}.input_layernorm.weight", dt, (s.hidden_size,)
            yield f"model.layers.{i}.post_attention_layernorm.weight", dt, (s.hidden_size,)
        yield "model.norm.weight", dt, (s.hidden_size,)
        if not s.tie_embeddings:
            yield "lm_head.weight", dt, (s.vocab_size // tp, s.hidden_size)

    def _kv_heads_per_rank(self) -> int:
        # With fewer kv heads than ranks, vLLM gives each rank one kv head, replicated.
        return max(1, self.shape.num_kv_heads // self.tp)

    def _build_blocks(self) -> Iterator[tuple[str, _Block]]:
        s, tp, hidden = self.shape, self.tp, self.shape.hidden_size
        q_n, kv_n = s.num_heads // tp * s.head_dim, self._kv_heads_per_rank() * s.head_dim
        inter_n, vocab_n = s.intermediate_size // tp, s.vocab_size // tp
        params = ("weight", "bias") if s.qkv_bias else ("weight",)
        vocab = ["model.embed_tokens.weight"] + ([] if s.tie_embeddings else ["lm_head.weight"])
        for r in range(tp):
            # Column-parallel (split along dim 0, whole rows); fused parts stack along dim 0:
            # rank r of qkv is cat(q_r, k_r, v_r), rank r of gate_up is cat(gate_r, up_r).
            # kv: rank r holds kv heads from r * num_kv_heads // tp on, as vLLM's
            # QKVParallelLinear; with fewer kv heads than ranks, consecutive ranks share one.
            kv0 = r * s.num_kv_heads // tp * s.head_dim
            for name in vocab:
                yield name, _rows(r, name, range(r * vocab_n, (r + 1) * vocab_n), 0, hidden)
            for i in range(s.num_layers):
                attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
                for param in params:
                    cols, qkv = (hidden if param == "weight" else 1), f"{attn}.qkv_proj.{param}"
                    for proj, rows, at in (
                        ("q_proj", range(r * q_n, (r + 1) * q_n), 0),
                        ("k_proj", range(kv0, kv0 + kv_n), q_n),
                        ("v_proj", range(kv0, kv0 + kv_n), q_n + kv_n),
                    ):
                        yield f"{attn}.{proj}.{param}", _rows(r, qkv, rows, at, cols)
                inter = range(r * inter_n, (r + 1) * inter_n)
                gate_up = f"{mlp}.gate_up_proj.weight"
                yield f"{mlp}.gate_proj.weight", _rows(r, gate_up, inter, 0, hidden)
                yield f"{mlp}.up_proj.weight", _rows(r, gate_up, inter, inter_n, hidden)
                # Row-parallel (split along dim 1): rank r holds a band of columns, all rows.
                for name, n in (
                    (f"{attn}.o_proj.weight", q_n),
                    (f"{mlp}.down_proj.weight", inter_n),
                ):
                    yield name, _Block(r, name, 0, hidden, r * n, (r + 1) * n, 0, 0, n)
                # Replicated: every rank holds the whole norm.
                for norm in ("input_layernorm", "post_attention_layernorm"):
                    name = f"model.layers.{i}.{norm}.weight"
                    yield name, _rows(r, name, range(hidden), 0, 1)
            yield "model.norm.weight", _rows(r, "model.norm.weight", range(hidden), 0, 1)

    def _check_invariants(self) -> None:
        landing: dict[tuple[int, str], list[_Block]] = defaultdict(list)
        for name, blocks in self._blocks.items():
            src_rows, src_cols = _matrix(self._trainer.spec(name).shape)
            keys = [(b.rank, b.dst) for b in blocks]
            if len(set(keys)) != len(keys):
                raise RuntimeError(f"placement bug: {name} feeds one tensor through two blocks")
            for b in blocks:
                dst_rows, dst_cols = _matrix(self._inference.spec(b.dst).shape)
                if dst_cols != b.dst_cols or not (
                    _inside(b.src_rect(), src_rows, src_cols)
                    and _inside(b.dst_rect(), dst_rows, dst_cols)
                ):
                    raise RuntimeError(f"placement bug: a block of {name} is out of bounds")
                landing[b.rank, b.dst].append(b)
            # distinct source rectangles tile the tensor (each element reaches some rank) and
            # within a rank they are disjoint (no element reaches a rank twice)
            per_rank = [[b.src_rect() for b in blocks if b.rank == r] for r in range(self.tp)]
            if not _tiles({b.src_rect() for b in blocks}, src_rows * src_cols) or any(
                not _tiles(set(rects), sum(_area(x) for x in rects)) for rects in per_rank
            ):
                raise RuntimeError(f"placement bug: {name} is not placed exactly once per rank")
        for spec in self._inference.tensors:
            for rank in range(self.tp):
                rects = [b.dst_rect() for b in landing.pop((rank, spec.name), [])]
                if len(set(rects)) != len(rects) or not _tiles(set(rects), spec.numel):
                    raise RuntimeError(
                        f"placement bug: {spec.name} on rank {rank} is not fed exactly once"
                    )
        if landing:
            raise RuntimeError(f"placement bug: blocks land outside the layout: {list(landing)}")
        if set(self._blocks) != {s.name for s in self._trainer.tensors}:
            raise RuntimeError("placement bug: some trainer tensors have no placement")

    def _blocks_of(self, trainer_name: str) -> tuple[_Block, ...]:
        try:
            return self._blocks[trainer_name]
        except KeyError:
            raise KeyError(f"no trainer tensor named {trainer_name!r} in this model") from None

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.tp:
            raise ValueError(f"rank {rank} is outside tensor-parallel degree {self.tp}")


def _check_divisible(s: ModelShape, tp: int) -> None:
    """Refuse shapes that do not shard evenly, naming every dimension that does not.

    Vocabulary padding is vLLM's job, not part of the weights the trainer publishes: our
    inference layout holds the unpadded rows, which are the first rows of vLLM's (padded)
    parameter. With tp > 1 that holds only when padding adds nothing: vLLM splits the padded
    vocabulary, so a vocabulary that is not a multiple of the padding would be split unevenly.
    """
    problems = [
        f"{what}={n} is not divisible by tp={tp}"
        for what, n in (
            ("num_heads", s.num_heads),
            ("intermediate_size", s.intermediate_size),
            ("vocab_size", s.vocab_size),
        )
        if n % tp
    ]
    if tp > 1 and s.vocab_size % VLLM_VOCAB_PADDING:
        problems.append(
            f"vocab_size={s.vocab_size} is not a multiple of vLLM's vocabulary padding "
            f"({VLLM_VOCAB_PADDING}), so vLLM would not split it evenly over {tp} ranks"
        )
    if s.num_kv_heads >= tp and s.num_kv_heads % tp:
        problems.append(f"num_kv_heads={s.num_kv_heads} is not divisible by tp={tp}")
    if s.num_kv_heads < tp and tp % s.num_kv_heads:
        problems.append(
            f"tp={tp} is not a multiple of num_kv_heads={s.num_kv_heads} (kv heads are "
            "replicated across ranks only in whole groups)"
        )
    if problems:
        raise ValueError("cannot shard this model: " + "; ".join(problems))


def _check_delta(
    name: str, positions: np.ndarray, values: np.ndarray, numel: int
) -> tuple[np.ndarray, np.ndarray]:
    pos, vals = np.asarray(positions), np.asarray(values)
    if pos.ndim != 1 or pos.dtype.kind not in "iu":
        raise ValueError(
            f"{name}: positions must be a 1-D integer array, got {pos.dtype}{pos.shape}"
        )
    if vals.shape != pos.shape:
        raise ValueError(f"{name}: {vals.shape} values for {pos.shape} positions")
    pos = pos.astype(np.int64, copy=False)
    if pos.size > 1 and not np.all(pos[1:] > pos[:-1]):
        raise ValueError(f"{name}: positions are not strictly ascending")
    if pos.size and (pos[0] < 0 or pos[-1] >= numel):
        raise ValueError(
            f"{name}: positions [{pos[0]}, {pos[-1]}] are outside its {numel} elements"
        )
    return pos, vals


def _band(b: _Block, cols: int, p: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The part of ``p`` (sorted positions within the block's rows) inside the block's column
    band, in ``b.dst`` coordinates, with the matching values."""
    rows = np.arange(b.row0, b.row1, dtype=np.int64)
    # per row, how much a position moves: (row - row0 + dst_row0) * dst_cols + dst_col0 - ...
    shift = (rows - b.row0 + b.dst_row0) * b.dst_cols + (b.dst_col0 - b.col0) - rows * cols
    if p.size < rows.size:  # few positions: test each one (divides only what it keeps)
        col = p % cols
        keep = (col >= b.col0) & (col < b.col1)
        p, v = p[keep], v[keep]
        return p + shift[p // cols - b.row0], v
    # Many positions: in each row the band's positions are one contiguous run of ``p``, so
    # gather the runs (work in the band's positions, not all of them, and no division).
    starts = np.searchsorted(p, rows * cols + b.col0)
    lengths = np.searchsorted(p, rows * cols + b.col1) - starts
    idx = np.arange(int(lengths.sum()), dtype=np.int64)
    idx += np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)
    return p[idx] + np.repeat(shift, lengths), v[idx]


def _rows(rank: int, dst: str, rows: range, at: int, cols: int) -> _Block:
    """Whole ``rows`` of a ``cols``-wide tensor, to row ``at`` of the same-width ``dst``."""
    return _Block(rank, dst, rows.start, rows.stop, 0, cols, at, 0, cols)


def _matrix(shape: tuple[int, ...]) -> tuple[int, int]:
    """A tensor as rows x columns; a 1-D tensor is one column."""
    return (shape[0], 1) if len(shape) == 1 else (shape[0], math.prod(shape[1:]))


def _inside(rect: tuple[int, int, int, int], rows: int, cols: int) -> bool:
    r0, r1, c0, c1 = rect
    return 0 <= r0 < r1 <= rows and 0 <= c0 < c1 <= cols


def _tiles(rects: set[tuple[int, int, int, int]], numel: int) -> bool:
    """Whether ``rects`` are pairwise disjoint and cover ``numel`` elements (so, when they all
    lie inside a tensor of ``numel`` elements, they tile it)."""
    for (a0, a1, b0, b1), (c0, c1, d0, d1) in itertools.combinations(rects, 2):
        if a0 < c1 and c0 < a1 and b0 < d1 and d0 < b1:
            return False
    return sum(_area(rect) for rect in rects) == numel


def _area(rect: tuple[int, int, int, int]) -> int:
    r0, r1, c0, c1 = rect
    return (r1 - r0) * (c1 - c0)
