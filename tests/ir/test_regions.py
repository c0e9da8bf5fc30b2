"""Region links (`ir/regions.py`): outer tensor axes of scan / while / cond tied to the body axes
holding the same data."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from nnscaler_jax.capture.jaxpr import InputInfo, graph_from_jaxpr
from nnscaler_jax.ir.graph import Role
from nnscaler_jax.ir.regions import region_links


def _graph(fn, *args):
    closed = jax.make_jaxpr(fn)(*args)
    graph, _ = graph_from_jaxpr(closed, [InputInfo(Role.INPUT)] * len(closed.jaxpr.invars))
    return graph


def _op(graph, primitive):
    (op,) = [op for op in graph.ops if op.primitive == primitive]
    return op


def _shapes(graph, op):
    out = {t.id: t.shape for t in op.inputs + op.outputs}
    for region in op.regions:
        out.update({t.id: t.shape for t in region.inputs + region.outputs})
    return out


def _check_sizes(graph, op, links):
    shapes = _shapes(graph, op)
    for (o, i), (b, j) in links:
        assert shapes[o][i] == shapes[b][j], ((o, i), (b, j))


def test_scan_links_consts_carries_and_stacked_slices():
    def fn(w, xs, c):
        def body(c, x):
            return jnp.tanh(c @ w + x), c * 2.0
        return lax.scan(body, c, xs)

    g = _graph(fn, jnp.ones((3, 3)), jnp.ones((5, 2, 3)), jnp.ones((2, 3)))
    scan = _op(g, "scan")
    (body,) = scan.regions
    assert (scan.params["num_consts"], scan.params["num_carry"]) == (1, 1)
    links = set(region_links(scan))
    w, c, xs = scan.inputs
    bw, bc, bx = body.inputs
    carry_out, ys = scan.outputs
    b_carry, b_y = body.outputs
    want = {((w.id, 0), (bw.id, 0)), ((w.id, 1), (bw.id, 1)),        # const: axis to axis
            ((c.id, 0), (bc.id, 0)), ((c.id, 1), (bc.id, 1)),        # carry in
            ((xs.id, 1), (bx.id, 0)), ((xs.id, 2), (bx.id, 1)),      # stacked: length skipped
            ((carry_out.id, 0), (b_carry.id, 0)), ((carry_out.id, 1), (b_carry.id, 1)),
            ((ys.id, 1), (b_y.id, 0)), ((ys.id, 2), (b_y.id, 1))}
    assert links == want
    _check_sizes(g, scan, links)
    # the stacked length axes hold no body axis
    assert not any(outer in {(xs.id, 0), (ys.id, 0)} for outer, _ in links)


def test_while_links_cond_consts_body_consts_and_carries():
    def fn(x, w, n):
        return lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, jnp.tanh(c[1] @ w)),
                              (0, x))[1]

    g = _graph(fn, jnp.ones((4, 3)), jnp.ones((3, 3)), 5)
    loop = _op(g, "while")
    _, body = loop.regions
    cn, bn = loop.params["cond_nconsts"], loop.params["body_nconsts"]
    assert (cn, bn) == (1, 1)  # n in the cond, w in the body
    links = region_links(loop)
    _check_sizes(g, loop, links)
    n, w, i0, x = loop.inputs
    assert [t.shape for t in loop.inputs] == [(), (3, 3), (), (4, 3)]
    pairs = set(links)
    assert ((w.id, 0), (body.inputs[0].id, 0)) in pairs          # body const
    assert ((x.id, 1), (body.inputs[2].id, 1)) in pairs          # carry into the body
    assert ((loop.outputs[1].id, 0), (body.outputs[1].id, 0)) in pairs  # carry out
    # scalars have no axes: nothing to link (the cond const n, the counter)
    linked = {t for pair in links for t, _ in pair}
    assert n.id not in linked and i0.id not in linked
    assert len(links) == 2 + 2 + 2  # w, x in, x out: two axes each


def test_cond_links_every_branch_but_not_the_index():
    def fn(p, x):
        return lax.cond(p, lambda a: a * 2.0, lambda a: a - 1.0, x)

    g = _graph(fn, True, jnp.ones((4, 3)))
    cond = _op(g, "cond")
    assert len(cond.regions) == 2
    links = region_links(cond)
    _check_sizes(g, cond, links)
    index, x = cond.inputs
    (out,) = cond.outputs
    for branch in cond.regions:
        assert ((x.id, 1), (branch.inputs[0].id, 1)) in links
        assert ((out.id, 0), (branch.outputs[0].id, 0)) in links
    assert all(outer[0] != index.id for outer, _ in links)
    assert len(links) == 2 * (2 + 2)  # per branch: x's two axes and the output's two


def test_plain_ops_have_no_links():
    g = _graph(lambda x: jnp.tanh(x) @ x.T, jnp.ones((4, 3)))
    assert all(region_links(op) == [] for op in g.ops)
