"""The embedded default model: built locally, loadable by transformers, reproducible, race-safe."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deltarl.rl import tiny_model
from deltarl.rl.tiny_model import MODEL_NAME, ensure_default_model

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_default_model(tmp_path_factory.mktemp("models"))


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_directory_holds_a_whole_model(model_dir: Path) -> None:
    assert model_dir.name == MODEL_NAME
    names = {p.name for p in model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    # no temporary build directory is left beside it
    assert [p.name for p in model_dir.parent.iterdir()] == [MODEL_NAME]


def test_tokenizer_round_trips_any_text(model_dir: Path) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    assert tok.eos_token == tiny_model.EOS_TOKEN
    assert tok.pad_token == tiny_model.PAD_TOKEN
    assert tok.eos_token_id != tok.pad_token_id
    assert len(tok) <= tiny_model.VOCAB_SIZE
    # byte-level: text far from the training set (non-Latin, emoji) still encodes exactly
    text = "def f(x):\n    return x * 2  # 2+2=4, ünïcödé, 数学, 🙂"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    # the BPE learned merges: Python source costs fewer tokens than bytes
    assert len(ids) < len(text.encode())


def test_weights_load_into_transformers_and_match_the_seeded_init(model_dir: Path) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    state = model.state_dict()
    expected = tiny_model.initial_weights()
    assert set(state) == set(expected)
    assert sum(p.numel() for p in model.parameters()) == tiny_model.parameter_count()
    assert tiny_model.parameter_count() < 5_000_000
    for name, arr in expected.items():
        want = torch.from_numpy(arr).to(torch.bfloat16).float()
        assert torch.equal(state[name], want), name
    out = model(torch.tensor([[5, 6, 7]])).logits
    assert out.shape == (1, 3, tiny_model.VOCAB_SIZE)
    assert torch.isfinite(out).all()


def test_rebuilding_gives_identical_files(model_dir: Path, tmp_path: Path) -> None:
    again = ensure_default_model(tmp_path)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert _digest(again / name) == _digest(model_dir / name), name


def test_existing_directory_is_reused_not_rebuilt(model_dir: Path) -> None:
    before = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert ensure_default_model(model_dir.parent) == model_dir
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == before


def test_racing_processes_both_get_one_whole_copy(tmp_path: Path) -> None:
    code = (
        "import sys; from pathlib import Path; "
        "from deltarl.rl.tiny_model import ensure_default_model; "
        "print(ensure_default_model(Path(sys.argv[1])))"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outs == [str(tmp_path / MODEL_NAME)] * 2
    assert [p.name for p in tmp_path.iterdir()] == [MODEL_NAME]
    transformers.AutoTokenizer.from_pretrained(tmp_path / MODEL_NAME)


def test_default_dir_follows_deltarl_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DELTARL_HOME", str(tmp_path))
    assert tiny_model.default_model_dir() == tmp_path / "models" / MODEL_NAME
    monkeypatch.delenv("DELTARL_HOME")
    assert tiny_model.default_model_dir() == Path.home() / ".cache/deltarl/models" / MODEL_NAME
