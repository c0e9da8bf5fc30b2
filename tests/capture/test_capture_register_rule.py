"""``register_rule`` end to end: a custom primitive warns once, then is annotated."""

from __future__ import annotations

import warnings

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import pytest
from custom_prims import softsign_primitive

import nnscaler_jax
from nnscaler_jax import trace
from nnscaler_jax.rules.registry import _REGISTRY

MY_PRIM = softsign_primitive("my_softsign")


class _Custom(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4, name="inner")(MY_PRIM.bind(nn.Dense(4, name="proj")(x)))


class _Wrapper(nn.Module):
    @nn.compact
    def __call__(self, x):
        return _Custom(name="block")(x)


@pytest.fixture
def restore_rules():
    saved = dict(_REGISTRY._user)
    yield
    _REGISTRY._user.clear()
    _REGISTRY._user.update(saved)


def _trace(x):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graph = trace(_Wrapper(), x)
    return graph, [w for w in caught if issubclass(w.category, UserWarning)]


def test_primitive_runs() -> None:
    x = jnp.array([1.0, -3.0])
    np.testing.assert_allclose(MY_PRIM.bind(x), x / (1 + jnp.abs(x)))


def test_custom_primitive_warns_then_register_rule(restore_rules) -> None:
    x = jnp.ones((2, 3))
    graph, caught = _trace(x)
    (op,) = [op for op in graph.walk() if op.primitive == "my_softsign"]
    assert not op.annotated and op.anno == "? -> ?"
    assert "!unannotated" in str(graph)
    assert op.module_path == "block"
    (w,) = caught
    msg = str(w.message)
    assert "my_softsign" in msg and "block" in msg and "register_rule" in msg

    nnscaler_jax.register_rule(MY_PRIM, "a b -> a b")
    graph, caught = _trace(x)
    assert not caught, [str(w.message) for w in caught]
    (op,) = [op for op in graph.walk() if op.primitive == "my_softsign"]
    assert op.annotated and op.anno == "a b -> a b"
    assert all(o.annotated for o in graph.walk())
    assert "!unannotated" not in str(graph)


def test_function_rule(restore_rules) -> None:
    @nnscaler_jax.register_rule("my_softsign")
    def _rule(params, in_avals, out_avals):
        return " ".join(f"d{i}" for i in range(len(in_avals[0].shape))) + " -> " + " ".join(
            f"d{i}" for i in range(len(out_avals[0].shape)))

    graph, caught = _trace(jnp.ones((2, 5, 3)))
    assert not caught
    (op,) = [op for op in graph.walk() if op.primitive == "my_softsign"]
    assert op.anno == "d0 d1 d2 -> d0 d1 d2"
