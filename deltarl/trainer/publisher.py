"""Publish the trainer's parameters as bf16 into the published WeightStore, one version a step.

The layout is the model's parameters in ``model.named_parameters()`` order, under their
Hugging Face state-dict names, as bf16 with their shapes: the names vLLM's weight loader
takes, and the values it would hold had it loaded those fp32 tensors and cast them to bf16
(``Tensor.copy_`` into a bf16 tensor rounds to nearest-even, as ``.to(torch.bfloat16)`` does).
Tied parameters appear once, under their first name (for a tied LM head, the embedding), as
``named_parameters`` lists them and as vLLM ties them again on load.

Each tensor is hashed (xxh3-128) right after it is written, while its bytes are still in
cache, on the hash pool while the next is copied (``DigestsAsWritten``), and the digests are
committed with the version: the export agent sends them instead of
hashing the model on the refit's path, and every receiver checks its bytes against what the
trainer wrote (a change to the published bytes after the commit is caught, not passed on).

The store is the trainer's: created on the first run, opened on a restart (the export agent
may still hold it, so it is never replaced) with a check that its layout is the model's.
It is not removed at exit: its active version stays what the newest checkpoint holds or what
a restart republishes. Version v is the weights after optimizer step v; version 0 the
initial weights.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from deltarl.codecs.checksum import DigestsAsWritten
from deltarl.engine.layout import Layout
from deltarl.engine.weight_store import WeightStore

logger = logging.getLogger(__name__)


def layout_of(model: nn.Module) -> Layout:
    """The published layout of ``model``: its parameters, in order, as bf16."""
    return Layout.pack((name, "bfloat16", tuple(p.shape)) for name, p in model.named_parameters())


class Publisher:
    """Writes bf16 versions of one model's parameters into one WeightStore."""

    def __init__(self, model: nn.Module, name: str, *, root: Path | None = None) -> None:
        self.model = model
        self.layout = layout_of(model)
        try:
            # Opening first: a store left by an earlier run of this trainer may be held by the
            # export agent, which create() would refuse to replace.
            self.store = WeightStore.open(name, root=root, layout=self.layout)
            logger.info("opened published store %s (version %s)", name, self.active_version)
        except FileNotFoundError:
            self.store = WeightStore.create(name, self.layout, root=root)

    @property
    def active_version(self) -> int | None:
        return self.store.active_version

    def publish(
        self, version: int, *, allow_older: bool = False, digest: str | None = None
    ) -> None:
        """Commit the current parameters, rounded to bf16, as ``version``, with each tensor's
        digest (``WriteTxn.commit``'s ``tensor_digests``).

        Each parameter is copied straight into its slot of the target buffer (the cast
        happens inside ``copy_``), so no full-size bf16 copy of the model is made.
        ``allow_older`` lets a restart make an older checkpoint's version active again.
        ``digest``: commit this model digest instead of the tensors' (a caller that vouches
        for another; no tensor digests are kept then, they would disagree with it).
        """
        params = list(self.model.named_parameters())
        with torch.no_grad(), self.store.begin_write() as txn, DigestsAsWritten() as hashes:
            buf = txn.buffer
            for tid, (name, p) in enumerate(params):
                spec = self.layout.tensors[tid]
                if spec.name != name or spec.shape != tuple(p.shape):
                    raise RuntimeError(
                        f"parameter {tid} is {name} {tuple(p.shape)} but the published layout "
                        f"has {spec.name} {spec.shape}: the model changed under the publisher"
                    )
                bits = self.layout.view(buf, tid)
                torch.from_numpy(bits).view(torch.bfloat16).copy_(p.detach().reshape(-1))
                if digest is None:
                    hashes.add(bits)  # while the bytes are in cache
            if digest is not None:
                txn.commit(version, allow_older=allow_older, digest=digest)
            else:
                txn.commit(version, allow_older=allow_older, tensor_digests=hashes.digests())

    def close(self) -> None:
        self.store.close()
