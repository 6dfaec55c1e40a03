"""Per-tensor digests: hashed on several threads, the same digests as one thread, in order."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from deltarl.codecs import checksum
from deltarl.codecs.checksum import _parts, tensor_digests
from deltarl.engine.layout import Layout


@given(st.lists(st.integers(0, 1000), min_size=1, max_size=40), st.integers(1, 9))
def test_parts_cover_every_index_once_in_order(sizes: list[int], parts: int) -> None:
    runs = _parts(sizes, parts)
    assert 1 <= len(runs) <= parts
    assert [i for r in runs for i in r] == list(range(len(sizes)))
    assert all(len(r) > 0 for r in runs)


def test_parts_balance_bytes() -> None:
    runs = _parts([10] * 100, 4)
    assert [len(r) for r in runs] == [25, 25, 25, 25]
    # one tensor larger than a share gets a run of its own; the rest share the others
    runs = _parts([100, 1, 1, 1, 1], 2)
    assert runs == [range(1), range(1, 5)]


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_digests_match_one_thread_whatever_the_split(
    monkeypatch: pytest.MonkeyPatch, threads: int
) -> None:
    # above PARALLEL_MIN_BYTES, so the pool does the work when threads > 1
    specs = [(f"t{i}", "bfloat16", (int(n),)) for i, n in enumerate([5 << 20, 7, 3 << 20, 0, 1])]
    specs += [(f"u{i}", "float32", (1 << 20,)) for i in range(3)]
    layout = Layout.pack(specs)
    buf = np.random.default_rng(0).integers(0, 256, layout.nbytes, dtype=np.uint8)
    want = [xxhash.xxh3_128_hexdigest(layout.view(buf, i).tobytes()) for i in range(len(layout))]
    assert layout.nbytes >= checksum.PARALLEL_MIN_BYTES
    monkeypatch.setattr(checksum, "HASH_THREADS", threads)
    assert tensor_digests(layout, buf) == want
    chosen = [6, 0, 3, 2]
    assert tensor_digests(layout, buf, chosen) == [want[i] for i in chosen]
