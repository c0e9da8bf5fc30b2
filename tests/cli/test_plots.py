"""Figures: per-planner bars of ``compare``'s results (the budget as a line, planners that do not
fit hatched, missing numbers skipped), memory breakdowns as stacked bars, the layout map of a
plan, and ``compare --plot`` / ``plan --plot`` writing PNGs."""

from __future__ import annotations

import json

import pytest
from matplotlib.figure import Figure
from meshes import make_mesh

import models
from nnscaler_jax import auto_parallel
from nnscaler_jax.cli import main
from nnscaler_jax.cli.plots import KINDS, layout_map, memory_breakdown, planner_bars
from nnscaler_jax.cost.model import CostModel

PNG = b"\x89PNG\r\n\x1a\n"
RESULTS = {"budget_bytes": 2 * 2**30, "planners": {
    "dp": {"fits": False, "step_time_s": None, "memory_bytes_per_device": 5 * 2**30,
           "comm_bytes": None, "search_s": 0.1, "features": None, "error": "no plan fits"},
    "megatron": {"fits": True, "step_time_s": 0.02, "memory_bytes_per_device": 2**30,
                 "comm_bytes": 3 * 2**20, "search_s": 0.1, "features": {}},
    "auto": {"fits": True, "step_time_s": 0.01, "memory_bytes_per_device": 1.5 * 2**30,
             "comm_bytes": 2**20, "search_s": 2.0, "features": {}},
    "broken": {"fits": None, "step_time_s": None, "memory_bytes_per_device": None,
               "comm_bytes": None, "search_s": 0.0, "features": None, "error": "boom"},
}}


def _budget_lines(ax):
    return [ln for ln in ax.lines if ln.get_gid() == "budget"]


def test_planner_bars():
    """Three axes; a bar per planner that has the number (dp's smallest estimate hatched grey
    on the memory plot, no bar for the missing ones); the budget a horizontal line in GiB."""
    fig = planner_bars(RESULTS)
    assert isinstance(fig, Figure) and len(fig.axes) == 3
    step, memory, comm = fig.axes
    assert [len(ax.patches) for ax in fig.axes] == [2, 3, 2]
    assert [p.get_hatch() for p in memory.patches] == ["//", None, None]
    assert [p.get_height() for p in memory.patches] == pytest.approx([5, 1, 1.5])
    assert [p.get_height() for p in step.patches] == pytest.approx([20, 10])      # ms
    assert "GiB" in memory.get_title() and "MiB" in comm.get_title()
    (line,) = _budget_lines(memory)
    assert list(line.get_ydata()) == pytest.approx([2, 2])
    assert [t.get_text() for t in step.get_xticklabels()] == list(RESULTS["planners"])
    assert sum(t.get_text() == "n/a" for t in step.texts) == 2
    # an explicit budget wins, none draws no line, the inner dict works too, empty works
    assert _budget_lines(planner_bars(RESULTS, budget_bytes=2**29).axes[1])[0].get_ydata()[0] \
        == pytest.approx(0.5)
    assert not _budget_lines(planner_bars({**RESULTS, "budget_bytes": None}).axes[1])
    assert [len(ax.patches) for ax in planner_bars(RESULTS["planners"]).axes] == [2, 3, 2]
    assert [len(ax.patches) for ax in planner_bars({"planners": {}}).axes] == [0, 0, 0]


@pytest.fixture(scope="module")
def gpt():
    spec = models.get("gpt", "tiny")
    (tokens,) = spec.make_args()
    pm = auto_parallel(make_mesh((2, 4), ("data", "model")), policy="megatron")(spec.module)
    return pm.make_plan(tokens), pm.graph


def test_memory_breakdown(gpt):
    """One stacked bar per plan, a container per kind; from dicts or from a plan priced on
    its graph (the bars add up to the cost model's breakdown)."""
    plan, graph = gpt
    bd = CostModel.for_axes(dict(plan.mesh), zero=plan.zero).memory_breakdown(plan, graph)
    half = {k: v // 2 for k, v in bd.items()}
    fig = memory_breakdown({"megatron": bd, "other": half}, budget_bytes=bd["peak"])
    (ax,) = fig.axes
    assert len(ax.containers) == len(KINDS) and len(ax.patches) == 2 * len(KINDS)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert [x for x in labels if x in KINDS] == list(KINDS)
    assert any(x.startswith("budget ") for x in labels)
    assert len(_budget_lines(ax)) == 1
    fig = memory_breakdown(plan, graph=graph)
    (ax,) = fig.axes
    assert len(ax.patches) == len(KINDS)
    top = max(p.get_y() + p.get_height() for p in ax.patches)
    assert top * 2**20 == pytest.approx(sum(bd[k] for k in KINDS))          # MiB
    assert len(memory_breakdown(bd).axes[0].patches) == len(KINDS)          # one dict
    with pytest.raises(ValueError, match="graph="):
        memory_breakdown(plan)


def test_layout_map(gpt):
    """Rows: the modules (repeated layers collapsed), columns: mesh axes, cells: the dim."""
    plan, graph = gpt
    fig = layout_map(plan, graph)
    (ax,) = fig.axes
    (image,) = ax.images
    rows = [t.get_text() for t in ax.get_yticklabels()]
    assert image.get_array().shape == (len(rows), 2)
    assert "h_* (x2)" in rows and "h_*/attn/query" in rows
    assert not any(r.startswith("h_0") for r in rows)
    texts = {t.get_text() for t in ax.texts}
    assert {"batch (2)", "heads (4)", "mlp hidden (128)", "replicated"} <= texts
    assert [t.get_text() for t in ax.get_xticklabels()] == ["data (2)", "model (4)"]
    # without the graph: the identifiers
    assert "n0 (matmul columns), d0, d2" in {t.get_text() for t in layout_map(plan).axes[0].texts}


@pytest.mark.filterwarnings("ignore:policy 'megatron' left")  # batch 2 over data 4
def test_compare_plot_writes_a_png(tmp_path, capsys):
    """--plot writes the bars; the JSON is still the last line and names the file. A 4x4 mesh
    is planned on abstract devices (nothing compiles)."""
    out = tmp_path / "bars.png"
    code = main(["compare", "--model", "gpt", "--mesh", "4x4", "--planners", "dp,megatron",
                 "--budget", "300KB", "--plot", str(out), "--json"])
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and res["plot"] == str(out)
    assert res["planners"]["dp"]["fits"] is False
    assert out.read_bytes()[:8] == PNG and out.stat().st_size > 10_000
    assert main(["compare", "--model", "gpt", "--mesh", "4x4", "--planners", "megatron",
                 "--plot", str(tmp_path / "no" / "dir.png")]) == 2
    assert "cannot write --plot" in capsys.readouterr().err


def test_plan_plot_writes_the_layout_map(tmp_path, capsys):
    out = tmp_path / "layout.png"
    assert main(["plan", "--model", "mlp", "--mesh", "2x4", "--policy", "megatron",
                 "--plot", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    assert out.read_bytes()[:8] == PNG
