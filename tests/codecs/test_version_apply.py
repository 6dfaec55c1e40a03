"""VersionApply: every chunk at most once, the right version only, and a verify that passes only
when the manifest's chunks all arrived and every tensor hashes right (contracts 1 and 3)."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from deltarl.codecs.checksum import tensor_digest
from deltarl.codecs.decoder import ChecksumMismatchError, VersionApply
from deltarl.codecs.encoder import DeltaEncoder
from deltarl.codecs.frame import NO_BASE, FrameError
from deltarl.codecs.manifest import RefitManifest
from tests.codecs.forge import OFF_TARGET, Forged, patch, reseal
from tests.codecs.sample_delta import BASE, TARGET, Case

# -- VersionApply: duplicates, the manifest, verification -------------------------------------


def _apply_all(
    case: Case, *, inplace: bool = False, hash_early: bool = True
) -> tuple[VersionApply, np.ndarray]:
    ref = case.ref.copy()
    target = ref if inplace else case.ref.copy()
    apply = VersionApply(case.layout, target, ref, base=BASE, version=TARGET, hash_early=hash_early)
    for c in case.chunks:
        assert apply.apply(c) is True
    return apply, target


@pytest.mark.parametrize("inplace", [False, True], ids=["separate", "in-place"])
def test_duplicate_chunk_is_acknowledged_and_changes_nothing(case: Case, inplace: bool) -> None:
    apply, target = _apply_all(case, inplace=inplace)
    done = target.tobytes()
    assert done == case.cur.tobytes()
    for c in [case.chunks[0], case.chunks[-1], *case.chunks]:
        assert apply.apply(c) is False
    assert target.tobytes() == done
    apply.verify(case.chunks_manifest)


def test_duplicate_in_the_middle_of_a_version(case: Case) -> None:
    ref = case.ref.copy()
    apply = VersionApply(case.layout, ref, ref, base=BASE, version=TARGET)
    assert apply.apply(case.chunks[1]) is True
    snapshot = ref.tobytes()
    assert apply.apply(case.chunks[1]) is False
    assert ref.tobytes() == snapshot
    for c in reversed(case.chunks):
        apply.apply(c)
    assert ref.tobytes() == case.cur.tobytes()
    apply.verify(case.chunks_manifest)


def test_same_chunk_id_with_another_checksum_is_refused(case: Case) -> None:
    apply, target = _apply_all(case)
    done = target.tobytes()
    other = reseal(case.chunks[0][:-1] + bytes([case.chunks[0][-1] ^ 1]))
    with pytest.raises(FrameError, match=r"chunk 0 of version 4 arrived twice with different"):
        apply.apply(other)
    assert target.tobytes() == done


def test_chunk_of_another_version_with_an_applied_id(case: Case) -> None:
    apply, target = _apply_all(case)
    done = target.tobytes()
    later = patch(case.chunks[0], OFF_TARGET, "q", TARGET + 1)
    with pytest.raises(FrameError, match=r"frame is for version 5, expected version 4"):
        apply.apply(later)
    assert target.tobytes() == done


def test_verify_passes_after_all_chunks(case: Case) -> None:
    apply, _ = _apply_all(case)
    apply.verify(case.chunks_manifest)
    apply.verify(RefitManifest.from_json(case.chunks_manifest.to_json()))


def test_verify_fails_if_a_chunk_is_missing(case: Case) -> None:
    ref = case.ref.copy()
    apply = VersionApply(case.layout, case.ref.copy(), ref, base=BASE, version=TARGET)
    for c in case.chunks[:1] + case.chunks[2:]:
        apply.apply(c)
    with pytest.raises(FrameError, match=r"version 4: chunks \[1\] have not arrived"):
        apply.verify(case.chunks_manifest)


def test_verify_fails_if_a_chunk_was_not_listed(case: Case) -> None:
    apply, _ = _apply_all(case)
    m = case.chunks_manifest
    short = dataclasses.replace(m, chunks=m.chunks[:-1])
    last = len(m.chunks) - 1
    with pytest.raises(FrameError, match=rf"not listed: \[{last}\]"):
        apply.verify(short)


def test_verify_fails_if_a_listed_checksum_differs(case: Case) -> None:
    apply, _ = _apply_all(case)
    m = case.chunks_manifest
    bad = dataclasses.replace(m.chunks[0], xxh3_64=m.chunks[0].xxh3_64 ^ 1)
    with pytest.raises(FrameError, match=r"checksum differs: \[0\]"):
        apply.verify(dataclasses.replace(m, chunks=[bad, *m.chunks[1:]]))


# Tampering after apply, by another writer: seen by a verify that hashes every tensor. With
# hash_early (the default) a tensor hashed as later chunks landed is not hashed again: the
# apply is the target's only writer while it is open (the store's write lock).
@pytest.mark.parametrize("name", ["w", "bias", "blk"])
def test_verify_names_a_tensor_tampered_after_apply(case: Case, name: str) -> None:
    apply, target = _apply_all(case, hash_early=False)
    case.layout.view(target, name)[-1] ^= 1
    with pytest.raises(
        ChecksumMismatchError, match=rf"version 4: 1 tensor\(s\) differ.*{name}"
    ) as e:
        apply.verify(case.chunks_manifest)
    assert e.value.names == [name]
    assert e.value.version == TARGET


def test_verify_names_every_tampered_tensor(case: Case) -> None:
    apply, target = _apply_all(case, hash_early=False)
    for name in ("emb", "i8"):
        case.layout.view(target, name)[0] ^= 0x40
    with pytest.raises(ChecksumMismatchError, match=r"2 tensor\(s\) differ after apply: emb, i8"):
        apply.verify(case.chunks_manifest)


def _first_tensors(chunks: list[bytes]) -> list[int]:
    """The tensor of each chunk's first record."""
    return [Forged.parse(c).records[0].tensor_id for c in chunks]


def test_tensors_before_a_chunks_first_are_hashed_as_it_lands(case: Case) -> None:
    # the sample's chunks start in tensors 0, 0, 1 and 1 (a wave may end inside a tensor):
    # each chunk proves the tensors before its first one written for good, so they are
    # hashed then, not at verify
    assert _first_tensors(case.chunks) == [0, 0, 1, 1]
    apply, target = _apply_all(case)
    assert target.tobytes() == case.cur.tobytes()
    final = {i: tensor_digest(case.layout.view(target, i)) for i in range(len(case.layout))}
    assert apply.early_digests() == {0: final[0]}
    assert apply.early_hash_s > 0
    apply.verify(case.chunks_manifest)


def test_a_tensor_written_after_its_early_hash_is_hashed_again(case: Case) -> None:
    # out of order: the last chunk lands first, and the tensors before its first one are
    # hashed while still holding the base; the chunks that write them come after
    ref = case.ref.copy()
    target = case.ref.copy()
    apply = VersionApply(case.layout, target, ref, base=BASE, version=TARGET)
    for c in reversed(case.chunks):
        apply.apply(c)
    assert target.tobytes() == case.cur.tobytes()
    assert apply.early_digests() == {}  # every early digest went stale: none is used
    apply.verify(case.chunks_manifest)


def test_a_tensor_wrong_when_hashed_early_fails_verify(case: Case) -> None:
    # fault: the bytes of tensor 0 are wrong when the next chunk's landing hashes it (as a
    # wrong decode would leave them); verify names it from the early digest
    ref = case.ref.copy()
    target = case.ref.copy()
    apply = VersionApply(case.layout, target, ref, base=BASE, version=TARGET)
    apply.apply(case.chunks[0])
    case.layout.view(target, "emb")[0] ^= 0x40
    for c in case.chunks[1:]:
        apply.apply(c)
    assert set(apply.early_digests()) == {0}
    with pytest.raises(ChecksumMismatchError, match=r"1 tensor\(s\) differ after apply: emb"):
        apply.verify(case.chunks_manifest)


def _another_send(case: Case, *, item_elems: int, first_chunk_id: int) -> list[bytes]:
    """The same delta encoded again, as a re-send would be: its chunk ids from
    ``first_chunk_id`` up, its records ``item_elems`` long (the case's are 128: 4096-byte
    chunks hold items of at most 4096 / 32 elements)."""
    enc = DeltaEncoder(case.layout, chunk_bytes=4096, item_elems=item_elems, dense_threshold=0.5)
    e = enc.encode(
        case.cur, case.ref, target_version=TARGET, base_version=BASE, first_chunk_id=first_chunk_id
    )
    return [c.data for c in e]


@pytest.mark.parametrize("item_elems", [128, 64], ids=["same-ranges", "straddling"])
def test_a_chunk_writing_what_another_chunk_wrote_is_refused_before_writing(
    case: Case, item_elems: int
) -> None:
    # fault: a chunk of another send of the version (another chunk id, so not a duplicate)
    # lands in this one's apply, in place. Its records cover ranges chunk 0 wrote: decoded,
    # they would read the new bytes as their base. Refused before it writes, naming both.
    target = case.ref.copy()
    apply = VersionApply(case.layout, target, target, base=BASE, version=TARGET)
    assert apply.apply(case.chunks[0]) is True
    after_first = target.tobytes()
    other = _another_send(case, item_elems=item_elems, first_chunk_id=100)
    assert other[0] != case.chunks[0]
    with pytest.raises(
        FrameError,
        match=r"chunk 100 of version 4: record \d+ \('emb'\) writes elements \[\d+, \d+\), "
        r"but chunk 0 of this version already wrote \[\d+, \d+\)",
    ):
        apply.apply(other[0])
    assert target.tobytes() == after_first
    # the refused chunk left nothing behind: the version's own chunks complete it
    for c in case.chunks[1:]:
        assert apply.apply(c) is True
    assert target.tobytes() == case.cur.tobytes()
    apply.verify(case.chunks_manifest)


def test_chunks_of_one_version_out_of_order_write_disjoint_ranges(case: Case) -> None:
    # every chunk's ranges are its own, whatever the order they land in: none is refused
    target = case.ref.copy()
    apply = VersionApply(case.layout, target, target, base=BASE, version=TARGET)
    order = [*case.chunks[1::2], *case.chunks[::2]]
    for c in order:
        assert apply.apply(c) is True
    assert target.tobytes() == case.cur.tobytes()
    apply.verify(case.chunks_manifest)


def test_verify_checks_the_whole_model_digest(case: Case) -> None:
    apply, _ = _apply_all(case)
    m = dataclasses.replace(case.chunks_manifest, model_xxh3_128="0" * 32)
    with pytest.raises(ChecksumMismatchError, match="whole-model checksum"):
        apply.verify(m)


def test_verify_refuses_a_manifest_of_another_layout(case: Case) -> None:
    apply, _ = _apply_all(case)
    m = case.chunks_manifest
    t = dataclasses.replace(m.tensors[0], shape=[4096])
    with pytest.raises(ChecksumMismatchError, match="does not describe this layout"):
        apply.verify(dataclasses.replace(m, tensors=[t, *m.tensors[1:]]))


@pytest.mark.parametrize(
    ("version", "base", "match"),
    [
        (TARGET + 1, BASE, r"manifest is for 3->5, this apply is 3->4"),
        (TARGET, BASE - 1, r"manifest is for 2->4, this apply is 3->4"),
        (TARGET, NO_BASE, r"manifest is for -1->4, this apply is 3->4"),
    ],
)
def test_verify_refuses_a_manifest_of_another_version(
    case: Case, version: int, base: int, match: str
) -> None:
    apply, _ = _apply_all(case)
    m = dataclasses.replace(case.chunks_manifest, version=version, base_version=base)
    with pytest.raises(FrameError, match=match):
        apply.verify(m)


def test_manifest_digests_are_the_tensor_digests(case: Case) -> None:
    for i, t in enumerate(case.chunks_manifest.tensors):
        assert t.xxh3_128 == tensor_digest(case.layout.view(case.cur, i))
    assert [c.id for c in case.chunks_manifest.chunks] == list(range(len(case.chunks)))
    assert re.fullmatch(r"[0-9a-f]{32}", case.chunks_manifest.model_xxh3_128)
