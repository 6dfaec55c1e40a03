"""Tiny Hugging Face models for the trainer tests, built here (no download, no tokenizer)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from deltarl.rl.samples import Group, Sample, encode_group
from deltarl.trainer.grpo import ScoredGroup
from deltarl.transport.blobs import blob_digest

VOCAB = 256


def tiny_config() -> Qwen2Config:
    # Tied embeddings: the published layout must then list the embedding once, as vLLM loads it.
    return Qwen2Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )


def tiny_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(), dtype=torch.float32)
    model.eval()
    return model


def save_tiny_model(path: Path, seed: int = 0) -> Path:
    tiny_model(seed).save_pretrained(path)
    return path


@torch.no_grad()
def sample_groups(
    model: torch.nn.Module,
    prompts: list[list[int]],
    *,
    n: int,
    max_tokens: int,
    generator: torch.Generator,
    reward: Callable[[list[int]], float],
) -> list[ScoredGroup]:
    """``n`` sampled completions per prompt with the log-probs an engine would record, as
    the trainer decodes them (``reward`` maps a completion to its reward)."""
    groups = []
    for pi, prompt in enumerate(prompts):
        seqs = torch.tensor([prompt] * n, dtype=torch.int64)
        logprobs = []
        for _ in range(max_tokens):
            logits = model(input_ids=seqs, use_cache=False).logits[:, -1].float()
            lp = torch.log_softmax(logits, dim=-1)
            tok = torch.multinomial(lp.exp(), 1, generator=generator)
            logprobs.append(lp.gather(-1, tok))
            seqs = torch.cat([seqs, tok], dim=1)
        lps = torch.cat(logprobs, dim=1)
        samples, rewards = [], []
        for i in range(n):
            completion = seqs[i, len(prompt) :].tolist()
            samples.append(
                Sample(
                    list(prompt), completion, lps[i].tolist(), [0] * len(completion), "", "length"
                )
            )
            rewards.append(float(reward(completion)))
        groups.append(ScoredGroup(Group(f"g{pi}", pi, tuple(samples)), tuple(rewards)))
    return groups


def shipped(groups: list[ScoredGroup]) -> tuple[list[dict[str, object]], dict[str, bytes]]:
    """``groups`` as a scheduler ships them: ``Batch.groups`` items naming their samples by
    digest, and the blobs its samples endpoint serves for those digests."""
    items, blobs = [], {}
    for g in groups:
        data = encode_group(g.group)
        digest = blob_digest(data)
        blobs[digest] = data
        items.append(
            {
                "group_id": g.group.group_id,
                "prompt_id": g.group.prompt_id,
                "samples_ref": digest,
                "rewards": list(g.rewards),
                "lag": 0,
            }
        )
    return items, blobs
