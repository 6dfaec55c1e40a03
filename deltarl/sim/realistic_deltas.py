"""Successive bf16 versions produced the way a trainer produces them.

fp32 master weights of a Llama-shaped parameter set, real gradients (next-token loss of the
model on random tokens), AdamW at an RL learning rate (1e-6 by default), cast to bf16 after
every step and laid out in one flat buffer. Most updates are below bf16's resolution and
round away; the fraction that does not is what the codec sees. It is measured by whoever
uses this (the changed ratio is never assumed).
"""

from __future__ import annotations

import numpy as np
import torch

from deltarl.codecs.checksum import DigestsAsWritten
from deltarl.engine.layout import Layout
from deltarl.sim.tiny_transformer import TinyCausalLM, TinyConfig


class RealisticDeltas:
    """A tiny trainer. ``version`` counts optimizer steps; ``publish`` gives the bf16 bytes."""

    def __init__(
        self,
        params: int,
        *,
        seed: int = 0,
        lr: float = 1e-6,
        weight_decay: float = 0.01,
        batch: int = 4,
        seq: int = 64,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.model = TinyCausalLM(TinyConfig.for_params(params))
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=lr, weight_decay=weight_decay
        )
        self._gen = gen
        self._batch, self._seq = batch, seq
        self._params = list(self.model.named_parameters())
        self.layout = Layout.pack((n, "bfloat16", tuple(p.shape)) for n, p in self._params)
        self.version = 0

    @property
    def param_count(self) -> int:
        return sum(p.numel() for _, p in self._params)

    def step(self) -> float:
        """One optimizer step on a fresh random batch; returns the loss."""
        vocab = self.model.config.vocab_size
        tokens = torch.randint(0, vocab, (self._batch, self._seq + 1), generator=self._gen)
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.model.loss(tokens)
        loss.backward()
        self.optimizer.step()
        self.version += 1
        return float(loss.detach())

    def publish(
        self, out: np.ndarray | None = None, *, digests: list[str] | None = None
    ) -> np.ndarray:
        """The current bf16 weights as a flat uint8 buffer (into ``out`` if given); with
        ``digests``, each tensor's xxh3-128 is appended to it as the tensor is written, as the
        trainer's publisher does (deltarl/trainer/publisher.py)."""
        if out is None:
            out = np.zeros(self.layout.nbytes, np.uint8)
        with torch.no_grad(), DigestsAsWritten() as hashes:
            for tid, (_, p) in enumerate(self._params):
                bits = self.layout.view(out, tid)
                torch.from_numpy(bits).view(torch.bfloat16).copy_(
                    p.detach().reshape(-1).to(torch.bfloat16)
                )
                if digests is not None:
                    hashes.add(bits)  # while the bytes are in cache
            if digests is not None:
                digests += hashes.digests()
        return out
