"""Plans: JSON round trip, reuse, the primitives' errors, ZeRO-3 storage, bad inputs."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from meshes import make_mesh

import models
from nnscaler_jax import Constraints, Plan, PlanError, auto_parallel, op_assign, op_order, op_trans
from nnscaler_jax.lower.hlo import expected_collectives, hlo_collectives, summarize


@pytest.fixture(scope="module")
def mlp():
    module, make_args, _ = models.get("mlp", "tiny")
    (x,) = make_args()
    return module, x, module.init(jax.random.key(0), x)


def test_plan_json_round_trip_and_reuse(mlp):
    module, x, v = mlp
    mesh = make_mesh((2, 4), ("data", "model"))
    pm = auto_parallel(mesh, policy="megatron")(module)
    plan = pm.make_plan(x)
    text = plan.to_json()
    again = Plan.from_json(text)
    assert again == plan and again.cost == plan.cost
    assert again.to_json() == text
    # a saved plan is reused without searching, and computes the same thing
    pm2 = auto_parallel(mesh, plan=again)(module)
    np.testing.assert_allclose(pm2.apply(v, x), pm.apply(v, x), rtol=1e-6)
    assert pm2.plan == plan
    # readable table: module paths and the mesh axes
    table = str(plan)
    assert "fc1" in table and "model" in table and "estimate" in table


def test_plan_cost_fields(mlp):
    module, x, _ = mlp
    plan = auto_parallel(make_mesh((2, 4), ("data", "model")), policy="dp")(module).make_plan(x)
    assert plan.cost.step_time_s > 0 and plan.cost.memory_bytes_per_device > 0
    assert plan.cost.comm_bytes >= 0


@pytest.mark.parametrize("text", ["{", "[]", json.dumps({"format": "other"}), "null"])
def test_bad_plan_json(text):
    with pytest.raises(PlanError, match="plan JSON"):
        Plan.from_json(text)


def test_plan_for_a_different_model_is_rejected(mlp):
    module, x, _ = mlp
    mesh = make_mesh((2, 4), ("data", "model"))
    plan = auto_parallel(mesh, policy="dp")(module).make_plan(x)
    gpt, make_args, _ = models.get("gpt", "tiny")
    pm = auto_parallel(mesh, plan=plan)(gpt)
    with pytest.raises(PlanError, match="another model"):
        pm.make_plan(*make_args())
    # same model, other mesh shape
    pm = auto_parallel(make_mesh((4, 2), ("data", "model")), plan=plan)(module)
    with pytest.raises(PlanError, match="mesh"):
        pm.make_plan(x)


def test_zero3_parameter_bytes_per_device(mlp):
    module, x, _ = mlp
    mesh = make_mesh((8, 1), ("data", "model"))
    v = auto_parallel(mesh, policy="zero3")(module).init(jax.random.key(0), x)
    total = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(v))
    for device in mesh.devices.flat:
        local = sum(s.data.nbytes for leaf in jax.tree_util.tree_leaves(v)
                    for s in leaf.addressable_shards if s.device == device)
        assert local == total // 8


def test_zero3_constraint_on_gpt_shards_every_divisible_weight():
    gpt, make_args, _ = models.get("gpt", "tiny", batch_size=8)
    mesh = make_mesh((2, 4), ("data", "model"))
    pm = auto_parallel(mesh, Constraints(zero=3), policy="megatron")(gpt)
    v = pm.init(jax.random.key(0), *make_args())
    total = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(v))
    local = sum(s.data.nbytes for leaf in jax.tree_util.tree_leaves(v)
                for s in leaf.addressable_shards if s.device == mesh.devices.flat[0])
    assert pm.plan.zero == 3
    assert local <= total / 6  # all but a few odd-sized leaves are split 8 ways


def test_megatron_mlp_block_has_one_forward_all_reduce(mlp):
    module, x, v = mlp
    mesh = make_mesh((2, 4), ("data", "model"))
    pm = auto_parallel(mesh, policy="megatron")(module)
    hlo = summarize(hlo_collectives(pm.compiled(v, x).as_text(), mesh))
    assert hlo == {("all_reduce", ("model",)): 1}
    assert summarize(expected_collectives(pm.graph, pm.plan)) == hlo


def test_gpt_megatron_collectives_match_the_plan():
    gpt, make_args, _ = models.get("gpt", "tiny", batch_size=8)
    args = make_args()
    mesh = make_mesh((2, 4), ("data", "model"))
    v = gpt.init(jax.random.key(0), *args)
    pm = auto_parallel(mesh, policy="megatron")(gpt)
    hlo = summarize(hlo_collectives(pm.compiled(v, *args).as_text(), mesh))
    # per layer: attention out-projection and MLP c_proj each all-reduce once over 'model'
    n_layers = gpt.config.n_layers if hasattr(gpt, "config") else 2
    assert hlo[("all_reduce", ("model",))] == 2 * n_layers
    expected = summarize(expected_collectives(pm.graph, pm.plan))
    assert expected[("all_reduce", ("model",))] == hlo[("all_reduce", ("model",))]


def test_dp_forward_has_no_collectives(mlp):
    module, x, v = mlp
    mesh = make_mesh((8, 1), ("data", "model"))
    pm = auto_parallel(mesh, policy="dp")(module)
    assert hlo_collectives(pm.compiled(v, x).as_text(), mesh) == []


# ---- bad inputs ------------------------------------------------------------------------------

def test_unknown_mesh_axis_in_a_policy(mlp):
    module, x, _ = mlp

    def policy(graph, mesh):
        op = next(op for op in graph.ops if op.primitive == "dot_general")
        op_assign(graph, op_trans(graph, op, op.annotation.operands[0].axes[0].dims[0].name, 2),
                  "pipe")
        return graph.finish()

    pm = auto_parallel(make_mesh((2, 4), ("data", "model")), policy=policy)(module)
    with pytest.raises(PlanError, match=r"fc1.*mesh axis 'pipe'"):
        pm.make_plan(x)


def test_policy_assigns_outside_the_mesh(mlp):
    module, x, _ = mlp

    def policy(graph, mesh):
        op = next(op for op in graph.ops if op.primitive == "dot_general")
        sub = op_trans(graph, op, op.annotation.operands[0].axes[0].dims[0].name, 2)[1]
        op_assign(graph, sub, {"data": 5})
        return graph.finish()

    pm = auto_parallel(make_mesh((2, 4), ("data", "model")), policy=policy)(module)
    with pytest.raises(PlanError, match="outside the mesh"):
        pm.make_plan(x)


def test_op_trans_errors_name_the_op(mlp):
    module, x, _ = mlp
    seen = {}

    def policy(graph, mesh):
        op = next(op for op in graph.ops if op.primitive == "dot_general")
        anno = op.annotation
        batch = anno.operands[0].axes[0].dims[0].name
        for bad, n, what in [("zz", 2, "not in the annotation"), (batch, 3, "not divisible")]:
            with pytest.raises(PlanError, match=what) as e:
                op_trans(graph, op, bad, n)
            seen[what] = str(e.value)
        return graph.finish()

    auto_parallel(make_mesh((2, 4), ("data", "model")), policy=policy)(module).make_plan(x)
    for msg in seen.values():
        assert "dot_general" in msg and "fc1" in msg and "(8, 16)" in msg


def test_op_order_against_a_data_dependency(mlp):
    module, x, _ = mlp

    def policy(graph, mesh):
        dots = [op for op in graph.ops if op.primitive == "dot_general"]
        op_order(graph, dots[1], dots[0])  # fc2 cannot run before fc1, which it reads
        return graph.finish()

    pm = auto_parallel(make_mesh((2, 4), ("data", "model")), policy=policy)(module)
    with pytest.raises(PlanError, match="depends on"):
        pm.make_plan(x)


def test_indivisible_batch_falls_back_or_errors(mlp):
    module, _, _ = mlp
    x = jnp.ones((3, 16))  # 3 rows on a data axis of 2

    def policy(graph, mesh):
        op = next(op for op in graph.ops if op.primitive == "dot_general")
        op_assign(graph, op_trans(graph, op, op.annotation.operands[0].axes[0].dims[0].name, 2),
                  "data")
        return graph.finish()

    pm = auto_parallel(make_mesh((2, 4), ("data", "model")), policy=policy)(module)
    with pytest.raises(PlanError, match=r"size 3 is not divisible"):
        pm.make_plan(x)
    # the built-in dp policy leaves an indivisible batch replicated instead of failing, and
    # says so (tests/plan/test_unsplit.py)
    with pytest.warns(UserWarning, match=r"size 3 over 'data' \(2\)"):
        out = auto_parallel(make_mesh((2, 4), ("data", "model")), policy="dp")(module).apply(
            module.init(jax.random.key(0), x), x)
    assert out.shape == (3, 16)


def test_wrong_shaped_args(mlp):
    module, _, v = mlp
    pm = auto_parallel(make_mesh((2, 4), ("data", "model")), policy="dp")(module)
    with pytest.raises(PlanError, match=r"(?s)MLP.*\(8, 5\) float32"):
        pm.apply(v, jnp.ones((8, 5)))
    # a string is a static option (as in jax.jit): the module fails on it, named with context
    with pytest.raises(PlanError, match=r"MLP: the call failed while tracing"):
        pm.apply(v, "tokens")


def test_bad_policy_and_mesh_and_constraints(mlp):
    module, x, _ = mlp
    mesh = make_mesh((2, 4), ("data", "model"))
    with pytest.raises(PlanError, match="unknown policy"):
        auto_parallel(mesh, policy="magic")(module).make_plan(x)
    with pytest.raises(PlanError, match="Mesh"):
        auto_parallel("2x4")
    with pytest.raises(PlanError, match="megatron needs a model axis"):
        auto_parallel(make_mesh((8,), ("data",)), policy="megatron")(module).make_plan(x)
    with pytest.raises(PlanError, match="ZeRO"):
        Constraints(zero=5)
    with pytest.raises(PlanError, match="matches no op"):
        from nnscaler_jax import Rule

        auto_parallel(mesh, Constraints(rules=(Rule(module="nope/*"),)))(module).make_plan(x)


def test_hlo_parser_reads_combined_collectives_with_index_comments():
    """XLA prints /*index=5*/ inside long tuple types of combined collectives."""
    mesh = make_mesh((2, 4), ("data", "model"))
    types = ", ".join(["f32[4]"] * 5 + ["/*index=5*/f32[4]", "f32[2,2]"])
    line = (f"  %all-reduce.3 = ({types}) all-reduce(%a, %b), channel_id=3, "
            "replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}, to_apply=%add")
    (c,) = hlo_collectives(line, mesh)
    assert c.kind == "all_reduce" and c.axes == ("data",) and c.bytes == 6 * 16 + 16


def test_hlo_parser_reads_mesh_groups_with_device_ids():
    """jax 0.10 prints ``device_ids=([2,4]T(1,0))`` when the HLO mesh orders devices
    differently from an iota (here a 5-axis mesh with the 'model' group as 'axis_3'); the
    groups must come out over the user's 'model' axis, not as size-1 groups."""
    mesh = make_mesh((2, 4), ("data", "model"))
    line = ("  %all-gather.1 = f32[2,8,8,16]{3,2,1,0} all-gather(%p), channel_id=1, "
            "replica_groups=mesh['axis_0'=1,'axis_1'=1,'axis_2'=1,'axis_3'=4,'axis_4'=2], "
            "device_ids=([2,4]T(1,0)) {'axis_3'}, dimensions={3}, use_global_device_ids=true")
    (c,) = hlo_collectives(line, mesh)
    assert c.kind == "all_gather" and c.axes == ("model",) and c.bytes == 2 * 8 * 8 * 16 * 4
    line = line.replace("{'axis_3'}", "{'axis_4'}")
    assert hlo_collectives(line, mesh)[0].axes == ("data",)
