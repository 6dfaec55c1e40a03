"""Checkpoints: atomic writes, keep-K, broken and half-written files skipped, exact resume."""

from __future__ import annotations

import logging
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from deltarl.rl.samples import Group, Sample
from deltarl.trainer.checkpoint import Checkpointer, CheckpointError
from deltarl.trainer.grpo import GRPOConfig, ScoredGroup, build_batch, train_step
from tests.trainer.tiny import tiny_model

ROOT = Path(__file__).resolve().parents[2]


def synthetic_groups(step: int, groups: int = 2, n: int = 4) -> list[ScoredGroup]:
    """Deterministic groups for ``step`` (what a scheduler would ship for it, every time)."""
    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for gi in range(groups):
        prompt = torch.randint(0, 256, (3,), generator=g).tolist()
        samples, rewards = [], []
        for _ in range(n):
            length = int(torch.randint(1, 6, (1,), generator=g))
            completion = torch.randint(0, 256, (length,), generator=g).tolist()
            logprobs = (-5.5 + 0.1 * torch.randn(length, generator=g)).tolist()
            samples.append(Sample(prompt, completion, logprobs, [step - 1] * length, "", "length"))
            rewards.append(float(torch.rand(1, generator=g)))
        out.append(ScoredGroup(Group(f"s{step}g{gi}", gi, tuple(samples)), tuple(rewards)))
    return out


def _setup(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = tiny_model(seed)
    return model, torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.01)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for s in steps:
        train_step(model, opt, build_batch(synthetic_groups(s)), GRPOConfig(micro_batch=3))


def _assert_same_state(a: dict, b: dict) -> None:
    """Bit-equal nested state (tensors by torch.equal, the rest by ==)."""
    assert type(a) is type(b)
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k, value in a.items():
            _assert_same_state(value, b[k])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same_state(x, y)
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype
        assert torch.equal(a, b)
    else:
        assert a == b


def test_save_read_and_keep_the_newest_k(tmp_path: Path) -> None:
    model, opt = _setup()
    ck = Checkpointer(tmp_path / "ck", keep=2)
    for step in (1, 2, 3):
        _train(model, opt, range(step, step + 1))
        path = ck.save(step=step, version=step, model=model, optimizer=opt, extra={"k": step})
        assert path == ck.path_of(step)
        assert path.is_file()
    assert ck.steps() == [2, 3]
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [
        "step-000000000002.ckpt",
        "step-000000000003.ckpt",
    ]  # no temp file left over
    found = ck.newest()
    assert found is not None
    path, state = found
    assert path == ck.path_of(3)
    assert (state["step"], state["version"], state["next_step"]) == (3, 3, 4)
    assert state["extra"] == {"k": 3}
    _assert_same_state(state["model"], model.state_dict())
    _assert_same_state(state["optimizer"], opt.state_dict())


def test_truncated_or_corrupted_newest_is_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model, opt = _setup()
    ck = Checkpointer(tmp_path, keep=5)
    for step in (1, 2, 3):
        _train(model, opt, range(step, step + 1))
        ck.save(step=step, version=step, model=model, optimizer=opt)
    # Step 3 cut short (a torn write), step 2 with one byte flipped in the middle.
    p3 = ck.path_of(3)
    p3.write_bytes(p3.read_bytes()[: p3.stat().st_size // 2])
    p2 = ck.path_of(2)
    data = bytearray(p2.read_bytes())
    data[len(data) // 2] ^= 0x40
    p2.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="no checkpoint trailer"):
        ck.read(p3)
    with pytest.raises(CheckpointError, match="digest mismatch"):
        ck.read(p2)
    fresh, fresh_opt = _setup(seed=9)
    with caplog.at_level(logging.WARNING, logger="deltarl.trainer.checkpoint"):
        found = ck.restore(fresh, fresh_opt)
    assert found is not None
    assert found.step == 1
    assert found.next_step == 2
    skipped = [r.getMessage() for r in caplog.records if "skipping checkpoint" in r.getMessage()]
    assert len(skipped) == 2
    assert "step 3" in skipped[0]
    assert "step 2" in skipped[1]
    # Nothing sound at all: None, and the model is left as it was.
    ck.path_of(1).write_bytes(b"")
    untouched = [p.detach().clone() for p in fresh.parameters()]
    other, other_opt = _setup(seed=9)
    assert ck.restore(other, other_opt) is None
    assert all(torch.equal(a, b) for a, b in zip(untouched, fresh.parameters(), strict=True))


def test_a_writer_killed_before_the_rename_leaves_only_an_ignored_temp(tmp_path: Path) -> None:
    """A real process dies (os._exit) between writing the temp file and renaming it."""
    model, opt = _setup()
    ck = Checkpointer(tmp_path, keep=3)
    _train(model, opt, range(1, 2))
    ck.save(step=1, version=1, model=model, optimizer=opt)
    child = f"""
import os, sys
sys.path.insert(0, {str(ROOT)!r})
import torch
from deltarl.trainer import checkpoint
from tests.trainer.tiny import tiny_model
model = tiny_model(3)
opt = torch.optim.AdamW(model.parameters())
checkpoint.os.replace = lambda *a: os._exit(137)  # die where a kill -9 would hurt most
checkpoint.Checkpointer({str(tmp_path)!r}).save(step=2, version=2, model=model, optimizer=opt)
"""
    proc = subprocess.run([sys.executable, "-c", child], check=False, timeout=120)
    assert proc.returncode == 137
    temps = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert len(temps) == 1
    assert temps[0].name.startswith(".step-000000000002.ckpt.")
    assert ck.steps() == [1]
    fresh, fresh_opt = _setup(seed=5)
    found = ck.restore(fresh, fresh_opt)
    assert found is not None
    assert found.step == 1
    _assert_same_state(fresh.state_dict(), model.state_dict())
    # Our own temp files (a save in progress) stay; the dead writer's go with the next start.
    own = tmp_path / f".step-000000000009.ckpt.{os.getpid()}.abcd.tmp"
    own.write_bytes(b"in progress")
    Checkpointer(tmp_path)
    assert [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == [own]


def test_resume_is_bit_identical_to_an_uninterrupted_run(tmp_path: Path) -> None:
    torch.manual_seed(0)
    straight, straight_opt = _setup()
    _train(straight, straight_opt, range(1, 7))

    model, opt = _setup()
    _train(model, opt, range(1, 4))
    torch.manual_seed(123)
    random.seed(5)
    np.random.seed(7)
    rng = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    Checkpointer(tmp_path).save(step=3, version=3, model=model, optimizer=opt)
    del model, opt
    # Everything the process had is gone: other weights, other RNG draws.
    torch.rand(100)
    random.random()
    np.random.rand(3)
    resumed, resumed_opt = _setup(seed=42)
    found = Checkpointer(tmp_path).restore(resumed, resumed_opt)
    assert found is not None
    assert found.next_step == 4
    assert torch.equal(torch.get_rng_state(), rng[0])
    assert random.getstate() == rng[1]
    assert np.array_equal(np.random.get_state()[1], rng[2])
    _train(resumed, resumed_opt, range(found.next_step, 7))

    _assert_same_state(resumed.state_dict(), straight.state_dict())
    _assert_same_state(resumed_opt.state_dict(), straight_opt.state_dict())


def test_restore_to_makes_an_older_checkpoint_newest_under_a_new_version(tmp_path: Path) -> None:
    model, opt = _setup()
    ck = Checkpointer(tmp_path / "ck", keep=3)
    for step in (5, 10, 15):
        _train(model, opt, range(step, step + 1))
        ck.save(step=step, version=step, model=model, optimizer=opt)
    kept = ck.read(ck.path_of(5))
    version, moved = ck.restore_to(5, above_version=17)  # the store had published 17
    assert version == 18
    assert [p.name for p in moved] == ["step-000000000010.ckpt", "step-000000000015.ckpt"]
    assert all(p.is_file() and p.parent.name.startswith("discarded-") for p in moved)
    assert ck.steps() == [5]
    found = ck.newest()
    assert found is not None
    state = found[1]
    assert (state["step"], state["version"], state["next_step"]) == (5, 18, 6)
    assert state["extra"]["restored_from_version"] == 5
    _assert_same_state(state["model"], kept["model"])  # the weights are step 5's, untouched
    _assert_same_state(state["optimizer"], kept["optimizer"])
    # Versions only go up: a second restore (the operator ran it twice) bumps again.
    assert ck.restore_to(5, above_version=0)[0] == 19
    with pytest.raises(CheckpointError, match="no checkpoint of step 7"):
        ck.restore_to(7, above_version=0)
