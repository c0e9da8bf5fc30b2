"""Co-sharded blocks: which ops a block takes, how it is priced (closed form against the same ops
recomputed) and that a plan co-sharding them runs and matches one device."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from meshes import make_mesh
from one_device import assert_like_one_device, updated

import models
from nnscaler_jax import Plan, auto_parallel
from nnscaler_jax.capture.trace import capture_spec, trace
from nnscaler_jax.cost import CostModel
from nnscaler_jax.cost.compute import grad_tensors
from nnscaler_jax.cost.fusion import fused_bytes
from nnscaler_jax.errors import PlanError
from nnscaler_jax.ir.coshard import block_of, chunk_counts, coshard_candidates, with_coshard
from nnscaler_jax.ir.repeats import span_key
from nnscaler_jax.plan.layouts import plan_layouts, sole_read_variables
from nnscaler_jax.planner import make_plan

B, S, D = 4, 32, 8


class Attn(nn.Module):
    @nn.compact
    def __call__(self, x):
        q, k, v = (nn.Dense(D, name=n)(x) for n in "qkv")
        p = jax.nn.softmax(jnp.einsum("bqd,bkd->bqk", q, k) / 4.0, axis=-1)
        return x + nn.Dense(D, name="o")(jnp.einsum("bqk,bkd->bqd", p, v))


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        return Attn(name="blk_1")(Attn(name="blk_0")(x))


@pytest.fixture(scope="module")
def graph():
    return trace(Net(), jax.ShapeDtypeStruct((B, S, D), jnp.float32))


def test_block_takes_the_scores_and_what_follows(graph):
    """One block per layer, along the batch (the longest block); it holds the projections,
    scores, softmax (its custom_jvp whole), weighted sum and output projection."""
    cands = coshard_candidates(graph, ways=2)
    assert [c.layer for c in cands] == ["blk_0", "blk_1"]
    block = block_of(graph, cands[0].seed, cands[0].dim)
    by_id = {op.id: op for op in graph.ops}
    prims = [by_id[i].primitive for i in block.ops]
    assert prims.count("dot_general") >= 3 and "exp" in prims
    paths = {by_id[i].module_path for i in block.ops}
    assert {"blk_0/q", "blk_0/k", "blk_0/o"} <= paths and cands[0].dim == "b0"
    g2 = with_coshard(graph, [(c.seed, c.dim, 2) for c in cands])
    assert [b.kind for b in g2.boundaries].count("coshard") == 2
    ids = [op.id for op in g2.ops]
    assert sorted(ids) == sorted(op.id for op in graph.ops)  # a permutation
    pos = [ids.index(i) for i in block.ops]
    assert pos == list(range(pos[0], pos[0] + len(pos)))  # contiguous


class Wider(nn.Module):
    @nn.compact
    def __call__(self, x):  # blk_1 differs from blk_0 (a wider hidden layer): no copy
        x = Attn(name="blk_0")(x)
        return x + nn.Dense(D, name="blk_1/out")(nn.Dense(4 * D, name="blk_1/hid")(x))


@pytest.mark.parametrize("model", [Net, Wider])
def test_a_copy_of_a_layer_takes_its_candidates_moved(model, monkeypatch):
    """A layer that runs the same program as an earlier one gets the earlier one's blocks at
    the same positions, exactly what growing them again finds; a layer that differs is grown."""
    g = trace(model(), jax.ShapeDtypeStruct((B, S, D), jnp.float32))
    keys = {layer: span_key(g, *_span(g, layer), layer) for layer in ("blk_0", "blk_1")}
    assert (keys["blk_0"] == keys["blk_1"]) == (model is Net)
    moved = coshard_candidates(g, ways=2)
    fresh = iter(range(10**6))  # no two spans alike: every layer grown
    monkeypatch.setattr("nnscaler_jax.ir.coshard.span_key", lambda *a: next(fresh))
    assert moved == coshard_candidates(g, ways=2)
    assert [c.layer for c in moved] == ["blk_0", "blk_1"]  # Wider: its MLP's block


def _span(g, layer):
    at = [i for i, op in enumerate(g.ops)
          if op.module_path == layer or op.module_path.startswith(layer + "/")]
    return at[0], at[-1]


def test_chunk_counts():
    assert chunk_counts(32, 4) == [2, 4, 8]
    assert chunk_counts(6, 4) == []


def test_closed_form_memory_and_time(graph):
    """A co-sharded block keeps only its inputs (like recomputed ops: the same for any chunk
    count), holds one chunk of its residuals at a time while its backward runs (1/k of them)
    next to its chunk loop's stacks (its chunked inputs, whole, laid out as the block reads
    them, its outputs, and the summed cotangents of the weights its chunks read whole), and
    costs one
    more forward of its ops plus the per-kernel floor of each chunk. The forward rerun leaves
    out the block's last ops, the output projection, its bias and the residual add: nothing in
    the block's backward reads what they compute (dead code, as XLA drops it)."""
    cm = CostModel.for_axes({"data": 2})
    plan = make_plan(graph, {"data": 2}, policy="dp")
    cands = coshard_candidates(graph, ways=2)
    by_id = {op.id: op for op in graph.ops}
    blocks = [block_of(graph, c.seed, c.dim) for c in cands]

    def chunked(k):
        return dataclasses.replace(plan, coshard=tuple((c.seed, c.dim, k) for c in cands))

    plain, two, four = (cm.memory_breakdown(p, graph) for p in (plan, chunked(2), chunked(4)))
    assert two["activations"] == four["activations"] < plain["activations"] / 4
    grads = grad_tensors(graph, cm.input_grads)  # what every chunk reads whole, summed over them
    # the chunked inputs' stacks as the block reads them: split over data (the example input
    # too, which arrives whole)
    held = max(sum(t.nbytes / 2 for t, a in
                   zip(b.inputs, b.eqn.params["in_axes"], strict=True) if a is not None)
               + sum(t.nbytes / (2 if t.shape[0] == B else 1) for t, a in  # (weights whole)
                     zip(b.inputs, b.eqn.params["in_axes"], strict=True)
                     if a is None and t.ndim and t.id in grads)
               + sum(t.nbytes / 2 for t in b.outputs)
               for b in with_coshard(graph, chunked(2).coshard).boundaries)
    assert held > 0
    assert two["transient"] - held == pytest.approx(2 * (four["transient"] - held), rel=1e-12)
    assert two["transient"] - held > plain["transient"]
    io = fused_bytes(graph)  # each op's reads and writes after XLA's fusion
    assert all([(by_id[i].primitive, by_id[i].module_path.rsplit("/", 1)[-1])
                for i in b.ops[-3:]] == [("dot_general", "o"), ("add", "o"), ("add", layer)]
               for b, layer in zip(blocks, ("blk_0", "blk_1"), strict=True))
    forward = sum(cm.forward_time(by_id[i], plan.op_plan(i).split, io) for b in blocks
                  for i in b.ops[:-3])
    over = sum(cm.chunk_overhead(by_id[i], plan.op_plan(i).split, 2, io) for b in blocks
               for i in b.ops)
    assert over > 0  # CPU nominal: tiny chunks are priced by the launch floor
    assert cm.plan_cost(chunked(2), graph).compute_time_s == pytest.approx(
        cm.plan_cost(plan, graph).compute_time_s + forward + over, rel=1e-9)


def test_json_round_trip(graph):
    plan = make_plan(graph, {"data": 2}, policy="dp")
    cs = dataclasses.replace(plan, coshard=((coshard_candidates(graph)[0].seed, "b0", 2),))
    assert Plan.from_json(cs.to_json()).coshard == cs.coshard


def test_a_block_that_cannot_chunk_is_a_plan_error(graph):
    dense = next(op for op in graph.ops if op.primitive == "dot_general")
    with pytest.raises(PlanError, match="cannot run in chunks along 'k0'"):
        block_of(graph, dense.id, "k0")


@pytest.mark.slow
@pytest.mark.parametrize("name,policy", [("gpt", "megatron"), ("t5", "auto")])
def test_cosharded_plan_matches_one_device(name, policy):
    """Through auto_parallel with a plan co-sharding every layer's block: a scan over chunks
    runs, forward and gradients equal the plain module's (Swin: tests/search/
    test_coshard_search.py, with the blocks the search picks)."""
    spec = models.get(name, "tiny")
    args = spec.make_args()
    graph = capture_spec(spec).graph
    plan = make_plan(graph, {"data": 2, "model": 4}, policy=policy)
    blocks = tuple((c.seed, c.dim, chunk_counts(c.size, 8)[0])
                   for c in coshard_candidates(graph, ways=8))
    assert blocks
    pm = auto_parallel(make_mesh((2, 4), ("data", "model")),
                       plan=dataclasses.replace(plan, coshard=blocks))(spec.module)
    v = pm.init(jax.random.key(0), *args)
    assert str(jax.make_jaxpr(pm.apply)(v, *args)).count("scan") >= len(blocks)
    assert_like_one_device(pm, spec.module, v, args)


def test_a_chunked_input_read_in_another_layout_trains_like_one_device():
    """T5 tiny's tied LM head co-sharded on the vocabulary reads its table split on the
    vocabulary while it is stored split on the features: the table is relaid out whole before
    the chunk loop (its gradient back after it) and the chunks read the relaid-out stack; 3 SGD
    steps leave the parameters the plain loop leaves (tests/train/test_xla_gpu.py: the relayout
    runs once, not in every chunk)."""
    import optax
    from one_device import assert_trains_like_one_device
    from tied_head import tied_head_plan

    spec, _, plan = tied_head_plan()
    args = spec.make_args(rng=jax.random.key(1))
    variables = spec.module.init(jax.random.key(0), *args)
    pm = auto_parallel(make_mesh((2, 4), ("data", "model")), plan=plan)(spec.module)
    step = pm.train_step(spec.loss_fn, optax.sgd(0.1))
    assert_trains_like_one_device(step, spec, variables, args, optax.sgd(0.1), 3)
    assert step.plan.coshard == plan.coshard


class CausalAttn(nn.Module):
    @nn.compact
    def __call__(self, x):
        q, k, v = (nn.Dense(D, name=n)(x) for n in "qkv")
        s = jnp.einsum("bqd,bkd->bqk", q, k) / 4.0
        s = jnp.where(jnp.tril(jnp.ones((S, S), bool)), s, jnp.finfo(s.dtype).min)
        return x + nn.Dense(D, name="o")(jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(s), v))


class CausalNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        return CausalAttn(name="blk_1")(CausalAttn(name="blk_0")(x))


@pytest.mark.parametrize("ways", [1, 4])
def test_a_causal_mask_is_made_per_chunk_and_counts_its_positions(ways):
    """A causal mask's positions (two iotas, one counting along the chunked query dim) join the
    block instead of being kept whole and cut (Llama-3-8B at 128K: 2 x 8 GiB per device); each
    chunk counts its own global positions, with the query dim also split ``ways`` ways over the
    mesh (chunk c holds rows c of every device's part): forward and gradients equal one
    device's. Counting from the chunk's 0 instead gets half the outputs wrong."""
    graph = trace(CausalNet(), jax.ShapeDtypeStruct((2, S, D), jnp.float32))
    cands = [c for c in coshard_candidates(graph, ways=8)
             if c.dim == {op.id: op for op in graph.ops}[c.seed].annotation.outputs[0]
             .axes[1].dims[0].name]  # along the scores' query dim
    assert len(cands) == 2
    by_id = {op.id: op for op in graph.ops}
    block = block_of(graph, cands[0].seed, cands[0].dim)
    assert [by_id[i].primitive for i in block.ops].count("iota") == 2

    def seq_split(draft, mesh):  # the seeds split their query dim over 'model'
        for c in cands:
            if ways > 1:
                draft.decide(by_id[c.seed], {"model": c.dim})
        return draft.finish()

    mesh = make_mesh((2, 4), ("data", "model"))
    plan = auto_parallel(mesh, policy=seq_split)(CausalNet()).make_plan(jnp.ones((2, S, D)))
    blocks = tuple((c.seed, c.dim, 2) for c in cands)
    pm = auto_parallel(mesh, plan=dataclasses.replace(plan, coshard=blocks))(CausalNet())
    x = jax.random.normal(jax.random.key(1), (2, S, D))
    v = pm.init(jax.random.key(0), x)
    assert str(jax.make_jaxpr(pm.apply)(v, x)).count("scan") >= 2
    assert_like_one_device(pm, CausalNet(), v, (x,))


def test_a_saved_plan_with_a_bad_block_is_refused(graph):
    """check_reuse (auto_parallel(plan=...)) refuses blocks this graph cannot run: a seed that
    is no op here, a dim the seed cannot chunk, a count that does not divide the dim."""
    from nnscaler_jax.errors import PlanFormatError
    from nnscaler_jax.plan.reuse import check_reuse

    plan = make_plan(graph, {"data": 2}, policy="dp")
    cand = coshard_candidates(graph)[0]
    check_reuse(dataclasses.replace(plan, coshard=((cand.seed, cand.dim, 2),)), graph,
                {"data": 2})
    for bad, match in [((10**6, cand.dim, 2), "no top-level op"),
                       ((cand.seed, "zz", 2), "cannot run in chunks along 'zz'"),
                       ((cand.seed, cand.dim, 3), "3 does not divide it")]:
        with pytest.raises(PlanFormatError, match=match):
            check_reuse(dataclasses.replace(plan, coshard=(bad,)), graph, {"data": 2})


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["megatron", "zero3"])
def test_the_head_and_its_loss_run_in_chunks_of_tokens(policy):
    """The chunked loss (issue 47) as a co-sharded block: in a training step's graph the ops
    after the last repeated layer (Llama's final norm, LM head and its cross-entropy) form a
    block along the tokens, and the step run with it in chunks (a scan, the logits of one
    chunk at a time) trains as the plain loop does; under ZeRO-3 the head's weight is gathered
    once per loop and its gradient reduced once (tests/train/test_xla_gpu.py)."""
    import optax

    spec = models.get("llama", "tiny")
    args = spec.make_args(rng=jax.random.key(1))
    variables = spec.module.init(jax.random.key(0), *args)
    graph = capture_spec(spec, loss=True).graph
    heads = [c for c in coshard_candidates(graph, ways=8) if c.layer == ""]
    assert [c.seed_path for c in heads] == ["lm_head"]
    by_id = {op.id: op for op in graph.ops}
    block = block_of(graph, heads[0].seed, heads[0].dim)
    prims = [by_id[i].primitive for i in block.ops]
    assert {"dot_general", "exp", "gather"} <= set(prims)  # the head, the softmax, the labels
    assert not any(by_id[i].module_path.startswith("layers_") for i in block.ops)
    first = next(i for i, op in enumerate(graph.ops) if op.module_path.startswith("layers_"))
    said = set()
    for op in graph.ops[:first]:  # before the layers (the embedding, RoPE tables): no head
        for name in op.annotation.splittable():
            with pytest.raises(PlanError) as e:
                block_of(graph, op.id, name)
            said.add("before them" in str(e.value))
    assert True in said
    blocks = ((heads[0].seed, heads[0].dim, chunk_counts(heads[0].size, 8)[0]),)
    plan = make_plan(graph, {"data": 2, "model": 4}, policy=policy)
    opt = optax.sgd(0.1)
    p, o, ref = variables["params"], opt.init(variables["params"]), []
    grad = jax.jit(jax.value_and_grad(
        lambda p: spec.loss_fn(spec.module.apply({"params": p}, *args), *args)))
    for _ in range(3):
        loss, g = grad(p)
        p, o = updated(opt, p, g, o)
        ref.append(float(loss))
    pm = auto_parallel(make_mesh((2, 4), ("data", "model")),
                       plan=dataclasses.replace(plan, coshard=blocks))(spec.module)
    step = pm.train_step(spec.loss_fn, opt)
    state = step.init(variables, *args)
    assert step.plan.coshard == blocks
    assert str(jax.make_jaxpr(step.jitted)(state, tuple(args))).count("scan[") >= 1
    losses = []
    for _ in range(3):
        state, metrics = step(state, *args)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, ref, rtol=1e-5)


@pytest.mark.parametrize("dtype,copies", [(jnp.float32, 1.0), (jnp.bfloat16, 1.5)])
def test_a_chunked_loss_prices_its_labels_dense_cotangent(monkeypatch, dtype, copies):
    """The backward of the labels' ``take_along_axis`` scatters into zeros of the logits'
    shape: a chunk's dense cotangent is live with the head block's residuals (measured with
    XLA:GPU on Llama-3-8B's chunked loss), so the block's transient holds one chunk of the
    float32 logits more than it would without it; bf16 logits, cast to float32 for the loss,
    hold their cotangent's bf16 copy too (half a chunk more)."""
    from nnscaler_jax.cost import plan_walk

    spec = models.get("llama", "tiny", dtype=dtype)
    graph = capture_spec(spec, loss=True).graph
    head = next(c for c in coshard_candidates(graph, ways=8) if c.layer == "")
    k = chunk_counts(head.size, 8)[0]
    plan = dataclasses.replace(make_plan(graph, {"data": 2, "model": 4}, policy="megatron"),
                               coshard=((head.seed, head.dim, k),))
    cm = CostModel.for_axes({"data": 2, "model": 4})
    priced = cm.memory_breakdown(plan, graph)["transient"]
    monkeypatch.setattr(plan_walk, "_dense_cotangent", lambda *a: 0.0)
    without = cm.memory_breakdown(plan, graph)["transient"]
    labels = next(op for op in graph.ops if op.primitive == "gather"
                  and op.inputs[0].role.name == "VALUE")
    lay = plan_layouts(labels, plan._by_id(), sole_read_variables(graph))[0][0]
    assert priced - without == pytest.approx(
        copies * cm._local_bytes(labels.inputs[0], lay) / k, rel=1e-9)
