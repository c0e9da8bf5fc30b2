"""Cheapest collective paths between RVD layouts: closed forms, properties, numpy simulation."""

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from nnscaler_jax.errors import PlanError
from nnscaler_jax.layout import Layout, comm_path
from nnscaler_jax.layout.comm import HOP_PENALTY_S, comm_time
from nnscaler_jax.mesh.topology import (
    LinkCost,
    MeshSpec,
    all_gather_time,
    all_reduce_time,
    all_to_all_time,
    reduce_scatter_time,
)

A, B = 1e-5, 1e-11
LINK = LinkCost(A, B)
MESH = MeshSpec(("data", "model"), (2, 4), (LINK, LINK))
SHAPE = (1024, 1024)
N = 4 * 1024 * 1024  # float32 (1024, 1024)
R2 = Layout.replicated(2)


def test_same_layout_is_empty():
    lay = Layout.of(2, {0: "data"}, partial=("model",))
    path = comm_path(lay, lay, SHAPE, 4, MESH)
    assert path.steps == () and path.time_s == 0.0 and path.bytes == 0


def test_all_reduce_one_axis_mesh():
    mesh = MeshSpec(("model",), (4,), (LINK,))
    path = comm_path(Layout.of(2, partial=("model",)), R2, SHAPE, 4, mesh)
    assert path.kinds == ("all_reduce",)
    assert path.steps[0].bytes == N
    assert path.time_s == all_reduce_time(LINK, 4, N)
    assert path.wire_bytes == pytest.approx(2 * 3 / 4 * N)


def test_all_reduce_uses_idle_axis_when_cheaper():
    # Hierarchical all-reduce: slice over the idle 'data' axis, all-reduce half the bytes, gather.
    path = comm_path(Layout.of(2, partial=("model",)), R2, SHAPE, 4, MESH)
    detour = all_reduce_time(LINK, 4, N // 2) + all_gather_time(LINK, 2, N)
    assert detour < all_reduce_time(LINK, 4, N)
    # as fast: reduce-scatter the half over 'model', gather both axes at once (2a + 1.25 b N)
    same = reduce_scatter_time(LINK, 4, N // 2) + all_gather_time(LINK, 8, N)
    assert same == pytest.approx(detour, rel=1e-12)
    assert path.kinds in {("slice", "all_reduce", "all_gather"),
                          ("slice", "reduce_scatter", "all_gather")}
    assert path.time_s == pytest.approx(detour, rel=1e-12)
    # With a latency-bound 'data' link the plain all-reduce wins.
    slow = MeshSpec(("data", "model"), (2, 4), (LinkCost(1.0, B), LINK))
    path = comm_path(Layout.of(2, partial=("model",)), R2, SHAPE, 4, slow)
    assert path.kinds == ("all_reduce",) and path.time_s == all_reduce_time(LINK, 4, N)


def test_all_gather_full_result_bytes():
    path = comm_path(Layout.of(2, {0: "data"}), R2, SHAPE, 4, MESH)
    assert path.kinds == ("all_gather",)
    assert path.steps[0].bytes == N and path.steps[0].src_dim == 0
    assert path.time_s == all_gather_time(LINK, 2, N)


def test_two_partial_axes_one_all_reduce_on_equal_links():
    # XLA reduces V(data, model) with one all-reduce over all 8 devices: a + 1.75 b N, cheaper
    # than reduce-scatter / all-reduce / all-gather (3a + 1.75 b N) or two all-reduces
    # (2a + 2.5 b N) when the links are equal.
    path = comm_path(Layout.of(2, partial=("data", "model")), R2, SHAPE, 4, MESH)
    assert path.kinds == ("all_reduce",) and path.steps[0].axis == ("data", "model")
    assert path.steps[0].bytes == N and path.bytes == N
    assert path.time_s == pytest.approx(A + 1.75 * B * N, rel=1e-12)
    assert path.time_s == all_reduce_time(LINK, 8, N)
    assert path.wire_bytes == pytest.approx(1.75 * N)
    assert "all_reduce[data,model: V->R]" in str(path)
    # only one of the two axes: the other stays partial
    half = comm_path(Layout.of(2, partial=("data", "model")), Layout.of(2, partial=("data",)),
                     SHAPE, 4, MESH)
    assert half.kinds == ("all_reduce",) and half.steps[0].axis == "model"


def test_two_partial_axes_hierarchical_across_nodes():
    # 'data' across nodes (slow), 'model' inside a node (fast): a flat ring over both waits for
    # the slow link (a_s + 1.75 b_s N); reduce-scatter inside, all-reduce the quarter across,
    # gather inside moves 1.75 N over the fast link but only N / 4 over the slow one.
    fast, slow = LinkCost(A, B), LinkCost(4 * A, 20 * B)
    mesh = MeshSpec(("data", "model"), (2, 4), (slow, fast))
    path = comm_path(Layout.of(2, partial=("data", "model")), R2, SHAPE, 4, mesh)
    flat = all_reduce_time(LinkCost(4 * A, 20 * B), 8, N)
    hier = (reduce_scatter_time(fast, 4, N) + all_reduce_time(slow, 2, N / 4)
            + all_gather_time(fast, 4, N))
    assert hier < flat
    assert path.kinds == ("reduce_scatter", "all_reduce", "all_gather")
    assert path.steps[0].axis == path.steps[2].axis == "model" and path.steps[1].axis == "data"
    assert path.time_s == pytest.approx(hier, rel=1e-12)


def test_two_partial_axes_latency_bound():
    slow = LinkCost(1e-3, 1e-15)
    mesh = MeshSpec(("data", "model"), (2, 4), (slow, slow))
    path = comm_path(Layout.of(2, partial=("data", "model")), R2, SHAPE, 4, mesh)
    assert path.kinds == ("all_reduce",)  # one latency, not two
    assert path.time_s == pytest.approx(all_reduce_time(slow, 8, N), rel=1e-12)


def test_dim_to_dim_is_one_all_to_all():
    path = comm_path(Layout.of(2, {0: "data"}), Layout.of(2, {1: "data"}), SHAPE, 4, MESH)
    assert path.kinds == ("all_to_all",)
    step = path.steps[0]
    assert (step.axis, step.src_dim, step.dst_dim, step.bytes) == ("data", 0, 1, N)
    assert path.time_s == all_to_all_time(LINK, 2, N) == A + B * N / 4


def test_reduce_scatter_and_free_local_steps():
    mesh = MeshSpec(("model",), (4,), (LINK,))
    path = comm_path(Layout.of(2, partial=("model",)), Layout.of(2, {1: "model"}), SHAPE, 4, mesh)
    assert path.kinds == ("reduce_scatter",) and path.steps[0].bytes == N
    assert path.time_s == reduce_scatter_time(LINK, 4, N)
    # On the 2x4 mesh the idle 'data' axis halves the reduce-scatter: 2a + b N (3/8 + 1/8).
    path = comm_path(Layout.of(2, partial=("model",)), Layout.of(2, {1: "model"}), SHAPE, 4, MESH)
    assert path.kinds == ("slice", "reduce_scatter", "all_gather")
    assert path.time_s == pytest.approx(2 * A + 0.5 * B * N, rel=1e-12)
    assert comm_path(R2, Layout.of(2, {0: ("data", "model")}), SHAPE, 4, MESH).time_s == 0.0
    assert comm_path(R2, Layout.of(2, partial=("data",)), SHAPE, 4, MESH).kinds == ("value_chunk",)


def test_only_minor_axis_is_gathered():
    src = Layout.of(2, {0: ("data", "model")})
    path = comm_path(src, Layout.of(2, {0: "model"}), SHAPE, 4, MESH)
    first = path.steps[0]
    # 'data' is major in dim 0: it cannot move alone first (here both move to dim 1 in one
    # all-to-all, cheaper than gathering all 8 blocks)
    assert first.kind in ("all_gather", "all_to_all") and first.axis in ("model",
                                                                          ("data", "model"))
    _check_chain(path, src, Layout.of(2, {0: "model"}), SHAPE, 4, MESH)


def test_a_group_of_axes_moves_to_another_dim_in_one_all_to_all():
    # D(1:(data,model)) -> D(0:(data,model)): 'data' cannot move alone (it is major), and
    # gathering all 8 blocks costs a + 7/8 b N; one all-to-all over the 8 devices: a + 7/64 b N
    src, dst = Layout.of(2, {1: ("data", "model")}), Layout.of(2, {0: ("data", "model")})
    path = comm_path(src, dst, SHAPE, 4, MESH)
    assert path.kinds == ("all_to_all",) and path.steps[0].axis == ("data", "model")
    assert (path.steps[0].src_dim, path.steps[0].dst_dim) == (1, 0)
    assert path.time_s == pytest.approx(all_to_all_time(LINK, 8, N), rel=1e-12)
    assert path.wire_bytes == pytest.approx(7 / 64 * N)



def test_partial_sums_are_reduced_before_data_moves():
    # moving 'model' first (an all-to-all of the partial values) would be as cheap; the lowering
    # cannot constrain partial values, so reductions (and local slices) come first
    src = Layout.of(2, {1: "model"}, partial=("data",))
    for dst in (Layout.of(2, {0: "model"}), R2, Layout.of(2, {0: ("model", "data")})):
        kinds = comm_path(src, dst, SHAPE, 4, MESH).kinds
        moving = [k for k in kinds if k not in ("slice", "value_chunk")]
        assert moving[0] in ("all_reduce", "reduce_scatter"), (dst, kinds)


def test_errors_and_memo():
    with pytest.raises(PlanError, match="not divisible"):
        comm_path(Layout.of(2, {0: "model"}), R2, (6, 4), 4, MESH)
    with pytest.raises(PlanError, match="not in the mesh"):
        comm_path(Layout.of(2, {0: "pipe"}), R2, SHAPE, 4, MESH)
    with pytest.raises(PlanError, match="itemsize"):
        comm_path(R2, R2, SHAPE, 0, MESH)
    a = comm_path(Layout.of(2, {0: "data"}), R2, [1024, 1024], 4, MESH)
    assert a is comm_path(Layout.of(2, {0: "data"}), R2, SHAPE, 4, MESH)
    assert comm_time(Layout.of(2, {0: "data"}), R2, SHAPE, 4, MESH) == a.time_s
    assert "all_gather[data: D0->R]" in str(a)


# ---- properties ------------------------------------------------------------------------------


def _check_chain(path, src, dst, shape, itemsize, mesh):
    """Steps chain src -> dst; each step is legal and its bytes follow the documented convention."""
    cur = src
    for s in path.steps:
        assert s.src == cur and s.time_s >= 0
        p = mesh.size(s.axis)
        local = s.src.local_bytes(shape, itemsize, mesh)
        if s.kind in ("all_gather", "all_to_all"):  # the minor-most axes of the dim
            group = s.axis if isinstance(s.axis, tuple) else (s.axis,)
            assert s.src.dims[s.src_dim][-len(group):] == group
        expected = {
            "all_gather": local * p,
            "all_to_all": local * p,
            "all_reduce": local,
            "reduce_scatter": local,
            "slice": 0,
            "value_chunk": 0,
        }[s.kind]
        assert s.bytes == expected
        cur = s.dst
    assert cur == dst
    assert path.time_s == pytest.approx(sum(s.time_s for s in path.steps), rel=1e-12, abs=0)


@st.composite
def layouts(draw, ndim, axes=("data", "model")):
    split: dict[int, list[str]] = {}
    partial = []
    for axis in axes:
        state = draw(st.sampled_from(["R", "V"] + list(range(ndim))))
        if state == "V":
            partial.append(axis)
        elif state != "R":
            split.setdefault(state, []).append(axis)
    split = {d: draw(st.permutations(v)) for d, v in split.items()}
    return Layout.of(ndim, split, partial=partial)


@st.composite
def problems(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.sampled_from([2, 4, 8, 12])) for _ in range(ndim))
    return shape, draw(layouts(ndim)), draw(layouts(ndim)), draw(layouts(ndim))


PROP_MESH = MeshSpec(("data", "model"), (2, 4), (LinkCost(1e-5, 1e-9), LinkCost(3e-6, 2e-10)))


def _valid(lay, shape):
    try:
        lay.check(shape, PROP_MESH)
    except PlanError:
        return False
    return True


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(problems())
def test_path_properties(problem):
    shape, a, b, c = problem
    assume(_valid(a, shape) and _valid(b, shape) and _valid(c, shape))
    assert comm_path(a, a, shape, 4, PROP_MESH).steps == ()
    ab = comm_path(a, b, shape, 4, PROP_MESH)
    bc = comm_path(b, c, shape, 4, PROP_MESH)
    ac = comm_path(a, c, shape, 4, PROP_MESH)
    for path, (s, d) in [(ab, (a, b)), (bc, (b, c)), (ac, (a, c))]:
        assert path.time_s >= 0 and path.bytes >= 0
        _check_chain(path, s, d, shape, 4, PROP_MESH)
    slack = HOP_PENALTY_S * (len(ab.steps) + len(bc.steps) + len(ac.steps))
    assert ac.time_s <= ab.time_s + bc.time_s + slack
    _simulate(ab, a, b, shape)


# ---- numpy simulation of a path on the 2x4 mesh -------------------------------------------------

COORDS = list(itertools.product(range(2), range(4)))


def _block(x, lay, c):
    """Device c's block of x under lay's D part."""
    sizes = dict(zip(PROP_MESH.axis_names, PROP_MESH.axis_sizes, strict=True))
    coord = dict(zip(PROP_MESH.axis_names, c, strict=True))
    for i, axes in enumerate(lay.dims):
        idx, ways = 0, 1
        for ax in axes:
            idx, ways = idx * sizes[ax] + coord[ax], ways * sizes[ax]
        x = np.split(x, ways, axis=i)[idx]
    return x


def _peers(c, axis):
    """Devices differing from ``c`` only along ``axis`` (a tuple: along all of those axes)."""
    if isinstance(axis, tuple):
        group = [c]
        for a in axis:
            group = [q for g in group for q in _peers(g, a)]
        return group
    k = PROP_MESH.index(axis)
    return [c[:k] + (j,) + c[k + 1 :] for j in range(PROP_MESH.axis_sizes[k])]


def _materialise(x, lay, rng):
    """Per-device arrays holding x under lay; partial sums split at random."""
    blocks = {c: _block(x, lay, c).astype(np.float64) for c in COORDS}
    for axis in lay.partial:
        out = {}
        for c in COORDS:
            peers = _peers(c, axis)
            if c == peers[0]:
                parts = [rng.standard_normal(blocks[c].shape) for _ in peers[1:]]
                parts = [blocks[c] - sum(parts)] + parts
                out.update(zip(peers, parts, strict=True))
        blocks = out
    return blocks


def _apply(step, blocks):
    p = PROP_MESH.size(step.axis)
    out = {}
    for c in COORDS:
        peers = _peers(c, step.axis)  # a tuple of axes: the group, major to minor
        group, i = [blocks[q] for q in peers], peers.index(c)
        if step.kind == "all_gather":
            out[c] = np.concatenate(group, axis=step.src_dim)
        elif step.kind == "all_to_all":
            whole = np.concatenate(group, axis=step.src_dim)
            out[c] = np.split(whole, p, axis=step.dst_dim)[i]
        elif step.kind == "all_reduce":
            out[c] = sum(group)
        elif step.kind == "reduce_scatter":
            out[c] = np.split(sum(group), p, axis=step.dst_dim)[i]
        elif step.kind == "slice":
            out[c] = np.split(blocks[c], p, axis=step.dst_dim)[i]
        else:  # value_chunk
            out[c] = blocks[c] if i == 0 else np.zeros_like(blocks[c])
    return out


def _simulate(path, src, dst, shape):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape)
    blocks = _materialise(x, src, rng)
    for step in path.steps:
        blocks = _apply(step, blocks)
    for axis in dst.partial:  # sum the partial values to compare with the true blocks
        blocks = {c: sum(blocks[q] for q in _peers(c, axis)) for c in COORDS}
    reduced = Layout(dims=dst.dims)
    for c in COORDS:
        np.testing.assert_allclose(blocks[c], _block(x, reduced, c), rtol=1e-9, atol=1e-9)


def test_steps_over_several_axes_compute_the_right_blocks():
    """Every collective over a tuple of axes (all-reduce / reduce-scatter of partial sums over
    both axes, all-gather or all-to-all of a dim split by both) turns its source into its
    destination."""
    from nnscaler_jax.layout.comm import CommPath, _transitions

    shape, seen = (8, 8), set()
    for src in [Layout.of(2, partial=("data", "model")), Layout.of(2, {0: ("data", "model")}),
                Layout.of(2, {1: ("model", "data")}),
                Layout.of(2, {0: "model"}, partial=("data",))]:
        for step in _transitions(src, shape, 4, PROP_MESH):
            if isinstance(step.axis, tuple):
                seen.add(step.kind)
                assert step.wire_bytes == pytest.approx(
                    {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1,
                     "all_to_all": 1 / 8}[step.kind] * 7 / 8 * step.bytes)
                _simulate(CommPath((step,), step.time_s, step.bytes), src, step.dst, shape)
    assert seen == {"all_reduce", "reduce_scatter", "all_gather", "all_to_all"}
