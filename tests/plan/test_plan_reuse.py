"""Saved plans at other sizes: a plan made at batch 8 runs at batch 16 (the fingerprint hashes
the model's structure, not its sizes), is re-priced there, and is refused, naming the op, dim,
size and mesh axis, where a split no longer divides; another model is still another model."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from meshes import make_mesh

import models
from nnscaler_jax import Plan, PlanError, auto_parallel, trace
from nnscaler_jax.capture.trace import capture_spec
from nnscaler_jax.cost.model import CostModel
from nnscaler_jax.errors import PlanFormatError
from nnscaler_jax.plan.plan import PipelineSettings, graph_fingerprint
from nnscaler_jax.plan.reuse import check_reuse
from nnscaler_jax.planner import make_plan

AXES = {"data": 2, "model": 4}


class Net(nn.Module):
    """``fc1`` (d -> hidden) -> relu -> ``fc2`` (hidden -> out)."""

    hidden: int = 32
    out: int = 16

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.out, name="fc2")(nn.relu(nn.Dense(self.hidden, name="fc1")(x)))


def _x(batch: int, d: int = 16) -> jax.Array:
    return jax.random.normal(jax.random.key(batch), (batch, d))


def _graph(batch: int, module: nn.Module | None = None):
    return trace(module or Net(), jax.ShapeDtypeStruct((batch, 16), jnp.float32))


def _splits(plan: Plan) -> list:
    return [(p.op, p.split, p.chunks) for p in plan.ops]


# ---- through auto_parallel --------------------------------------------------------------------

@pytest.mark.parametrize(("policy", "net", "d"), [
    ("dp", Net(), 16), ("megatron", Net(), 16),
    ("auto", Net(1024, 256), 256),  # wide enough for the search to split it
], ids=["dp", "megatron", "auto"])
def test_a_plan_made_at_batch_8_runs_at_batch_16(policy, net, d):
    mesh = make_mesh((2, 4), ("data", "model"))
    plan = auto_parallel(mesh, policy=policy)(net).make_plan(_x(8, d))
    assert any(p.split for p in plan.ops)
    x = _x(16, d)
    v = net.init(jax.random.key(0), x)
    for saved in (plan, plan.to_json()):
        pm = auto_parallel(mesh, plan=saved)(net)
        np.testing.assert_allclose(pm.apply(v, x), net.apply(v, x), rtol=1e-5, atol=1e-5)
        assert pm.plan == plan and _splits(pm.plan) == _splits(plan)
        assert pm.plan.variables == plan.variables
        # priced at batch 16: twice the compute of batch 8
        assert pm.plan.cost.compute_time_s > plan.cost.compute_time_s


def test_the_zoo_mlp_plan_at_batch_8_runs_at_batch_16():
    mesh = make_mesh((2, 4), ("data", "model"))
    module, make_args, _ = models.get("mlp", "tiny")
    plan = auto_parallel(mesh, policy="megatron")(module).make_plan(*make_args())
    module16, make_args16, _ = models.get("mlp", "tiny", batch_size=16)
    (x,) = make_args16()
    v = module16.init(jax.random.key(1), x)
    pm = auto_parallel(mesh, plan=plan)(module16)
    np.testing.assert_allclose(pm.apply(v, x), module16.apply(v, x), rtol=1e-5, atol=1e-6)
    assert _splits(pm.plan) == _splits(plan)


def test_batch_6_on_a_data_axis_of_4_is_refused_naming_size_and_axis():
    mesh = make_mesh((4, 2), ("data", "model"))
    plan = auto_parallel(mesh, policy="dp")(Net()).make_plan(_x(8))
    pm = auto_parallel(mesh, plan=plan)(Net())
    with pytest.raises(PlanError, match=r"over mesh axis 'data' \(4\), but its size here is 6, "
                       r"which 4 does not divide") as info:
        pm.make_plan(_x(6))
    e = info.value
    assert isinstance(e, PlanFormatError)
    assert e.axis == "data" and e.op == "dot_general" and e.module_path == "fc1"
    assert e.shapes[0] == (6, 16)
    msg = str(e)
    assert "re-plan" in msg and "4 or 8" in msg and "axis 0 of input 0, shape (6, 16)" in msg


def test_another_model_is_still_another_model():
    mesh = make_mesh((2, 4), ("data", "model"))
    plan = auto_parallel(mesh, policy="dp")(Net()).make_plan(_x(8))
    gpt, make_args, _ = models.get("gpt", "tiny")
    with pytest.raises(PlanFormatError, match=r"another model .*the plan has \d+ ops, this "
                       r"graph \d+"):
        auto_parallel(mesh, plan=plan)(gpt).make_plan(*make_args())


# ---- make_plan on graphs ----------------------------------------------------------------------

def test_the_fingerprint_ignores_sizes_but_not_structure():
    assert graph_fingerprint(_graph(8)) == graph_fingerprint(_graph(16))
    assert graph_fingerprint(_graph(8)) != graph_fingerprint(_graph(8, nn.Dense(4)))
    assert graph_fingerprint(_graph(8)).startswith("s1-")


def test_make_plan_reuses_and_reprices_at_other_sizes():
    saved = make_plan(_graph(8), AXES, policy="megatron")
    g16 = _graph(16)
    reused = make_plan(g16, AXES, plan=saved)
    assert reused == saved and _splits(reused) == _splits(saved)
    assert reused.cost == CostModel.for_axes(AXES).plan_cost(saved, g16) != saved.cost
    unpriced = dataclasses.replace(saved, cost=None)
    assert make_plan(g16, AXES, plan=unpriced) is unpriced  # nothing to re-price


def test_a_gpt_plan_reused_at_another_sequence_length():
    spec = models.get("gpt", "tiny")
    saved = make_plan(capture_spec(spec).graph, AXES, policy="megatron")
    shorter = capture_spec(models.get("gpt", "tiny", seq_len=8)).graph
    reused = make_plan(shorter, AXES, plan=saved)
    assert _splits(reused) == _splits(saved)
    assert reused.cost.compute_time_s < saved.cost.compute_time_s


def test_axes_on_one_dim_multiply():
    axes = {"data": 2, "fsdp": 4}
    saved = make_plan(_graph(8), axes, policy="dp")
    assert any(len(p.split) == 2 for p in saved.ops)  # the batch over both axes: 8 ways
    assert make_plan(_graph(16), axes, plan=saved) == saved
    with pytest.raises(PlanFormatError, match=r"'data' \(2\) x 'fsdp' \(4\) = 8 ways, but its "
                       r"size here is 4") as info:
        make_plan(_graph(4), axes, plan=saved)
    assert info.value.axis == "data,fsdp"


def test_a_variable_spec_that_does_not_divide_is_refused():
    """A hand-edited plan storing a variable split where its size does not divide."""
    g = _graph(8, Net(hidden=6))  # fc1's bias: (6,)
    saved = make_plan(g, AXES, policy="dp")
    spec = dict(saved.variables)
    ok = dict(spec, **{"params/fc2/bias": (("data", "model"),)})  # 16 over 8 divides
    assert make_plan(g, AXES, plan=dataclasses.replace(saved, variables=tuple(ok.items())))
    bad = dict(spec, **{"params/fc1/bias": ("model",)})
    with pytest.raises(PlanFormatError, match=r"variable 'params/fc1/bias' of shape \(6,\) is "
                       r"stored with dim 0 split over mesh axes \['model'\] \(4 ways\)"):
        make_plan(g, AXES, plan=dataclasses.replace(saved, variables=tuple(bad.items())))


def test_micro_batches_must_divide_the_new_batch():
    saved = make_plan(_graph(8), AXES, policy="dp")
    piped = dataclasses.replace(saved, pipeline=PipelineSettings(stages=1, microbatches=4))
    check_reuse(piped, _graph(16), AXES)
    with pytest.raises(PlanFormatError, match="4 micro-batches, but the batch here is 6"):
        check_reuse(piped, _graph(6), AXES)


def test_a_plan_saved_with_a_size_fingerprint_still_loads():
    """Plans saved before fingerprints left sizes out: accepted when the ops match."""
    saved = make_plan(_graph(8), AXES, policy="dp")
    old = dataclasses.replace(saved, fingerprint="f2b7e88e9ac7440a")
    assert make_plan(_graph(16), AXES, plan=old) == old
    with pytest.raises(PlanFormatError, match="another model"):
        make_plan(_graph(8, nn.Dense(4)), AXES, plan=old)


# ---- renumbered: a plan onto the same ops traced again (pipeline stage plans) ----------------

class _NetAndLoss(nn.Module):
    """Net's ops, then its loss's (as a pipeline stage with the loss the planned part lacks)."""

    @nn.compact
    def __call__(self, x):
        y = nn.Dense(16, name="fc2")(nn.relu(nn.Dense(32, name="fc1")(x)))
        return jnp.mean(y * y)


def test_renumbered_maps_a_plan_onto_the_same_ops_traced_again():
    from nnscaler_jax.plan.reuse import renumbered

    plan = make_plan(_graph(8), AXES, policy="megatron")
    key = lambda ops, ids: [(ops[i].module_path, ops[i].primitive) for i in ids]
    for other in (_graph(16), trace(_NetAndLoss(), jax.ShapeDtypeStruct((8, 16), jnp.float32))):
        got = renumbered(plan, other)
        ops = {op.id: op for op in other.walk()}
        assert got is not None and got.variables == plan.variables
        assert [p.split for p in got.ops] == [p.split for p in plan.ops]
        assert key(ops, [p.op for p in got.ops]) == [(p.module_path, p.primitive)
                                                      for p in plan.ops]
    # other modules: not the plan's ops
    assert renumbered(plan, trace(nn.Sequential([Net()]),
                                  jax.ShapeDtypeStruct((8, 16), jnp.float32))) is None
