"""A custom jax primitive without an annotation rule, for tests of ``register_rule`` and of the
missing-rule warning."""

import jax
import jax.numpy as jnp
from jax.extend import core as jcore
from jax.interpreters import mlir


def softsign_primitive(name: str) -> jcore.Primitive:
    """``x / (1 + |x|)`` as a new primitive called ``name`` (evaluates, lowers, no rule)."""
    prim = jcore.Primitive(name)
    prim.def_impl(lambda x: x / (1 + jnp.abs(x)))
    prim.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
    mlir.register_lowering(prim, mlir.lower_fun(lambda x: x / (1 + jnp.abs(x)),
                                                multiple_results=False))
    return prim
