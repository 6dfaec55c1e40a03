"""PlacementMap against a reference that builds vLLM's fused, sharded tensors in full with torch."""

from __future__ import annotations

import dataclasses
import functools
import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deltarl.engine.placement import ModelShape, PlacementMap

SHAPES = {
    # multi-head attention, untied embeddings
    "llama_mha": ModelShape(16, 24, 2, 4, 4, 4, 64, tie_embeddings=False, qkv_bias=False),
    # GQA (8 heads over 2 kv heads), head_dim * num_heads != hidden_size, tied embeddings
    "llama_gqa_tied": ModelShape(16, 32, 2, 8, 2, 3, 128, tie_embeddings=True, qkv_bias=False),
    # Qwen2-like: q/k/v biases, GQA, tied
    "qwen2_tied": ModelShape(24, 48, 1, 4, 2, 6, 64, tie_embeddings=True, qkv_bias=True),
    # one kv head (MQA): replicated on every rank as soon as tp > 1; biases, untied
    "qwen2_mqa": ModelShape(8, 16, 2, 4, 1, 2, 64, tie_embeddings=False, qkv_bias=True),
}
CASES = [(name, tp) for name in SHAPES for tp in (1, 2, 4)]

LLAMA3_8B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "torch_dtype": "bfloat16",
}
QWEN2_05B = {
    "model_type": "qwen2",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
}


# -- the reference: trainer tensors in, vLLM's per-rank tensors out, built in full -------------


def trainer_names(s: ModelShape) -> list[str]:
    names = ["model.embed_tokens.weight"]
    for i in range(s.num_layers):
        a, m = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        for p in ("q_proj", "k_proj", "v_proj"):
            names += [f"{a}.{p}.weight"] + ([f"{a}.{p}.bias"] if s.qkv_bias else [])
        names += [f"{a}.o_proj.weight"]
        names += [f"{m}.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
        names += [
            f"model.layers.{i}.{n}.weight" for n in ("input_layernorm", "post_attention_layernorm")
        ]
    names += ["model.norm.weight"] + ([] if s.tie_embeddings else ["lm_head.weight"])
    return names


def reference(s: ModelShape, tp: int, t: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """vLLM's weights of every rank, built the way its weight loaders do, in vLLM's order."""

    def kv_shard(x: torch.Tensor, r: int) -> torch.Tensor:
        if s.num_kv_heads >= tp:
            return x.chunk(tp, 0)[r]
        head = r * s.num_kv_heads // tp  # replicated: each rank takes one whole head
        return x.narrow(0, head * s.head_dim, s.head_dim)

    ranks = []
    for r in range(tp):
        out = {"model.embed_tokens.weight": t["model.embed_tokens.weight"].chunk(tp, 0)[r]}
        for i in range(s.num_layers):
            a, m = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
            for p in ("weight", "bias") if s.qkv_bias else ("weight",):
                q = t[f"{a}.q_proj.{p}"].chunk(tp, 0)[r]
                k, v = kv_shard(t[f"{a}.k_proj.{p}"], r), kv_shard(t[f"{a}.v_proj.{p}"], r)
                out[f"{a}.qkv_proj.{p}"] = torch.cat([q, k, v], 0)
            out[f"{a}.o_proj.weight"] = t[f"{a}.o_proj.weight"].chunk(tp, 1)[r]
            gate, up = t[f"{m}.gate_proj.weight"], t[f"{m}.up_proj.weight"]
            out[f"{m}.gate_up_proj.weight"] = torch.cat([gate.chunk(tp, 0)[r], up.chunk(tp, 0)[r]])
            out[f"{m}.down_proj.weight"] = t[f"{m}.down_proj.weight"].chunk(tp, 1)[r]
            for n in ("input_layernorm", "post_attention_layernorm"):
                out[f"model.layers.{i}.{n}.weight"] = t[f"model.layers.{i}.{n}.weight"].clone()
        out["model.norm.weight"] = t["model.norm.weight"].clone()
        if not s.tie_embeddings:
            out["lm_head.weight"] = t["lm_head.weight"].chunk(tp, 0)[r]
        ranks.append(out)
    return ranks


def flat_numpy(ranks: list[dict[str, torch.Tensor]]) -> list[dict[str, np.ndarray]]:
    return [{n: x.contiguous().reshape(-1).numpy().copy() for n, x in r.items()} for r in ranks]


def trainer_tensors(pmap: PlacementMap, fill: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Trainer tensors holding global element ids ("ids") or random bf16 bit patterns."""
    gen = torch.Generator().manual_seed(seed)
    out, offset = {}, 0
    for spec in pmap.trainer_layout().tensors:
        if fill == "ids":
            x = torch.arange(offset, offset + spec.numel, dtype=torch.int64)
        else:
            x = torch.randint(-(2**15), 2**15, (spec.numel,), dtype=torch.int16, generator=gen)
        out[spec.name] = x.reshape(spec.shape)
        offset += spec.numel
    return out


@functools.cache
def case(name: str, tp: int) -> tuple[PlacementMap, list[dict[str, np.ndarray]]]:
    """The map and, per rank, each inference element's source as a global trainer element id."""
    pmap = PlacementMap(SHAPES[name], tp)
    return pmap, flat_numpy(reference(pmap.shape, tp, trainer_tensors(pmap, "ids")))


def apply(pmap: PlacementMap, bufs: list[dict[str, np.ndarray]], name: str, pos, vals) -> None:
    for placed in pmap.translate(name, pos, vals):
        assert placed.values.dtype == np.asarray(vals).dtype
        assert np.all(np.diff(placed.positions) > 0), "positions must come out strictly ascending"
        bufs[placed.rank][placed.name][placed.positions] = placed.values


# -- layouts -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "tp"), CASES)
def test_layouts_match_reference(name, tp):
    pmap = PlacementMap(SHAPES[name], tp)
    trainer = trainer_tensors(pmap, "ids")
    assert list(trainer) == trainer_names(pmap.shape)
    assert all(s.dtype == "bfloat16" for s in pmap.trainer_layout().tensors)
    for r, ref in enumerate(reference(pmap.shape, tp, trainer)):
        layout = pmap.inference_layout(r)
        assert [(s.name, s.shape) for s in layout.tensors] == [
            (n, tuple(x.shape)) for n, x in ref.items()
        ]


@pytest.mark.parametrize(("name", "tp"), CASES)
def test_assemble_builds_each_ranks_tensor_as_vllms_loaders_do(name, tp):
    """What a rank's read-back compares its engine against: every inference tensor of every
    rank, from random bf16 bit patterns, equal to the reference built the loaders' way; and
    only the trainer tensors that feed it are read."""
    pmap = PlacementMap(SHAPES[name], tp)
    trainer = {n: x.numpy() for n, x in trainer_tensors(pmap, "bits", seed=3).items()}
    ref = reference(pmap.shape, tp, {n: torch.from_numpy(x) for n, x in trainer.items()})
    for r in range(tp):
        for spec in pmap.inference_layout(r).tensors:
            read: list[str] = []

            def source(n: str, read: list[str] = read) -> np.ndarray:
                read.append(n)
                return trainer[n]

            got = pmap.assemble(r, spec.name, source)
            assert got.shape == spec.shape
            assert np.array_equal(got, ref[r][spec.name].numpy()), (r, spec.name)
            assert read == list(pmap.sources(r, spec.name))


# -- translate ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "tp"), CASES)
def test_all_positions_feed_every_inference_element_exactly_once(name, tp):
    pmap, ids = case(name, tp)
    got = [{n: np.full_like(x, -1) for n, x in rank.items()} for rank in ids]
    count = [{n: np.zeros(x.size, np.int64) for n, x in rank.items()} for rank in ids]
    offset = 0
    for spec in pmap.trainer_layout().tensors:
        gid = np.arange(offset, offset + spec.numel, dtype=np.int64)
        for placed in pmap.translate(spec.name, np.arange(spec.numel), gid):
            np.add.at(count[placed.rank][placed.name], placed.positions, 1)
            got[placed.rank][placed.name][placed.positions] = placed.values
        offset += spec.numel
    for r in range(tp):
        for n in ids[r]:
            assert np.all(count[r][n] == 1), f"rank {r} {n}: not fed exactly once"
            np.testing.assert_array_equal(got[r][n], ids[r][n], err_msg=f"rank {r} {n}")


@settings(max_examples=40, deadline=None)
@given(
    which=st.sampled_from(CASES),
    seed=st.integers(0, 2**31 - 1),
    density=st.sampled_from([0.0, 0.005, 0.1, 0.5, 1.0]),
)
def test_sparse_delta_applies_bit_exactly(which, seed, density):
    """Old inference weights + the translated delta == the reference built from new weights."""
    pmap, ids = case(*which)
    rng = np.random.default_rng(seed)
    old = trainer_tensors(pmap, "bits", seed)
    new = {n: x.clone() for n, x in old.items()}
    bufs = flat_numpy(reference(pmap.shape, pmap.tp, old))
    touched = [{n: np.zeros(x.size, bool) for n, x in rank.items()} for rank in ids]
    offset = 0
    for name, x in new.items():
        flat = x.view(-1)
        pos = np.flatnonzero(rng.random(flat.numel()) < density)
        flat[torch.from_numpy(pos)] = torch.randint(-(2**15), 2**15, (pos.size,), dtype=torch.int16)
        apply(pmap, bufs, name, pos, flat.numpy()[pos])
        for r, rank in enumerate(ids):  # where the reference says these elements must land
            for n, src in rank.items():
                touched[r][n] |= np.isin(src, pos + offset)
        offset += flat.numel()
    expect = flat_numpy(reference(pmap.shape, pmap.tp, new))
    before = flat_numpy(reference(pmap.shape, pmap.tp, old))
    for r in range(pmap.tp):
        for n in ids[r]:
            np.testing.assert_array_equal(bufs[r][n], expect[r][n], err_msg=f"rank {r} {n}")
            untouched = ~touched[r][n]
            np.testing.assert_array_equal(bufs[r][n][untouched], before[r][n][untouched])


@settings(max_examples=30, deadline=None)
@given(which=st.sampled_from(CASES), data=st.data())
def test_translate_range_places_a_dense_range(which, data):
    pmap, ids = case(*which)
    specs = pmap.trainer_layout().tensors
    idx = data.draw(st.integers(0, len(specs) - 1))
    spec = specs[idx]
    start = data.draw(st.integers(0, spec.numel))
    stop = data.draw(st.integers(start, spec.numel))
    base = sum(s.numel for s in specs[:idx])
    placed = pmap.translate_range(spec.name, start, stop, np.arange(base + start, base + stop))
    seen = {}
    for p in placed:
        np.testing.assert_array_equal(ids[p.rank][p.name][p.positions], p.values)
        seen[p.rank, p.name] = p.positions
    for r, rank in enumerate(ids):  # and nothing fed by the range was left out
        for n, src in rank.items():
            want = np.flatnonzero((src >= base + start) & (src < base + stop))
            np.testing.assert_array_equal(seen.get((r, n), np.empty(0, np.int64)), want)


def test_replicated_kv_head_is_placed_on_every_rank_that_holds_it():
    pmap = PlacementMap(SHAPES["llama_gqa_tied"], 4)  # 2 kv heads over 4 ranks
    head_elems = 3 * 16  # head_dim x hidden
    placed = pmap.translate(
        "model.layers.0.self_attn.k_proj.weight", np.array([0, head_elems]), np.array([7, 9])
    )
    q_elems = 2 * 3 * 16  # each rank's q part comes first in qkv_proj
    assert [(p.rank, p.positions.tolist(), p.values.tolist()) for p in placed] == [
        (0, [q_elems], [7]),
        (1, [q_elems], [7]),
        (2, [q_elems], [9]),
        (3, [q_elems], [9]),
    ]
    norm = pmap.translate("model.norm.weight", np.array([5]), np.array([1]))
    assert [(p.rank, p.name, p.positions.tolist()) for p in norm] == [
        (r, "model.norm.weight", [5]) for r in range(4)
    ]


def test_empty_delta_places_nothing():
    pmap, _ = case("qwen2_tied", 2)
    assert pmap.translate("model.norm.weight", np.empty(0, np.int64), np.empty(0, np.int16)) == []


def test_row_parallel_shard_maps_columns():
    pmap = PlacementMap(SHAPES["llama_mha"], 2)  # o_proj: 16 x 16, each rank 16 x 8
    placed = pmap.translate(
        "model.layers.1.self_attn.o_proj.weight", np.array([3, 8, 17, 31]), np.arange(4)
    )
    assert [(p.rank, p.positions.tolist(), p.values.tolist()) for p in placed] == [
        (0, [3, 9], [0, 2]),
        (1, [0, 15], [1, 3]),
    ]


def test_sources_name_the_feeding_trainer_tensors():
    pmap = PlacementMap(SHAPES["qwen2_tied"], 2)
    a = "model.layers.0.self_attn"
    assert pmap.sources(1, f"{a}.qkv_proj.bias") == tuple(f"{a}.{p}_proj.bias" for p in "qkv")
    assert pmap.sources(0, "model.layers.0.mlp.gate_up_proj.weight") == (
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
    )
    assert pmap.sources(0, "model.norm.weight") == ("model.norm.weight",)
    assert pmap.sources(1, "model.embed_tokens.weight") == ("model.embed_tokens.weight",)


# -- real model shapes -------------------------------------------------------------------------


def test_llama3_8b_shapes():
    shape = ModelShape.from_hf_config(LLAMA3_8B)
    assert (shape.head_dim, shape.num_kv_heads, shape.qkv_bias, shape.tie_embeddings) == (
        128,
        8,
        False,
        False,
    )
    pmap = PlacementMap(shape, 8)
    assert pmap.trainer_layout().numel == 8_030_261_248  # the published parameter count
    # only the norms are replicated: 65 norms of 4096 on 7 more ranks
    assert 8 * pmap.inference_layout(0).numel == 8_030_261_248 + 7 * 65 * 4096
    qkv = pmap.inference_layout(3).spec("model.layers.31.self_attn.qkv_proj.weight")
    assert qkv.shape == ((4 + 2) * 128, 4096)
    assert pmap.sources(3, qkv.name)[1] == "model.layers.31.self_attn.k_proj.weight"


def test_qwen2_05b_shapes():
    shape = ModelShape.from_hf_config(QWEN2_05B)
    assert (shape.head_dim, shape.qkv_bias, shape.tie_embeddings) == (64, True, True)
    pmap = PlacementMap(shape, 2)
    assert pmap.trainer_layout().numel == 494_032_768
    assert "lm_head.weight" not in {s.name for s in pmap.inference_layout(0).tensors}
    with pytest.raises(ValueError, match="num_heads=14 is not divisible by tp=4"):
        PlacementMap(shape, 4)


def test_from_hf_config_defaults():
    config = {
        k: v
        for k, v in LLAMA3_8B.items()
        if k not in ("num_key_value_heads", "tie_word_embeddings")
    }
    shape = ModelShape.from_hf_config({**config, "head_dim": None}, dtype="float16")
    assert (shape.num_kv_heads, shape.head_dim, shape.tie_embeddings, shape.dtype) == (
        32,
        128,
        False,
        "float16",
    )
    assert ModelShape.from_hf_config({**config, "head_dim": 64}).head_dim == 64


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"model_type": "qwen3"}, "unsupported model_type 'qwen3'"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"vocab_size": None}, "vocab_size must be a positive int"),
        ({"num_attention_heads": 12, "head_dim": 128}, "num_heads=12 is not a multiple of num_kv"),
        ({"num_attention_heads": 20}, "hidden_size=4096 is not a multiple of 20 heads"),
    ],
)
def test_from_hf_config_refuses_what_it_cannot_place(patch, message):
    with pytest.raises(ValueError, match=message):
        ModelShape.from_hf_config({**LLAMA3_8B, **patch})


def test_from_hf_config_names_missing_keys():
    config = {k: v for k, v in LLAMA3_8B.items() if k not in ("hidden_size", "vocab_size")}
    with pytest.raises(ValueError, match="missing hidden_size, vocab_size"):
        ModelShape.from_hf_config(config)


# -- serialisation -----------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "tp"), CASES[:6])
def test_json_round_trip(name, tp):
    pmap = PlacementMap(SHAPES[name], tp)
    back = PlacementMap.from_json(pmap.to_json().decode())
    assert back == pmap
    assert hash(back) == hash(pmap)
    assert back.inference_layout(tp - 1).to_json() == pmap.inference_layout(tp - 1).to_json()
    assert back.trainer_layout().to_json() == pmap.trainer_layout().to_json()
    assert back != PlacementMap(SHAPES[name], 1 if tp > 1 else 2)


@pytest.mark.parametrize(
    "data",
    [b"{", b"[]", b'{"tp": 2}', b'{"shape": {"hidden_size": 8}, "tp": 2}'],
)
def test_from_json_rejects_malformed(data):
    with pytest.raises(ValueError, match="malformed placement map"):
        PlacementMap.from_json(data)


def test_from_json_rejects_bad_values():
    with pytest.raises(ValueError, match="tensor-parallel degree"):
        PlacementMap.from_json(
            PlacementMap(SHAPES["llama_mha"], 2).to_json().replace(b'"tp":2', b'"tp":"2"')
        )
    with pytest.raises(ValueError, match="num_layers must be a positive int"):
        PlacementMap.from_json(
            PlacementMap(SHAPES["llama_mha"], 2)
            .to_json()
            .replace(b'"num_layers":2', b'"num_layers":0')
        )


# -- clear errors ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "tp", "message"),
    [
        ({"num_heads": 6, "num_kv_heads": 6}, 4, "num_heads=6 is not divisible by tp=4"),
        ({"intermediate_size": 30}, 4, "intermediate_size=30 is not divisible by tp=4"),
        (
            {"num_heads": 6, "num_kv_heads": 6, "intermediate_size": 30, "vocab_size": 320},
            3,
            "^cannot shard this model: vocab_size=320 is not divisible by tp=3$",
        ),
        ({"vocab_size": 200}, 2, "vocab_size=200 is not a multiple of vLLM's vocabulary padding"),
        ({"num_heads": 12, "num_kv_heads": 6}, 4, "num_kv_heads=6 is not divisible by tp=4"),
        ({"num_heads": 12, "num_kv_heads": 3}, 4, "tp=4 is not a multiple of num_kv_heads=3"),
    ],
)
def test_indivisible_dimensions_are_refused(changes, tp, message):
    with pytest.raises(ValueError, match=message):
        PlacementMap(dataclasses.replace(SHAPES["llama_mha"], **changes), tp)


def test_any_vocabulary_is_accepted_without_sharding():
    pmap = PlacementMap(dataclasses.replace(SHAPES["llama_mha"], vocab_size=33), 1)
    assert pmap.inference_layout(0).spec("lm_head.weight").shape == (33, 16)


@pytest.mark.parametrize("tp", [0, -1, True, 2.0])
def test_bad_tp_is_refused(tp):
    with pytest.raises(ValueError, match="tensor-parallel degree"):
        PlacementMap(SHAPES["llama_mha"], tp)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"hidden_size": 0}, "hidden_size must be a positive int"),
        ({"num_layers": True}, "num_layers must be a positive int"),
        ({"tie_embeddings": 1}, "tie_embeddings must be a bool"),
        ({"num_kv_heads": 3}, "num_heads=4 is not a multiple of num_kv_heads=3"),
        ({"dtype": "bf16"}, "unsupported dtype 'bf16'"),
    ],
)
def test_bad_model_shape_is_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(SHAPES["llama_mha"], **changes)


def test_unknown_names_and_ranks():
    pmap = PlacementMap(SHAPES["llama_mha"], 2)
    with pytest.raises(
        KeyError,
        match=re.escape("no trainer tensor named 'model.layers.0.self_attn.qkv_proj.weight'"),
    ):
        pmap.translate("model.layers.0.self_attn.qkv_proj.weight", np.array([0]), np.array([0]))
    with pytest.raises(KeyError, match=re.escape("lm_head.bias")):
        pmap.translate_range("lm_head.bias", 0, 1, np.array([0]))
    with pytest.raises(KeyError, match=re.escape("model.layers.0.self_attn.q_proj.weight")):
        pmap.sources(0, "model.layers.0.self_attn.q_proj.weight")
    with pytest.raises(ValueError, match="rank 2 is outside tensor-parallel degree 2"):
        pmap.inference_layout(2)
    with pytest.raises(ValueError, match="rank -1"):
        pmap.sources(-1, "model.norm.weight")


@pytest.mark.parametrize(
    ("positions", "values", "message"),
    [
        (np.array([3, 1]), np.array([0, 0]), "not strictly ascending"),
        (np.array([1, 1]), np.array([0, 0]), "not strictly ascending"),
        (np.array([-1, 2]), np.array([0, 0]), "outside its 16 elements"),
        (np.array([2, 16]), np.array([0, 0]), "outside its 16 elements"),
        (np.array([1.0, 2.0]), np.array([0, 0]), "1-D integer array"),
        (np.array([[1, 2]]), np.array([[0, 0]]), "1-D integer array"),
        (np.array([1, 2]), np.array([0]), "values for"),
    ],
)
def test_bad_deltas_are_refused(positions, values, message):
    pmap = PlacementMap(SHAPES["llama_mha"], 2)
    with pytest.raises(ValueError, match=message):
        pmap.translate("model.norm.weight", positions, values)


def test_bad_ranges_are_refused():
    pmap = PlacementMap(SHAPES["llama_mha"], 2)
    for start, stop in ((-1, 3), (4, 3), (0, 17)):
        with pytest.raises(ValueError, match="outside its 16 elements"):
            pmap.translate_range("model.norm.weight", start, stop, np.zeros(max(stop - start, 0)))
