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
