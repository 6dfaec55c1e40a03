"""The publisher: bf16 of the fp32 masters under the HF names, created once, reopened after."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from deltarl.codecs.checksum import model_digest, tensor_digests
from deltarl.engine.weight_store import SegmentFormatError, WeightStore
from deltarl.trainer.publisher import Publisher, layout_of
from tests.trainer.tiny import save_tiny_model, tiny_model


def published(store: WeightStore) -> tuple[int, dict[str, torch.Tensor]]:
    """The active version and its tensors (bf16 copies) as a reader sees them."""
    with store.lease() as snap:
        buf = np.array(snap.buffer, copy=True)
        version = snap.version
    out = {}
    for tid, spec in enumerate(store.layout.tensors):
        bits = torch.from_numpy(store.layout.view(buf, tid).copy())
        out[spec.name] = bits.view(torch.bfloat16).reshape(spec.shape)
    return version, out


def test_layout_is_the_hf_parameter_names_in_order_as_bf16() -> None:
    model = tiny_model(0)
    layout = layout_of(model)
    names = [n for n, _ in model.named_parameters()]
    assert [s.name for s in layout.tensors] == names
    assert names[0] == "model.embed_tokens.weight"
    assert "lm_head.weight" not in names  # tied: listed once, as vLLM ties it on load
    assert all(s.dtype == "bfloat16" for s in layout.tensors)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert all(s.shape == shapes[s.name] for s in layout.tensors)


def test_published_bits_are_what_vllm_would_load(tmp_path: Path) -> None:
    model_dir = save_tiny_model(tmp_path / "model", seed=1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    pub = Publisher(model, "pub", root=tmp_path)
    pub.publish(0)
    version, tensors = published(pub.store)
    assert version == 0
    # vLLM reads the checkpoint's tensors by name and casts them to the model dtype.
    on_disk = load_file(model_dir / "model.safetensors")
    assert set(tensors) <= set(on_disk)
    for name, t in tensors.items():
        assert torch.equal(t.view(torch.int16), on_disk[name].to(torch.bfloat16).view(torch.int16))

    # After a change, the next version is bf16 of the new fp32 values, with real rounding
    # (values that are not representable in bf16 exercise round-to-nearest-even).
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-3)
    pub.publish(1)
    version, tensors = published(pub.store)
    assert version == 1
    changed = 0
    for name, p in model.named_parameters():
        want = p.detach().to(torch.bfloat16)
        assert torch.equal(tensors[name].view(torch.int16), want.view(torch.int16)), name
        changed += int((want.float() != p.detach()).sum())
    assert changed > 0  # the cast really rounded something
    # Each tensor's digest is committed with the version: the export agent sends these.
    with pub.store.lease() as snap:
        assert snap.tensor_digests == tensor_digests(pub.store.layout, snap.buffer)
        assert snap.digest == model_digest(snap.tensor_digests)
    pub.close()


def test_a_digest_given_by_the_caller_is_committed_without_tensor_digests(
    tmp_path: Path,
) -> None:
    """A caller vouching for another model digest (a rollout store fed as the apply agent
    feeds it, in tests) gets that digest, and no tensor digests that would disagree with it."""
    pub = Publisher(tiny_model(0), "pub", root=tmp_path)
    pub.publish(0, digest="0" * 32)
    with pub.store.lease() as snap:
        assert (snap.digest, snap.tensor_digests) == ("0" * 32, None)
    pub.close()


def test_restart_opens_the_same_store_and_may_go_back(tmp_path: Path) -> None:
    model = tiny_model(0)
    first = Publisher(model, "pub", root=tmp_path)
    first.publish(0)
    first.publish(5)
    first.close()  # a trainer killed after version 5 leaves its segment behind
    again = Publisher(model, "pub", root=tmp_path)
    assert again.active_version == 5
    with pytest.raises(ValueError, match="does not increase"):
        again.publish(3)
    again.publish(3, allow_older=True)  # the checkpoint's version, republished on resume
    assert again.active_version == 3
    again.publish(4)
    assert again.active_version == 4
    again.close()
    # Another model under the same store name is refused, not silently reinterpreted.
    other = torch.nn.Linear(3, 2)
    with pytest.raises(SegmentFormatError, match="different layout"):
        Publisher(other, "pub", root=tmp_path)
