"""The KV pool shared by engines (deltarl/rollout/kv_pool.py), on real vLLM engines: a prompt's
blocks computed by one engine serve another, within a weight version and never across one;
vLLM's own example connector, keyed by tokens alone, serves them across (the problem)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.installed import require_vllm

require_vllm()

from deltarl.engine.weight_store import WeightStore  # noqa: E402
from deltarl.rl.tiny_model import ensure_default_model  # noqa: E402
from deltarl.rollout.engine import VllmEngine, VllmEngineConfig  # noqa: E402
from tests.rollout.test_vllm_engine import commit, perturbed, run, weights_and_store  # noqa: E402

PROMPT = "count the apples and the pears in the basket, then the plums. " * 12
BLOCK = 32

base_weights, store = weights_and_store("kvpool")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_default_model(tmp_path_factory.mktemp("models"))


def engine(model_dir: Path, **knobs: object) -> VllmEngine:
    return VllmEngine(VllmEngineConfig(model=model_dir, max_model_len=512, chat=False, **knobs))  # type: ignore[arg-type]


@pytest.fixture
def pool(tmp_path: Path) -> Path:
    return tmp_path / "kv-pool"


def test_a_second_engine_takes_the_first_ones_blocks_from_the_pool(
    model_dir: Path, pool: Path
) -> None:
    with engine(model_dir, kv_pool=str(pool)) as a:
        first = run(a, PROMPT)
    assert first.cached_tokens == [0]  # nothing pooled yet: computed, and stored
    prompt = len(first.samples[0]["prompt_token_ids"])
    with engine(model_dir, kv_pool=str(pool)) as b:  # its own cache is empty
        got = run(b, PROMPT)
    # Whole blocks of the prompt but its last token come from the pool.
    assert got.cached_tokens == [(prompt - 1) // BLOCK * BLOCK]
    assert got.cached_tokens[0] >= 4 * BLOCK


def test_after_a_weight_update_no_block_of_the_old_version_is_served(
    model_dir: Path, pool: Path, store: WeightStore, base_weights: dict
) -> None:
    with engine(model_dir, kv_pool=str(pool)) as a:
        run(a, PROMPT)  # stored under version 0
    version = commit(store, perturbed(base_weights, seed=7, scale=0.05))
    with engine(model_dir, kv_pool=str(pool)) as b:
        assert run(b, PROMPT, seed=1).cached_tokens[0] > 0  # version 0: from the pool
        b.update_weights(store.name, store.path.parent, version)
        assert run(b, PROMPT, seed=2).cached_tokens == [0]  # version 1: computed afresh
    with engine(model_dir, kv_pool=str(pool)) as c:  # a third engine, still at version 0
        assert run(c, PROMPT, seed=3).cached_tokens[0] > 0  # version 0's blocks still serve it


def test_the_token_keyed_example_connector_serves_old_blocks_after_an_update(
    model_dir: Path, pool: Path, store: WeightStore, base_weights: dict
) -> None:
    """The problem the versioned pool exists for, measured: same engines, same update."""
    plain = {
        "kv_transfer_config": {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(pool)},
        }
    }
    with engine(model_dir, engine_args=plain) as a:
        run(a, PROMPT)
    version = commit(store, perturbed(base_weights, seed=8, scale=0.05))
    with engine(model_dir, engine_args=plain) as b:
        b.update_weights(store.name, store.path.parent, version)
        stale = run(b, PROMPT, seed=2)
    assert stale.cached_tokens[0] > 0  # blocks computed by the old weights, served to new ones


def test_a_pool_and_a_connector_of_ones_own_are_refused_together(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="kv_pool"):
        VllmEngineConfig(
            model=tmp_path, kv_pool=str(tmp_path), engine_args={"kv_transfer_config": {}}
        )


def _published(pool: Path, version: int) -> list[Path]:
    base = pool / f"deltarl-v{version}"
    return [p for p in base.iterdir() if not p.name.startswith(".")] if base.is_dir() else []


def test_blocks_are_published_whole_under_their_version(model_dir: Path, pool: Path) -> None:
    """Each prompt's layers are written aside and renamed into place after the forward pass:
    nothing is left staged, and the published key holds one file per attention layer."""
    with engine(model_dir, kv_pool=str(pool)) as a:
        # the start's warm-up request was pooled under a namespace of its own, removed after
        assert a.warm_up_seconds is not None
        assert (list(pool.rglob("*")) if pool.is_dir() else []) == []
        run(a, PROMPT)
    (key,) = _published(pool, 0)
    layers = sorted(p.name for p in key.iterdir())
    assert layers
    assert all(n.endswith(".safetensors") for n in layers)
    staging = pool / "deltarl-v0" / ".staging"
    assert not staging.exists() or not any(staging.iterdir())


def test_an_update_expires_the_versions_the_engine_no_longer_keeps(
    model_dir: Path, pool: Path, store: WeightStore, base_weights: dict
) -> None:
    with engine(model_dir, kv_pool=str(pool), kv_pool_keep_versions=1) as a:
        run(a, PROMPT)
        assert _published(pool, 0)
        version = commit(store, perturbed(base_weights, seed=9, scale=0.05))
        a.update_weights(store.name, store.path.parent, version)
        assert not (pool / "deltarl-v0").exists()  # renamed away within the update
        run(a, PROMPT, seed=4)
        assert _published(pool, version)
    deadline = time.monotonic() + 30
    while any(p.name.startswith(".trash-") for p in pool.iterdir()):
        assert time.monotonic() < deadline, "the expired version's files were never removed"
        time.sleep(0.1)


def test_keep_versions_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="kv_pool_keep_versions"):
        VllmEngineConfig(model=tmp_path, kv_pool=str(tmp_path), kv_pool_keep_versions=0)
