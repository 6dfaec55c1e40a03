"""Items dealt to threads by cost (kernels.deal): every item once, loads evened out, and the
bytes written the same whichever thread runs which item."""

from __future__ import annotations

import functools
import itertools

import numba
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from deltarl.codecs import kernels
from deltarl.codecs.decoder import VersionApply
from deltarl.codecs.encoder import DeltaEncoder
from deltarl.engine.layout import Layout
from tests.codecs.test_conditioned import LAYOUT as CONDITIONED_LAYOUT
from tests.codecs.test_conditioned import _versions as conditioned_versions

_real_deal = kernels.deal


@given(
    st.lists(st.integers(0, 10**9), max_size=300),
    st.integers(1, 9),
)
def test_every_item_once_and_no_thread_above_the_greedy_bound(
    costs: list[int], threads: int
) -> None:
    c = np.array(costs, np.int64)
    order, bounds = kernels.deal(c, threads)
    assert sorted(order.tolist()) == list(range(len(costs)))
    assert bounds[0] == 0
    assert bounds[-1] == len(costs)
    assert np.all(np.diff(bounds) >= 0)
    assert len(bounds) - 1 <= threads
    loads = [int(c[order[a:b]].sum()) for a, b in itertools.pairwise(bounds)]
    if costs:
        # list scheduling: no thread ends more than one item past an even share
        assert max(loads) <= sum(costs) / (len(bounds) - 1) + max(costs)


def test_a_layer_of_alternating_costs_is_split_evenly() -> None:
    # The case that motivated it: heavy and light tensors alternating, as a layer's are.
    costs = np.array([10, 1] * 20, np.int64)
    order, bounds = kernels.deal(costs, 2)
    loads = [int(costs[order[a:b]].sum()) for a, b in itertools.pairwise(bounds)]
    assert loads == [110, 110]


def _delta() -> tuple[Layout, np.ndarray, np.ndarray]:
    """Tensors changed at very different rates, several items each."""
    layout = Layout.pack(
        [(f"t{i}", "bfloat16", (4096 + 64 * i,)) for i in range(12)] + [("f", "float32", (5000,))]
    )
    rng = np.random.default_rng(7)
    ref = rng.integers(0, 256, layout.nbytes, dtype=np.uint8)
    cur = ref.copy()
    for i in range(12):
        v = layout.view(cur, f"t{i}")
        v[rng.choice(v.size, [3, 400, 20, 1500][i % 4], replace=False)] += 1
    f = layout.view(cur, "f")
    f[rng.choice(f.size, 300, replace=False)] += 7
    return layout, ref, cur


def _conditioned_delta() -> tuple[Layout, np.ndarray, np.ndarray]:
    """AdamW-like steps, which move mostly the small weights: conditioned coding pays."""
    v = conditioned_versions()
    return CONDITIONED_LAYOUT, v[0], v[1]


def _encode_apply(
    layout: Layout, ref: np.ndarray, cur: np.ndarray, *, conditioned: bool
) -> tuple[list[bytes], bytes]:
    enc = DeltaEncoder(layout, item_elems=1024, conditioned=conditioned)
    e = enc.encode(cur, ref, target_version=2, base_version=1)
    chunks = [c.data for c in e]
    assert e.manifest is not None
    if conditioned:  # the case exercises the conditioned kernels too
        assert "conditioned" in {t.coding for t in e.manifest.tensors}
    target = ref.copy()
    va = VersionApply(layout, target, target, base=1, version=2)
    for c in chunks:
        va.apply(c)
    va.verify(e.manifest)
    return chunks, target.tobytes()


@pytest.fixture
def restore_threads() -> object:
    n = numba.get_num_threads()
    yield
    numba.set_num_threads(n)


@pytest.mark.usefixtures("restore_threads")
@pytest.mark.parametrize("conditioned", [False, True])
def test_the_same_bytes_whichever_thread_runs_an_item(
    monkeypatch: pytest.MonkeyPatch, conditioned: bool
) -> None:
    layout, ref, cur = _conditioned_delta() if conditioned else _delta()
    run = functools.partial(_encode_apply, layout, ref, cur, conditioned=conditioned)
    chunks, applied = run()
    assert applied == cur.tobytes()
    numba.set_num_threads(1)
    assert run() == (chunks, applied)
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    # more threads' worth of dealing than there are threads, and the reverse of LPT's order
    monkeypatch.setattr(kernels, "deal", functools.partial(_real_deal, threads=5))
    assert run() == (chunks, applied)

    def reversed_deal(
        costs: np.ndarray, threads: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        order, bounds = _real_deal(costs, threads)
        return order[::-1].copy(), bounds

    monkeypatch.setattr(kernels, "deal", reversed_deal)
    assert run() == (chunks, applied)
