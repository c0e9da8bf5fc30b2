"""Stage DP: closed-form objective, never worse than a hand split it can express; CLI output."""

import jax.numpy as jnp
import pytest

import models
from nnscaler_jax.capture.trace import trace
from nnscaler_jax.errors import PlanError
from nnscaler_jax.pipeline.stage_dp import evaluate, search_stages
from nnscaler_jax.pipeline.units import layer_units


@pytest.fixture(scope="module")
def units():
    spec = models.get("gpt", "gpt3-1.3b", scan_layers=True, dtype=jnp.bfloat16, batch_size=1)
    return layer_units(trace(spec.module, *spec.make_args()), batch=1)


def test_objective_closed_form(units):
    n = len(units)
    bounds = ((0, n // 2), (n // 2, n))
    p = evaluate(units, bounds, tp=2, dp=1, microbatches=8, microbatch_size=2)
    assert p.step_time_s == pytest.approx(sum(p.stage_time_s) + 7 * max(p.stage_time_s))
    # 1F1B: the first stage keeps 2 micro-batches in flight, GPipe all 8
    g = evaluate(units, bounds, tp=2, dp=1, microbatches=8, microbatch_size=2, schedule="gpipe")
    assert g.memory_bytes[0] > p.memory_bytes[0]


def test_search_beats_or_matches_megatron_split(units):
    n = len(units)  # prefix + 24 layers + suffix
    best = search_stages(units, devices=16, global_batch=64, memory_per_device=80 * 2**30)
    assert best.stages * best.tp * best.dp == 16
    assert [b for _, b in best.bounds][-1] == n and best.bounds[0][0] == 0
    per = 24 // 4
    hand = tuple((0 if k == 0 else 1 + per * k, 1 + per * (k + 1) if k < 3 else n)
                 for k in range(4))
    mega = evaluate(units, hand, tp=4, dp=1, microbatches=64, microbatch_size=1)
    assert best.step_time_s <= mega.step_time_s * (1 + 1e-9)


def test_search_memory_error(units):
    with pytest.raises(PlanError, match="smallest estimate"):
        search_stages(units, devices=2, global_batch=4, memory_per_device=2**30)


def test_cli_plan_pipeline(tmp_path, capsys):
    from nnscaler_jax.cli import main

    png = tmp_path / "g.png"
    # (plan makes the plan train runs: a 'stage' axis, and a batch the micro-batches divide)
    assert main(["plan", "--model", "gpt", "--preset", "tiny", "--mesh", "2", "--axes", "stage",
                 "--batch-size", "4", "--policy", "dp", "--pipeline", "2", "--microbatches",
                 "4", "--schedule", "1f1b", "--gantt", str(png)]) == 0
    out = capsys.readouterr().out
    assert "stage 0 | F0 F1 .  B0 F2 B1 F3 B2 .  B3" in out
    assert "stage 1: h_1" in out and png.read_bytes()[:4] == b"\x89PNG"
