"""`lower/relayout.py`: the steps a relayout is lowered in are the priced path's, forward and
backward (closed cases; the compile-level checks are in test_no_full_remat.py)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from meshes import make_mesh

from nnscaler_jax import trace
from nnscaler_jax.layout import Layout, comm_path
from nnscaler_jax.lower.hlo import hlo_collectives
from nnscaler_jax.lower.relayout import backward_steps, reduced_layout, relayout_steps
from nnscaler_jax.lower.replay import Lowering
from nnscaler_jax.mesh.topology import DEFAULT_LINK, LinkCost, MeshSpec
from nnscaler_jax.primitives import Draft

MESH = MeshSpec(("data", "model"), (2, 4), (DEFAULT_LINK,) * 2)
SHAPE = (64, 64, 64)


def L(split=None, partial=()):  # reads like the RVD notation
    return Layout.of(3, split, partial)


def test_one_constraint_per_step_of_the_priced_path():
    src, dst = L({2: ("data", "model")}), L({0: "data"})
    path = comm_path(src, dst, SHAPE, 4, MESH)
    steps = relayout_steps(src, dst, SHAPE, 4, MESH)
    assert steps == tuple(s.dst for s in path.steps) and steps[-1] == dst
    assert relayout_steps(dst, dst, SHAPE, 4, MESH) == ()
    # a slice before a collective on another axis is its own step (XLA cannot fuse the two)
    assert relayout_steps(L({0: "data"}), L({1: "model"}), SHAPE, 4, MESH) == (
        L({0: "data", 1: "model"}), L({1: "model"}))
    # slices in a row are one constraint
    assert relayout_steps(Layout.replicated(3), L({0: "data", 1: "model"}), SHAPE, 4, MESH) == (
        L({0: "data", 1: "model"}),)


def test_the_path_follows_the_links():
    # a slow 'data' link: the relayout avoids collectives over it where it can
    slow = MeshSpec(("data", "model"), (2, 4), (LinkCost(1e-3, 1e-8), DEFAULT_LINK))
    src, dst = L({0: "data", 2: "model"}), L({1: ("data", "model")})
    for mesh in (MESH, slow):
        steps = relayout_steps(src, dst, SHAPE, 4, mesh)
        assert steps == tuple(s.dst for s in comm_path(src, dst, SHAPE, 4, mesh).steps
                              if not s.dst.partial)


def test_partial_sums_are_reduced_where_the_path_leaves_them():
    v = L({0: "data"}, partial=("model",))
    assert reduced_layout(v, None, SHAPE, 4, MESH) == L({0: "data"})
    # the consumer splits dim 1 over 'model': reduce-scatter there (was: whatever the consumer
    # split first, an all-reduce when the dim was taken)
    assert reduced_layout(v, L({1: "model"}), SHAPE, 4, MESH) == L({0: "data", 1: "model"})
    want = L({0: ("data", "model")})
    red = reduced_layout(v, want, SHAPE, 4, MESH)
    assert not red.partial and red == next(s.dst for s in comm_path(v, want, SHAPE, 4,
                                                                       MESH).steps
                                           if not s.dst.partial)
    # partial sums the consumer wants are reduced too (a sharding cannot hold them)
    assert relayout_steps(L({0: "data"}), L({0: "data"}, partial=("model",)), SHAPE, 4,
                          MESH) == ()


def test_backward_steps_are_the_priced_gradient_path():
    # ZeRO-3: a weight stored split over 'data', read replicated by a data-parallel op: its
    # gradient (partial over 'data') is reduce-scattered straight into its storage
    stored, read = L({0: "data"}), Layout.replicated(3)
    split = (("data", "b0"),)
    assert backward_steps(stored, read, split, SHAPE, 4, MESH) == (stored,)
    assert comm_path(L(partial=("data",)), stored, SHAPE, 4, MESH).kinds == ("reduce_scatter",)
    # no data-parallel axis: from the consumer's layout, the forward path walked back (what
    # the constraints' transposes do: no custom derivative needed)
    src, dst = L({0: "data"}), L({1: "model"})
    back = backward_steps(src, dst, (), SHAPE, 4, MESH)
    assert back == (dst,) + relayout_steps(dst, src, SHAPE, 4, MESH)
    assert back == tuple(reversed(relayout_steps(src, dst, SHAPE, 4, MESH))) + (src,)


class Dense(nn.Module):
    @nn.compact
    def __call__(self, x):
        return jnp.tanh(nn.Dense(64, use_bias=False, name="fc")(x))


@pytest.fixture(scope="module")
def zero3():
    """A data-parallel Dense whose kernel is stored split over 'data' (read replicated)."""
    mesh = make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    x = jax.random.normal(jax.random.key(1), (16, 64))
    variables = Dense().init(jax.random.key(0), x)
    graph = trace(Dense(), x, variables=variables)
    draft = Draft(graph, {"data": 2, "model": 4})
    dot = next(op for op in graph.ops if op.primitive == "dot_general")
    draft.decide(dot, {"data": "m0"})
    draft.store_variable("params/fc/kernel", ("data", None))
    return Lowering(graph, draft.finish(), mesh), variables, x


def _loss(low):
    def loss(kernel, x):
        return jnp.sum(low(kernel, x)[0] ** 2)
    return loss


def test_a_zero3_gradient_is_reduce_scattered_into_its_storage(zero3):
    low, variables, x = zero3
    kernel = variables["params"]["fc"]["kernel"]
    grad = jax.jit(jax.grad(_loss(low)), in_shardings=low.input_shardings())
    text = grad.lower(kernel, x).compile().as_text()
    reductions = [c for c in hlo_collectives(text, low.mesh)
                  if c.kind in ("all_reduce", "reduce_scatter")]
    # plain constraints all-reduce the whole gradient (64 x 64 x 4 B) and slice it; the priced
    # reduce-scatter moves half of it per device (XLA:CPU writes it as an all-reduce of the
    # halves and a permute)
    assert reductions and all(c.bytes <= 64 * 64 * 4 // 2 for c in reductions), reductions
    want = jax.grad(lambda k, x: jnp.sum(Dense().apply({"params": {"fc": {"kernel": k}}}, x)
                                         ** 2))(kernel, x)
    np.testing.assert_allclose(grad(kernel, x), want, rtol=1e-5, atol=1e-6)


def test_forward_mode_still_differentiates_the_relayout(zero3):
    low, variables, x = zero3
    kernel = variables["params"]["fc"]["kernel"]
    _, tangent = jax.jvp(lambda k: low(k, x)[0], (kernel,), (jnp.ones_like(kernel),))
    _, want = jax.jvp(lambda k: Dense().apply({"params": {"fc": {"kernel": k}}}, x), (kernel,),
                      (jnp.ones_like(kernel),))
    np.testing.assert_allclose(tangent, want, rtol=1e-5, atol=1e-6)
