"""``--plan FILE`` (nnscaler_jax/cli): a plan written by ``plan --out FILE`` is what ``train``,
``verify`` and ``compare`` run or price, without a search; one that is not a plan, or is for
another model or mesh, is refused in one line (exit 2), its advice in the command line's flags.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nnscaler_jax import Plan


def _last_json(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def megatron_mlp(cli, tmp_path_factory) -> str:
    """``plan --model mlp --mesh 2x4 --policy megatron --out FILE``: the saved plan's path."""
    path = str(tmp_path_factory.mktemp("plans") / "mlp.json")
    code, _, err = cli(["plan", "--model", "mlp", "--mesh", "2x4", "--policy", "megatron",
                         "--out", path])
    assert code == 0, err
    return path


def _no_search(monkeypatch) -> None:
    """Any planning but the saved plan's check fails the test."""
    from nnscaler_jax import planner

    def refuse(*a, **k):
        raise AssertionError("searched although --plan gives the plan")

    monkeypatch.setattr(planner, "plan_and_report", refuse)


def test_train_runs_the_saved_plan_without_a_search(cli, megatron_mlp, monkeypatch):
    _no_search(monkeypatch)
    code, out, err = cli(["train", "--model", "mlp", "--mesh", "2x4", "--steps", "2",
                           "--plan", megatron_mlp, "--json"])
    assert code == 0, err
    res = _last_json(out)
    assert res["plan"]["policy"] == "megatron" and len(res["losses"]) == 2
    saved = Plan.from_json(Path(megatron_mlp).read_text())
    assert res["predicted_step_s"] == pytest.approx(saved.cost.step_time_s)


def test_verify_checks_the_saved_plan(cli, megatron_mlp, monkeypatch):
    _no_search(monkeypatch)
    code, out, err = cli(["verify", "--model", "mlp", "--mesh", "2x4", "--plan",
                           megatron_mlp, "--json"])
    assert code == 0, err
    res = _last_json(out)
    assert res["ok"] is True and res["policy"] == "megatron" and res["plan"] == megatron_mlp


@pytest.mark.slow
@pytest.mark.parametrize("model", ["gpt", "gpt_nnx"])
def test_a_saved_pipelined_plan_of_a_dropout_model_trains_and_verifies_its_runtime(cli,
                                                                                  tmp_path,
                                                                                  model):
    """A pipelined plan is planned as the pipelined step plans (its graph: the saved plan
    ran under ``train``, where the rng keys' type once made it "another model"), and
    ``verify`` checks the pipeline runtime ``train`` runs (its micro-batches and their dropout
    keys; nnx: drawn from the module's first stream's key), not the plan's SPMD program."""
    path = str(tmp_path / "piped.json")
    where = ["--model", model, "--preset", "tiny-dropout", "--mesh", "2x1", "--axes",
             "stage,data"]
    code, _, err = cli(["plan", *where, "--pipeline", "2", "--microbatches", "2", "--out",
                        path])
    assert code == 0, err
    code, out, err = cli(["train", *where, "--plan", path, "--steps", "1", "--json"])
    assert code == 0, err
    assert _last_json(out)["plan"]["stages"] == 2
    code, out, err = cli(["verify", *where, "--plan", path, "--json"])
    assert code == 0, err
    res = _last_json(out)
    assert res["ok"] is True and res["runtime"] == "CutProgram", res  # (dropout: the cut one)
    assert 0 < res["grad_rel_diff"] <= res["tolerance"]


def test_compare_prices_the_saved_plan_as_one_more_row(cli, megatron_mlp):
    """The saved plan is a row of its own, ``plan:FILE``, beside the planners, priced under the
    same budget: over it, ``fits: false`` with its estimate."""
    code, out, err = cli(["compare", "--model", "mlp", "--mesh", "2x4", "--planners", "dp",
                           "--plan", megatron_mlp, "--json"])
    assert code == 0, err
    rows = _last_json(out)["planners"]
    name = f"plan:{megatron_mlp}"
    assert list(rows) == ["dp", name]
    saved = Plan.from_json(Path(megatron_mlp).read_text())
    assert rows[name]["fits"] is True
    assert rows[name]["memory_bytes_per_device"] == saved.cost.memory_bytes_per_device
    assert rows[name]["step_time_s"] == pytest.approx(saved.cost.step_time_s)

    budget = saved.cost.memory_bytes_per_device - 1
    code, out, err = cli(["compare", "--model", "mlp", "--mesh", "2x4", "--planners", "dp",
                           "--plan", megatron_mlp, "--budget", str(budget), "--json"])
    assert code == 0, err
    row = _last_json(out)["planners"][name]
    assert row["fits"] is False and row["memory_bytes_per_device"] == budget + 1


@pytest.mark.parametrize("command", ["train", "verify", "compare"])
@pytest.mark.parametrize("case, needle", [
    ("another mesh", "this plan is for mesh {'data': 2, 'model': 4}, not {'data': 4, 'model': 2}"),
    ("another model", "this plan was made for another model"),
    ("not a plan", "not a valid plan JSON"),
    ("no file", "cannot read --plan"),
])
def test_a_plan_that_does_not_apply_is_refused_in_one_line(cli, megatron_mlp, tmp_path,
                                                            command, case, needle):
    model, mesh, path = "mlp", "2x4", megatron_mlp
    if case == "another mesh":
        mesh = "4x2"
    elif case == "another model":
        model = "gpt"
    elif case == "not a plan":
        path = str(tmp_path / "bad.json")
        (tmp_path / "bad.json").write_text('{"format": "something else"}')
    else:
        path = str(tmp_path / "missing.json")
    argv = [command, "--model", model, "--mesh", mesh, "--plan", path, "--json"]
    if command == "compare":
        argv += ["--planners", "dp"]
    code, out, err = cli(argv)
    assert code == 2, err
    assert needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert _last_json(out) == {"ok": False, "command": command,
                               "error": err.split(": ", 2)[2].strip()}
    assert "make_plan()" not in err and "Plan.to_json()" not in err  # said in CLI terms


@pytest.mark.parametrize("flags", [["--policy", "dp"], ["--zero", "1"], ["--zero", "0"],
                                   ["--pipeline", "2"], ["--precision", "bf16"]])
def test_train_refuses_plan_settings_beside_a_saved_plan(cli, megatron_mlp, flags):
    code, _, err = cli(["train", "--model", "mlp", "--plan", megatron_mlp, *flags])
    assert code == 2
    assert f"drop {' '.join(flags)}" in err and len(err.strip().splitlines()) == 1
