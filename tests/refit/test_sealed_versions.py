"""Defect: forged weights. With the cluster's data key, the apply agent activates only versions
whose manifest is sealed under it (a MAC) and whose every chunk matches the BLAKE2b-256 the
sealed manifest lists; a forger with a self-consistent version (xxh3 sums that all hold) gets
nothing activated. Without the key, a sealed manifest is refused (it could not be checked).
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deltarl.codecs.checksum import chunk_hash
from deltarl.codecs.decoder import VersionApply
from deltarl.codecs.encoder import DeltaEncoder
from deltarl.codecs.frame import CHUNKS_PER_SEND, FrameError, FrameHeader
from deltarl.codecs.manifest import RefitManifest
from deltarl.codecs.manifest_seal import SealError, open_sealed, seal
from deltarl.config.refit import ApplyConfig
from deltarl.engine.layout import Layout
from deltarl.engine.weight_store import WeightStore
from deltarl.refit.apply import ApplyCore
from deltarl.transport.base import ReceivedChunk, ReceivedManifest, make_receiver
from deltarl.transport.link_config import ShmLinkConfig
from tests.refit.test_apply_core import FeedContext, _versions

KEY = secrets.token_bytes(32)


def _core(tmp: Path, layout: Layout, key: bytes | None) -> tuple[ApplyCore, WeightStore]:
    store = WeightStore.create("r", layout, root=tmp)
    link = ShmLinkConfig(name="t", root=tmp)
    cfg = ApplyConfig(control="ipc:///unused", rollout_store="r", link=link, stalled_job_s=0.3)
    return ApplyCore(cfg, FeedContext(), store, make_receiver(link), mac_key=key), store


def _encode(
    layout: Layout, vs: list[np.ndarray], v: int, base: int | None, send: int = 0
) -> tuple[list[bytes], RefitManifest]:
    enc = DeltaEncoder(layout, chunk_bytes=64 << 10, hash_chunks=True)
    ref = None if base is None else vs[base]
    first = send * CHUNKS_PER_SEND
    e = enc.encode(vs[v], ref, target_version=v, base_version=base, first_chunk_id=first)
    chunks = [c.data for c in e]
    assert e.manifest is not None
    return chunks, e.manifest


async def _send(core: ApplyCore, v: int, chunks: list[bytes], manifest: bytes) -> None:
    for data in chunks:
        chunk_id = FrameHeader.parse(memoryview(data)).chunk_id
        await core._on_item(ReceivedChunk(v, chunk_id, data))
    await core._on_item(ReceivedManifest(v, manifest))


def test_only_versions_sealed_with_the_cluster_key_are_activated(tmp_path: Path) -> None:
    layout, vs = _versions(3)
    rng = np.random.default_rng(7)
    forged = rng.integers(0, 256, vs[0].size, dtype=np.uint8)  # the forger's weights

    async def scenario() -> None:
        core, store = _core(tmp_path, layout, KEY)
        chunks, manifest = _encode(layout, [forged], 0, None)
        # a self-consistent full version, unsealed / sealed with another key: refused
        await _send(core, 5, *_renumbered(manifest, 5))
        await _send(core, 6, *_renumbered(manifest, 6, key=secrets.token_bytes(32)))
        assert store.active_version is None
        assert core.seal_failures == 2
        # The forger's version 6 is open (its chunks' xxh3 hold; only the manifest, which never
        # came, could prove them): an older real version waits while 6 gets chunks...
        chunks, manifest = _encode(layout, vs, 0, None)
        await core._on_item(ReceivedChunk(0, 0, chunks[0]))
        assert core.job is not None
        assert core.job.version == 6
        # ... and replaces it once 6 has stalled; 6 is not remembered as failed
        await asyncio.sleep(0.4)
        await _send(core, 0, chunks, seal(manifest.to_json(), KEY))
        assert store.active_version == 0
        assert 6 not in core.finished
        # a chunk whose xxh3-64 the (sealed) manifest lists, but not its BLAKE2b-256: the
        # case of a forged chunk made to collide with xxh3. The version fails, 0 stays.
        chunks, manifest = _encode(layout, vs, 1, 0)
        entries = list(manifest.chunks)
        entries[0] = dataclasses.replace(entries[0], blake2b=chunk_hash(b"another chunk"))
        colliding = dataclasses.replace(manifest, chunks=entries)
        await _send(core, 1, chunks, seal(colliding.to_json(), KEY))
        assert store.active_version == 0
        assert "BLAKE2b" in core.receiver_state().failed_reason
        # sent again (the export agent's next send of it): activated, bit-exact
        chunks, manifest = _encode(layout, vs, 1, 0, send=1)
        await _send(core, 1, chunks, seal(manifest.to_json(), KEY))
        assert store.active_version == 1
        with store.lease() as snap:
            assert np.array_equal(snap.buffer, vs[1])
        await core.close()

    asyncio.run(scenario())


def _renumbered(
    manifest: RefitManifest, v: int, key: bytes | None = None
) -> tuple[list[bytes], bytes]:
    """The forger's version 0, made again as version ``v`` (as a forger would encode it)."""
    layout = Layout.pack([(t.name, t.dtype, tuple(t.shape)) for t in manifest.tensors])
    rng = np.random.default_rng(v)
    weights = rng.integers(0, 256, layout.nbytes, dtype=np.uint8)
    enc = DeltaEncoder(layout, chunk_bytes=64 << 10, hash_chunks=True)
    e = enc.encode(weights, None, target_version=v)
    out = [c.data for c in e]
    assert e.manifest is not None
    body = e.manifest.to_json()
    return out, body if key is None else seal(body, key)


def test_an_agent_without_the_key_refuses_a_sealed_manifest(tmp_path: Path) -> None:
    layout, vs = _versions(1)

    async def scenario() -> None:
        core, store = _core(tmp_path, layout, None)
        chunks, manifest = _encode(layout, vs, 0, None)
        await _send(core, 0, chunks, seal(manifest.to_json(), KEY))
        assert store.active_version is None
        assert core.seal_failures == 1
        await core.close()

    asyncio.run(scenario())


def test_verify_checks_chunk_hashes_only_when_asked(tmp_path: Path) -> None:
    layout, vs = _versions(1)
    chunks, manifest = _encode(layout, vs, 0, None)
    plain = dataclasses.replace(
        manifest, chunks=[dataclasses.replace(c, blake2b="") for c in manifest.chunks]
    )
    for hash_chunks, listed, ok in (
        (False, plain, True),
        (True, manifest, True),
        (True, plain, False),  # a keyed agent needs the hashes
    ):
        target = np.zeros_like(vs[0])
        apply = VersionApply(layout, target, None, base=None, version=0, hash_chunks=hash_chunks)
        for c in chunks:
            apply.apply(c)
        if ok:
            apply.verify(listed)
        else:
            with pytest.raises(FrameError, match="BLAKE2b"):
                apply.verify(listed)


def test_a_seal_opens_only_whole_and_under_its_key() -> None:
    body = b'{"version":1}'
    sealed = seal(body, KEY)
    assert open_sealed(sealed, KEY) == body
    assert open_sealed(body, None) == body
    for data, key, why in (
        (body, KEY, "not sealed"),
        (sealed, None, "no data key"),
        (sealed, secrets.token_bytes(32), "does not hold"),
        (sealed[:-1], KEY, "malformed"),
        (sealed + b"0", KEY, "malformed"),
        (body + b"\n" + b"x" * 88, KEY, "malformed"),
    ):
        with pytest.raises(SealError, match=why):
            open_sealed(data, key)


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=0), st.integers(min_value=1, max_value=255))
def test_any_changed_byte_breaks_the_seal(where: int, flip: int) -> None:
    sealed = bytearray(seal(b'{"version":7,"base_version":6,"kind":"delta"}', KEY))
    sealed[where % len(sealed)] ^= flip
    with pytest.raises(SealError):
        open_sealed(bytes(sealed), KEY)
