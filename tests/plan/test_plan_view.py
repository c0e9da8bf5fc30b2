"""Looking at a plan: ``plan.summary()`` collapses repeated layers with the same layout into one
group row, ``plan._repr_html_()`` / ``plan.view(graph)`` is the notebook view (module x mesh
axis -> the dim split, in words with the graph), variables, estimate, features, per-op detail."""

from __future__ import annotations

import dataclasses
from html.parser import HTMLParser

import pytest
from meshes import make_mesh

import models
from nnscaler_jax import Constraints, Plan, Rule, auto_parallel
from nnscaler_jax.plan.plan import OpPlan, PipelineSettings, PlanCost
from nnscaler_jax.plan.view import layout_rows


@pytest.fixture(scope="module")
def gpt4():
    """A 4-layer GPT tiny under Megatron on 2 x 4: (plan, graph, tokens, spec)."""
    spec = models.get("gpt", "tiny", n_layers=4)
    (tokens,) = spec.make_args()
    pm = auto_parallel(make_mesh((2, 4), ("data", "model")), policy="megatron")(spec.module)
    plan = pm.make_plan(tokens)
    return plan, pm.graph, tokens, spec


class _Balanced(HTMLParser):
    """Fails on a closing tag that does not close the open one; ``open`` left at the end."""

    def __init__(self) -> None:
        super().__init__()
        self.open: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag not in ("br", "hr", "img", "meta", "col"):
            self.open.append(tag)

    def handle_endtag(self, tag):
        assert self.open and self.open[-1] == tag, (tag, self.open[-4:])
        self.open.pop()


def _check_html(text: str) -> None:
    p = _Balanced()
    p.feed(text)
    p.close()
    assert not p.open


def _rows(summary: str) -> dict[str, str]:
    """First cell of each table line (indent stripped) -> the line."""
    return {ln.strip().split("  ")[0]: ln for ln in summary.splitlines()}


def test_summary_collapses_repeated_layers(gpt4):
    plan, _, _, _ = gpt4
    table, summary = str(plan), plan.summary()
    assert all(f"h_{i}/attn/query" in table for i in range(4))   # the full table: every layer
    rows = _rows(summary)
    assert "h_* (x4)" in rows                                    # one group row for h_0 .. h_3
    assert not any(f"h_{i}" in summary for i in range(4))
    assert {"attn", "query", "c_fc", "c_proj", "wte", "ln_f"} <= set(rows)
    assert len(summary.splitlines()) < len(table.splitlines()) / 2
    # the group's sharded variables once, with the collapsed path
    assert "params/h_*/attn/query/kernel: P(None, 'model', None)" in summary
    assert "estimate: step" in summary and "micro-batches: 1" in summary
    # format(plan, "summary") is the summary; plain formatting stays str(plan)
    assert format(plan, "summary") == summary and f"{plan}" == table
    with pytest.raises(ValueError, match="summary"):
        format(plan, "wide")


def test_summary_names_the_split_dims_with_the_graph(gpt4):
    """Without the graph: annotation identifiers (a plan holds no shapes); with it: batch,
    heads, the MLP hidden dim and the partial sums of a row-parallel matmul."""
    plan, graph, _, _ = gpt4
    plain = _rows(plan.summary())
    assert "n0 (matmul columns)" in plain["query"] and "m0 (matmul rows)" in plain["query"]
    rows = _rows(plan.summary(graph))
    assert rows["query"].split()[1:5] == ["batch", "(2)", "heads", "(4)"]
    assert "heads (4) -> partial sums" in rows["out"]
    assert "mlp hidden (128)" in rows["c_fc"]
    assert "mlp hidden (128) -> partial sums" in rows["c_proj"]
    assert rows["ln_1"].split()[1:4] == ["batch", "(2)", "-"]
    assert plan.view(graph).summary() == plan.summary(graph) == str(plan.view(graph))


def test_layers_that_differ_stay_apart(gpt4):
    """Recomputing h_1 only: h_0, h_1 [recompute] and h_{2..3} (x2) — only consecutive layers
    with the same layout (and recompute) collapse."""
    _, _, tokens, spec = gpt4
    mesh = make_mesh((2, 4), ("data", "model"))
    pm = auto_parallel(mesh, Constraints(rules=(Rule(module="h_1", recompute=True),)),
                       policy="megatron")(spec.module)
    plan = pm.make_plan(tokens)
    rows = _rows(plan.summary())
    assert {"h_0", "h_1 [recompute]", "h_{2..3} (x2)"} <= set(rows)
    groups = [r for r in layout_rows(plan) if r.depth == 0 and r.path.startswith("h_")]
    assert [(r.path, r.count, r.members, r.notes) for r in groups] == [
        ("h_0", 1, (), ()), ("h_1", 1, (), ("recompute",)),
        ("h_{2..3}", 2, ("h_2", "h_3"), ())]


def test_html_view(gpt4):
    """Module paths, the split dims, variables (shape with the graph), estimate, features and
    the per-op detail in a collapsed <details>; valid, balanced HTML."""
    plan, graph, _, _ = gpt4
    for text in (plan._repr_html_(), plan.view(graph)._repr_html_()):
        _check_html(text)
        for needle in ("h_*", "x4: h_0 .. h_3", "attn", "query", "c_fc", "ln_f",
                       "data (2)", "model (4)",
                       "params/h_*/mlp/c_fc/kernel", "P(None, &#x27;model&#x27;)", "replicated",
                       "step time", "memory per device", "comm bytes", "micro-batches: 1",
                       "ZeRO stage 0", "<details><summary>per-op detail (389 ops)"):
            assert needle in text, needle
        assert text.count("<tr>") > len(plan.ops)          # every op in the detail
    alone, full = plan._repr_html_(), plan.view(graph)._repr_html_()
    assert "n0 (matmul columns)" in alone and "plan.view(pm.graph)" in alone
    for needle in ("batch (2)", "heads (4)", "mlp hidden (128)", "(32, 4, 8)", "(32, 128)"):
        assert needle in full and needle not in alone, needle


def _synthetic() -> Plan:
    """Two pipelined blocks with co-sharded attention, recompute, ZeRO-3 and bfloat16, one
    module path with HTML in it."""
    ops = []
    for i in range(2):
        ops += [OpPlan(10 * i, "dot_general", f"blk_{i}/attn/qk", (("model", "b1"),),
                       chunks=("b0", 6)),
                OpPlan(10 * i + 1, "dot_general", f"blk_{i}/mlp<fc>", (("model", "n0"),)),
                OpPlan(10 * i + 2, "add", f"blk_{i}/mlp<fc>", (("model", "+"),),
                       keep_partial=True)]
    return Plan(mesh=(("stage", 2), ("model", 4)), fingerprint="x", ops=tuple(ops),
                variables=(("params/blk_0/mlp<fc>/kernel", (None, "model")),
                           ("params/blk_1/mlp<fc>/kernel", (None, "model"))),
                zero=3, policy="mine", precision="bfloat16", recompute=("blk_0", "blk_1"),
                cost=PlanCost(0.25, 3 * 2**30, 5 * 2**20, 0.2, 0.05),
                pipeline=PipelineSettings(stages=2, microbatches=8, schedule="1f1b",
                                          stage_of=(("blk_0", 0), ("blk_1", 1))))


def test_html_features_and_escaping():
    plan = _synthetic()
    text = plan._repr_html_()
    _check_html(text)
    assert "mlp<fc>" not in text and "mlp&lt;fc&gt;" in text
    for needle in ("blk_* <small>(x2: blk_0, blk_1; recompute; stages 0..1)</small>",
                   "co-sharded (2 ops run as sequential chunks)", "x6 along b0",
                   "value-split chains: 2 ops keep partial sums", "micro-batches: 8",
                   "ZeRO stage 3", "precision: bfloat16", "schedule 1f1b",
                   "pipeline: 2 stages, 8 micro-batches", "recompute (2 groups): blk_0, blk_1",
                   "250.000 ms",
                   "3.00 GiB", "5.00 MiB (5,242,880 B)", "partial sums",
                   "b1 (matmul batch dim)", "params/blk_*/mlp&lt;fc&gt;/kernel"):
        assert needle in text, needle
    summary = plan.summary()
    assert "blk_* (x2) [recompute; stages 0..1]" in summary
    # a layer whose layout differs is its own row
    other = dataclasses.replace(plan, ops=plan.ops[:-1] + (dataclasses.replace(
        plan.ops[-1], split=()),))
    assert [r.path for r in layout_rows(other) if r.depth == 0] == ["blk_0", "blk_1"]


def test_nnx_lists_and_leaf_modules():
    """nnx list items (``h/0``, ``h/1``) collapse as ``h/*``; two numbered leaves (``ln_1``,
    ``ln_2``) stay apart, three or more collapse."""
    ops = tuple(OpPlan(i, "add", f"h/{i // 2}/ln_{i % 2 + 1}", (("data", "d0"),))
                for i in range(6))
    ops += tuple(OpPlan(10 + i, "add", f"Dense_{i}", ()) for i in range(3))
    rows = layout_rows(Plan(mesh=(("data", 2),), fingerprint="x", ops=ops))
    assert [(r.path, r.label, r.count) for r in rows] == [
        ("h", "h", 1), ("h/*", "h/*", 3), ("h/*/ln_1", "ln_1", 3), ("h/*/ln_2", "ln_2", 3),
        ("Dense_*", "Dense_*", 3)]
