"""`deltarl bench gpu-apply`: its JSON shape, its checks, and the device checksum itself, run
on the CPU here (the GPU figures come from scripts/gpu-check.sh; the gpu-marked test below
runs the same bench on a CUDA device)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from deltarl.bench import gpu_apply
from deltarl.bench.gpu_apply import WEIGHT_PERIOD, device_checksums, layout_for, main

from deltarl.engine.layout import Layout

SIZE_KEYS = {
    "params": int,
    "model_bytes": int,
    "changed": int,
    "changed_ratio": float,
    "upload_bytes_sparse": int,
    "sparse_s": float,
    "checksum_s": float,
    "full_s": float,
    "full_gbps": float,
    "speedup": float,
    "faster": str,
    "bit_exact": bool,
    "checksums_match": bool,
}


def _reference(layout: Layout, buf: np.ndarray) -> np.ndarray:
    """The checksums computed independently: Python integers, modulo 2**64."""
    out = []
    for t in layout.tensors:
        w = buf[t.offset : t.offset + t.nbytes].view(np.uint16).astype(object)
        weights = np.arange(t.numel, dtype=np.int64) % WEIGHT_PERIOD + 1
        plain = int(w.sum()) % (1 << 64)
        weighted = int((w * weights.astype(object)).sum()) % (1 << 64)
        out.append([plain, weighted])
    return np.array(out, dtype=np.uint64).view(np.int64)


def _words(buf: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(buf).view(torch.int16)


def test_json_shape_and_both_paths_bit_exact(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["--params", "300000", "--repeat", "2", "--device", "cpu", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert result["device"] == "cpu"
    assert result["worker_ext_path"] in ("sparse", "full")
    (size,) = result["sizes"]
    assert {k: type(size[k]) for k in SIZE_KEYS} == SIZE_KEYS
    assert size["bit_exact"]
    assert size["checksums_match"]
    assert 0.03 < size["changed_ratio"] < 0.045
    # int32 positions (the model is far below 2**31 elements) and 16-bit values
    assert size["upload_bytes_sparse"] == size["changed"] * 6


def test_checksums_match_an_independent_computation() -> None:
    layout = layout_for(200_000)
    buf = np.random.default_rng(1).integers(0, 256, layout.nbytes, dtype=np.uint8)
    got = device_checksums(_words(buf), layout).numpy()
    assert np.array_equal(got, _reference(layout, buf))


def test_chunked_checksums_equal_unchunked(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tensor longer than a chunk is summed chunk by chunk with the same weights."""
    layout = Layout.pack([("a", "bfloat16", (5, 30_011)), ("b", "bfloat16", (7,))])
    buf = np.random.default_rng(2).integers(0, 256, layout.nbytes, dtype=np.uint8)
    whole = device_checksums(_words(buf), layout)
    monkeypatch.setattr(gpu_apply, "CHUNK_ELEMS", WEIGHT_PERIOD)  # 5 chunks of tensor a
    assert torch.equal(device_checksums(_words(buf), layout), whole)
    assert np.array_equal(whole.numpy(), _reference(layout, buf))


def test_a_flipped_bit_or_two_swapped_words_change_only_their_tensor() -> None:
    layout = layout_for(100_000)
    buf = np.random.default_rng(3).integers(0, 256, layout.nbytes, dtype=np.uint8)
    before = device_checksums(_words(buf), layout)
    t = layout.tensors[2]
    flipped = buf.copy()
    flipped[t.offset + 11] ^= 0x80  # the top bit of word 5: the sign of a bf16
    after = device_checksums(_words(flipped), layout)
    assert not torch.equal(after[2], before[2])
    assert torch.equal(torch.cat([after[:2], after[3:]]), torch.cat([before[:2], before[3:]]))

    swapped = buf.copy()
    words = swapped[t.offset : t.offset + t.nbytes].view(np.uint16)
    i = 3
    j = i + 1 + int(np.flatnonzero(words[i + 1 :] != words[i])[0])  # a different word
    words[[i, j]] = words[[j, i]]
    moved = device_checksums(_words(swapped), layout)
    assert torch.equal(moved[2, 0], before[2, 0])  # the plain sum cannot see a swap...
    assert not torch.equal(moved[2, 1], before[2, 1])  # ...the weighted one does


def test_a_device_copy_that_differs_is_not_bit_exact() -> None:
    host = torch.zeros(3 << 20, dtype=torch.int16)
    copy = host.clone()
    assert gpu_apply._equal(copy, host)
    copy[-1] = 1  # in the last of the compared pieces
    assert not gpu_apply._equal(copy, host)


def test_changed_positions_lie_inside_tensors_sorted_and_distinct() -> None:
    layout = layout_for(150_000)
    positions = gpu_apply._changed_positions(layout, 0.05, np.random.default_rng(4))
    assert np.all(np.diff(positions) > 0)
    starts = np.array([t.offset // 2 for t in layout.tensors])
    ends = starts + np.array([t.numel for t in layout.tensors])
    tid = np.searchsorted(starts, positions, side="right") - 1
    assert np.all(positions >= starts[tid])
    assert np.all(positions < ends[tid])


def test_largest_fit_is_bounded_by_the_cap() -> None:
    cpu = torch.device("cpu")
    assert 0 < gpu_apply.largest_fit(cpu, 0.037, 1_000_000) <= 1_000_000


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(SystemExit):
        main(["--changed", "1.5"])
    with pytest.raises(SystemExit):
        main(["--params", "10", "--device", "cpu"])


@pytest.mark.gpu
def test_on_a_cuda_device(capsys: pytest.CaptureFixture[str]) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here: scripts/gpu-check.sh runs this on a GPU machine")
    assert main(["--params", "98000000", "--repeat", "3", "--json"]) == 0
    (size,) = json.loads(capsys.readouterr().out)["sizes"]
    assert size["bit_exact"]
    assert size["checksums_match"]
