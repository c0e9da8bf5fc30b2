"""Mixed precision as a plan setting (``Constraints(precision=...)``, ``Plan.precision``).

The program computes in bfloat16 / float16 (params and floating inputs cast on entry) with
float32 master weights: its results and gradients are float32, its graph's matmuls 16-bit. Each
result is checked against the single-device program with the same casts (written out here by
hand: ``module.apply`` on cast params and inputs, the output cast to float32) within the 16-bit
tolerance of :mod:`nnscaler_jax.lower.verify`. The cost model prices the 16-bit activations and
the float32 weight state (16 bytes per parameter under Adam)."""

from __future__ import annotations

import json
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from meshes import make_mesh

import models
from nnscaler_jax import Constraints, Plan, PlanError, auto_parallel
from nnscaler_jax.capture.flax import linen_traceable, nnx_traceable
from nnscaler_jax.capture.trace import capture, capture_spec
from nnscaler_jax.cli.main import main
from nnscaler_jax.cost.devices import cluster_preset
from nnscaler_jax.cost.model import CostModel
from nnscaler_jax.errors import ConstraintError, PlanFormatError
from nnscaler_jax.lower.verify import max_rel_diff, precision_rtol
from nnscaler_jax.planner import make_plan

BF16 = "bfloat16"
AXES = {"data": 2, "model": 4}


class MLP(nn.Module):
    hidden: int = 64
    out: int = 16

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.out, name="fc2")(nn.gelu(nn.Dense(self.hidden, name="fc1")(x)))


def _cast(tree, dtype):
    return jax.tree.map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating)
                        else a, tree)


def _reference(module, variables, args, loss, dtype):
    """Forward and gradients of the single-device program with the same casts."""
    def fwd(p):
        out = module.apply({**variables, "params": _cast(p, dtype)}, *_cast(args, dtype))
        return out.astype(jnp.float32)
    return jax.jit(jax.value_and_grad(_with_output(loss, fwd), has_aux=True))(variables["params"])


def _with_output(loss, fwd):
    """``p -> (loss, output)`` for ``value_and_grad(..., has_aux=True)``."""
    def f(p):
        out = fwd(p)
        return loss(out), out
    return f


def _check_against_reference(module, args, loss, policy, precision=BF16):
    mesh = make_mesh((2, 4), ("data", "model"))
    dtype = jnp.dtype(precision)
    pm = auto_parallel(mesh, Constraints(precision=precision), policy=policy)(module)
    variables = pm.init(jax.random.key(0), *args)
    (_, out), grads = jax.jit(jax.value_and_grad(
        _with_output(loss, lambda p: pm.apply({"params": p}, *args)), has_aux=True))(
            variables["params"])
    (_, ref_out), ref_grads = _reference(module, variables, args, loss, dtype)
    tol = precision_rtol(precision)
    assert out.dtype == jnp.float32
    assert {g.dtype for g in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32)}
    assert max_rel_diff(out, ref_out)[0] <= tol
    diff, where = max_rel_diff(grads, ref_grads)
    assert diff <= tol, (diff, where)
    dots = [op for op in pm.graph.walk() if op.primitive == "dot_general"]
    assert dots and {t.dtype for op in dots for t in op.inputs} == {precision}
    assert {t.dtype for t in pm.graph.variables} == {"float32"}
    assert pm.plan.precision == precision
    return pm, variables


@pytest.mark.parametrize("policy", ["dp", "megatron", "auto"])
def test_mlp_bf16_matches_single_device(policy):
    x = jax.random.normal(jax.random.key(1), (8, 16))
    _check_against_reference(MLP(), (x,), lambda o: jnp.mean(o ** 2), policy)


def test_mlp_fp16_matches_single_device():
    x = jax.random.normal(jax.random.key(1), (8, 16))
    _check_against_reference(MLP(), (x,), lambda o: jnp.mean(o ** 2), "megatron", "float16")


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["dp", "megatron", "auto"])
def test_gpt_tiny_bf16_matches_single_device(policy):
    # the zoo's layers compute in their config's dtype: built at the same precision
    spec = models.get("gpt", "tiny", dtype=jnp.bfloat16)
    args = spec.make_args()
    _check_against_reference(spec.module, args, lambda o: spec.loss_fn(o, *args), policy)


def test_program_given_to_xla_has_bf16_dots():
    mesh = make_mesh((2, 4), ("data", "model"))
    x = jnp.ones((8, 16))
    pm = auto_parallel(mesh, Constraints(precision=BF16), policy="megatron")(MLP())
    variables = pm.init(jax.random.key(0), x)
    lowered = jax.jit(lambda v: pm.apply(v, x)).lower(variables).as_text()
    dots = [line for line in lowered.splitlines() if "stablehlo.dot_general" in line]
    assert len(dots) == 2 and all("xbf16>" in line.split("->")[0] for line in dots)
    # XLA:CPU runs a bf16 dot as an f32 dot of bf16-rounded operands; the values are bf16
    hlo = pm.compiled(variables, x).as_text()
    assert "bf16[" in hlo


def test_graph_keeps_float32_variables_and_results():
    c = capture(MLP(), jax.ShapeDtypeStruct((8, 16), jnp.float32), precision="bf16")
    assert c.graph.meta["precision"] == BF16
    assert {t.dtype for t in c.graph.inputs} == {"float32"}
    assert [t.dtype for t in c.graph.outputs] == ["float32"]
    casts = c.graph.ops[:5]  # 4 params and the input, each in its module
    assert all(op.primitive == "convert_element_type" for op in casts)
    assert sorted(op.module_path for op in casts) == ["", "fc1", "fc1", "fc2", "fc2"]


def test_cost_model_prices_bf16_activations_and_fp32_state():
    # (H100s compute bf16 arithmetic in bf16: on A100s XLA keeps some bf16 residuals in
    # float32, tests/cost/test_residuals.py)
    cm = lambda: CostModel.for_cluster(cluster_preset("h100-80g-8x"), AXES)
    x = jax.ShapeDtypeStruct((4096, 1024), jnp.float32)  # tokens >> params: matmul bound
    out = {}
    for precision in (None, BF16):
        graph = capture(MLP(hidden=4096, out=1024), x, precision=precision).graph
        model = cm()
        plan = make_plan(graph, AXES, policy="dp", cost_model=model)
        out[precision] = (model.memory_breakdown(plan, graph), plan.cost, plan)
    (m32, c32, _), (m16, c16, p16) = out[None], out[BF16]
    assert p16.precision == BF16
    # the activations kept for the backward are half; the backward also reads the bf16 copies
    # of fc2's kernel (for the gradient of its input; replicated under dp) and of the input
    # (for fc1's kernel gradient; the batch over 'data'): XLA keeps these casts alive too. The
    # GELU's tanh is kept in bf16 only: XLA:GPU rebuilds a float32 one in the backward
    copies = 4096 * 1024 * 2 + 4096 * 1024 * 2 // 2
    tanh = 4096 * 4096 * 2 // 2
    assert m16["activations"] == m32["activations"] // 2 + copies + tanh
    assert c16.compute_time_s < c32.compute_time_s
    assert c16.step_time_s < c32.step_time_s
    for kind in ("params", "grads", "optimizer"):
        assert m16[kind] == m32[kind]
    n_params = 1024 * 4096 * 2 + 4096 + 1024
    assert m16["params"] + m16["grads"] + m16["optimizer"] == 16 * n_params  # dp: replicated


def test_cost_model_gpt_bf16_plan_is_smaller_and_faster():
    axes = AXES
    res = {}
    for precision in (None, BF16):
        graph = capture_spec(models.get("gpt", "gpt2-small"), precision=precision).graph
        model = CostModel.for_cluster(cluster_preset("a100-80g-8x"), axes)
        plan = make_plan(graph, axes, policy="megatron", cost_model=model)
        res[precision] = (model.memory_breakdown(plan, graph), plan.cost)
    (m32, c32), (m16, c16) = res[None], res[BF16]
    # softmax and norm statistics stay float32 in the model: less than a half saved, not more
    assert 0.5 * m32["activations"] <= m16["activations"] < 0.75 * m32["activations"]
    assert c16.step_time_s < c32.step_time_s
    assert [m16[k] for k in ("params", "grads", "optimizer")] == \
        [m32[k] for k in ("params", "grads", "optimizer")]


def test_saved_bf16_plan_round_trips_and_applies():
    mesh = make_mesh((2, 4), ("data", "model"))
    x = jax.random.normal(jax.random.key(1), (8, 16))
    pm = auto_parallel(mesh, Constraints(precision="bf16"), policy="megatron")(MLP())
    variables = pm.init(jax.random.key(0), x)
    y = pm.apply(variables, x)
    text = pm.plan.to_json()
    assert json.loads(text)["precision"] == BF16
    assert Plan.from_json(text) == pm.plan
    assert str(pm.plan).splitlines()[0].endswith("precision=bfloat16")
    pm2 = auto_parallel(mesh, plan=text)(MLP())
    np.testing.assert_array_equal(pm2.apply(variables, x), y)
    assert pm2.plan.precision == BF16
    assert any(op.primitive == "dot_general" and op.inputs[0].dtype == BF16
               for op in pm2.graph.walk())
    # a plan saved before precision existed loads as the model's own dtypes
    old = json.loads(text)
    del old["precision"]
    assert Plan.from_json(json.dumps(old)).precision is None
    with pytest.raises(PlanFormatError):
        Plan.from_json(json.dumps({**old, "precision": "int3"}))
    with pytest.raises(ConstraintError, match="saved plan"):
        auto_parallel(mesh, Constraints(precision="float16"), plan=text)(MLP())


def test_precision_must_match_the_captured_graph():
    x = jax.ShapeDtypeStruct((8, 16), jnp.float32)
    g32 = capture(MLP(), x).graph
    with pytest.raises(ConstraintError, match="captured"):
        make_plan(g32, AXES, policy="dp", constraints=Constraints(precision=BF16))
    g16 = capture(MLP(), x, precision=BF16).graph
    saved = make_plan(g16, AXES, policy="dp")
    assert saved.precision == BF16  # from the graph
    with pytest.raises(PlanFormatError, match="bfloat16"):
        make_plan(g32, AXES, plan=saved)
    assert make_plan(g16, AXES, plan=saved).precision == BF16


def test_bad_precision_is_a_constraint_error():
    with pytest.raises(ConstraintError, match="int8"):
        Constraints(precision="int8")
    with pytest.raises(ConstraintError):
        capture(MLP(), jnp.ones((2, 16)), precision="float64")
    assert Constraints(precision=jnp.float16).precision == "float16"
    assert Constraints(precision="bf16").precision == BF16
    assert issubclass(ConstraintError, PlanError)


def test_precision_selects_the_program():
    x = jnp.ones((2, 16))
    v = jax.eval_shape(MLP().init, jax.random.key(0), x)
    keys = {linen_traceable(MLP(), (x,), {}, variables=v, compute_dtype=p).static_key
            for p in (None, "bfloat16", "float16")}
    assert len(keys) == 3
    m = nnx.Linear(16, 4, rngs=nnx.Rngs(0))
    assert nnx_traceable(m, (x,), {}).static_key != \
        nnx_traceable(m, (x,), {}, compute_dtype=BF16).static_key


class NetNnx(nnx.Module):
    def __init__(self, rngs):
        self.fc = nnx.Linear(16, 64, rngs=rngs)
        self.bn = nnx.BatchNorm(64, rngs=rngs)

    def __call__(self, x):
        return nnx.relu(self.bn(self.fc(x)))


def test_nnx_batchnorm_keeps_float32_state():
    mesh = make_mesh((2, 4), ("data", "model"))
    x = jax.random.normal(jax.random.key(1), (8, 16)) * 3 + 1
    module = NetNnx(nnx.Rngs(0))
    params_before = jax.tree.map(np.asarray, nnx.state(module, nnx.Param))
    ref = NetNnx(nnx.Rngs(0))
    graphdef, params, stats = nnx.split(ref, nnx.Param, nnx.BatchStat)
    ref = nnx.merge(graphdef, _cast(params, jnp.bfloat16), stats)
    y_ref = ref(x.astype(jnp.bfloat16))
    pm = auto_parallel(mesh, Constraints(precision=BF16), policy="dp")(module)
    y = pm(x)
    assert y.dtype == jnp.float32
    np.testing.assert_allclose(y, y_ref.astype(jnp.float32), rtol=2e-2, atol=2e-2)
    state = nnx.state(pm.module)
    assert {a.dtype for a in jax.tree.leaves(state)} == {jnp.dtype(jnp.float32)}
    # the params come back as stored (not rounded through bfloat16), the statistics updated
    jax.tree.map(np.testing.assert_array_equal, nnx.state(pm.module, nnx.Param), params_before)
    np.testing.assert_allclose(pm.module.bn.mean[...], ref.bn.mean[...], rtol=1e-2, atol=1e-3)
    assert not np.allclose(pm.module.bn.mean[...], 0.0)
    grads = nnx.grad(lambda m: jnp.mean(m(x) ** 2))(pm)
    assert {g.dtype for g in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32)}


class NetBN(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.BatchNorm(use_running_average=not train, name="bn")(nn.Dense(32, name="fc")(x))
        return nn.Dense(8, name="out")(nn.relu(x))


def test_linen_mutable_batch_stats_stay_float32():
    mesh = make_mesh((2, 4), ("data", "model"))
    x = jax.random.normal(jax.random.key(1), (8, 16)) + 2
    pm = auto_parallel(mesh, Constraints(precision=BF16), policy="dp")(NetBN())
    variables = pm.init(jax.random.key(0), x, train=False)
    y, updates = pm.apply(variables, x, train=True, mutable=["batch_stats"])
    ref_y, ref_updates = NetBN().apply(
        {**variables, "params": _cast(variables["params"], jnp.bfloat16)},
        x.astype(jnp.bfloat16), train=True, mutable=["batch_stats"])
    assert y.dtype == jnp.float32
    assert {a.dtype for a in jax.tree.leaves(updates)} == {jnp.dtype(jnp.float32)}
    assert max_rel_diff(updates, ref_updates)[0] <= precision_rtol(BF16)
    assert max_rel_diff(y, ref_y.astype(jnp.float32))[0] <= precision_rtol(BF16)
    # everything returned, the params too with mutable=True, is as stored
    _, every = pm.apply(variables, x, train=True, mutable=True)
    jax.tree.map(np.testing.assert_array_equal, every["params"], variables["params"])


def test_verify_uses_the_precision_tolerance():
    mesh = make_mesh((2, 4), ("data", "model"))
    x = jax.random.normal(jax.random.key(1), (8, 16))
    pm = auto_parallel(mesh, Constraints(precision=BF16), policy="megatron", verify=True)(MLP())
    pm.apply(pm.init(jax.random.key(0), x), x)  # raises VerificationError if off


class Pinned(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(8, dtype=jnp.float32, name="pinned")(x)


def test_float32_pinned_layers_warn():
    with pytest.warns(UserWarning, match="still compute in float32.*pinned"):
        capture(Pinned(), jnp.ones((2, 16)), precision=BF16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        capture(Pinned(), jnp.ones((2, 16)), precision="float32")


class Rotary(nn.Module):
    """A float32 matmul of positions and constants only (rotary angles) beside a bf16 layer."""

    @nn.compact
    def __call__(self, x):
        inv = 1.0 / (10000.0 ** (jnp.arange(0, 8, 2, dtype=jnp.float32) / 8))
        ang = jnp.einsum("s,f->sf", jnp.arange(x.shape[1], dtype=jnp.float32), inv)
        return nn.Dense(8, name="proj")(x) * jnp.cos(ang).sum().astype(x.dtype)


def test_float32_matmuls_of_constants_do_not_warn():
    """The rotary angles' einsum reads no data: float32 is the model's choice there (Llama's
    128K preset warned about 64 such matmuls, "their layers set dtype=jnp.float32")."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        capture(Rotary(), jnp.ones((2, 4, 16)), precision=BF16)


def test_capture_spec_sets_the_zoo_compute_dtype():
    graph = capture_spec(models.get("gpt", "tiny"), precision=BF16).graph
    assert {op.inputs[0].dtype for op in graph.walk() if op.primitive == "dot_general"} == {BF16}
    with pytest.raises(PlanError, match="dtype=jnp.bfloat16"):
        capture_spec(models.get("gpt_nnx", "tiny"), precision=BF16)


def test_cli_compare_takes_precision(capsys):
    # (GPT-2 small: its activations make the difference; a tiny model's bf16 weight copies
    # outweigh its few activations' savings once no gradient is held at the peak, and the tiny
    # GPT's float32 GELU keeps no tanh on GPUs, XLA:GPU rebuilds it. On H100s: on A100s XLA
    # keeps bf16 residual sums and activations in float32)
    argv = ["compare", "--model", "gpt", "--preset", "gpt2-small", "--mesh", "2x4", "--planners",
            "dp,megatron", "--cluster", "h100-80g-8x", "--json"]
    assert main(argv + ["--precision", "bf16"]) == 0
    bf16 = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main(argv) == 0
    fp32 = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert bf16["precision"] == BF16 and fp32["precision"] is None
    for name in ("dp", "megatron"):
        assert bf16["planners"][name]["fits"] and fp32["planners"][name]["fits"]
        assert bf16["planners"][name]["memory_bytes_per_device"] < \
            fp32["planners"][name]["memory_bytes_per_device"]
    assert main(argv + ["--precision", "int4"]) == 2
