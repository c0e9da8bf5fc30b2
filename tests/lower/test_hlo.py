"""`lower/hlo.py`: reading collectives out of HLO text (synthetic lines in each replica-group
syntax XLA prints; nothing compiled), the collectives a plan implies (`expected_collectives`),
and `xla_stderr` compiling past jax's persistent compilation cache."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import monitoring
from meshes import make_mesh

from nnscaler_jax import trace
from nnscaler_jax.lower.hlo import (
    HloCollective,
    expected_collectives,
    hlo_collectives,
    summarize,
    xla_stderr,
)
from nnscaler_jax.primitives import Draft


@pytest.fixture(scope="module")
def mesh():
    return make_mesh((2, 4), ("data", "model"))


def _ids(mesh):
    return np.vectorize(lambda d: d.id)(mesh.devices)


def _groups(rows):
    return "{" + ",".join("{" + ",".join(str(int(i)) for i in r) + "}" for r in rows) + "}"


def _line(op, groups, ty="f32[8,4]{1,0}"):
    return f"  %x.1 = {ty} {op}({ty} %p), channel_id=1, replica_groups={groups}, to_apply=%add"


def test_explicit_groups_name_the_axis_they_span(mesh):
    ids = _ids(mesh)
    (c,) = hlo_collectives(_line("all-reduce", _groups(ids)), mesh)          # rows: 'model'
    assert c == HloCollective("all_reduce", 8 * 4 * 4, ("model",))
    (c,) = hlo_collectives(_line("all-reduce", _groups(ids.T)), mesh)        # columns: 'data'
    assert c.axes == ("data",)
    (c,) = hlo_collectives(_line("all-reduce", _groups([ids.reshape(-1)])), mesh)
    assert c.axes == ("data", "model")
    odd = [[ids[0, 0], ids[1, 1]], [ids[0, 1], ids[1, 0]]]   # no mesh axis groups these
    assert hlo_collectives(_line("all-reduce", _groups(odd)), mesh)[0].axes == ("?",)
    single = [[i] for i in ids.reshape(-1)]                   # groups of one: no axis
    assert hlo_collectives(_line("all-reduce", _groups(single)), mesh)[0].axes == ()


def test_iota_groups(mesh):
    if not (_ids(mesh) == np.arange(8).reshape(2, 4)).all():
        pytest.skip("iota groups index devices in mesh order only when ids are an iota")
    assert hlo_collectives(_line("all-gather", "[2,4]<=[8]"), mesh)[0].axes == ("model",)
    assert hlo_collectives(_line("all-gather", "[4,2]<=[2,4]T(1,0)"), mesh)[0].axes == ("data",)


def test_kinds_bytes_and_async_pairs(mesh):
    ids = _ids(mesh)
    g = _groups(ids)
    text = "\n".join([
        _line("reduce-scatter", g, "bf16[2,4]{1,0}"),
        _line("all-to-all", g, "(f32[4], s32[2,2], pred[8])"),
        f"  %s = f32[16]{{0}} all-gather-start(f32[4] %p), replica_groups={g}",
        "  %d = f32[16]{0} all-gather-done(f32[16] %s)",
        "  %add.3 = f32[8,4]{1,0} add(f32[8,4] %a, f32[8,4] %b)",
    ])
    got = hlo_collectives(text, mesh)
    assert [(c.kind, c.bytes) for c in got] == [
        ("reduce_scatter", 2 * 4 * 2),
        ("all_to_all", 4 * 4 + 4 * 4 + 8 * 1),
        ("all_gather", 16 * 4),
    ]
    pairs = ",".join(f"{{{ids[0, j]},{ids[1, j]}}}" for j in range(4))
    line = f"  %cp = f32[4]{{0}} collective-permute(f32[4] %p), source_target_pairs={{{pairs}}}"
    assert hlo_collectives(line, mesh) == [HloCollective("ppermute", 16, ("data",))]


def test_a_collective_in_a_loop_runs_its_trip_count(mesh):
    """A co-sharded chunk loop's collective is one instruction that runs once per chunk: the
    totals a plan's ``comm_bytes`` is compared with count every run."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from nnscaler_jax.train.xla_gpu import collective_totals

    def f(a):
        return jax.lax.fori_loop(0, 5, lambda i, c: c + jax.lax.psum(c * i, "model"), a)

    step = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("model"), out_specs=P("model")))
    x = jax.ShapeDtypeStruct((64,), jnp.float32, sharding=NamedSharding(mesh, P("model")))
    text = step.lower(x).compile().as_text()
    (c,) = hlo_collectives(text, mesh)
    assert (c.kind, c.bytes, c.axes, c.times) == ("all_reduce", 16 * 4, ("model",), 5)
    assert collective_totals(text, mesh)["all_reduce"] == {
        "count": 5, "bytes": 5 * 64, "plan_bytes": 5 * 64}


def test_a_collective_without_groups_spans_nothing(mesh):
    (c,) = hlo_collectives("  %r = f32[2]{0} all-reduce(f32[2] %p), to_apply=%add", mesh)
    assert c.axes == () and c.bytes == 8


class TwoDense(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(8, use_bias=False, name="fc1")(x)
        return jnp.tanh(nn.Dense(4, use_bias=False, name="fc2")(h))


@pytest.fixture(scope="module")
def graph():
    return trace(TwoDense(), jax.ShapeDtypeStruct((8, 16), jnp.float32))


def _plan(graph, fc1=None, fc2=None, store=None, mesh=None):
    d = Draft(graph, dict(mesh or {"data": 2, "model": 4}))
    for path, split in (("fc1", fc1), ("fc2", fc2)):
        op = graph.op(path)
        if split is not None:
            d.decide(op, split)
    for name, spec in (store or {}).items():
        d.store_variable(name, spec)
    return d.finish()


def test_megatron_forward_implies_one_all_reduce(graph):
    plan = _plan(graph, fc1={"model": "n0"}, fc2={"model": "k0"})
    got = expected_collectives(graph, plan)
    assert [(k, a) for k, a, _ in got] == [("all_reduce", "model")]  # fc2's partial sums
    assert summarize(got) == {("all_reduce", ("model",)): 1}


def test_a_split_read_replicated_is_gathered(graph):
    plan = _plan(graph, fc1={"model": "n0"}, fc2={})
    got = expected_collectives(graph, plan)
    h = graph.op("fc2").inputs[0]
    assert got == [("all_gather", "model", str(h))]


def test_a_split_moved_to_another_dim_is_an_all_to_all(graph):
    plan = _plan(graph, fc1={"model": "m0"}, fc2={"model": "k0"})
    got = [(k, a) for k, a, _ in expected_collectives(graph, plan)]
    # h: rows split (fc1) -> columns split (fc2 contracts them); then fc2's partial sums
    assert got == [("all_to_all", "model"), ("all_reduce", "model")]


def test_sharded_storage_read_whole_is_gathered(graph):
    plan = _plan(graph, fc1={}, fc2={}, store={"params/fc1/kernel": ("data", None)})
    kernel = next(t for t in graph.variables if t.name == "params/fc1/kernel")
    assert expected_collectives(graph, plan) == [("all_gather", "data", str(kernel))]


def test_axes_of_size_one_imply_nothing(graph):
    plan = _plan(graph, fc1={"model": "n0"}, fc2={}, mesh={"data": 2, "model": 1})
    assert expected_collectives(graph, plan) == []


def test_summarize_counts_both_kinds_of_items():
    items = [HloCollective("all_reduce", 4, ("model",)), ("all_reduce", "model", "%1"),
             HloCollective("all_gather", 4, ("data", "model"))]
    assert summarize(items) == {("all_reduce", ("model",)): 2,
                                ("all_gather", ("data", "model")): 1}


def test_traffic_counts_large_buffers_once_per_kernel_and_loop_trip():
    """``hlo_traffic`` of a compiled program: a loop of 5 trips over a 1 MiB buffer moves it 5
    times per kernel inside the body; buffers under the threshold are not counted."""
    from nnscaler_jax.lower.hlo import hlo_traffic

    n = 1 << 18  # float32: 1 MiB

    def f(x, small):
        def body(i, c):
            y, s = c
            return jnp.sin(y) * jnp.cos(y) + i, s * 2.0   # one elementwise kernel on y
        return jax.lax.fori_loop(0, 5, body, (x, small))

    x = jnp.ones((n,), jnp.float32)
    text = jax.jit(f).lower(x, jnp.ones((4,), jnp.float32)).compile().as_text()
    traffic = hlo_traffic(text, 1 << 20)
    # the body's one fused kernel reads y and writes the next y, 5 times (XLA:CPU adds a copy
    # of the loop's input outside it)
    assert traffic.by_kind["fusion:kLoop"] == 5 * 2 * (1 << 20)
    assert traffic.bytes == sum(traffic.by_kind.values())
    assert hlo_traffic(text, 1 << 21).bytes == 0          # nothing is 2 MiB or more
    one = hlo_traffic(jax.jit(lambda x: jnp.sin(x) * 2).lower(x).compile().as_text(), 1 << 20)
    assert one.bytes == 2 * (1 << 20) and one.kernels == 1   # read x, write the result


def test_xla_stderr_compiles_what_the_persistent_cache_holds():
    """The suite runs with jax's persistent compilation cache (the root conftest): a program it
    holds is loaded, not compiled, and XLA logs nothing. Inside ``xla_stderr`` (what the
    involuntary-rematerialization checks read) the program is compiled again."""
    assert jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir
    hits = []

    def listener(event, **_kw):
        if event == "/jax/compilation_cache/cache_hits":
            hits.append(event)

    def program():  # a new closure each time: jit's in-memory cache does not know it
        return jax.jit(lambda x: jnp.sin(x) * 3.0 + 0.125).lower(jnp.arange(7.0))

    program().compile()
    monitoring.register_event_listener(listener)
    try:
        program().compile()
        served = len(hits)
        with xla_stderr():
            program().compile()
        inside = len(hits) - served
        program().compile()  # the cache is on again afterwards
    finally:
        monitoring.unregister_event_listener(listener)
    assert (served, inside, len(hits)) == (1, 0, 2)
