"""The cost model's predictions against what XLA compiles (see scripts/bench_predict.py).

MLP tiny on a 2x4 (data, model) mesh, the training step ``value_and_grad`` of the loss:

- comm: the plan's ``comm_bytes`` (alpha-beta ``n``: all-reduce / all-gather = result bytes,
  reduce-scatter / all-to-all = p x result bytes) vs the HLO collectives in that convention;
- memory: the plan's ``memory_breakdown`` minus optimizer state vs XLA's
  argument + output + temp - alias of the grad step (no optimizer state in it; it returns
  every gradient, so all of them are held: ``CostModel(grads_held=True)``).
"""


import jax
import pytest
from meshes import make_mesh

import models
from nnscaler_jax import auto_parallel
from nnscaler_jax.cost.model import CostModel
from nnscaler_jax.lower.hlo import hlo_collectives

pytestmark = pytest.mark.slow  # compiles and runs programs over the mesh


def _measure(policy):
    spec = models.get("mlp", "tiny", batch_size=8)
    mesh = make_mesh((2, 4), ("data", "model"))
    args = spec.make_args(abstract=False)
    pm = auto_parallel(mesh, policy=policy)(spec.module)
    variables = pm.init(jax.random.key(0), *args)
    plan, graph = pm.plan, pm.graph
    step = jax.jit(jax.value_and_grad(lambda v: spec.loss_fn(pm.apply(v, *args), *args)))
    compiled = step.lower(variables).compile()
    text = compiled.as_text()
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape, strict=True))
    hlo_n = 0
    for c in hlo_collectives(text, mesh):
        p = 1
        for a in c.axes:
            p *= sizes[a]
        if p > 1:
            hlo_n += c.bytes * (p if c.kind in ("reduce_scatter", "all_to_all") else 1)
    m = compiled.memory_analysis()
    xla_mem = (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
               - m.alias_size_in_bytes)
    bd = CostModel.for_axes(dict(plan.mesh), zero=plan.zero, grads_held=True).memory_breakdown(
        plan, graph)
    return plan, hlo_n, xla_mem, bd


@pytest.mark.parametrize("policy", ["dp", "megatron"])
def test_mlp_comm_bytes_match_hlo(policy):
    plan, hlo_n, _, _ = _measure(policy)
    assert plan.cost.comm_bytes > 0
    assert plan.cost.comm_bytes == pytest.approx(hlo_n, rel=0.10)


def test_mlp_dp_grad_step_memory_matches_xla():
    _, _, xla_mem, bd = _measure("dp")
    assert bd["peak"] - bd["optimizer"] == pytest.approx(xla_mem, rel=0.15)
