"""`cost/relayout.py`: partial sums dropped, the gradient layout a reader hands back, and the
price of one relayout (ZeRO-3 storage helpers: tests/plan/test_zero_layout.py)."""

from __future__ import annotations

import math

import pytest

from nnscaler_jax.cost.relayout import drop_partial, grad_source, partial_grad_axes, relayout_price
from nnscaler_jax.layout import Layout, comm_path
from nnscaler_jax.mesh.topology import LinkCost, MeshSpec, all_gather_time, all_reduce_time
from nnscaler_jax.plan.plan import VALUE

LINK = LinkCost(2e-6, 1e-9)
MESH = MeshSpec(("data", "model"), (2, 4), (LINK, LINK))


def test_drop_partial():
    lay = Layout.of(2, {0: "data"}, partial=("model",))
    assert drop_partial(lay) == Layout.of(2, {0: "data"})
    plain = Layout.of(2, {1: "model"})
    assert drop_partial(plain) == plain  # (memoised: an equal layout, maybe not this object)


def test_partial_grad_axes_are_split_axes_the_read_replicates():
    want = Layout.of(2, {0: "data"})
    split = (("data", "m"), ("model", "k"), ("fsdp", VALUE))
    # 'data' splits the operand itself; a value split is no dim split; 'model' splits the op
    # but the operand is read whole over it: its gradient comes back as partial sums there
    assert partial_grad_axes(want, split) == ("model",)
    assert partial_grad_axes(Layout.replicated(2), (("model", "m"), ("model", "n"))) == ("model",)
    assert partial_grad_axes(Layout.of(2, partial=("model",)), (("model", "k"),)) == ()
    assert partial_grad_axes(want, ()) == ()


def test_grad_source_is_the_read_layout_with_those_partial_sums():
    want = Layout.of(2, {1: "model"})
    got = grad_source(want, (("data", "b"), ("model", "n")))
    assert got == Layout.of(2, {1: "model"}, partial=("data",))


def test_relayout_price_matches_the_collective():
    shape, n = (8, 4), 8 * 4 * 4
    t, b = relayout_price(Layout.of(2, partial=("model",)), Layout.replicated(2), shape, 4, MESH)
    assert t == pytest.approx(all_reduce_time(LINK, 4, n)) and b == n
    t, b = relayout_price(Layout.of(2, {0: "data"}), Layout.replicated(2), shape, 4, MESH)
    assert t == pytest.approx(all_gather_time(LINK, 2, n)) and b == n
    src, dst = Layout.of(2, {0: "data"}), Layout.of(2, {1: "model"})
    path = comm_path(src, dst, shape, 4, MESH)
    assert relayout_price(src, dst, shape, 4, MESH) == (path.time_s, path.bytes)


def test_the_same_layout_is_free_and_an_impossible_one_infinitely_slow():
    lay = Layout.of(2, {0: "data"})
    assert relayout_price(lay, lay, (8, 4), 4, MESH) == (0.0, 0)
    # 3 rows cannot be split 4 ways over 'model'
    t, b = relayout_price(Layout.replicated(2), Layout.of(2, {0: "model"}), (3, 4), 4, MESH)
    assert math.isinf(t) and b == 0
