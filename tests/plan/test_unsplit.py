"""Silent fallbacks are said: dims a policy wanted to split but left replicated because the mesh
axis does not divide them are listed on the plan (``plan.unsplit``, a section of ``str(plan)``)
and warned about once when the plan is made."""

from __future__ import annotations

import dataclasses
import json
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from meshes import make_mesh

from nnscaler_jax import Plan, auto_parallel, trace
from nnscaler_jax.plan.plan import Unsplit, unsplit_summary
from nnscaler_jax.planner import make_plan

AXES = {"data": 2, "model": 4}
LEFT = "left replicated (size does not divide)"


class Net(nn.Module):
    """``fc1`` (16 -> hidden) -> relu -> ``fc2`` (hidden -> 16)."""

    hidden: int = 32

    @nn.compact
    def __call__(self, x):
        return nn.Dense(16, name="fc2")(nn.relu(nn.Dense(self.hidden, name="fc1")(x)))


def _graph(batch: int, hidden: int = 32):
    return trace(Net(hidden), jax.ShapeDtypeStruct((batch, 16), jnp.float32))


def _unsplit_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "left" in str(w.message)
            and issubclass(w.category, UserWarning)]


def test_dp_on_batch_3_over_data_2_warns_once_and_lists_it():
    mesh = make_mesh((2, 4), ("data", "model"))
    x = jax.random.normal(jax.random.key(0), (3, 16))
    v = Net().init(jax.random.key(1), x)
    pm = auto_parallel(mesh, policy="dp")(Net())
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = pm.apply(v, x)
        pm.apply(v, x)  # the same program: no second warning
    np.testing.assert_allclose(out, Net().apply(v, x), rtol=1e-5, atol=1e-6)
    said = _unsplit_warnings(record)
    assert len(said) == 1
    msg = said[0]
    assert "policy 'dp'" in msg and "size 3 over 'data' (2)" in msg
    assert "op 6 dot_general at 'fc1', dim 'm0'" in msg and "a multiple of 2" in msg
    hit = next(w for w in record if "left" in str(w.message))
    assert hit.filename == __file__  # points at the caller, not into the package
    plan = pm.plan
    assert plan.unsplit and all(u.axis == "data" and u.size == 3 for u in plan.unsplit)
    assert {u.module_path for u in plan.unsplit} >= {"fc1", "fc2"}
    table = str(plan)
    assert LEFT in table and f"{len(plan.unsplit)} op dims" in table
    assert "size 3 over 'data' (2)" in table


def test_megatron_hidden_10_over_model_4_is_listed():
    with pytest.warns(UserWarning, match=r"size 10 over 'model' \(4\)"):
        plan = make_plan(_graph(8, hidden=10), AXES, policy="megatron")
    tp = [u for u in plan.unsplit if u.axis == "model"]
    assert tp and all(u.size == 10 and u.axis_size == 4 for u in tp)
    assert {u.module_path for u in tp} == {"fc1", "fc2", ""}
    assert ("fc1", "dot_general") in {(u.module_path, u.primitive) for u in tp}
    assert "size 10 over 'model' (4)" in str(plan)
    assert not [u for u in plan.unsplit if u.axis == "data"]  # batch 8 over data 2 divides


def test_megatron_hidden_10_runs_replicated_and_matches():
    mesh = make_mesh((2, 4), ("data", "model"))
    x = jax.random.normal(jax.random.key(2), (8, 16))
    v = Net(10).init(jax.random.key(3), x)
    with pytest.warns(UserWarning, match="left .* op dims replicated"):
        out = auto_parallel(mesh, policy="megatron")(Net(10)).apply(v, x)
    np.testing.assert_allclose(out, Net(10).apply(v, x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("policy", ["dp", "megatron", "zero3", "auto"])
def test_a_divisible_case_says_nothing(policy):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        plan = make_plan(_graph(8), AXES, policy=policy)
    assert not _unsplit_warnings(record)
    assert plan.unsplit == () and LEFT not in str(plan) and "unsplit" not in plan.to_json()


def test_the_search_lists_batch_dims_a_data_axis_does_not_divide():
    with pytest.warns(UserWarning, match=r"(?s)policy 'auto'.*size 3 over 'data' \(2\)"):
        plan = make_plan(_graph(3), AXES, policy="auto")
    assert plan.unsplit and {u.axis for u in plan.unsplit} == {"data"}
    assert ("fc1", "dot_general") in {(u.module_path, u.primitive) for u in plan.unsplit}
    assert LEFT in str(plan)


def test_a_policy_can_note_what_it_left_unsplit():
    def mine(draft, mesh):
        op = next(op for op in draft.ops if op.primitive == "dot_general")
        draft.note_unsplit(op, op.annotation.inputs[0].axes[0].dims[0].name, "data")
        return draft.finish()

    with pytest.warns(UserWarning, match=r"(?s)policy 'mine' left 1 op dims.*size 3 over 'data'"):
        plan = make_plan(_graph(3), AXES, policy=mine)
    assert plan.unsplit == (Unsplit(6, "dot_general", "fc1", "m0", 3, "data", 2),)


def test_unsplit_round_trips_json_and_older_json_loads():
    with pytest.warns(UserWarning):
        plan = make_plan(_graph(3), AXES, policy="dp")
    again = Plan.from_json(plan.to_json())
    assert again.unsplit == plan.unsplit and again == plan
    older = json.loads(plan.to_json())
    del older["unsplit"]
    loaded = Plan.from_json(json.dumps(older))
    assert loaded.unsplit == () and loaded == plan  # not compared: what a policy said
    assert dataclasses.replace(plan, unsplit=()) == plan


def test_a_saved_plan_is_not_warned_about_again():
    with pytest.warns(UserWarning):
        plan = make_plan(_graph(3), AXES, policy="dp")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert make_plan(_graph(3), AXES, plan=plan) == plan
    assert not _unsplit_warnings(record)


def test_many_notes_print_a_few_grouped_lines():
    notes = tuple(Unsplit(i, "add", f"blk{i // 4}/mlp", "d0", 3 + i % 2, "data", 2)
                  for i in range(200))
    lines = unsplit_summary(notes)
    assert len(lines) == 2  # sizes 3 and 5 on 'data'
    assert lines[0].startswith("size 3 over 'data' (2): 100 ops in blk0/mlp, blk1/mlp")
    assert "and 44 more" in lines[0]
    many = tuple(dataclasses.replace(n, size=n.op) for n in notes)
    lines = unsplit_summary(many, limit=6)
    assert len(lines) == 7 and lines[-1] == "... and 194 more (size, axis) groups"
    plan = Plan(mesh=tuple(AXES.items()), fingerprint="f", ops=(), unsplit=many)
    assert len(str(plan).splitlines()) < 15
