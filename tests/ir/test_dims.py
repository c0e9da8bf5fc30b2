"""Dimension classes (`ir/dims.py`): which tensor axes split together, which are frozen, and the
annotation a region gets from its body's classes."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from nnscaler_jax import trace
from nnscaler_jax.ir.anno import parse_anno
from nnscaler_jax.ir.dims import DimClasses, compose_anno, dim_classes, graph_dim_classes
from nnscaler_jax.ir.graph import Op, Role, Tensor


def T(i, *shape):
    return Tensor(i, shape, "float32")


# x[8,4] @ w[4,6] -> y[8,6]; tanh(y) -> z[8,6]
X, W, Y, Z = T(0, 8, 4), T(1, 4, 6), T(2, 8, 6), T(3, 8, 6)
MATMUL = Op(10, "dot_general", (X, W), (Y,), "m k+, k+ n -> m n")
TANH = Op(11, "tanh", (Y,), (Z,), "a b -> a b")


def test_identifiers_shared_across_ops_make_one_class():
    c = dim_classes([MATMUL, TANH])
    rows = c.cls(0, 0)
    assert rows == c.cls(2, 0) == c.cls(3, 0)           # m, then a
    assert c.cls(1, 1) == c.cls(2, 1) == c.cls(3, 1)    # n, then b
    assert c.cls(0, 1) == c.cls(1, 0)                   # k
    assert len({c.cls(0, 0), c.cls(1, 1), c.cls(0, 1)}) == 3
    # the class id is the smallest member key
    assert rows == (0, 0) and c.cls(1, 1) == (1, 1) and c.cls(0, 1) == (0, 1)
    assert sorted(c.members((0, 0))) == [(0, 0), (2, 0), (3, 0)]
    assert c.cls(99, 0) is None


def test_a_contracted_dim_is_frozen_only_when_asked():
    # inside a region, splitting k would leave partial sums the region cannot hold
    assert dim_classes([MATMUL]).frozen == {(0, 1)}
    assert dim_classes([MATMUL], reduce_frozen=False).frozen == frozenset()
    # a reduction whose identifier reaches an output is no partial sum
    keep = Op(12, "cumsum", (Y,), (Z,), "a b+ -> a b+")
    assert dim_classes([keep]).frozen == frozenset()


@pytest.mark.parametrize(("anno", "frozen_axes"), [
    ("a b^ -> a b^", {1}),          # frozen
    ("a 6 -> a 6", {1}),            # fixed size
    ("(a c) b -> (a c) b", {0}),    # grouped: the axis is not one splittable dim
])
def test_frozen_fixed_and_grouped_axes_are_frozen(anno, frozen_axes):
    op = Op(13, "f", (Y,), (Z,), anno)
    c = dim_classes([op])
    got = {i for i in range(2) if c.cls(2, i) in c.frozen}
    assert got == frozen_axes


def test_an_unannotated_op_freezes_all_its_axes():
    op = Op(14, "custom", (Y,), (Z,), "? -> ?", annotated=False)
    c = dim_classes([TANH, op])
    assert {c.cls(2, 0), c.cls(2, 1)} <= c.frozen


def test_extra_unions_tie_classes():
    c = dim_classes([MATMUL, TANH], [((3, 0), (1, 1))])
    assert c.cls(0, 0) == c.cls(1, 1) == (0, 0)


def test_compose_anno_names_classes_and_marks_frozen():
    classes = DimClasses(of={(0, 0): (0, 0), (2, 0): (0, 0), (0, 1): (0, 1), (1, 1): (1, 1)},
                         frozen=frozenset({(0, 1)}))
    text = compose_anno(classes, [((0, 0), (0, 1)), None, ()], [(None, (2, 0), (1, 1))])
    a = parse_anno(text)  # valid annotation language
    assert len(a.inputs) == 3 and len(a.outputs) == 1
    x, rep, scalar = a.inputs
    (out,) = a.outputs
    assert rep.axes is None and scalar.axes == ()
    ident = lambda op, i: op.axes[i].dims[0]
    assert ident(x, 0).name == ident(out, 1).name          # one class, one identifier
    assert ident(x, 1).kind.value == "^"                   # frozen class
    assert ident(out, 0).kind.value == "^"                 # no body axis: frozen, fresh
    names = [ident(x, 0).name, ident(x, 1).name, ident(out, 0).name, ident(out, 2).name]
    assert len(set(names)) == 4


def test_compose_anno_never_runs_out_of_names():
    n = 40  # more classes than letters
    classes = DimClasses(of={(i, 0): (i, 0) for i in range(n)}, frozen=frozenset())
    text = compose_anno(classes, [tuple((i, 0) for i in range(n))], [])
    names = [ax.dims[0].name for ax in parse_anno(text).inputs[0].axes]
    assert len(set(names)) == n


class _Stack(nn.Module):
    """Two Dense layers under nn.scan: the carry [b, d] passes through the loop."""

    @nn.compact
    def __call__(self, x):
        class Cell(nn.Module):
            @nn.compact
            def __call__(self, c, _):
                return jnp.tanh(nn.Dense(c.shape[-1])(c)), None

        scan = nn.scan(Cell, variable_axes={"params": 0}, split_rngs={"params": True}, length=2)
        return scan(name="layers")(x, None)[0]


def test_graph_dim_classes_tie_region_bodies_to_the_outer_tensors():
    g = trace(_Stack(), jax.ShapeDtypeStruct((4, 8), jnp.float32))
    (scan,) = [op for op in g.ops if op.primitive == "scan"]
    (body,) = scan.regions
    c = graph_dim_classes(g)
    (x,) = [t for t in g.inputs if t.role is Role.INPUT]
    batch = c.cls(x.id, 0)
    # the batch axis of the input reaches the body's matmul and the scan's carry out
    dot = next(op for op in body.ops if op.primitive == "dot_general")
    assert c.cls(dot.inputs[0].id, 0) == batch
    assert c.cls(g.outputs[0].id, 0) == batch
    assert batch not in c.frozen
    # policies may split reductions (partial sums): the contracted dim is not frozen there
    kernel = next(t for t in g.variables if t.name.endswith("kernel"))
    assert c.cls(kernel.id, 1) not in c.frozen
    # the stacked kernel's leading layer axis has no body counterpart (and the scan's own
    # composed annotation is not used): it belongs to no class
    assert kernel.shape == (2, 8, 8) and c.cls(kernel.id, 0) is None
