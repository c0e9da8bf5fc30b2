"""Lowering bugs found by ``scripts/fuzz_plans.py``, each reduced to a small plan.

- A ``cond`` whose branches end in ops split differently: the branches' results carried
  different shardings and XLA refused the program ("Inconsistent conditional sharding among
  instructions"). Each branch now leaves its results in the cond's output layouts.
- On an Explicit mesh the results were handed to the types the user's code reads with one
  constraint from the plan's layout (``auto_axes``' ``out_sharding``): from features split over
  ``(model, data)`` to the batch over ``model`` XLA replicated the tensor first ("Involuntary
  full rematerialization"). They now leave along the priced path.
- Grouped convolutions (``feature_group_count > 1``) under GSPMD: XLA's SPMD partitioner computes
  a conv split along its groups wrongly, all-reduces the kernel gradient (a
  ``batch_group_count`` conv) over every device when the batch is split over one mesh axis and
  replicated over another (``dp`` on a 2x4 mesh: 4x the gradient), and aborts the process when
  the batch is split down to one example per device. A split grouped conv now runs on each
  device's pieces in a ``shard_map``.
"""

import subprocess
import sys
import textwrap

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from meshes import make_mesh

from nnscaler_jax import auto_parallel, op_assign, op_trans
from nnscaler_jax.lower.hlo import xla_stderr
from nnscaler_jax.lower.verify import max_rel_diff

pytestmark = pytest.mark.slow  # compiles and runs programs over the mesh

RTOL = 1e-5


def _check(module, x, mesh, policy):
    """Forward and parameter gradients of ``module`` planned with ``policy`` equal the
    single-device program's."""
    v = module.init(jax.random.key(1), x)
    pm = auto_parallel(mesh, policy=policy)(module)
    out = pm.apply(v, x)
    ref = module.apply(v, x)
    assert max_rel_diff(out, ref)[0] <= RTOL, max_rel_diff(out, ref)
    ct = jax.random.normal(jax.random.key(2), ref.shape)
    grads = jax.jit(jax.grad(lambda v: jnp.sum(pm.apply(v, x) * ct)))(v)
    ref_grads = jax.grad(lambda v: jnp.sum(module.apply(v, x) * ct))(v)
    assert max_rel_diff(grads, ref_grads)[0] <= RTOL, max_rel_diff(grads, ref_grads)
    return pm


class CondNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.normal(0.3), (x.shape[-1], x.shape[-1]))
        return jax.lax.cond(jnp.mean(x) > 0, lambda h: jnp.tanh(h @ w),
                            lambda h: (h @ w) * 0.5 + h, x)


def _branch_policy(graph, mesh):
    """The last op of branch 0 split along the batch, of branch 1 along the features."""
    n = graph.mesh_axes["data"]
    (cond,) = [op for op in graph.ops if op.primitive == "cond"]
    for branch, pos in zip(cond.regions, (0, 2), strict=True):
        last = branch.ops[-1]
        dim = last.annotation.outputs[0].axes[pos].dims[0].name
        op_assign(graph, op_trans(graph, last, dim, n), "data")
    return graph.finish()


@pytest.mark.parametrize("sign", [1.0, -1.0])  # either branch taken
def test_cond_branches_split_differently_agree_on_their_results(sign):
    mesh = make_mesh((8,), ("data",))
    x = sign * jnp.abs(jax.random.normal(jax.random.key(0), (8, 4, 8)))
    pm = _check(CondNet(), x, mesh, _branch_policy)
    splits = [p.split for p in pm.plan.ops if p.primitive in ("tanh", "add")]
    assert len({s for s in splits if s}) == 2  # the branches' last ops split differently


def _weight_in_one_branch_policy(graph, mesh):
    """Branch 1's matmul reads the weight split 2-D (rows over 'data', columns over 'model');
    branch 0's reads it whole."""
    (cond,) = [op for op in graph.ops if op.primitive == "cond"]
    (dot,) = [op for op in cond.regions[1].ops if op.primitive == "dot_general"]
    k, n = dot.annotation.inputs[1].names()
    for sub in op_trans(graph, dot, k, 2):
        op_assign(graph, sub, {"data": sub.splits[-1][2]})
        op_assign(graph, op_trans(graph, sub, n, 4), "model")
    return graph.finish()


def test_cond_branches_reading_an_operand_differently_agree_on_its_gradient():
    """The gradients of the cond's operands are the results of the backward pass's branches:
    they were constrained as each branch read the operand and XLA refused the gradient
    program. Each branch now takes its operands in the cond's input layouts."""
    mesh = make_mesh((2, 4), ("data", "model"))
    x = -jnp.abs(jax.random.normal(jax.random.key(0), (8, 4, 8)))  # branch 1 taken
    pm = _check(CondNet(), x, mesh, _weight_in_one_branch_policy)
    (dot,) = [p for p in pm.plan.ops if p.primitive == "dot_general" and p.split]
    assert len(dot.split) == 2


class GroupedConv(nn.Module):
    kernel: int = 1

    @nn.compact
    def __call__(self, x):
        return nn.Conv(8, (self.kernel,), feature_group_count=2)(x)


@pytest.mark.parametrize("shape,names,policy", [
    ((2, 4), ("data", "model"), "dp"),           # kernel gradient was 4x
    ((2, 4), ("data", "model"), "megatron"),     # same (the conv has no tensor-parallel dim)
    ((2, 2, 2), ("data", "model", "seq"), "auto"),  # the forward was wrong
])
def test_grouped_conv_matches_single_device(shape, names, policy):
    mesh = make_mesh(shape, names)
    x = jax.random.normal(jax.random.key(0), (8, 4, 16))
    _check(GroupedConv(), x, mesh, policy)


def _conv_policy(dims):
    """Split the conv's annotated dims ``dims`` = [(position in the lhs, mesh axis)]."""
    def policy(graph, mesh):
        for op in graph.ops:
            if op.primitive == "conv_general_dilated":
                subs = [op]
                for pos, axis in dims:
                    dim = op.annotation.inputs[0].axes[pos].dims[0].name
                    subs = [p for s in subs for p in op_trans(graph, s, dim,
                                                              graph.mesh_axes[axis])]
                    for k in range(0, len(subs), graph.mesh_axes[axis]):
                        op_assign(graph, subs[k:k + graph.mesh_axes[axis]], axis)
        return graph.finish()
    return policy


@pytest.mark.parametrize("dims", [
    [(2, "data")],                   # the groups over 2 of 8 devices
    [(2, "data"), (0, "model")],     # groups, then the batch
    [(1, "model")],                  # a pointwise spatial dim over 4 of 8 devices
])
def test_grouped_conv_split_by_hand(dims):
    mesh = make_mesh((2, 4), ("data", "model"))
    x = jax.random.normal(jax.random.key(0), (8, 4, 16))
    pm = _check(GroupedConv(), x, mesh, _conv_policy(dims))
    (conv,) = [p for p in pm.plan.ops if p.primitive == "conv_general_dilated"]
    assert len(conv.split) == len(dims)


def test_grouped_conv_batch_split_to_one_example_per_device_does_not_abort():
    """XLA aborted the process (a failed CHECK) compiling this gradient: run it in another."""
    code = textwrap.dedent("""
        import os
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
        import jax, jax.numpy as jnp, flax.linen as nn
        from nnscaler_jax import auto_parallel
        m = nn.Conv(8, (1,), feature_group_count=2)
        x = jax.random.normal(jax.random.key(0), (8, 4, 16))
        v = m.init(jax.random.key(1), x)
        pm = auto_parallel(jax.make_mesh((8,), ("data",)), policy="dp")(m)
        g = jax.jit(jax.grad(lambda v: jnp.sum(pm.apply(v, x) ** 2)))(v)
        r = jax.grad(lambda v: jnp.sum(m.apply(v, x) ** 2))(v)
        d = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))), g, r)
        assert max(jax.tree.leaves(d)) < 1e-5, d
        print("ok")
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=False)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-2000:]


class GatedLinear(nn.Module):
    """``(x @ w) * x``: the product is linear in the partial sums of ``x @ w``."""

    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.normal(0.3), (x.shape[-1], x.shape[-1]))
        return jnp.tanh((x @ w) * x)


def _gated_policy(graph, mesh):
    """The matmul row-parallel over 'model' (partial sums), the product value-split."""
    n = graph.mesh_axes["model"]
    for op in graph.ops:
        if op.primitive == "dot_general":
            k = next(d for d in op.annotation.inputs[1].names())
            op_assign(graph, op_trans(graph, op, k, n), "model")
        elif op.primitive == "mul":
            op_assign(graph, op_trans(graph, op, "value", n), "model")
    return graph.finish()


def test_value_chain_reads_one_input_in_two_layouts():
    """The chain's matmul reads ``x`` split along its features, the product reads it whole:
    the region took one layout per outside value (the first reader's) and the product got a
    quarter of ``x`` (a shape error)."""
    mesh = make_mesh((2, 4), ("data", "model"))
    x = jax.random.normal(jax.random.key(0), (8, 4, 8))
    pm = _check(GatedLinear(), x, mesh, _gated_policy)
    (dot,) = [p for p in pm.plan.ops if p.primitive == "dot_general"]
    assert dot.keep_partial


class ScaledLinear(nn.Module):
    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.normal(0.3), (x.shape[-1], x.shape[-1]))
        return ((x * 0.5) @ w) * 2.0


def _scaled_policy(graph, mesh):
    """Both products value-split (the first on a whole input: its result is whole), the
    matmul between them row-parallel: it reads the first product split along its features."""
    n = graph.mesh_axes["model"]
    for op in graph.ops:
        if op.primitive == "mul":
            op_assign(graph, op_trans(graph, op, "value", n), "model")
        elif op.primitive == "dot_general":
            k = op.annotation.inputs[1].names()[0]
            op_assign(graph, op_trans(graph, op, k, n), "model")
    return graph.finish()


def test_value_chain_cut_where_a_value_is_read_in_another_layout_than_made():
    """The three ops keep or take partial sums, so they ran as one shard_map region, where the
    matmul got the first product whole instead of its feature split (a TypeError from the
    local matmul). The region now ends before the matmul, which reads the product along the
    priced path."""
    mesh = make_mesh((2, 4), ("data", "model"))
    x = jax.random.normal(jax.random.key(0), (8, 4, 8))
    pm = _check(ScaledLinear(), x, mesh, _scaled_policy)
    (dot,) = [p for p in pm.plan.ops if p.primitive == "dot_general"]
    assert dot.keep_partial


def _features_over_both_axes(graph, mesh):
    """The last op's features split over 'model', then 'data' (8 ways)."""
    last = graph.ops[-1]
    dim = last.annotation.outputs[0].names()[-1]
    subs = op_trans(graph, last, dim, 4)
    op_assign(graph, subs, "model")
    for sub in subs:
        op_assign(graph, op_trans(graph, sub, dim, 2), "data")
    return graph.finish()


def test_explicit_results_leave_along_the_priced_path():
    mesh = make_mesh((4, 2), ("model", "data"), axis_types=(AxisType.Explicit,) * 2)
    module = nn.Dense(8)
    x_np = np.asarray(jax.random.normal(jax.random.key(0), (4, 4, 16)))
    x = jax.device_put(x_np, NamedSharding(mesh, P("model")))  # typed: batch over 'model'
    v = module.init(jax.random.key(1), x_np)
    pm = auto_parallel(mesh, policy=_features_over_both_axes)(module)
    with xla_stderr() as err:
        out = pm.apply(v, x)
        jax.block_until_ready(out)
    assert "Involuntary full rematerialization" not in err[0], err[0][-1500:]
    assert jax.typeof(out).sharding.spec == P("model", None, None)  # as the plain module's
    assert max_rel_diff(out, module.apply(v, x_np))[0] <= RTOL
