"""The rollout engine's configuration refuses what would mis-tag token versions."""

from __future__ import annotations

from pathlib import Path

import pytest

from deltarl.rollout.engine import SYNC_ENGINE_ARGS, VllmEngineConfig


def test_async_scheduling_cannot_be_turned_on() -> None:
    with pytest.raises(ValueError, match=r"async_scheduling = True is refused.*new version"):
        VllmEngineConfig(model=Path("m"), engine_args={"async_scheduling": True})
    # Saying it is off, or nothing, is fine; the engine passes it off either way.
    assert VllmEngineConfig(model=Path("m"), engine_args={"async_scheduling": False})
    assert VllmEngineConfig(model=Path("m")).engine_args == {}
    assert SYNC_ENGINE_ARGS == {"async_scheduling": False}


@pytest.mark.parametrize("key", ["tensor_parallel_size", "distributed_executor_backend", "dtype"])
def test_engine_args_cannot_set_what_the_engine_sets_itself(key: str) -> None:
    with pytest.raises(ValueError, match=rf"engine_args: {key} are set by the engine's own"):
        VllmEngineConfig(model=Path("m"), engine_args={key: 2})


def test_tensor_parallel_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive int"):
        VllmEngineConfig(model=Path("m"), tensor_parallel_size=0)
