"""The embedded default model: a tiny Qwen2 and a byte-level BPE tokenizer, made locally.

``deltarl up`` must run with no download, so the default policy is built on first use from
nothing but seeds and text that ships with Python: a Qwen2-shaped ``transformers`` config of
about a million parameters, weights drawn from a seeded generator and saved as bf16
safetensors (what the rollout engine serves; the trainer loads them into fp32), and a
byte-level BPE tokenizer trained on a fixed list of standard-library sources. The result is an
ordinary Hugging Face model directory that ``transformers`` and vLLM both load.

The directory is built under a temporary name and renamed into place, so a reader never sees
a half-written model and two processes that race to build it both end up with one whole copy.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import shutil
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from tokenizers import Tokenizer

MODEL_NAME = "tiny-qwen2-v1"
"""Bump the suffix whenever anything below changes the files: old caches then stay valid."""

SEED = 20240917
EOS_TOKEN = "<|endoftext|>"  # noqa: S105 - a token's spelling, not a secret
PAD_TOKEN = "<|pad|>"  # noqa: S105

# Qwen2 shape, scaled down. vocab is a multiple of 64 (what GPU kernels like); untied
# embeddings, because tied ones make vLLM skip lm_head.weight when loading, and a refit must
# be able to address every tensor the trainer publishes under its own name.
VOCAB_SIZE = 1024
HIDDEN = 128
LAYERS = 4
HEADS = 4
KV_HEADS = 2
INTERMEDIATE = 384
MAX_POSITIONS = 2048
INIT_STD = 0.02

# Standard-library sources the tokenizer learns from: plain, stable modules present in every
# CPython 3.11 build (code and English docstrings, the text a toy policy will see). Paths are
# relative to sysconfig's stdlib directory; order matters for reproducibility.
TRAINING_SOURCES = (
    "textwrap.py",
    "string.py",
    "heapq.py",
    "bisect.py",
    "functools.py",
    "argparse.py",
    "calendar.py",
    "fractions.py",
    "difflib.py",
    "json/decoder.py",
    "json/encoder.py",
    "csv.py",
    "random.py",
    "statistics.py",
)


def deltarl_home() -> Path:
    """Where deltarl keeps generated files: ``$DELTARL_HOME``, else ``~/.cache/deltarl``."""
    env = os.environ.get("DELTARL_HOME")
    return Path(env) if env else Path.home() / ".cache" / "deltarl"


def models_root() -> Path:
    return deltarl_home() / "models"


def default_model_dir() -> Path:
    """The default model's directory (it may not exist yet: see ``ensure_default_model``)."""
    return models_root() / MODEL_NAME


def ensure_default_model(root: Path | None = None) -> Path:
    """The default model's directory under ``root`` (default ``models_root()``), built if missing.

    Returns ``root / MODEL_NAME``. Safe to call from several processes at once: each builds in
    its own temporary directory and the first rename wins; the others discard their copy.
    """
    root = models_root() if root is None else Path(root)
    final = root / MODEL_NAME
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{MODEL_NAME}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    tmp.mkdir()
    try:
        _build(tmp)
        try:
            # rename(2) onto an existing non-empty directory fails, so at most one copy wins.
            tmp.rename(final)
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not final.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


# ---- building ---------------------------------------------------------------------------


def _build(out: Path) -> None:
    tokenizer = _train_tokenizer()
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    pad_id = tokenizer.token_to_id(PAD_TOKEN)
    _save_tokenizer(tokenizer, out)
    _save_config(out, eos_id=eos_id, pad_id=pad_id)
    _save_weights(out)
    (out / "deltarl_model.json").write_text(
        json.dumps(
            {
                "name": MODEL_NAME,
                "seed": SEED,
                "tokenizer_sources": list(TRAINING_SOURCES),
                # The sources are this interpreter's files: another CPython release may train a
                # slightly different tokenizer, so record which one made this copy.
                "python": sys.version.split()[0],
            },
            indent=2,
        )
        + "\n"
    )


def _training_text() -> Iterator[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for rel in TRAINING_SOURCES:
        path = stdlib / rel
        try:
            yield path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise FileNotFoundError(
                f"the default model's tokenizer is trained on Python's own sources, but "
                f"{path} is missing (is this a stripped Python install without .py files?)"
            ) from None


def _train_tokenizer() -> Tokenizer:
    # tokenizers is imported here, not at module level: the directory helpers above are used
    # by processes that never build a model.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: PLC0415

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        # Every byte is a token, so any text encodes, whatever the training set held.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_text(), trainer=trainer)
    if tok.get_vocab_size() > VOCAB_SIZE:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, over {VOCAB_SIZE}")
    return tok


def _save_tokenizer(tok: Tokenizer, out: Path) -> None:
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415 - heavy import

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, bos_token=None
    )
    fast.model_max_length = MAX_POSITIONS
    fast.save_pretrained(out)


def _save_config(out: Path, *, eos_id: int, pad_id: int) -> None:
    from transformers import GenerationConfig, Qwen2Config  # noqa: PLC0415 - heavy import

    config = Qwen2Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=MAX_POSITIONS,
        max_window_layers=LAYERS,
        tie_word_embeddings=False,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        initializer_range=INIT_STD,
        dtype="bfloat16",
    )
    config.architectures = ["Qwen2ForCausalLM"]
    config.save_pretrained(out)
    GenerationConfig(bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=pad_id).save_pretrained(
        out
    )


def weight_shapes() -> list[tuple[str, tuple[int, ...]]]:
    """The model's tensors (Hugging Face state-dict names) and shapes, in a fixed order."""
    head_dim = HIDDEN // HEADS
    kv = KV_HEADS * head_dim
    shapes: list[tuple[str, tuple[int, ...]]] = [
        ("model.embed_tokens.weight", (VOCAB_SIZE, HIDDEN))
    ]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes += [
            (p + "input_layernorm.weight", (HIDDEN,)),
            (p + "self_attn.q_proj.weight", (HIDDEN, HIDDEN)),
            (p + "self_attn.q_proj.bias", (HIDDEN,)),
            (p + "self_attn.k_proj.weight", (kv, HIDDEN)),
            (p + "self_attn.k_proj.bias", (kv,)),
            (p + "self_attn.v_proj.weight", (kv, HIDDEN)),
            (p + "self_attn.v_proj.bias", (kv,)),
            (p + "self_attn.o_proj.weight", (HIDDEN, HIDDEN)),
            (p + "post_attention_layernorm.weight", (HIDDEN,)),
            (p + "mlp.gate_proj.weight", (INTERMEDIATE, HIDDEN)),
            (p + "mlp.up_proj.weight", (INTERMEDIATE, HIDDEN)),
            (p + "mlp.down_proj.weight", (HIDDEN, INTERMEDIATE)),
        ]
    shapes += [("model.norm.weight", (HIDDEN,)), ("lm_head.weight", (VOCAB_SIZE, HIDDEN))]
    return shapes


def initial_weights() -> dict[str, np.ndarray]:
    """The seeded fp32 initial weights: N(0, INIT_STD) matrices, unit norms, zero biases.

    Drawn with numpy's PCG64 rather than transformers' initialisers, whose code (and so the
    values) changes between releases; the model must be the same wherever it is rebuilt.
    """
    rng = np.random.Generator(np.random.PCG64(SEED))
    out: dict[str, np.ndarray] = {}
    for name, shape in weight_shapes():
        if name.endswith("norm.weight"):
            out[name] = np.ones(shape, np.float32)
        elif name.endswith(".bias"):
            out[name] = np.zeros(shape, np.float32)
        else:
            out[name] = (rng.standard_normal(shape, dtype=np.float32) * INIT_STD).astype(np.float32)
    return out


def _save_weights(out: Path) -> None:
    import torch  # noqa: PLC0415 - heavy import
    from safetensors.torch import save_file  # noqa: PLC0415

    tensors = {
        name: torch.from_numpy(arr).to(torch.bfloat16) for name, arr in initial_weights().items()
    }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def parameter_count() -> int:
    return sum(int(np.prod(shape)) for _, shape in weight_shapes())
