"""The rollout engine on a GPU (``-m gpu``; scripts/gpu-check.sh runs these): SmolLM2 in bf16,
refits from the weight store bit-exact inside the engine, async scheduling off, and tokens
tagged with the version they were computed under across a refit.

Skipped where there is no CUDA device (the reason is given); vLLM itself must import.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.installed import require_vllm

require_vllm()
if not torch.cuda.is_available():
    pytest.skip(
        "no CUDA device here: the GPU path runs in scripts/gpu-check.sh", allow_module_level=True
    )


from deltarl.engine.weight_store import WeightStore  # noqa: E402
from deltarl.rl.pretrained import ensure_model  # noqa: E402
from deltarl.rollout.engine import FinishedGroup, VllmEngine, VllmEngineConfig  # noqa: E402
from tests.rollout.test_vllm_engine import (  # noqa: E402
    commit,
    perturbed,
    store_digest,
    weights_and_store,
)

pytestmark = pytest.mark.gpu

PROMPT = 'What is 17 + 25? End your reply with "Answer: <number>".'


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_model("smollm2-135m", tmp_path_factory.mktemp("models"))


base_weights, store = weights_and_store("gpu")


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[VllmEngine]:
    # A small KV cache and memory share: scripts/gpu-check.sh runs two engines on one GPU.
    eng = VllmEngine(
        VllmEngineConfig(
            model=model_dir,
            max_model_len=1024,
            kv_cache_bytes=1 << 30,
            engine_args={"gpu_memory_utilization": 0.3},
        )
    )
    eng.start()
    yield eng
    eng.close()


def test_async_scheduling_is_off_on_the_gpu(engine: VllmEngine) -> None:
    assert engine._engine is not None
    assert engine._engine.vllm_config.scheduler_config.async_scheduling is False


def test_refits_are_bit_exact_in_the_engine(
    engine: VllmEngine, store: WeightStore, base_weights: dict
) -> None:
    for seed in (1, 2):
        version = commit(store, perturbed(base_weights, seed=seed, scale=0.01))
        report = engine.update_weights(store.name, store.path.parent, version)
        assert report["digest"] == store_digest(store)
        assert engine.version == version


def test_tokens_keep_the_version_they_were_computed_under(
    engine: VllmEngine, store: WeightStore, base_weights: dict
) -> None:
    old = commit(store, perturbed(base_weights, seed=3, scale=0.01))
    engine.update_weights(store.name, store.path.parent, old)
    engine.add_group("crossing", PROMPT, 1, {"temperature": 1.0, "max_tokens": 48, "seed": 5})
    done: list[FinishedGroup] = []
    for _ in range(4):
        done += engine.step()
    new = commit(store, perturbed(base_weights, seed=4, scale=0.01))
    engine.update_weights(store.name, store.path.parent, new)
    while engine.has_work():
        done += engine.step()
    versions = done[0].samples[0]["token_versions"]
    k = versions.count(old)
    # four engine steps before the refit: at most four tokens (prefill + decodes) are old
    assert 0 < k <= 4
    assert versions == [old] * k + [new] * (len(versions) - k)


def test_engine_throughput_is_reported(engine: VllmEngine) -> None:
    """Not a target (benchmarks hold those): the figure scripts/gpu-check.sh prints."""
    for i in range(32):
        engine.add_group(f"t{i}", PROMPT, 8, {"temperature": 1.0, "max_tokens": 128, "seed": i})
    t0 = time.perf_counter()
    tokens = 0
    while engine.has_work():
        for group in engine.step():
            tokens += sum(len(s["token_ids"]) for s in group.samples)
    seconds = time.perf_counter() - t0
    print(f"GPU engine: {tokens} tokens in {seconds:.2f} s = {tokens / seconds:.0f} tokens/s")
    assert tokens > 0
