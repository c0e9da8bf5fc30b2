"""The profile database: timing ops, JSON round trip, and the cost model preferring it."""

import json

import jax
import pytest

import models
from nnscaler_jax import trace
from nnscaler_jax.cli import main
from nnscaler_jax.cost import ProfileDB, profile_ops
from nnscaler_jax.cost.model import CostModel
from nnscaler_jax.errors import PlanError


@pytest.fixture(scope="module")
def graph():
    module, make_args, _ = models.get("mlp", "tiny")
    return trace(module, *make_args())


def test_profile_round_trip(graph, tmp_path):
    path = tmp_path / "profile.json"
    db = profile_ops(graph, path=path, runs=2, warmup=1)
    kind = jax.devices()[0].device_kind
    distinct = {(op.primitive, tuple(t.shape for t in op.inputs)) for op in graph.walk()}
    assert len(db) == len(distinct)
    assert all(k.endswith("|" + kind) and v > 0 for k, v in db.entries.items())
    again = ProfileDB.load(path)
    assert again == db
    dot = next(op for op in graph.ops if op.primitive == "dot_general")
    assert again.lookup_op(dot, kind) == db.lookup_op(dot, kind) > 0
    assert again.lookup_op(dot, "some other gpu") is None
    # a second run adds to the same file
    assert len(profile_ops(graph, path=path, runs=1, warmup=1)) == len(db)


def test_bad_profile_json(tmp_path):
    with pytest.raises(PlanError, match="profile database"):
        ProfileDB.from_json('{"format": "other"}')
    with pytest.raises(PlanError, match="nnscaler-jax profile"):
        ProfileDB.load(tmp_path / "missing.json")
    assert len(ProfileDB.load(tmp_path / "missing.json", missing_ok=True)) == 0


def test_cost_model_prefers_profiled_times(graph):
    dot = next(op for op in graph.ops if op.primitive == "dot_general")
    kind = jax.devices()[0].device_kind
    axes = {"data": 4}
    roofline = CostModel.for_axes(axes)
    fwd = roofline.forward_time(dot, ())
    db = ProfileDB()
    db.record(dot.primitive, [t.shape for t in dot.inputs], [t.shape for t in dot.outputs],
              dot.inputs[0].dtype, kind, 1000 * fwd)
    slow = CostModel.for_axes(axes, profile=db)
    assert slow.op_time(dot, ()) == pytest.approx(1000 * roofline.op_time(dot, ()))
    split = (("data", "m0"),)
    # only the unsplit shape profiled: scaled by 1 / ways
    assert slow.op_time(dot, split) == pytest.approx(1000 * roofline.op_time(dot, split))
    # the local shape profiled: used as is
    (x, w), (y,) = dot.inputs, dot.outputs
    db.record(dot.primitive, [(x.shape[0] // 4, x.shape[1]), w.shape],
              [(y.shape[0] // 4, y.shape[1])], x.dtype, kind, 7e-3)
    local = CostModel.for_axes(axes, profile=db)
    assert local.forward_time(dot, split) == pytest.approx(7e-3)
    # other ops keep the roofline; another device kind ignores the database
    add = next(op for op in graph.ops if op.primitive == "add")
    assert slow.op_time(add, ()) == roofline.op_time(add, ())
    from nnscaler_jax.cost.devices import H100_80G

    h100 = CostModel.for_axes(axes, device=H100_80G, profile=db)
    assert h100.op_time(dot, ()) == CostModel.for_axes(axes, device=H100_80G).op_time(dot, ())


def test_cli_profile(tmp_path, capsys):
    out = tmp_path / "db.json"
    assert main(["profile", "--model", "mlp", "--out", str(out), "--runs", "1", "--json"]) == 0
    obj = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert obj["ok"] and obj["path"] == str(out) and obj["entries"] == len(ProfileDB.load(out))
    assert any(k.startswith("dot_general|") for k in obj["profiled"])
