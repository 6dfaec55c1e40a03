"""The vLLM rollout engine at float32 with chat prompts, on the tiny model given a chat template.

One float32 engine serves the module. The weight store holds bf16 versions (what the trainer
publishes); vLLM widens them on load, and the worker's read-back must still compare every
widened parameter bit for bit. The tiny model has no chat template of its own: a copy of it
gets one, so ``chat = "auto"`` renders prompts through it.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

try:
    import vllm  # noqa: F401
except Exception as exc:  # noqa: BLE001 - a broken install (e.g. CUDA torchvision) raises anything
    pytest.skip(f"vLLM does not import ({type(exc).__name__}: {exc})", allow_module_level=True)

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from deltarl.engine.weight_store import WeightStore
from deltarl.rl.tiny_model import ensure_default_model
from deltarl.rollout.engine import VllmEngine, VllmEngineConfig
from deltarl.rollout.worker_ext import WeightVerificationError
from tests.rollout.test_vllm_engine import (
    _fused_plain,
    _model_class,
    commit,
    perturbed,
    run,
    store_digest,
    weights_and_store,
)

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
PROMPT = "What is 47 + 385?"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tiny = ensure_default_model(tmp_path_factory.mktemp("models"))
    chat = tmp_path_factory.mktemp("chat-model") / "tiny-chat"
    shutil.copytree(tiny, chat)
    (chat / "chat_template.jinja").write_text(TEMPLATE)
    return chat


base_weights, store = weights_and_store("fp32")


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[VllmEngine]:
    eng = VllmEngine(VllmEngineConfig(model=model_dir, max_model_len=512, dtype="float32"))
    eng.start()
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(model_dir)


def _params(engine: VllmEngine) -> dict[str, torch.Tensor]:
    assert engine._engine is not None
    worker = engine._engine.engine_core.engine_core.model_executor.driver_worker.worker  # type: ignore[attr-defined]
    return dict(worker.model_runner.get_model().named_parameters())


def _widened(engine: VllmEngine, store: WeightStore) -> int:
    """Store tensors (bf16) the engine holds 1:1 as float32 parameters: what must be read back."""
    params = _params(engine)
    with store.lease() as snap:
        return sum(
            1
            for spec in store.layout.tensors
            if (p := params.get(spec.name)) is not None
            and p.shape == snap.tensor(spec.name).shape
            and p.dtype == torch.float32
        )


def test_chat_true_without_a_template_is_refused(tmp_path: Path) -> None:
    # First in the module: before its engine is built (one engine per process at a time).
    tiny = ensure_default_model(tmp_path / "models")
    eng = VllmEngine(VllmEngineConfig(model=tiny, max_model_len=256, chat=True))
    with pytest.raises(ValueError, match="no chat template"):
        eng.start()
    assert eng._engine is None  # closed again: the process may build another engine


def test_prompts_are_rendered_with_the_chat_template(
    engine: VllmEngine, tokenizer: PreTrainedTokenizerBase
) -> None:
    assert engine.chat  # "auto", and the model has a template
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False
    )
    assert rendered == f"<|user|>{PROMPT}\n<|assistant|>"
    want = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    group = run(engine, PROMPT, n=2, max_tokens=6)
    for s in group.samples:
        assert s["prompt_token_ids"] == want  # what the trainer trains on
        assert s["prompt_token_ids"] != tokenizer(PROMPT)["input_ids"]
        assert s["token_versions"] == [engine.version] * len(s["token_ids"])


def test_cpu_engines_prefill_whole_prompts(engine: VllmEngine) -> None:
    assert engine._engine is not None
    scheduler = engine._engine.vllm_config.scheduler_config
    assert scheduler.enable_chunked_prefill is False
    assert scheduler.max_num_batched_tokens >= 8192


def test_a_bf16_version_loads_into_float32_and_is_read_back_widened(
    engine: VllmEngine, store: WeightStore, base_weights: dict
) -> None:
    assert {p.dtype for p in _params(engine).values()} == {torch.float32}
    new = perturbed(base_weights, seed=21, scale=0.05)
    version = commit(store, new)
    report = engine.update_weights(store.name, store.path.parent, version, only_changed=False)
    # every 1:1 parameter is a widened bf16 tensor now, compared, not skipped (embeddings,
    # lm_head and the 9 norms at least), and so is every plain fused one, through the
    # placement map (the q/k/v biases at least; vLLM-CPU may repack the linear weights)
    assert report["readback_tensors"] == _widened(engine, store) + _fused_plain(engine, store)
    assert _fused_plain(engine, store) >= 4
    assert report["digest"] == store_digest(store)
    norm = _params(engine)["model.norm.weight"]
    assert torch.equal(norm, new["model.norm.weight"].float())
    group = run(engine, PROMPT, n=2, max_tokens=6)
    assert all(s["token_versions"] == [version] * len(s["token_ids"]) for s in group.samples)


def test_a_corrupted_tensor_is_caught_by_the_widened_read_back(
    engine: VllmEngine, store: WeightStore, base_weights: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    cls = _model_class(engine)
    original = cls.load_weights

    def corrupts_a_norm(self: object, weights: Iterator) -> object:
        return original(self, ((n, t + 1 if n == "model.norm.weight" else t) for n, t in weights))

    monkeypatch.setattr(cls, "load_weights", corrupts_a_norm)
    version = commit(store, perturbed(base_weights, seed=22, scale=0.05))
    with pytest.raises(WeightVerificationError, match=r"model\.norm\.weight differs"):
        engine.update_weights(store.name, store.path.parent, version, only_changed=False)
    monkeypatch.undo()
    report = engine.update_weights(store.name, store.path.parent, version)
    assert report["digest"] == store_digest(store)

    # A change below bf16's precision in the engine's float32 copy: narrowing it to bf16 would
    # round it away; the comparison with the widened store tensor sees it.
    norm = _params(engine)["model.norm.weight"]
    with torch.no_grad():
        norm.view(torch.int32)[0] ^= 1
    with pytest.raises(WeightVerificationError, match=r"model\.norm\.weight differs"):
        engine.update_weights(store.name, store.path.parent, version)  # nothing handed over
    report = engine.update_weights(store.name, store.path.parent, version)  # all again
    assert report["tensors"] == report["total"]
    assert report["digest"] == store_digest(store)
