"""A batch the caller has not laid out (numpy arrays, arrays on one device) reaches the pipelined
training step split over the data axes, not copied whole to every device: the compiled step's
argument bytes per device hold only the device's rows. (The SPMD step needs no placing: XLA's
propagation splits such an argument as the plan's first op reads it; the pipelined step reads
its micro-batches ``[M, D, b]``, a layout of the batch no argument sharding can say.)"""
import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import models
from nnscaler_jax import Constraints, auto_parallel

pytestmark = pytest.mark.slow


def _argument_bytes(step, state, batch):
    return step.lower(state, *batch).compile().memory_analysis().argument_size_in_bytes


def _check(pm, mesh, module, loss_fn, variables, args, ways):
    step = pm.train_step(loss_fn, optax.sgd(0.1))
    state = step.init(variables, *args)
    host = tuple(np.asarray(a) for a in args)  # as a data loader gives them
    whole = tuple(jax.device_put(a, NamedSharding(mesh, P())) for a in args)
    rows = sum(a.nbytes for a in host)
    saved = _argument_bytes(step, state, whole) - _argument_bytes(step, state, host)
    assert saved == rows - rows // ways  # each device holds 1 / ways of the rows
    _, from_host = step(state, *host)
    state = step.init(variables, *args)
    _, from_whole = step(state, *whole)
    np.testing.assert_allclose(float(from_host["loss"]), float(from_whole["loss"]), rtol=1e-6)


def test_pipelined_step_splits_a_host_batch_over_the_data_axes():
    mesh = jax.make_mesh((2, 4), ("stage", "data"))  # Explicit axis types
    module, make_args, loss_fn = models.get("gpt", "tiny", batch_size=8)
    args = make_args(rng=jax.random.key(1))
    variables = module.init(jax.random.key(0), *args)
    pm = auto_parallel(mesh, Constraints(pipeline_stages=2, microbatches=2,
                                         schedule="1f1b"))(module)
    _check(pm, mesh, module, loss_fn, variables, args, ways=4)
