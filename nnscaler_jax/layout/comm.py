"""The cheapest sequence of collectives turning one RVD layout into another.

States are the :class:`~nnscaler_jax.layout.rvd.Layout` s of one tensor that are valid on the mesh;
an edge changes the state of one mesh axis ``a`` (``p`` devices) by one collective over ``a``
(nnScaler's RVD transitions on one device set), or reduces partial sums over several axes at once
(below):

==============  ===============  ==============================================================
kind            transition       ``bytes`` (the ``n`` of :mod:`nnscaler_jax.mesh.topology`)
==============  ===============  ==============================================================
all_gather      D(i) -> R        local bytes *after* the gather (p x before)
all_to_all      D(i) -> D(j)     p x the local bytes (identical before and after)
all_reduce      V -> R           local bytes (identical before and after)
reduce_scatter  V -> D(i)        local bytes *before* the scatter (p x after)
slice           R -> D(i)        0 — local, free
value_chunk     R -> V           0 — local, free (one replica keeps the value, the others zeros)
==============  ===============  ==============================================================

One collective may also run over several axes ``(a1, a2, ...)`` at once, through the devices of
all of them (``p = p1 x p2``, priced on the slowest of their links): an all-reduce of partial
sums over those axes (``V(a1, a2) -> R``), a reduce-scatter of them onto one dim, or an
all-gather or all-to-all of the minor-most axes splitting one dim (``D(2:(a1,a2)) ->
D(0:(a1,a2))`` is one all-to-all over all their devices). That is what XLA emits for such a change,
one collective whose replica groups span the axes. The search still finds two all-reduces, or
reduce-scatter / all-reduce / all-gather, when those are cheaper (a fast axis inside a node, a
slow one across nodes).

"Local bytes" are the bytes of one device's block (``Layout.local_bytes``); partial sums keep the
block's full shape. Ordering constraint: a dim split by several axes ``(a1, a2)`` holds blocks
in ``a1``-major order, so only its minor-most axis can be gathered or moved by all-to-all, and a
new split axis always becomes the minor-most one. To drop a major axis the search first removes
the minor ones (it never re-orders axes inside a dim in place).

Partial sums are reduced before any data moves: out of a layout with partial axes the only
steps are reductions (all-reduce, reduce-scatter), local slices and ``value_chunk``. A partial
value has no sharding to constrain it to, so the lowering reduces it in its producer's output
constraint, at the first layout of the path without partial sums
(:func:`nnscaler_jax.lower.relayout.reduced_layout`); XLA gets there by reductions of the
producer's block (after slicing it), never by gathering or exchanging partial values.

The search is a Dijkstra shortest path over the graph of all valid layouts (built with networkx,
searched on its numbered nodes with networkx's order and tie rule); the graph is
built once per (shape, itemsize, mesh), one single-source search per source layout answers every
destination (a search only pays per source: a planner asks for thousands of pairs of few sources),
and every answer is memoised. Each edge weighs its time
plus :data:`HOP_PENALTY_S`, so among equally fast paths the one with fewer steps wins (it also
makes local steps cost "tiny" rather than 0); reported times exclude the penalty.

>>> from nnscaler_jax.mesh.topology import LinkCost, MeshSpec, all_reduce_time
>>> link = LinkCost(1e-5, 1e-10)
>>> mesh = MeshSpec(("model",), (4,), (link,))
>>> path = comm_path(Layout.of(2, partial=("model",)), Layout.replicated(2), (1024, 1024), 4, mesh)
>>> [s.kind for s in path.steps], path.time_s == all_reduce_time(link, 4, 4 * 1024 * 1024)
(['all_reduce'], True)
"""

from __future__ import annotations

import functools
import heapq
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import networkx as nx

from nnscaler_jax.errors import PlanError
from nnscaler_jax.layout.rvd import Layout
from nnscaler_jax.mesh.topology import CollectiveKind, MeshSpec, collective_time, wire_bytes

HOP_PENALTY_S = 1e-12
"""Extra search weight per step (seconds): prefers fewer steps among equally fast paths."""


@dataclass(frozen=True, slots=True)
class Collective:
    """One step of a :class:`CommPath`: a collective (or local op) over one mesh axis.

    Attributes:
        kind: the collective (``slice`` and ``value_chunk`` are local and free).
        axis: the mesh axis it runs over (a tuple of axes for a collective over several at once:
            in mesh order for a reduction, major to minor for an all-gather).
        bytes: the ``n`` of the cost formula (see the module docstring), per device.
        time_s: its alpha-beta time.
        src: the layout before the step.
        dst: the layout after the step.
        src_dim: tensor dim split by ``axis`` before the step (None unless it was ``D``).
        dst_dim: tensor dim split by ``axis`` after the step (None unless it is ``D``).
        wire_bytes: bytes each device sends (``(time_s - alpha) / beta``; 0 for local steps).
    """

    kind: CollectiveKind
    axis: str | tuple[str, ...]
    bytes: int
    time_s: float
    src: Layout
    dst: Layout
    src_dim: int | None = None
    dst_dim: int | None = None
    wire_bytes: float = 0.0

    def __str__(self) -> str:
        before = (
            "V"
            if self.kind in ("all_reduce", "reduce_scatter")
            else ("R" if self.src_dim is None else f"D{self.src_dim}")
        )
        after = (
            "V"
            if self.kind == "value_chunk"
            else ("R" if self.dst_dim is None else f"D{self.dst_dim}")
        )
        axis = ",".join(self.axis) if isinstance(self.axis, tuple) else self.axis
        return (
            f"{self.kind}[{axis}: {before}->{after}] {self.src} -> {self.dst} "
            f"(n={self.bytes} B, {self.time_s * 1e6:.3f} us)"
        )


@dataclass(frozen=True, slots=True)
class CommPath:
    """The cheapest collectives from one layout to another.

    Attributes:
        steps: the steps in order; ``steps[k].dst == steps[k + 1].src``. Empty if src == dst.
        time_s: total time (sum of the steps' times).
        bytes: sum of the steps' ``bytes`` (the cost-formula ``n``, per device).
    """

    steps: tuple[Collective, ...]
    time_s: float
    bytes: int

    @property
    def wire_bytes(self) -> float:
        """Bytes each device sends over the whole path."""
        return sum(s.wire_bytes for s in self.steps)

    @property
    def kinds(self) -> tuple[str, ...]:
        """The steps' kinds, in order."""
        return tuple(s.kind for s in self.steps)

    def __str__(self) -> str:
        if not self.steps:
            return "(no communication)"
        return "\n".join(str(s) for s in self.steps) + f"\ntotal {self.time_s * 1e6:.3f} us"


def _step(
    kind: CollectiveKind,
    axis: str | tuple[str, ...],
    src: Layout,
    dst: Layout,
    n: int,
    mesh: MeshSpec,
    src_dim: int | None,
    dst_dim: int | None,
) -> Collective:
    p = mesh.size(axis)
    return Collective(
        kind=kind,
        axis=axis,
        bytes=n,
        time_s=collective_time(kind, mesh.link(axis), p, n),
        src=src,
        dst=dst,
        src_dim=src_dim,
        dst_dim=dst_dim,
        wire_bytes=wire_bytes(kind, p, n),
    )


def _divisible(layout: Layout, dim: int, shape: tuple[int, ...], mesh: MeshSpec) -> bool:
    ways = 1
    for a in layout.dims[dim]:
        ways *= mesh.size(a)
    return shape[dim] % ways == 0


def _transitions(
    src: Layout, shape: tuple[int, ...], itemsize: int, mesh: MeshSpec
) -> Iterator[Collective]:
    """Every step out of ``src`` that lands on a layout valid for ``shape``: one axis changes,
    or partial sums over several axes are all-reduced at once."""
    local = src.local_bytes(shape, itemsize, mesh)
    yield from _group_transitions(src, shape, local, mesh)
    for axis in mesh.axis_names:
        p = mesh.size(axis)
        state = src.axis_state(axis)
        if state[0] == "D":
            i = state[1]
            if src.dims[i][-1] != axis or src.partial:
                continue  # not minor-most: gathering it would interleave blocks; partial sums
                # are reduced before their data moves (see the module docstring)
            yield _step(
                "all_gather", axis, src, src.replace_axis(axis, ("R",)), local * p, mesh, i, None
            )
            for j in range(src.ndim):
                dst = src.replace_axis(axis, ("D", j))
                if j != i and _divisible(dst, j, shape, mesh):
                    yield _step("all_to_all", axis, src, dst, local * p, mesh, i, j)
        elif state[0] == "V":
            yield _step(
                "all_reduce", axis, src, src.replace_axis(axis, ("R",)), local, mesh, None, None
            )
            for j in range(src.ndim):
                dst = src.replace_axis(axis, ("D", j))
                if _divisible(dst, j, shape, mesh):
                    yield _step("reduce_scatter", axis, src, dst, local, mesh, None, j)
        else:
            for j in range(src.ndim):
                dst = src.replace_axis(axis, ("D", j))
                if _divisible(dst, j, shape, mesh):
                    yield _step("slice", axis, src, dst, 0, mesh, None, j)
            yield _step(
                "value_chunk", axis, src, src.replace_axis(axis, ("V",)), 0, mesh, None, None
            )


def _group_transitions(
    src: Layout, shape: tuple[int, ...], local: int, mesh: MeshSpec
) -> Iterator[Collective]:
    """Collectives over several mesh axes at once (one ring through all their devices):
    all-reduce or reduce-scatter of partial sums over a set of axes, all-gather of the minor-most
    axes splitting one dim (their blocks are contiguous), or all-to-all of them onto another
    dim (where they become the minor-most axes, in the same order)."""
    partial = tuple(a for a in mesh.axis_names if a in src.partial and mesh.size(a) > 1)
    for k in range(2, len(partial) + 1):
        for group in itertools.combinations(partial, k):
            reduced = src
            for axis in group:
                reduced = reduced.replace_axis(axis, ("R",))
            yield _step("all_reduce", group, src, reduced, local, mesh, None, None)
            for j in range(src.ndim):
                dst = reduced
                for axis in group:
                    dst = dst.replace_axis(axis, ("D", j))
                if _divisible(dst, j, shape, mesh):
                    yield _step("reduce_scatter", group, src, dst, local, mesh, None, j)
    for i, axes in enumerate(src.dims):
        axes = tuple(a for a in axes if mesh.size(a) > 1) if len(axes) > 1 and \
            not src.partial else ()
        for k in range(2, len(axes) + 1):
            group = axes[-k:]
            dst = src
            for axis in group:
                dst = dst.replace_axis(axis, ("R",))
            yield _step("all_gather", group, src, dst, local * mesh.size(group), mesh, i, None)
            for j in range(src.ndim):
                moved = src
                for axis in group:
                    moved = moved.replace_axis(axis, ("D", j))
                if j != i and _divisible(moved, j, shape, mesh):
                    yield _step("all_to_all", group, src, moved, local * mesh.size(group), mesh,
                                i, j)


@functools.lru_cache(maxsize=256)
def _layout_graph(shape: tuple[int, ...], itemsize: int, mesh: MeshSpec) -> nx.DiGraph:
    """All layouts valid for ``shape`` on ``mesh`` (all reachable from replicated), as a graph."""
    graph = nx.DiGraph()
    start = Layout.replicated(len(shape))
    graph.add_node(start)
    # one object per layout: the adjacency then holds the nodes themselves, and Dijkstra's
    # dict lookups match by identity (an equal copy costs a Layout.__eq__ per probe)
    node = {start: start}
    frontier = [start]
    while frontier:
        src = frontier.pop()
        for step in _transitions(src, shape, itemsize, mesh):
            dst = node.get(step.dst)
            if dst is None:
                dst = node[step.dst] = step.dst
                graph.add_node(dst)
                frontier.append(dst)
            graph.add_edge(src, dst, step=step, weight=step.time_s + HOP_PENALTY_S)
    return graph


@dataclass(frozen=True)
class _Indexed:
    """A layout graph with its nodes numbered: ``succ[i]`` lists ``(j, weight, step)`` in the
    graph's adjacency order (the order networkx's Dijkstra relaxes them)."""

    index: dict[Layout, int]
    succ: tuple[tuple[tuple[int, float, Collective], ...], ...]


@functools.lru_cache(maxsize=256)
def _indexed(shape: tuple[int, ...], itemsize: int, mesh: MeshSpec) -> _Indexed:
    graph = _layout_graph(shape, itemsize, mesh)
    nodes = tuple(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    succ = tuple(tuple((index[v], e["weight"], e["step"]) for v, e in graph.adj[u].items())
                 for u in nodes)
    return _Indexed(index, succ)


@functools.lru_cache(maxsize=4096)
def _paths_from(
    src: Layout, shape: tuple[int, ...], itemsize: int, mesh: MeshSpec
) -> tuple[_Indexed, list[int], list[Collective | None]] | None:
    """The cheapest path from ``src`` to every layout reachable from it, as each layout's
    predecessor and the step into it (one single-source Dijkstra, None where ``src`` is not a
    layout of the graph). Each path is the one a search for that destination alone finds
    (``nx.dijkstra_path``: the search stops at the destination, after which nothing changes
    its path): this is networkx's Dijkstra on numbered nodes, with its order and its tie rule
    (a layout's path changes only for a strictly shorter one), ~4x faster than on the graph
    of layouts, which a planner runs thousands of times."""
    g = _indexed(shape, itemsize, mesh)
    s = g.index.get(src)
    if s is None:
        return None
    n = len(g.succ)
    done, seen = [False] * n, [float("inf")] * n
    pred, step = [-1] * n, [None] * n
    seen[s] = 0.0
    fringe, count = [(0.0, 0, s)], itertools.count(1)
    while fringe:
        d, _, v = heapq.heappop(fringe)
        if done[v]:
            continue
        done[v] = True
        for u, w, st in g.succ[v]:
            du = d + w
            if not done[u] and du < seen[u]:
                seen[u], pred[u], step[u] = du, v, st
                heapq.heappush(fringe, (du, next(count), u))
    return g, pred, step


@functools.lru_cache(maxsize=65536)
def _cached_path(
    src: Layout, dst: Layout, shape: tuple[int, ...], itemsize: int, mesh: MeshSpec
) -> CommPath:
    if src == dst:
        src.check(shape, mesh)
        return CommPath(steps=(), time_s=0.0, bytes=0)
    index = _indexed(shape, itemsize, mesh).index
    for lay in (src, dst):  # the graph's layouts are the valid ones; else say what is wrong
        if lay not in index:
            lay.check(shape, mesh)
    found = _paths_from(src, shape, itemsize, mesh)
    j = None if found is None else found[0].index.get(dst)  # (the graph its search ran on)
    if j is None or found[1][j] < 0:
        raise PlanError(
            f"no sequence of collectives turns layout {src} into {dst} for tensor shape {shape} on "
            f"mesh axes {mesh.axis_names} (sizes {mesh.axis_sizes}); this is a bug, please report"
        )
    _, pred, step = found
    steps = []
    while pred[j] >= 0:
        steps.append(step[j])
        j = pred[j]
    steps = tuple(reversed(steps))
    return CommPath(
        steps=steps, time_s=sum(s.time_s for s in steps), bytes=sum(s.bytes for s in steps)
    )


def comm_path(
    src: Layout, dst: Layout, shape: Sequence[int], itemsize: int, mesh: MeshSpec
) -> CommPath:
    """The cheapest collectives (alpha-beta time) turning layout ``src`` into ``dst``.

    Args:
        src: the producer's layout.
        dst: the consumer's layout.
        shape: the tensor's global shape.
        itemsize: bytes per element.
        mesh: the abstract mesh with one link cost per axis.

    Returns:
        The :class:`CommPath` (empty when ``src == dst``). Memoised.

    Raises:
        PlanError: a layout is invalid for ``shape`` / ``mesh``, or ``itemsize`` is not positive.
    """
    shape = tuple(int(s) for s in shape)
    if int(itemsize) <= 0:
        raise PlanError(f"comm_path: itemsize must be a positive number of bytes, got {itemsize}")
    return _cached_path(src, dst, shape, int(itemsize), mesh)


def comm_time(
    src: Layout, dst: Layout, shape: Sequence[int], itemsize: int, mesh: MeshSpec
) -> float:
    """Time in seconds of :func:`comm_path` ``(src, dst, shape, itemsize, mesh)``."""
    return comm_path(src, dst, shape, itemsize, mesh).time_s
