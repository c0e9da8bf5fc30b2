"""Closed-form checks of the cost model: DP / Megatron communication, ZeRO memory, scan, clusters."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from meshes import make_mesh

import models
from models.mlp import MLP, Config
from nnscaler_jax import trace
from nnscaler_jax.cost import (
    LinkCost,
    all_gather_time,
    all_reduce_time,
    cluster_preset,
    device_preset,
    reduce_scatter_time,
)
from nnscaler_jax.cost.devices import H100_80G, IB_NDR, NVLINK_H100
from nnscaler_jax.cost.fusion import fused_bytes
from nnscaler_jax.cost.model import CostModel
from nnscaler_jax.cost.residuals import residual_outputs
from nnscaler_jax.errors import PlanError
from nnscaler_jax.planner import make_plan, plan_and_report

LINK = LinkCost(alpha_s=3e-6, beta_s_per_byte=1e-10)


@pytest.fixture(scope="module")
def mlp_graph():
    module, make_args, _ = models.get("mlp", "tiny")
    (x,) = make_args()
    return trace(module, x), x


def _plan(graph, shape, policy):
    return make_plan(graph, make_mesh(shape, ("data", "model")), policy=policy)


def _model(plan, **kw):
    return CostModel.for_axes(dict(plan.mesh), links=LINK, **kw)


def test_dp_mlp_costs_exactly_the_gradient_all_reduces(mlp_graph):
    graph, _ = mlp_graph
    plan = _plan(graph, (4, 1), "dp")
    cost = _model(plan).plan_cost(plan, graph)
    weights = graph.variables
    assert cost.comm_time_s == pytest.approx(
        sum(all_reduce_time(LINK, 4, v.nbytes) for v in weights), rel=1e-12)
    assert cost.comm_bytes == sum(v.nbytes for v in weights)
    assert cost.comm_kinds == (("all_reduce", cost.comm_bytes),)
    assert cost.step_time_s == pytest.approx(cost.compute_time_s + cost.comm_time_s)


def test_megatron_mlp_costs_two_activation_all_reduces(mlp_graph):
    graph, x = mlp_graph
    plan = _plan(graph, (1, 4), "megatron")
    act = x.size * x.dtype.itemsize  # fc2's output [b, d] == the block input [b, d]
    # a block inside a model: forward all-reduce after fc2, backward all-reduce of the input grad
    cost = _model(plan, input_grads=True).plan_cost(plan, graph)
    assert cost.comm_time_s == pytest.approx(2 * all_reduce_time(LINK, 4, act), rel=1e-12)
    assert cost.comm_bytes == 2 * act
    assert cost.comm_kinds == (("all_reduce", 2 * act),)
    # the whole model: nobody needs the gradient of the example input
    cost = _model(plan).plan_cost(plan, graph)
    assert cost.comm_time_s == pytest.approx(all_reduce_time(LINK, 4, act), rel=1e-12)


def test_zero3_communication_is_a_gather_and_a_reduce_scatter(mlp_graph):
    graph, _ = mlp_graph
    plan = _plan(graph, (4, 1), "zero3")
    assert plan.zero == 3
    model = _model(plan)
    cost = model.plan_cost(plan, graph)
    # kernels: gathered for the forward (and kept for the backward, as XLA does), gradients
    # reduce-scattered; biases are reshaped before use, so their gradient leaves the reshape
    # replicated: all-reduce
    expect = sum(all_gather_time(LINK, 4, v.nbytes) + (
        reduce_scatter_time if v.ndim == 2 else all_reduce_time)(LINK, 4, v.nbytes)
        for v in graph.variables)
    assert cost.comm_time_s == pytest.approx(expect, rel=1e-12)
    # the gathered weights are kept for the backward: activations grow by their full bytes
    dp = _model(_plan(graph, (4, 1), "dp")).memory_breakdown(_plan(graph, (4, 1), "dp"), graph)
    mem = model.memory_breakdown(plan, graph)
    assert mem["activations"] - dp["activations"] == sum(v.nbytes for v in graph.variables)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_zero_memory_matches_mixed_precision_adam(mlp_graph, zero):
    graph, _ = mlp_graph
    n = 4
    plan = _plan(graph, (n, 1), "dp")
    psi = sum(v.nbytes // 4 for v in graph.variables)
    model = _model(plan, zero=zero, param_bytes=2, grad_bytes=2, optimizer_bytes=12)
    mem = model.memory_breakdown(plan, graph)
    expect = {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n,
              3: 16 * psi / n}[zero]
    assert mem["params"] + mem["grads"] + mem["optimizer"] == expect
    # (the gradients are stored as said; at the peak only those built up over the backward
    # count: all of them here, as XLA reduces a model this small in one combined collective)
    assert mem["grads_held"] == mem["grads"]
    assert mem["peak"] == sum(mem[k] for k in ("params", "grads_held", "optimizer",
                                               "activations", "transient"))
    assert model.plan_cost(plan, graph).memory_bytes_per_device == mem["peak"]


def test_zero3_policy_storage_gives_the_same_memory(mlp_graph):
    graph, _ = mlp_graph
    plan = _plan(graph, (4, 1), "zero3")
    psi = sum(v.nbytes // 4 for v in graph.variables)
    mem = _model(plan, param_bytes=2, grad_bytes=2, optimizer_bytes=12).memory_breakdown(
        plan, graph)
    assert mem["params"] + mem["grads"] + mem["optimizer"] == 16 * psi / 4
    # default: fp32 params, grads and two fp32 Adam moments; + fp32 master copy
    full = _model(plan).memory_breakdown(plan, graph)
    assert full["params"] + full["grads"] + full["optimizer"] == 16 * psi / 4
    master = _model(plan, master_weights=True).memory_breakdown(plan, graph)
    assert master["optimizer"] - full["optimizer"] == 4 * psi / 4


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return MLP(Config())(x), None


class _Scanned(nn.Module):
    length: int

    @nn.compact
    def __call__(self, x):
        scan = nn.scan(_Block, variable_axes={"params": 0}, split_rngs={"params": True},
                       length=self.length)
        return scan()(x, None)[0]


class _Remat(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.remat(MLP)(Config())(x)


def test_scan_length_multiplies_compute():
    x = jnp.ones((8, 16))
    costs = {}
    for length in (1, 3):
        graph = trace(_Scanned(length), x)
        (scan,) = [op for op in graph.ops if op.primitive == "scan"]
        assert scan.params["length"] == length
        plan = _plan(graph, (4, 1), "dp")
        model = _model(plan)
        costs[length] = (model.plan_cost(plan, graph), model.op_time(scan, ()))
        mem = model.memory_breakdown(plan, graph)
        costs[length] += (mem["activations"],)
    one, three = costs[1], costs[3]
    assert three[0].compute_time_s == pytest.approx(3 * one[0].compute_time_s, rel=1e-9)
    assert three[1] == pytest.approx(3 * one[1], rel=1e-9)
    assert three[2] == 3 * one[2]
    assert three[0].comm_bytes == 3 * one[0].comm_bytes  # three layers of weights to all-reduce


def test_remat_keeps_only_boundary_inputs_and_recomputes():
    x = jnp.ones((8, 16))
    plain, remat = trace(MLP(Config()), x), trace(_Remat(), x)
    assert any(b.kind in ("checkpoint", "remat", "remat2") for b in remat.boundaries)
    out = {}
    for name, graph in (("plain", plain), ("remat", remat)):
        plan = _plan(graph, (4, 1), "dp")
        model = _model(plan)
        out[name] = (model.memory_breakdown(plan, graph), model.plan_cost(plan, graph))
    assert out["remat"][0]["activations"] == x.nbytes // 4  # the block input, batch-split
    assert out["remat"][0]["activations"] < out["plain"][0]["activations"]
    assert out["remat"][1].compute_time_s > out["plain"][1].compute_time_s


def test_backward_counts_matmul_operands_that_need_gradients(mlp_graph):
    graph, _ = mlp_graph
    dot = next(op for op in graph.ops if op.primitive == "dot_general")  # x @ W1
    model = CostModel.for_axes({"data": 4})
    fwd = model.forward_time(dot, (("data", "m0"),))
    assert model.op_time(dot, (("data", "m0"),)) == pytest.approx(2 * fwd)  # dW only
    grads = CostModel.for_axes({"data": 4}, input_grads=True)
    assert grads.op_time(dot, (("data", "m0"),)) == pytest.approx(3 * fwd)  # dW and dx
    assert fwd == pytest.approx(model.forward_time(dot, ()) / 4)


def test_dtype_aware_peak():
    h100 = device_preset("H100-80G")
    assert h100.peak("bfloat16", matmul=True) == 989e12
    assert h100.peak("float32", matmul=True) == 494.7e12  # TF32
    assert h100.peak("float32", matmul=False) == 67e12
    a100 = device_preset("a100-40g")
    assert (a100.flops, a100.flops_fp32, a100.bandwidth) == (312e12, 19.5e12, 1.555e12)
    assert device_preset("a100-80g").memory_bytes == 80e9
    h200 = device_preset("h200")
    assert (h200.flops, h200.memory_bytes, h200.bandwidth) == (989e12, 141e9, 4.8e12)
    with pytest.raises(PlanError, match="presets"):
        device_preset("tpu-v9")


def test_mesh_spec_links_follow_the_node_convention():
    c = cluster_preset("h100-80g-8x")
    assert c.device == H100_80G and c.intra == NVLINK_H100 and c.inter == IB_NDR
    m = c.mesh_spec(("data", "model"), (4, 8))
    assert (m.link("data"), m.link("model")) == (IB_NDR, NVLINK_H100)
    m = c.mesh_spec(("data", "fsdp", "model"), (2, 2, 2))
    assert m.links == (NVLINK_H100,) * 3
    m = c.mesh_spec(("data", "fsdp", "model"), (4, 4, 2))  # 2 fits, 4 x 2 fits, 4 x 4 x 2 not
    assert m.links == (IB_NDR, NVLINK_H100, NVLINK_H100)
    m = c.mesh_spec(("data", "model"), (2, 16))  # the model axis alone spans two nodes
    assert m.links == (IB_NDR, IB_NDR)
    m = c.mesh_spec(("data", "model"), (4, 8), placement={"data": "intra", "model": "inter"})
    assert m.links == (NVLINK_H100, IB_NDR)
    with pytest.raises(PlanError, match="unknown mesh axis"):
        c.mesh_spec(("data",), (8,), placement={"model": "intra"})
    model = CostModel.for_cluster(c, {"data": 4, "model": 8})
    assert model.device == H100_80G and model.mesh.link("data") == IB_NDR
    assert NVLINK_H100.beta_s_per_byte == pytest.approx(1 / 450e9)
    assert cluster_preset("a100-80g-8x").inter.beta_s_per_byte == pytest.approx(1 / 25e9)


def test_cluster_prices_the_data_axis_over_infiniband(mlp_graph):
    graph, _ = mlp_graph
    plan = _plan(graph, (4, 1), "dp")
    c = cluster_preset("a100-80g-8x")
    inside = CostModel.for_cluster(c, dict(plan.mesh)).plan_cost(plan, graph)
    across = CostModel.for_cluster(c, dict(plan.mesh), placement={"data": "inter"}).plan_cost(
        plan, graph)
    assert inside.comm_time_s == pytest.approx(
        sum(all_reduce_time(c.intra, 4, v.nbytes) for v in graph.variables))
    assert across.comm_time_s > inside.comm_time_s


def test_make_plan_fills_the_plan_cost(mlp_graph):
    graph, _ = mlp_graph
    plan = _plan(graph, (2, 4), "megatron")
    assert plan.cost == CostModel.for_axes(dict(plan.mesh)).plan_cost(plan, graph)
    assert plan.cost.memory_bytes_per_device > 0 and plan.cost.step_time_s > 0


def test_local_cpu_is_measured_when_called():
    dev = device_preset("cpu")
    assert dev.kind == jax.devices()[0].device_kind
    from nnscaler_jax.cost import local_cpu

    local = local_cpu(n=128, repeats=1)
    assert local.flops > 0 and local.bandwidth > 0 and local.kind == dev.kind


def test_per_op_terms_add_up_to_the_plan(mlp_graph):
    graph, _ = mlp_graph
    plan = _plan(graph, (2, 4), "megatron")
    model = _model(plan)
    splits = {p.op: p.split for p in plan.ops}
    ops = list(graph.walk())
    mem = model.memory_breakdown(plan, graph)
    saved = residual_outputs(graph)
    assert mem["activations"] == sum(
        model.activation_bytes(op, splits.get(op.id, ()), saved.get(op.id, ())) for op in ops)
    traffic = fused_bytes(graph)  # each op's reads and writes after XLA's fusion
    assert model.plan_cost(plan, graph).compute_time_s == pytest.approx(
        sum(model.op_time(op, splits.get(op.id, ()), None, traffic) for op in ops))


@pytest.mark.parametrize("groups", [1, 4])
def test_conv_flops_are_output_elements_times_window_times_group_features(groups):
    """A 7x7 stride-2 conv, 32 -> 64 features (in ``groups`` groups) on 2 x 56 x 56 images:
    2 x (2 x 28 x 28 x 64) x (7 x 7 x 32 / groups) FLOPs; the input's spatial size must not
    enter (it did once: WRN's stem was priced 2.4 million times too high)."""
    from nnscaler_jax.cost.compute import op_flops

    conv = nn.Conv(64, (7, 7), strides=2, feature_group_count=groups, use_bias=False)
    x = jnp.ones((2, 56, 56, 32))
    graph = trace(conv, x)
    (op,) = [o for o in graph.walk() if o.primitive == "conv_general_dilated"]
    assert op_flops(op) == 2 * (2 * 28 * 28 * 64) * (7 * 7 * 32 // groups)


def test_a_saved_matmul_operand_reaching_it_by_an_all_gather_is_kept_gathered(mlp_graph):
    """fc1 splits its output features over 'model', fc2 splits its own output features: fc2
    reads the hidden activation h all-gathered (replicated) and its weight gradient needs h, so
    XLA keeps the gathered copy for the backward (measured on WRN's searched plan: 0.47 ->
    0.85 of XLA's memory once counted); fc2 is h's one reader, so h's own shard is dead once
    gathered (XLA:GPU, GPT-3 1.3B's projections reading the attention's output gathered:
    0.947 -> 0.966 once dropped)."""
    graph, _ = mlp_graph
    mesh = make_mesh((1, 4), ("data", "model"))

    def policy(draft, mesh):
        draft.decide(draft.op("fc1"), {"model": "n0"})
        draft.decide(draft.op("fc2"), {"model": "n0"})
        return draft.finish()

    plan = make_plan(graph, mesh, policy=policy)
    model = _model(plan)
    splits = {p.op: p.split for p in plan.ops}
    saved = residual_outputs(graph)
    own = sum(model.activation_bytes(op, splits.get(op.id, ()), saved.get(op.id, ()))
              for op in graph.walk())
    h = graph.op("fc2").inputs[0]
    shard = h.nbytes // 4  # (h split over 'model' as fc1 makes it)
    assert model.memory_breakdown(plan, graph)["activations"] == own - shard + h.nbytes



class _Bf16MLP(nn.Module):
    """The MLP in bf16: each Dense casts its float32 kernel before its matmul."""

    @nn.compact
    def __call__(self, x):
        h = nn.gelu(nn.Dense(64, dtype=jnp.bfloat16, name="fc1")(x))
        return nn.Dense(32, dtype=jnp.bfloat16, name="fc2")(h)


def _fc2_cast_split(split_cast: bool):
    """fc2 splits the batch over 'data'; its kernel's bf16 cast splits its rows over 'data'
    too (``split_cast``: a weight stored split, cast where it is stored) or runs whole."""
    def policy(draft, mesh):
        cast = next(o for o in draft.walk() if o.primitive == "convert_element_type"
                    and o.module_path == "fc2" and o.inputs[0].ndim == 2)
        dot = next(o for o in draft.walk()
                   if o.primitive == "dot_general" and o.module_path == "fc2")
        draft.decide(cast, {"data": "d0"} if split_cast else {})
        draft.decide(dot, {"data": "m0"})
        return draft.finish()
    return policy


def test_a_weights_cast_gathered_for_a_matmul_is_kept_gathered_only():
    """fc2's transpose reads its bf16 kernel for h's gradient. Cast where the kernel is stored
    (split over 'data') and gathered for the matmul, the gathered copy stays for the backward
    and the cast's shard is dead once gathered (the float32 kernel is held anyway): the plan
    keeps what the plan casting the whole kernel keeps (measured with XLA:GPU, GPT-3 6.7B in
    bf16 on A100 with its weights stored split: 1.5 GiB of cast shards a device were counted
    next to their gathered copies, estimate / XLA:GPU 0.914 -> 0.995). An activation gathered
    for a matmul keeps its shard: the test above."""
    graph = trace(_Bf16MLP(), jnp.ones((8, 16)))
    mesh = make_mesh((4, 2), ("data", "model"))
    split = make_plan(graph, mesh, policy=_fc2_cast_split(True))
    whole = make_plan(graph, mesh, policy=_fc2_cast_split(False))
    model = _model(split)
    cast = next(p for p in split.ops if p.primitive == "convert_element_type" and p.split)
    assert cast.module_path == "fc2" and cast.split == (("data", "d0"),)
    assert model.memory_breakdown(split, graph)["activations"] == \
        model.memory_breakdown(whole, graph)["activations"]


def test_a_recomputed_block_rebuilds_its_gathered_operand_with_its_residuals(mlp_graph):
    """The plan above with fc2 recomputed: the gathered copy of h is no longer kept from the
    forward; fc2's forward runs again in the backward, gathers h again, and the copy is live
    with the block's residuals while fc2's backward runs, next to h's cotangent, a partial sum
    as large until it is reduced back: the block's transient holds both (XLA's peak in Swin
    tiny's recomputed blocks holds such all-gathered operands: estimate / XLA 0.627 -> 0.893
    once counted; a Swin at 64 px, embed 32, whose fc2 gathers its input over all 8 devices,
    holds the copy and the cotangent at once: 0.821 with the copy alone)."""
    graph, _ = mlp_graph
    mesh = make_mesh((1, 4), ("data", "model"))

    def policy(draft, mesh):
        draft.decide(draft.op("fc1"), {"model": "n0"})
        draft.decide(draft.op("fc2"), {"model": "n0"})
        return draft.finish()

    plan = make_plan(graph, mesh, policy=policy)
    model = _model(plan)
    kept = model.memory_breakdown(plan, graph)
    again = model.memory_breakdown(dataclasses.replace(plan, recompute=("fc2",)), graph)
    h = graph.op("fc2").inputs[0]
    # (the block's input, h's shard, is kept for it instead)
    assert again["activations"] == kept["activations"] - h.nbytes + h.nbytes // 4
    # fc2 saves no output of its own: its transient is the gathered h and h's cotangent, and
    # the cotangent of fc2's output (split over 'model' as fc2 computes it)
    out = graph.op("fc2").outputs[0]
    assert again["transient"] == max(kept["transient"], 2 * h.nbytes + out.nbytes // 4) \
        > kept["transient"]

def test_a_scan_body_output_relaid_into_a_split_carry_is_priced_per_iteration():
    """A 3-layer nn.scan of Dense(32) whose carry crosses layer boundaries split over 'model'
    while the body's matmul runs replicated: every iteration all-gathers the carry for the
    matmul (forward) and all-gathers the carry's gradient back from the split layout (the
    backward of slicing the body's output into the carry): 2 x 3 x the carry's bytes."""
    from nnscaler_jax.ir.anno import parse_anno

    class Cell(nn.Module):
        @nn.compact
        def __call__(self, c, _):
            return nn.Dense(32, use_bias=False)(c), None

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            layers = nn.scan(Cell, variable_axes={"params": 0}, split_rngs={"params": True},
                             length=3)
            return layers(name="s")(x, None)[0]

    axes = {"data": 2, "model": 4}
    graph = trace(Net(), jnp.ones((8, 32)))
    scan = next(op for op in graph.walk() if op.primitive == "scan")
    k = scan.params["num_consts"]
    hidden = parse_anno(scan.anno).inputs[k].axes[-1].dims[0].name

    def policy(draft, mesh):
        for op in draft.graph.walk():
            draft.decide(op, {"model": hidden} if op.id == scan.id else {})
        return draft.finish()

    plan = make_plan(graph, axes, policy=policy)
    cost = CostModel.for_axes(axes, links=LINK).plan_cost(plan, graph)
    assert cost.comm_bytes == 2 * 3 * scan.inputs[k].nbytes


@pytest.mark.parametrize("axes", [("model",), ("data", "model")])
def test_an_output_left_as_partial_sums_costs_one_all_reduce(axes):
    """A model whose last op leaves partial sums that nothing reads: the program hands back the
    value, so the lowering all-reduces it over the partial axes in one collective (XLA's
    replica groups span them all). ``plan_cost``, the search tables and the compiled HLO agree."""
    from nnscaler_jax import auto_parallel
    from nnscaler_jax.lower.hlo import hlo_collectives
    from nnscaler_jax.search import search_policy

    module, x = nn.Dense(8, use_bias=False), jnp.ones((16, 32))
    graph = trace(module, x)
    mesh = make_mesh((2, 4), ("data", "model"))
    model = CostModel.for_axes({"data": 2, "model": 4}, links=LINK)

    def policy(draft, mesh):  # the contraction dim split: partial sums over ``axes``
        draft.decide(draft.graph.ops[0], {a: "k0" for a in axes})
        return search_policy("auto", cost_model=model)(draft, mesh)

    planned = plan_and_report(graph, {"data": 2, "model": 4}, policy=policy, cost_model=model)
    plan, report = planned.plan, planned.report
    out = 16 * 8 * 4  # bytes of the output, whole on every device
    assert plan.cost.comm_bytes == out
    assert plan.cost.comm_time_s == pytest.approx(
        all_reduce_time(LINK, 4 if axes == ("model",) else 8, out), rel=1e-12)
    # the search's tables price the same all-reduce (the op was decided by hand)
    assert report.objective_s == pytest.approx(plan.cost.step_time_s, rel=1e-9)
    pm = auto_parallel(mesh, plan=plan)(module)
    variables = pm.init(jax.random.key(0), x)
    hlo = jax.jit(pm.apply).lower(variables, x).compile().as_text()
    cols = [c for c in hlo_collectives(hlo, mesh) if c.kind == "all_reduce"]
    assert [(c.bytes, set(c.axes)) for c in cols] == [(out, set(axes))]


def test_a_copy_of_the_model_keeps_its_own_memo():
    """Prices are memoised on the model; a ``dataclasses.replace`` copy on another mesh prices
    by its own mesh, not by what the original memoised."""
    import dataclasses

    from nnscaler_jax.ir.graph import Tensor
    from nnscaler_jax.layout import Layout

    t, lay = Tensor(0, (8, 4), "float32"), Layout.of(2, {0: "data"})
    two = CostModel.for_axes({"data": 2})
    assert two._local_bytes(t, lay) == 4 * 4 * 4
    four = dataclasses.replace(two, mesh=CostModel.for_axes({"data": 4}).mesh)
    assert four._local_bytes(t, lay) == 2 * 4 * 4
    assert two._local_bytes(t, lay) == 4 * 4 * 4



@pytest.mark.parametrize("precision", ["bfloat16", None])
def test_a_whole_batch_loss_casts_its_cotangent_where_its_logits_were(monkeypatch, precision):
    """The labels' gather builds the float32 logits' dense cotangent; in bf16 its copy cast
    back to the logits' type is made once the loss's backward has read the kept bf16 logits
    (their last use), so it takes their place and adds nothing (measured with XLA:GPU: GPT-3
    1.3B's Megatron plan in bf16 on H100s, 12.54 GiB at the loss's backward; pricing the copy
    beside the kept logits gave 13.33 GiB, 0.94). Where nothing keeps the logits (a chunked
    loss recomputes them) the copy counts: ``tests/ir/test_coshard.py``."""
    from nnscaler_jax.capture.trace import capture_spec
    from nnscaler_jax.cost import plan_walk

    graph = capture_spec(models.get("gpt", "tiny"), precision=precision, loss=True).graph
    plan = make_plan(graph, {"data": 2, "model": 4}, policy="megatron")
    calls, real = [], plan_walk._dense_cotangent

    def spy(*args):
        got = real(*args)
        if got:
            calls.append((got, args))
        return got

    monkeypatch.setattr(plan_walk, "_dense_cotangent", spy)
    CostModel.for_axes({"data": 2, "model": 4}).plan_cost(plan, graph)
    # the labels' gather on the logits (not the embedding lookups' on the tables)
    got, (model, g, op, ins, grads, _kept) = max(
        (c for c in calls if c[1][2].module_path == ""), key=lambda c: c[1][2].inputs[0].nbytes)
    vocab = next(v for v in graph.variables if "wte" in v.name).shape[0]
    assert op.inputs[0].shape[-1] == vocab
    dense = model._local_bytes(op.inputs[0], ins[0])
    assert got == dense
    # not kept: the bf16 copy (half the float32 cotangent) counts, as it did before
    assert real(model, g, op, ins, grads, None) == dense * (1.5 if precision else 1.0)
