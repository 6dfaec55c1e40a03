"""Skip a test module only where an installed part is genuinely absent.

A part that is installed but broken (vLLM whose import raises because a CUDA build of
torchvision came along, say) must fail the run, not turn it green by skipping: the install is
what is wrong, and a skip would hide it.
"""

from __future__ import annotations

import importlib
import importlib.util

import pytest


def require(module: str, why: str) -> None:
    """Skip the calling module if ``module`` is not installed; import it otherwise, so that a
    broken installation raises here and fails the collection."""
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed here: {why}", allow_module_level=True)
    importlib.import_module(module)


def require_vllm() -> None:
    require("vllm", "these tests run the rollout engine (scripts/install.sh installs it)")
