"""The peer coders of ``deltarl bench codec --peers`` (bench/codec_peers.py): each decodes what
it encoded bit for bit, on real-shaped deltas and on edge cases, and the bench reports them."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import orjson
import pytest
from deltarl.bench.codec_peers import PEERS, leb128, unleb128
from hypothesis import given, settings
from hypothesis import strategies as st

from deltarl.engine.layout import Layout
from deltarl.sim.realistic_deltas import RealisticDeltas


@given(st.lists(st.integers(0, 2**63 - 1), max_size=200))
@settings(max_examples=200, deadline=None)
def test_leb128_round_trips(values: list[int]) -> None:
    data = np.frombuffer(leb128(np.array(values, np.uint64)), np.uint8)
    back, used = unleb128(data, len(values))
    assert back.tolist() == values
    assert used == data.size


def test_leb128_refuses_a_stream_that_ends_early() -> None:
    data = np.frombuffer(leb128(np.array([300, 5], np.uint64)), np.uint8)
    with pytest.raises(ValueError, match="ends early"):
        unleb128(data[:-1], 2)


@pytest.mark.parametrize("peer", PEERS, ids=lambda p: p.name)
def test_each_peer_is_bit_exact_on_adamw_deltas_and_edges(peer) -> None:
    gen = RealisticDeltas(300_000, seed=5)
    ref = gen.publish()
    gen.step()
    cur = gen.publish()
    target = ref.copy()
    peer.apply(gen.layout, target, peer.encode(gen.layout, ref, cur))
    assert np.array_equal(target, cur)
    # no change at all; every element changed; the first and last element only
    layout = Layout.pack([("a", "bfloat16", (64,)), ("b", "float32", (3,)), ("c", "int8", (0,))])
    base = np.random.default_rng(0).integers(0, 256, layout.nbytes, dtype=np.uint8)
    for change in ([], list(range(64)), [0, 63]):
        new = base.copy()
        layout.view(new, "a")[change] ^= 0x5A5A
        out = base.copy()
        peer.apply(layout, out, peer.encode(layout, base, new))
        assert np.array_equal(out, new), change


def test_bench_codec_reports_its_peers() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "deltarl.cli", "bench", "codec", "--params", "300000",
         "--steps", "1", "--repeat", "1", "--peers", "--json"],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    (step,) = orjson.loads(out.stdout)["steps"]
    assert set(step["peers"]) == {p.name for p in PEERS}
    for figures in step["peers"].values():
        assert set(figures) == {
            "wire_bytes",
            "bytes_per_change",
            "encode_gbps",
            "apply_gbps",
            "bit_exact",
        }
        assert figures["bit_exact"] is True
        assert figures["bytes_per_change"] > 0
    # Which is smaller is measured, not asserted: at this size the codec's per-record framing
    # weighs more than at the 98M parameters the README reports.
