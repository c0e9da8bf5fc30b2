"""Flax partitioning metadata is honoured by the search as constraints."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from nnscaler_jax import PlanError
from nnscaler_jax.capture.metadata import partitioning_specs
from nnscaler_jax.capture.trace import capture
from nnscaler_jax.search import search

AXES = {"data": 2, "model": 4}
init = nn.initializers.lecun_normal()


class Boxed(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(16, use_bias=False, name="fc1",
                     kernel_init=nn.with_partitioning(init, (None, "model")))(x)
        h = nn.relu(h)
        return nn.Dense(8, use_bias=False, name="fc2",
                        kernel_init=nn.with_logical_partitioning(init, ("mlp", None)))(h)


def _setup():
    x = jax.ShapeDtypeStruct((8, 8), jnp.float32)
    boxed = jax.eval_shape(Boxed().init, jax.random.key(0), x)
    graph = capture(Boxed(), x, variables=nn.unbox(boxed)).graph
    return graph, boxed


def test_partitioning_specs_reads_linen_boxes():
    _, boxed = _setup()
    specs = partitioning_specs(boxed, logical_rules=(("mlp", "model"),))
    assert specs == {"params/fc1/kernel": (None, "model"), "params/fc2/kernel": ("model", None)}


def test_metadata_pins_the_storage_split():
    graph, boxed = _setup()
    free, _ = search(graph, AXES)
    assert dict(free.variables)["params/fc1/kernel"] != (None, "model")  # not chosen freely
    specs = partitioning_specs(boxed, logical_rules=(("mlp", "model"),))
    plan, _ = search(graph, AXES, partitioning=specs)
    stored = dict(plan.variables)
    assert stored["params/fc1/kernel"] == (None, "model")
    assert stored["params/fc2/kernel"] == ("model", None)


def test_unmeetable_metadata_is_a_plan_error():
    graph, _ = _setup()
    with pytest.raises(PlanError, match="fc1/kernel"):
        search(graph, {"data": 2, "model": 3}, partitioning={"params/fc1/kernel": ("model",
                                                                                     None)})
