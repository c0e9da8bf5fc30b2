"""The command line, run in-process (``main([...])``) with the 8 devices of conftest."""

import json

import jax
import optax
import pytest

import models
from nnscaler_jax import Plan, auto_parallel
from nnscaler_jax.cli import main


def _last_json(capsys):
    out = capsys.readouterr().out
    return json.loads(out.strip().splitlines()[-1])


def test_graph_json(capsys):
    assert main(["graph", "--model", "mlp", "--json"]) == 0
    res = _last_json(capsys)
    assert res["model"] == "mlp" and res["preset"] == "tiny"
    assert res["ops"] > 0 and 0.0 <= res["annotated_fraction"] <= 1.0
    assert res["params"] == models.param_count("mlp", "tiny")
    assert res["param_bytes"] == 4 * res["params"]
    assert isinstance(res["unannotated"], dict) and res["trace_s"] >= 0


def test_graph_table_and_ir(capsys):
    assert main(["graph", "--model", "mlp", "--print-ir"]) == 0
    out = capsys.readouterr().out
    assert "dot_general" in out and "fc1" in out and "parameters: 2,128" in out


@pytest.mark.slow
def test_verify_megatron(capsys):
    assert main(["verify", "--model", "mlp", "--mesh", "2x4", "--policy", "megatron",
                 "--json"]) == 0
    res = _last_json(capsys)
    assert res["ok"] is True
    assert res["max_rel_diff"] < 1e-4
    assert res["mesh"] == "2x4" and res["policy"] == "megatron"


def test_plan_json_round_trip(capsys, tmp_path):
    path = tmp_path / "plan.json"
    assert main(["plan", "--model", "mlp", "--mesh", "2x4", "--policy", "megatron", "--json",
                 "--out", str(path)]) == 0
    res = _last_json(capsys)
    plan = Plan.from_json(json.dumps(res["plan"]))
    assert plan == Plan.from_json(path.read_text())
    assert set(res["cost"]) >= {"step_time_s", "memory_bytes_per_device", "comm_bytes"}

    spec = models.get("mlp", "tiny")
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    # the training step's plan (the module and its loss), as train runs it
    step = auto_parallel(mesh, policy="megatron")(spec.module).train_step(
        spec.loss_fn, optax.adamw(1e-3))
    step.abstract_init(spec.init_abstract(), *spec.make_args(abstract=True))
    assert plan == step.plan


def test_compare_json(capsys):
    assert main(["compare", "--model", "mlp", "--mesh", "2x4", "--planners", "dp,megatron",
                 "--json"]) == 0
    res = _last_json(capsys)
    assert set(res["planners"]) == {"dp", "megatron"}
    for r in res["planners"].values():
        assert set(r) >= {"search_s", "step_time_s", "memory_bytes_per_device", "comm_bytes",
                          "fits", "features"}
        assert r["fits"] is True  # CPU devices: no default budget
    assert res["budget_bytes"] is None  # (budgets: tests/cli/test_compare.py)


@pytest.mark.parametrize("argv, needle", [
    (["plan", "--model", "nope"], "mlp"),  # the valid models are listed
    (["plan", "--model", "mlp", "--preset", "huge"], "tiny"),
    (["plan", "--model", "mlp", "--mesh", "4x4"], "16 devices"),
    (["plan", "--model", "mlp", "--mesh", "2by4"], "2by4"),
    (["verify", "--model", "mlp", "--policy", "nope"], "megatron"),
])
def test_user_errors_exit_2(capsys, argv, needle):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_demo(capsys):
    assert main(["demo", "--steps", "3", "--json"]) == 0
    res = _last_json(capsys)
    assert res["ok"] is True and res["max_rel_diff"] < 1e-4
    losses = res["losses"]
    assert len(losses) == 3 and losses[-1] < losses[0]


def test_plan_with_the_alpa_policy(capsys):
    """``--policy alpa`` is taken, as ``auto_parallel(mesh, policy="alpa")`` takes it."""
    assert main(["plan", "--model", "mlp", "--mesh", "2x4", "--policy", "alpa", "--json"]) == 0
    res = _last_json(capsys)
    assert res["policy"] == "alpa" and Plan.from_json(json.dumps(res["plan"])).policy == "alpa"
