"""`rules/_build.py`: shapes of avals and the annotation text builders the rule modules share;
whatever they build must parse and bind to the shapes it was built for."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nnscaler_jax.ir.anno import DimKind, parse_anno
from nnscaler_jax.rules._build import (
    Fresh,
    anno,
    frozen_operand,
    group,
    operand,
    replicated,
    shape_of,
)


def test_shape_of_arrays_avals_and_non_arrays():
    assert shape_of(jax.ShapeDtypeStruct((2, 3), jnp.float32)) == (2, 3)
    assert shape_of(jax.core.ShapedArray((np.int64(4),), jnp.float32)) == (4,)
    assert shape_of(jax.core.ShapedArray((), jnp.float32)) == ()
    assert shape_of(object()) is None  # a token or a ref: not plannable


def test_shape_of_a_symbolic_shape_is_none():
    aval = jax.ShapeDtypeStruct(jax.export.symbolic_shape("b, 4"), jnp.float32)
    assert shape_of(aval) is None


def test_operand_and_anno_text():
    assert operand(None) == "?"
    assert operand([]) == "()"
    assert operand(["a", "k+", "1"]) == "a k+ 1"
    assert anno([], ["a"]) == " -> a"
    assert anno(["a b", "?"], ["a", "()"]) == "a b, ? -> a, ()"


def test_group_is_one_axis():
    assert group(["h"]) == "h"
    text = anno([group(["h", "d"])], [operand(["h", "d"])])
    a = parse_anno(text)
    assert len(a.inputs[0].axes) == 1 and [d.name for d in a.inputs[0].axes[0].dims] == ["h", "d"]
    assert a.bind([(12,)], [(3, 4)]) == {"h": 3, "d": 4}


def test_fresh_names_are_distinct_and_frozen_ones_marked():
    f = Fresh("x")
    names = f.many(30) + [f.frozen() for _ in range(3)]
    assert len(set(names)) == 33
    assert all(n.startswith("x") for n in names)
    assert [n.endswith("^") for n in names].count(True) == 3
    # independent generators restart
    assert Fresh("x")() == "x0" and Fresh()() == "d0"


def test_frozen_operand():
    f = Fresh("r")
    assert frozen_operand(None, f) == "?"
    assert frozen_operand((), f) == "()"
    text = frozen_operand((2, 3), f)
    (op,) = parse_anno(f"{text} -> ()").inputs
    assert all(ax.dims[0].kind is DimKind.FROZEN for ax in op.axes) and len(op.axes) == 2


@pytest.mark.parametrize(("ins", "outs"), [
    ([(2, 3), ()], [(3,)]),
    ([(4,)], [(4,), (1, 1)]),
    ([], [(5,)]),
])
def test_replicated_parses_binds_and_splits_nothing(ins, outs):
    avals = lambda shapes: [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    text = replicated(avals(ins), avals(outs))
    a = parse_anno(text)
    a.bind(ins, outs)  # binds to the shapes it was built from
    assert a.splittable() == []
    names = [n for o in a.operands for n in o.names()]
    assert len(names) == len(set(names))  # no two axes tied together


def test_replicated_marks_non_arrays():
    text = replicated([object(), jax.ShapeDtypeStruct((2,), jnp.float32)], [object()])
    a = parse_anno(text)
    assert a.inputs[0].axes is None and a.outputs[0].axes is None
