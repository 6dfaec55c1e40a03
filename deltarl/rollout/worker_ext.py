"""The vLLM worker extension that loads a weight version from the rollout WeightStore.

vLLM mixes this class into its worker (``worker_extension_cls``), and the engine calls its
methods through ``collective_rpc``. Only small control values cross that call (a store name,
a directory, a version): the tensors never leave the worker's process, which maps the shared
memory segment itself and reads the leased version zero-copy.

Why ``reload_weights`` and not editing parameters: on CPU (and for quantised or fused layers
anywhere) vLLM repacks weights after loading, so writing a parameter's ``.weight`` in place
is silently ignored. ``Worker.reload_weights(weights_iterator=...)`` runs the model's own
``load_weights`` and the post-load processing, layer by layer.

Only changed tensors: the extension remembers the digest of every tensor it last handed to
vLLM, and hands over only what differs. vLLM's layerwise reload processes a *whole* vLLM
layer once all of its elements arrived, and rebuilds a partly loaded layer from empty
storage: so a changed ``q_proj.weight`` drags the whole fused ``qkv_proj`` layer (q, k, v,
weights and biases) along. The grouping comes from the model's ``packed_modules_mapping``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deltarl.codecs.checksum import model_digest, tensor_digest
from deltarl.engine.weight_store import Snapshot, WeightStore

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

QUALNAME = "deltarl.rollout.worker_ext.DeltaWorkerExtension"
"""What ``VllmEngine`` passes as vLLM's ``worker_extension_cls``."""


def layer_key(name: str, packed: dict[str, list[str]]) -> str:
    """The vLLM layer that loads the HF tensor ``name``: ``...q_proj.bias`` -> ``...qkv_proj``.

    ``packed`` is the model's ``packed_modules_mapping`` (fused layer -> its HF parts).
    """
    module = name.rpartition(".")[0]
    parent, _, leaf = module.rpartition(".")
    for fused, parts in packed.items():
        if leaf in parts:
            return f"{parent}.{fused}" if parent else fused
    return module


def tensors_to_load(
    names: list[str],
    digests: dict[str, str],
    previous: dict[str, str] | None,
    packed: dict[str, list[str]],
) -> list[str]:
    """The tensors to hand to vLLM: every one whose layer holds a changed tensor.

    ``previous`` is what vLLM holds (None: unknown, so everything). A layer is loaded whole or
    not at all, because vLLM rebuilds a partly loaded layer from empty storage.
    """
    if previous is None or set(previous) != set(names):
        return list(names)
    dirty = {layer_key(n, packed) for n in names if digests[n] != previous[n]}
    return [n for n in names if layer_key(n, packed) in dirty]


class DeltaWorkerExtension:
    """Mixed into vLLM's worker; ``self`` is the worker (``self.model_runner``, ...)."""

    # What this worker's model holds, name -> digest, as last handed over; None when unknown
    # (loaded from the model directory, or a load failed half-way).
    _deltarl_digests: dict[str, str] | None = None
    _deltarl_version: int | None = None

    def deltarl_load_version(
        self,
        store_name: str,
        store_root: str | None = None,
        expected_version: int | None = None,
        only_changed: bool = True,
    ) -> dict[str, Any]:
        """Load the store's active version into the model; its version, digest and costs.

        ``expected_version``: refuse (ValueError) if the active version is another one, e.g.
        because the pointer moved on or rolled back since the caller looked. ``only_changed``:
        hand vLLM only the layers whose tensors changed since the last load (False: all).
        Returns ``version``, ``digest`` (model digest over all the version's tensors, equal to
        the store's and the manifest's when bit-exact), ``tensors`` (how many were handed
        over), ``total`` (in the version), and timings in seconds.
        """
        t0 = time.perf_counter()
        root = None if store_root is None else Path(store_root)
        with (
            WeightStore.open(store_name, root=root, readonly=True) as store,
            store.lease() as snap,
        ):
            if expected_version is not None and snap.version != expected_version:
                raise ValueError(
                    f"weight store {store_name!r} holds version {snap.version}, not the "
                    f"expected {expected_version}: it moved on or rolled back meanwhile"
                )
            names = [spec.name for spec in snap.layout.tensors]
            # Hash the leased bytes: the very memory handed to vLLM below, and frozen by the
            # lease until it is released after the load.
            digests = {name: tensor_digest(snap.array(i)) for i, name in enumerate(names)}
            t_hash = time.perf_counter()
            previous = self._deltarl_digests if only_changed else None
            chosen = tensors_to_load(names, digests, previous, self._deltarl_packed())
            self._deltarl_digests = None  # unknown until the load below completes
            if chosen:
                self.reload_weights(weights_iterator=_iter_tensors(snap, chosen))  # type: ignore[attr-defined]
            self._deltarl_digests = digests
            self._deltarl_version = snap.version
            version = snap.version
        t_end = time.perf_counter()
        logger.info(
            "loaded weight version %d: %d of %d tensors in %.3f s",
            version,
            len(chosen),
            len(names),
            t_end - t0,
        )
        return {
            "version": version,
            "digest": model_digest(digests[n] for n in names),
            "tensors": len(chosen),
            "total": len(names),
            "seconds": t_end - t0,
            "hash_seconds": t_hash - t0,
            "load_seconds": t_end - t_hash,
        }

    def deltarl_status(self) -> dict[str, Any]:
        """The version this worker last loaded from a store (None: still the model's files)."""
        return {"version": self._deltarl_version, "known": self._deltarl_digests is not None}

    def _deltarl_packed(self) -> dict[str, list[str]]:
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        packed = getattr(model, "packed_modules_mapping", None) or {}
        return {str(k): [str(p) for p in v] for k, v in dict(packed).items()}


def _iter_tensors(snap: Snapshot, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    # Zero-copy views into the leased buffer; vLLM's weight loaders copy them into the
    # model's storage, and never write into a loaded tensor.
    for name in names:
        yield name, snap.tensor(name)
