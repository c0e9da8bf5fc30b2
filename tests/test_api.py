"""``auto_parallel``'s wrappers: one program per call signature (planned once, shared by
``make_plan`` / ``init`` / ``apply``), the class decorator's per-instance wrapper, the
missing-rule warning and ``pm.graph``."""

from __future__ import annotations

import warnings

import flax.linen as nn
import jax
import pytest
from custom_prims import softsign_primitive
from flax import nnx

from nnscaler_jax import PlanError, auto_parallel
from nnscaler_jax.ir.graph import Graph
from nnscaler_jax.lower.verify import max_rel_diff


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(8, name="fc2")(nn.relu(nn.Dense(32, name="fc1")(x)))


class MLPNnx(nnx.Module):
    def __init__(self, rngs):
        self.fc1 = nnx.Linear(8, 32, rngs=rngs)
        self.fc2 = nnx.Linear(32, 8, rngs=rngs)

    def __call__(self, x):
        return self.fc2(nnx.relu(self.fc1(x)))


def _x():
    return jax.random.normal(jax.random.key(1), (8, 8))


def test_decorated_linen_class_keeps_one_wrapper_per_instance(mesh, plans):
    @auto_parallel(mesh, policy="megatron")
    class Block(MLP):
        pass

    x = _x()
    blk = Block()
    v = blk.init(jax.random.key(0), x)
    outs = [blk.apply(v, x) for _ in range(3)]
    assert len(plans) == 1, f"init + 3 applies planned {len(plans)} times"
    ref = nn.Module.apply(blk, v, x)   # the original code, unwrapped
    for out in outs:
        assert max_rel_diff(out, ref)[0] <= 1e-5
    other = Block()                    # another instance: its own wrapper
    other.apply(v, x)
    assert len(plans) == 2


def test_make_plan_init_apply_compiled_share_one_program(mesh, plans):
    x = _x()
    pm = auto_parallel(mesh, policy="megatron")(MLP())
    plan = pm.make_plan(x)
    v = pm.init(jax.random.key(0), x)
    out = pm.apply(v, x)
    pm.compiled(v, x)
    assert len(plans) == 1, f"make_plan + init + apply + compiled planned {len(plans)} times"
    assert pm.plan is plan
    assert max_rel_diff(out, MLP().apply(v, x))[0] <= 1e-5


def test_init_then_apply_plan_once(mesh, plans):
    """Without make_plan first: init's program is apply's."""
    x = _x()
    pm = auto_parallel(mesh, policy="dp")(MLP())
    v = pm.init(jax.random.key(0), x)
    pm.apply(v, x)
    pm.apply(v, x)
    assert len(plans) == 1


def test_nnx_make_plan_then_call_plan_once(mesh, plans):
    x = _x()
    pm = auto_parallel(mesh, policy="megatron")(MLPNnx(nnx.Rngs(0)))
    plan = pm.make_plan(x)
    pm(x)
    pm(x)
    assert len(plans) == 1, f"make_plan + 2 calls planned {len(plans)} times"
    assert pm.plan is plan


SOFTSIGN = softsign_primitive("api_test_softsign")  # no test registers a rule for it


class _Custom(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4, name="inner")(SOFTSIGN.bind(nn.Dense(4, name="proj")(x)))


class _WithCustom(nn.Module):
    @nn.compact
    def __call__(self, x):
        return _Custom(name="block")(x)


def test_primitive_without_rule_warns_once_per_program(mesh):
    x = _x()
    pm = auto_parallel(mesh, policy="dp")(_WithCustom())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        v = pm.init(jax.random.key(0), x)
        out = pm.apply(v, x)
        pm.apply(v, x)
    msgs = [str(w.message) for w in caught if "api_test_softsign" in str(w.message)]
    assert len(msgs) == 1, msgs
    (msg,) = msgs
    assert "block" in msg and "replicated" in msg
    assert "nnscaler_jax.register_rule('api_test_softsign'" in msg
    assert max_rel_diff(out, _WithCustom().apply(v, x))[0] <= 1e-5

    with pytest.warns(UserWarning, match="(?s)no annotation rule.*api_test_softsign"):
        auto_parallel(mesh, policy="dp")(_WithCustom()).make_plan(x)


def test_graph_of_the_last_planned_call(mesh):
    x = _x()
    pm = auto_parallel(mesh, policy="megatron")(MLP())
    with pytest.raises(PlanError, match="no graph yet: call init/apply or make_plan first"):
        pm.graph  # noqa: B018 - the property raises
    pm.make_plan(x)
    graph = pm.graph
    assert isinstance(graph, Graph)
    assert {op.module_path for op in graph.ops if op.primitive == "dot_general"} == {"fc1", "fc2"}
    assert {p.op for p in pm.plan.ops} <= {op.id for op in graph.walk()}

    nm = auto_parallel(mesh, policy="dp")(MLPNnx(nnx.Rngs(0)))
    with pytest.raises(PlanError, match="no graph yet"):
        nm.graph  # noqa: B018
    nm(x)
    assert {op.module_path for op in nm.graph.ops if op.primitive == "dot_general"} == {
        "fc1", "fc2"}


def test_a_saved_plan_is_taken_as_plan_json_text_dict_or_path(mesh, tmp_path):
    import json

    from nnscaler_jax import Plan
    from nnscaler_jax.errors import PlanFormatError

    x = _x()
    saved = auto_parallel(mesh, policy="megatron")(MLP()).make_plan(x)
    (tmp_path / "plan.json").write_text(saved.to_json())
    for given in (saved, saved.to_json(), json.loads(saved.to_json()), tmp_path / "plan.json",
                  str(tmp_path / "plan.json")):
        reused = auto_parallel(mesh, plan=given)(MLP()).make_plan(x)
        assert isinstance(reused, Plan) and reused == saved and reused.policy == "megatron"
    with pytest.raises(PlanFormatError, match="path to a saved plan"):
        auto_parallel(mesh, plan=42)
    with pytest.raises(PlanFormatError, match="no readable file"):
        auto_parallel(mesh, plan=str(tmp_path / "missing.json"))
    with pytest.raises(PlanFormatError, match="not a valid plan JSON"):
        auto_parallel(mesh, plan='{"format": "something else"}')


def test_zero3_under_the_search_shards_the_stored_variables(mesh):
    """Constraints(zero=3) with the default policy (the search) stores every variable sharded
    over the data axis; it printed zero=3 and stored them as zero=0."""
    from nnscaler_jax import Constraints

    x = _x()
    key = jax.random.key(0)

    def device0_bytes(variables):
        return sum(leaf.addressable_shards[0].data.nbytes
                   for leaf in jax.tree_util.tree_leaves(variables))

    plain = auto_parallel(mesh)(MLP())
    zero3 = auto_parallel(mesh, Constraints(zero=3))(MLP())
    v0, v3 = plain.init(key, x), zero3.init(key, x)
    assert zero3.plan.zero == 3
    assert all("data" in str(s) for _, s in zero3.plan.variables)
    assert device0_bytes(v3) * 2 == device0_bytes(v0)  # data axis of size 2, every leaf divides
    assert max_rel_diff(zero3.apply(v3, x), plain.apply(v0, x))[0] <= 1e-5
