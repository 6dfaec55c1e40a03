"""``deltarl bench codec --checkpoints A B ...`` on Hugging Face-style safetensors directories:
the deltas between them are encoded bit-exact, the per-layer changed ratios are the ones
made, and checkpoints that do not match are refused with the tensor named."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest
import torch
from deltarl.bench.codec_checkpoints import read_checkpoints
from safetensors.torch import save_file


def _checkpoint(root: Path, name: str, tensors: dict[str, torch.Tensor], shards: int = 1) -> Path:
    d = root / name
    d.mkdir()
    names = sorted(tensors)
    for k in range(shards):
        part = {n: tensors[n].contiguous() for n in names[k::shards]}
        save_file(part, str(d / f"model-{k:05d}-of-{shards:05d}.safetensors"))
    return d


def _model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.layers.0.mlp.up_proj.weight": torch.randn(64, 32, generator=g).bfloat16(),
        "model.layers.1.mlp.up_proj.weight": torch.randn(64, 32, generator=g).bfloat16(),
        "model.norm.weight": torch.ones(32, dtype=torch.float32),
        "lm_head.weight": torch.randn(100, 32, generator=g).bfloat16(),
    }


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "deltarl.cli", "bench", "codec", "--repeat", "1", "--json", *args],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


def test_consecutive_checkpoints_are_encoded_with_their_layer_ratios(tmp_path: Path) -> None:
    a = _model()
    b = {k: v.clone() for k, v in a.items()}
    b["model.layers.0.mlp.up_proj.weight"].view(-1)[:256] += 1.0  # 256 of 2048
    b["model.layers.1.mlp.up_proj.weight"].view(-1)[:128] *= 3.0  # 128 of 2048
    c = {k: v.clone() for k, v in b.items()}
    c["lm_head.weight"].view(-1)[:32] = 0.5
    c["model.norm.weight"][:3] = 2.0
    dirs = [
        _checkpoint(tmp_path, "a", a),
        _checkpoint(tmp_path, "b", b, shards=2),  # sharded: the same model
        _checkpoint(tmp_path, "c", c),
    ]
    proc = _bench("--checkpoints", *map(str, dirs))
    assert proc.returncode == 0, proc.stderr
    steps = orjson.loads(proc.stdout)["steps"]
    assert [s["step"] for s in steps] == [1, 2]
    assert all(s["bit_exact"] for s in steps)
    ups = "model.layers.*.mlp.up_proj.weight"
    first, second = steps[0]["layers"], steps[1]["layers"]
    assert first[ups] == pytest.approx(384 / 4096, abs=1e-3)  # a few bf16 values may not move
    assert first["lm_head.weight"] == 0
    assert second[ups] == 0
    assert second["lm_head.weight"] <= 32 / 3200
    assert second["model.norm.weight"] == pytest.approx(3 / 32)
    assert 0 < steps[0]["changed_ratio"] < 1


def test_checkpoints_that_do_not_match_are_refused(tmp_path: Path) -> None:
    a = _model()
    b = dict(a)
    b["lm_head.weight"] = torch.zeros(101, 32).bfloat16()
    dirs = [_checkpoint(tmp_path, "a", a), _checkpoint(tmp_path, "b", b)]
    proc = _bench("--checkpoints", *map(str, dirs))
    assert proc.returncode == 2
    assert "lm_head.weight" in proc.stderr
    with pytest.raises(ValueError, match="at least two"):
        read_checkpoints(dirs[:1])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="safetensors"):
        read_checkpoints([dirs[0], tmp_path / "empty"])
