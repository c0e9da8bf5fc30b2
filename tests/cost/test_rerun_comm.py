"""A recomputed layer's forward relayouts run again in its backward, as XLA compiles it: a
Megatron-split GPT recomputed whole all-reduces the attention's output projection twice (the
MLP's projection feeds only the residual add, dead code in the recompute), selectively (its
matmul outputs kept, reduced) not at all. The cost model prices exactly those collectives
again (``plan_walk.relayout_reruns``); before, recompute cost no communication."""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import subprocess
import sys
import textwrap

import pytest

import models
from nnscaler_jax.capture.trace import capture_spec
from nnscaler_jax.cost import CostModel
from nnscaler_jax.cost.relayout import relayout_price
from nnscaler_jax.layout import Layout
from nnscaler_jax.planner import make_plan

AXES = {"data": 2, "model": 4}
ROOT = pathlib.Path(__file__).resolve().parents[2]
LAYERS = 3
GPT = {"seq_len": 32, "n_positions": 32, "d_model": 64, "n_heads": 4, "n_layers": LAYERS,
       "vocab_size": 128, "batch_size": 8}


def _plans():
    graph = capture_spec(models.get("gpt", "tiny", **GPT)).graph
    plain = make_plan(graph, AXES, policy="megatron")
    return graph, {name: dataclasses.replace(plain, recompute=rc) for name, rc in
                   (("plain", ()), ("redo", ("h_*",)), ("sel", ("h_*:dots",)))}


def test_a_recomputed_layer_pays_its_all_reduce_again():
    """Closed form: full recompute adds one forward all-reduce of the ``[batch / 2, seq, d]``
    attention output per layer; selective recompute adds none."""
    graph, plans = _plans()
    cm = CostModel.for_axes(AXES)
    comm = {k: cm.plan_cost(p, graph).comm_time_s for k, p in plans.items()}
    one, _ = relayout_price(Layout(((), (), ()), ("model",)), Layout(((), (), ())),
                            (GPT["batch_size"] // 2, GPT["seq_len"], GPT["d_model"]), 4,
                            cm.mesh)
    assert one > 0
    assert comm["redo"] - comm["plain"] == pytest.approx(LAYERS * one, rel=1e-9)
    assert comm["sel"] == pytest.approx(comm["plain"], rel=1e-12)


_HLO = textwrap.dedent("""
    import dataclasses, json, os, sys
    from nnscaler_jax.mesh.cpu import cpu_xla_flags
    os.environ["XLA_FLAGS"] = cpu_xla_flags(os.environ.get("XLA_FLAGS", ""), keep_remat=True)
    import jax, jax.numpy as jnp
    sys.path.insert(0, "tests/cost")
    from test_rerun_comm import _plans, GPT
    import models
    from nnscaler_jax import auto_parallel
    from nnscaler_jax.cost import CostModel
    from nnscaler_jax.lower.hlo import hlo_collectives

    graph, plans = _plans()
    spec = models.get("gpt", "tiny", **GPT)
    args, mesh = spec.make_args(), jax.make_mesh((2, 4), ("data", "model"))
    cm, out = CostModel.for_axes({"data": 2, "model": 4}), {}
    for name, plan in plans.items():
        pm = auto_parallel(mesh, plan=plan)(spec.module)
        v = pm.init(jax.random.key(0), *args)
        grad = jax.jit(jax.grad(lambda v: jnp.mean(pm.apply(v, *args) ** 2)))
        got = hlo_collectives(grad.lower(v).compile().as_text(), mesh)
        out[name] = {"model_all_reduce": sum(c.bytes for c in got if c.kind == "all_reduce"
                                             and c.axes == ("model",)),
                     "predicted": cm.plan_cost(plan, graph).comm_bytes}
    print(json.dumps(out))
""")


@functools.cache
def _compiled() -> dict:
    res = subprocess.run([sys.executable, "-c", _HLO], capture_output=True, text=True,
                         timeout=600, check=False, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_xla_reruns_the_collectives_the_cost_model_prices_again():
    """XLA:CPU keeping recompute (``cpu_xla_flags(keep_remat=True)``), the compiled gradient's
    all-reduces over the model axis: full recompute adds one ``[4, 32, 64]`` f32 (32 KB) per
    layer (measured 589,824 -> 688,128 bytes), selective none; the predicted bytes moved grow
    by the same amount."""
    got = _compiled()
    plain, redo, sel = got["plain"], got["redo"], got["sel"]
    layer = GPT["batch_size"] // 2 * GPT["seq_len"] * GPT["d_model"] * 4
    assert redo["model_all_reduce"] - plain["model_all_reduce"] == LAYERS * layer
    assert sel["model_all_reduce"] == plain["model_all_reduce"]
    assert redo["predicted"] - plain["predicted"] == pytest.approx(LAYERS * layer, rel=1e-9)
    assert sel["predicted"] == plain["predicted"]


def test_a_dropped_matmul_rebuilds_the_operands_its_transpose_reads(monkeypatch):
    """T5's co-sharded LM head: the chunk loop's backward does not need the head's logits
    (the dot's output: dead code when recomputed), but its transpose reads the table's
    transposed view, relaid out for the dot: that relayout runs again in the backward
    (measured with XLA:GPU on T5-8: the table's chunks are gathered in the backward's chunk
    loop as in the forward's). Priced: one more forward relayout of the view."""
    from nnscaler_jax.cost import plan_walk
    from nnscaler_jax.ir.coshard import chunk_counts, coshard_candidates
    from nnscaler_jax.plan.layouts import plan_layouts, sole_read_variables

    graph = capture_spec(models.get("t5", "tiny"), loss=True).graph
    head = next(c for c in coshard_candidates(graph, ways=8) if c.seed_path == "shared")
    plain = make_plan(graph, AXES, policy="megatron")
    ops = tuple(dataclasses.replace(p, split=(("data", "d1"), ("model", "d1")))
                if p.op == head.seed else p for p in plain.ops)  # the view split as stored
    plan = dataclasses.replace(plain, ops=ops,
                               coshard=((head.seed, head.dim, chunk_counts(head.size, 8)[0]),))
    cm = CostModel.for_axes(AXES)
    priced = cm.plan_cost(plan, graph).comm_bytes
    monkeypatch.setattr(plan_walk, "rebuilt_operands", lambda *a: frozenset())
    once = cm.plan_cost(plan, graph).comm_bytes
    by_id, sole = plan._by_id(), sole_read_variables(graph)
    view = next(op for op in graph.ops if op.id == head.seed).outputs[0]
    dot = next(op for op in graph.ops if view in op.inputs)
    have = plan_layouts(next(op for op in graph.ops if op.id == head.seed), by_id, sole)[1][0]
    want = plan_layouts(dot, by_id, sole)[0][list(dot.inputs).index(view)]
    assert have != want
    again = relayout_price(have, want, view.shape, 4, cm.mesh)[1]
    assert again > 0
    assert priced - once == pytest.approx(again, rel=1e-9)
