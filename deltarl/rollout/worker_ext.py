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

import contextlib
import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deltarl.codecs.checksum import model_digest, tensor_digest
from deltarl.engine.placement import ModelShape, PlacementMap
from deltarl.engine.weight_store import Snapshot, WeightStore

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

MAX_NAMED = 8  # tensors a load's report names as differing from the committed digests
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
    # The placement map of the store's layout at this worker's tensor-parallel degree, and
    # what it was built for (built once per layout, not per load).
    _deltarl_map: PlacementMap | None = None
    _deltarl_map_key: tuple[Any, int] | None = None

    def deltarl_kv_namespace(self, name: str) -> None:
        """The KV pool's namespace in this worker's process (``kv_pool.py``)."""
        from deltarl.rollout.kv_pool import set_namespace  # noqa: PLC0415 - only with a pool

        set_namespace(name)

    def deltarl_load_version(
        self,
        store_name: str,
        store_root: str | None = None,
        expected_version: int | None = None,
        only_changed: bool = True,
    ) -> dict[str, Any]:
        """Load the store's active version into the model, verify it; its version and digest.

        ``expected_version``: refuse (ValueError) if the active version is another one, e.g.
        because the pointer moved on or rolled back since the caller looked. ``only_changed``:
        hand vLLM only the layers whose tensors changed since the last load (False: all).

        What is proven, and how (any failure raises WeightVerificationError, and the worker
        then counts its weights as unknown, so the next load hands over everything):

        * Consumed bytes: every tensor handed over is hashed (xxh3-128) inside the weights
          iterator at the moment vLLM's loader pulls it, i.e. the bytes the loader received,
          from the lease that keeps them frozen until the load ends. If the loader did not
          pull every tensor handed over (stopped early, a layer not reached), the load fails.
        * Loader coverage: where the model's ``load_weights`` reports what it loaded (vLLM
          parameter names), every parameter of the handed-over layers must be among them,
          so a name the loader received but skipped fails the load.
        * Read-back: after the load and vLLM's post-load processing, every model parameter
          whose checkpoint form is known is read back from the engine's model and compared
          bit for bit with the store, whether or not it was handed over this time: those
          that keep the checkpoint's name and shape (embeddings, norms, an untied lm_head),
          and the fused or tensor-parallel ones (qkv_proj, gate_up_proj, a rank's shard of
          any), which the placement map (``engine/placement.py``) assembles for this rank
          from only the store's rectangles that feed it. A float32 engine holds the bf16
          tensors widened: those are compared with the store's widened to float32 (exact).
        * ``digest``: the model digest (``codecs.checksum.model_digest``, layout order) of the
          consumed digests, plus the remembered digests of the layers not handed over (which
          were consumed by an earlier load). Equal to the manifest's when bit-exact.

        Not proven: parameters repacked into a kernel format (vLLM-CPU's oneDNN linear
        weights on AVX-512, quantised weights) or padded (a vocabulary padded for tensor
        parallelism) cannot be read back in the checkpoint format; for them, the consumed
        bytes are what is proven, not the kernel-format tensors vLLM derived from them.
        Likewise a kernel's private copy of a read-back parameter (the CPU lm_head GEMM
        keeps a packed copy) is derived from the parameter by vLLM, not compared.

        Returns ``version``, ``digest``, ``manifest_digest`` (the digest the apply agent
        committed with this version, read under the same lease: what ``digest`` must equal;
        None for a store written without one), ``tensors`` (how many were handed over and consumed),
        ``total`` (in the version), ``readback_tensors`` (how many were read back and equal),
        ``chosen_by`` (how the changed layers were found: "committed" tensor digests, "hashed"
        from the leased bytes, or "all" handed over), ``differ`` (up to ``MAX_NAMED`` tensors
        the engine holds otherwise than the digests committed with the version say; empty
        without them) and ``differ_count``, and timings in seconds.
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
            # The tensor digests the apply agent committed with the version (verified against
            # these bytes before its flip), or None: read once, under the lease.
            committed = snap.tensor_digests
            previous = self._deltarl_digests if only_changed else None
            packed = self._deltarl_packed()
            chosen_by = "all"
            if previous is None or set(previous) != set(names):
                chosen = list(names)  # everything: no need to hash ahead to choose
            else:
                # What changed: from the committed digests, else from the leased bytes, a
                # pass over the model. Either only chooses what is handed over: the reported
                # digest comes from the bytes consumed below, and a tensor not handed over
                # counts with the digest the engine already holds, so a table that lied
                # could make the load fail its checks, never pass a wrong engine.
                if committed is not None:
                    ahead, chosen_by = dict(zip(names, committed, strict=True)), "committed"
                else:
                    ahead = {name: tensor_digest(snap.array(name)) for name in names}
                    chosen_by = "hashed"
                chosen = tensors_to_load(names, ahead, previous, packed)
            t_hash = time.perf_counter()
            self._deltarl_digests = None  # unknown until the load below is verified
            consumed: dict[str, str] = {}
            if chosen:
                model = self.model_runner.get_model()  # type: ignore[attr-defined]
                with _loaded_names(model) as loaded:
                    self.reload_weights(  # type: ignore[attr-defined]
                        weights_iterator=_iter_hashed(snap, chosen, consumed)
                    )
                missing = [n for n in chosen if n not in consumed]
                if missing:
                    raise WeightVerificationError(
                        f"vLLM's loader did not take {len(missing)} of the {len(chosen)} "
                        f"tensors handed over for version {snap.version}, e.g. {missing[:3]}"
                    )
                skipped = _skipped_params(model, chosen, packed, loaded)
                if skipped:
                    raise WeightVerificationError(
                        f"vLLM's loader took but did not load {len(skipped)} parameters of "
                        f"version {snap.version}'s layers, e.g. {skipped[:3]}"
                    )
            t_load = time.perf_counter()
            digests = {name: consumed.get(name) or (previous or {})[name] for name in names}
            try:
                readback = self._deltarl_readback(snap)
            except WeightVerificationError:
                if not snap.revoked:
                    raise
                readback = 0  # the store changed under the read-back: told below
            if snap.revoked:
                # This load outlasted the apply agent's lease bound, which then wrote into
                # the buffer (I4 in weight_store.py): what the engine took may be torn. Its
                # weights are unknown (the next load hands over everything); the caller is
                # told, and loads the newest version.
                logger.warning(
                    "the lease on version %d was revoked during the load: discarded",
                    snap.version,
                )
                return {"version": snap.version, "revoked": True, "digest": None}
            self._deltarl_digests = digests
            self._deltarl_version = snap.version
            version = snap.version
            manifest_digest = snap.digest
            # Which tensors the engine holds otherwise than the committed digests say: what
            # an operator needs when the model digests differ (empty when they agree).
            differ = (
                []
                if committed is None
                else [n for n, c in zip(names, committed, strict=True) if digests[n] != c]
            )
        t_end = time.perf_counter()
        logger.info(
            "loaded weight version %d: %d of %d tensors, %d read back, in %.3f s",
            version,
            len(chosen),
            len(names),
            readback,
            t_end - t0,
        )
        return {
            "version": version,
            "digest": model_digest(digests[n] for n in names),
            "manifest_digest": manifest_digest,
            "differ": differ[:MAX_NAMED],
            "differ_count": len(differ),
            "tensors": len(chosen),
            "total": len(names),
            "readback_tensors": readback,
            "seconds": t_end - t0,
            "hash_seconds": t_hash - t0,
            "chosen_by": chosen_by,
            "load_seconds": t_load - t_hash,
            "readback_seconds": t_end - t_load,
        }

    def _deltarl_readback(self, snap: Snapshot) -> int:
        """Compare every engine parameter whose checkpoint form is known with the store,
        bitwise: those stored 1:1 (name, shape), and the fused or tensor-parallel ones
        (``qkv_proj``, ``gate_up_proj``, a rank's shard) through the placement map, which
        builds this rank's tensor from only the store's rectangles that feed it. The dtype
        must be the store's or a float32 widening of bf16; anything else is not readable as
        loaded (repacked into a kernel format, padded, quantised) and is skipped."""
        import torch  # noqa: PLC0415 - in the worker's process, torch is loaded anyway

        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        placement = self._deltarl_placement(snap)
        compared = 0
        for name, param in model.named_parameters():
            want = self._deltarl_expected(snap, placement, name, tuple(param.shape))
            if want is None:
                continue  # renamed, repacked or padded: not readable as loaded
            if param.dtype != want.dtype:
                if (param.dtype, want.dtype) != (torch.float32, torch.bfloat16):
                    continue  # a conversion that may round: nothing exact to compare
                # A float32 engine (vLLM casts the bf16 checkpoint on load). Widening bf16 to
                # float32 is exact and one-to-one, so the engine's parameter must equal the
                # widened store tensor bit for bit; comparing this way round (rather than
                # narrowing the parameter) also catches stray low mantissa bits.
                want = want.to(torch.float32)
            have = param.detach().contiguous().reshape(-1).view(torch.uint8)
            ref = want.contiguous().reshape(-1).view(torch.uint8).to(have.device)
            if not torch.equal(have, ref):
                differ = int((have != ref).sum())
                raise WeightVerificationError(
                    f"engine parameter {name} differs from version {snap.version} in "
                    f"the store ({differ} of {have.numel()} bytes) after the load"
                )
            compared += 1
        return compared

    def _deltarl_expected(
        self,
        snap: Snapshot,
        placement: tuple[PlacementMap, int] | None,
        name: str,
        shape: tuple[int, ...],
    ) -> torch.Tensor | None:
        """What parameter ``name`` of this rank must hold, from the leased store; None if
        neither the store (1:1) nor the placement map gives a tensor of its shape."""
        import torch  # noqa: PLC0415

        if name in snap.layout and snap.layout.spec(name).shape == shape:
            return snap.tensor(name)  # stored 1:1 (at any tensor-parallel degree)
        if placement is None:
            return None
        pmap, rank = placement
        layout = pmap.inference_layout(rank)
        if name not in layout or layout.spec(name).shape != shape:
            return None
        bits = pmap.assemble(rank, name, snap.array)
        dtype = getattr(torch, layout.spec(name).dtype)
        return torch.from_numpy(bits).view(dtype)

    def _deltarl_placement(self, snap: Snapshot) -> tuple[PlacementMap, int] | None:
        """This worker's placement map and tensor-parallel rank, for a model the map knows
        whose store holds exactly the map's trainer tensors; None otherwise (then only the
        1:1 parameters are compared, and only at tensor-parallel degree 1)."""
        from vllm.distributed import (  # noqa: PLC0415 - vLLM's, in its worker
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        key = (snap.layout, get_tensor_model_parallel_world_size())
        if self._deltarl_map_key != key:
            self._deltarl_map_key, self._deltarl_map = key, None
            config = self.model_runner.model_config.hf_config.to_dict()  # type: ignore[attr-defined]
            try:
                pmap = PlacementMap(ModelShape.from_hf_config(config), key[1])
            except ValueError as e:
                logger.info("no placement map for this model (%s): 1:1 read-back only", e)
            else:
                trainer = pmap.trainer_layout()
                # By name: the store's order is its own (a safetensors file sorts by name).
                if {t.name: t.shape for t in trainer.tensors} == {
                    t.name: t.shape for t in snap.layout.tensors
                }:
                    self._deltarl_map = pmap
        if self._deltarl_map is None:
            return None
        return self._deltarl_map, get_tensor_model_parallel_rank()

    def deltarl_status(self) -> dict[str, Any]:
        """The version this worker last loaded from a store (None: still the model's files)."""
        return {"version": self._deltarl_version, "known": self._deltarl_digests is not None}

    def _deltarl_packed(self) -> dict[str, list[str]]:
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        packed = getattr(model, "packed_modules_mapping", None) or {}
        return {str(k): [str(p) for p in v] for k, v in dict(packed).items()}


class WeightVerificationError(RuntimeError):
    """The engine's weights after a load are not provably the store's version."""


def _iter_hashed(
    snap: Snapshot, names: list[str], consumed: dict[str, str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Zero-copy views into the leased buffer, each hashed into ``consumed`` as it is pulled.

    The hash is taken when vLLM asks for the tensor, so ``consumed`` holds exactly what the
    loader received; vLLM's weight loaders copy the views and never write into them.
    """
    for name in names:
        consumed[name] = tensor_digest(snap.array(name))
        yield name, snap.tensor(name)


@dataclass
class _Loaded:
    names: set[str] | None = None
    """What ``model.load_weights`` reported loading (vLLM names); None: it reports nothing."""


@contextlib.contextmanager
def _loaded_names(model: torch.nn.Module) -> Iterator[_Loaded]:
    """Capture what ``model.load_weights`` returns while vLLM reloads the weights."""
    loaded = _Loaded()
    original = model.load_weights
    own = "load_weights" in vars(model)

    def load_weights(
        weights: Iterable[tuple[str, torch.Tensor]], *args: object, **kwargs: object
    ) -> Iterable[str] | None:
        result = original(weights, *args, **kwargs)
        loaded.names = None if result is None else {str(n) for n in result}
        return result

    model.load_weights = load_weights  # type: ignore[method-assign]
    try:
        yield loaded
    finally:
        if own:
            model.load_weights = original  # type: ignore[method-assign]
        else:
            del model.load_weights  # the class's method again


def _skipped_params(
    model: torch.nn.Module, chosen: list[str], packed: dict[str, list[str]], loaded: _Loaded
) -> list[str]:
    """Parameters of the layers handed over that the loader did not report as loaded."""
    names = loaded.names
    if names is None:
        return []
    layers = {layer_key(n, packed) for n in chosen}
    return [
        name
        for name, _ in model.named_parameters()
        if name.rpartition(".")[0] in layers and name not in names
    ]
