"""A Llama-shaped causal language model in plain torch, with Hugging Face parameter names.

It exists so that deltas are measured on real training dynamics without a download: the
parameter set has the shapes and names of a Llama checkpoint (so the placement map applies
to it), and its gradients come from a real loss. It is not the model the RL loop trains
(that one comes from transformers); it is the workload generator's engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812 - the conventional name


@dataclass(frozen=True)
class TinyConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def param_count(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        per_layer = 4 * h * h + 3 * h * i + 2 * h
        return 2 * v * h + self.num_layers * per_layer + h

    @classmethod
    def for_params(cls, params: int) -> TinyConfig:
        """A config of about ``params`` parameters with a Llama-like aspect ratio.

        Width grows with the square root of the size; the vocabulary is a quarter of the
        parameters at most (as in small Llama/Qwen models, where embeddings dominate).
        """
        if params < 10_000:
            raise ValueError(
                f"a transformer-shaped model needs at least 10k parameters, not {params}"
            )
        hidden = max(32, min(4096, int(math.sqrt(params / 190)) // 32 * 32))
        vocab = max(256, min(32000, params // 8 // hidden // 64 * 64))
        inter = (hidden * 11 // 4 + 31) // 32 * 32
        per_layer = 4 * hidden * hidden + 3 * hidden * inter + 2 * hidden
        layers = max(1, round((params - 2 * vocab * hidden - hidden) / per_layer))
        # Heads must divide the hidden size (a multiple of 32): head dim 64 where it fits,
        # else 32 (hidden // 64 heads broke the model at e.g. 25M parameters: 352 / 5).
        heads = hidden // 64 if hidden % 64 == 0 else hidden // 32
        return cls(vocab, hidden, inter, layers, heads)


class _RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class _Attention(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.heads = cfg.num_heads
        self.q_proj = nn.Linear(h, h, bias=False)
        self.k_proj = nn.Linear(h, h, bias=False)
        self.v_proj = nn.Linear(h, h, bias=False)
        self.o_proj = nn.Linear(h, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape

        def split(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, self.heads, h // self.heads).transpose(1, 2)

        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, h))


class _MLP(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.input_layernorm = _RMSNorm(cfg.hidden_size)
        self.self_attn = _Attention(cfg)
        self.post_attention_layernorm = _RMSNorm(cfg.hidden_size)
        self.mlp = _MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class _Backbone(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(_Layer(cfg) for _ in range(cfg.num_layers))
        self.norm = _RMSNorm(cfg.hidden_size)


class TinyCausalLM(nn.Module):
    """Parameter names match transformers' LlamaForCausalLM (untied embeddings)."""

    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = _Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        for name, p in self.named_parameters():
            if not name.endswith("norm.weight"):
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(tokens)
        for layer in self.model.layers:
            x = layer(x)
        return self.lm_head(self.model.norm(x))

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
