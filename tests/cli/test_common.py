"""`cli/common.py`: the command line's shared helpers called directly: the device request,
tables, mesh and model parsing with one-line usage errors, policies, the plan helper."""

from __future__ import annotations

import argparse
import json

import jax
import pytest

import models
from nnscaler_jax.cli import common
from nnscaler_jax.cli.common import (
    COUNT_FLAG,
    UsageError,
    available_models,
    check_policy,
    cost_dict,
    emit,
    fmt_bytes,
    model_spec,
    parse_mesh,
    policy_names,
    request_devices,
    table,
)


@pytest.fixture
def cold(monkeypatch):
    """As if JAX's backends had not started yet, with XLA_FLAGS restored afterwards."""
    monkeypatch.setattr(common, "backends_started", lambda: False)
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    return monkeypatch


def test_request_devices_sets_the_flag_once(cold):
    import os

    request_devices(None)
    assert os.environ["XLA_FLAGS"] == f"{COUNT_FLAG}=8"
    request_devices(None)  # a count already named: kept
    assert os.environ["XLA_FLAGS"] == f"{COUNT_FLAG}=8"
    request_devices(4)     # an explicit count replaces it
    assert os.environ["XLA_FLAGS"] == f"{COUNT_FLAG}=4"
    cold.setenv("XLA_FLAGS", f"--xla_dump_to=/tmp/x {COUNT_FLAG}=8")
    request_devices(4)     # other flags kept
    assert os.environ["XLA_FLAGS"].split() == ["--xla_dump_to=/tmp/x", f"{COUNT_FLAG}=4"]


def test_request_devices_is_a_no_op_once_backends_run(monkeypatch):
    import os

    assert len(jax.devices()) == 8  # starts the backends (if no test did yet)
    monkeypatch.setenv("XLA_FLAGS", "--foo")
    assert common.backends_started()
    request_devices(2)
    assert os.environ["XLA_FLAGS"] == "--foo"


def test_table_aligns_first_column_left_others_right():
    text = table(["model", "ms"], [["mlp", 1.5], ["gpt", 12.25]])
    lines = text.splitlines()
    assert lines == ["model     ms",
                     "-----  -----",
                     "mlp      1.5",
                     "gpt    12.25"]


def test_sizes_in_the_unit_that_fits_and_emit(capsys):
    assert fmt_bytes(3 * 2**20) == "3.00 MiB" and fmt_bytes(0) == "0 B"
    assert fmt_bytes(1023) == "1023 B" and fmt_bytes(1024) == "1.00 KiB"
    assert fmt_bytes(30383.58 * 2**20) == "29.67 GiB"  # not "30383.58 MiB"
    assert fmt_bytes(2**40) == "1.00 TiB" and fmt_bytes(3 * 2**50) == "3.00 PiB"
    assert fmt_bytes(2**60) == "1024.00 PiB"  # the largest unit goes on
    emit(argparse.Namespace(json=False), "hello", {"a": 1})
    emit(argparse.Namespace(json=True), "", {"a": 1})
    out = capsys.readouterr().out.splitlines()
    assert out == ["hello", json.dumps({"a": 1})]


def test_parse_mesh_default_and_given_names():
    mesh = parse_mesh("2x4", None)
    assert mesh.axis_names == ("data", "model") and dict(mesh.shape) == {"data": 2, "model": 4}
    assert parse_mesh("8", None).axis_names == ("data",)
    assert parse_mesh("2x2x2", None).axis_names == ("data", "fsdp", "model")
    assert parse_mesh("2x4", " dp , tp").axis_names == ("dp", "tp")
    assert list(parse_mesh("2x2", None).devices.flat) == jax.devices()[:4]


@pytest.mark.parametrize(("text", "axes", "what"), [
    ("2x", None, "bad mesh '2x'"),
    ("", None, "bad mesh ''"),
    ("2x0", None, "at least 1"),
    ("2x4", "data", "must name the 2 axes"),
    ("2x4", "data,data", "must name the 2 axes"),
    ("2x4", "data,", "must name the 2 axes"),
    ("1x1x1x1", None, "name them with --axes"),
    ("4x4", None, "needs 16 devices, but 8 are available"),
])
def test_parse_mesh_usage_errors(text, axes, what):
    with pytest.raises(UsageError, match=what):
        parse_mesh(text, axes)


def test_model_spec_and_its_usage_errors():
    assert model_spec("mlp", "tiny").module == models.get("mlp", "tiny").module
    assert "mlp" in available_models() and set(available_models()) <= set(models.names())
    with pytest.raises(UsageError, match="unknown model 'nope'; choose one of: .*mlp"):
        model_spec("nope", "tiny")
    with pytest.raises(UsageError, match="has no preset 'huge'; choose one of: tiny"):
        model_spec("mlp", "huge")


def test_policies():
    """``--policy`` takes every name ``auto_parallel(mesh, policy=...)`` takes, ``alpa`` too."""
    from nnscaler_jax.search.entry import POLICIES

    names = policy_names()
    assert {"dp", "zero3", "megatron", "auto", "alpa"} <= set(names) and set(names) == set(POLICIES)
    assert names == sorted(names)
    assert check_policy("dp") == "dp" and check_policy("alpa") == "alpa"
    with pytest.raises(UsageError, match="unknown policy 'nope'; choose one of: .*alpa"):
        check_policy("nope")


def test_make_plan_on_abstract_args_and_its_cost_dict():
    spec = models.get("mlp", "tiny")
    mesh = parse_mesh("2x4", None)
    plan = common.make_plan(spec, mesh, "dp")
    from nnscaler_jax.planner import make_plan

    # the same plan as planning the captured training step's graph (the module and its loss)
    # directly (abstract args: nothing allocated)
    assert plan == make_plan(common.capture_model(spec, loss=True).graph, mesh, policy="dp")
    assert plan.policy == "dp"
    d = cost_dict(plan)
    assert d["step_time_s"] == plan.cost.step_time_s and set(d) >= {"comm_bytes"}
    from dataclasses import replace

    assert cost_dict(replace(plan, cost=None)) is None
