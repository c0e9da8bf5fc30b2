"""The fuzzer's meshes and plans (``scripts/fuzz_plans.py``): a seeded random mesh over 8 CPU
devices (1-D, 2-D or 3-D, names from data / model / fsdp / ..., Auto or Explicit axis types)
and a plan: a built-in policy or a random policy written with ``op_trans`` / ``op_assign`` /
``op_order`` (dim splits, 2-D and same-dim multi-axis splits, value-split chains, replicas,
co-sharding, orders), kept as the actions it took so that a finding replays and shrinks."""

from __future__ import annotations

import itertools
import random
from typing import Any

import jax
import numpy as np
from fuzz_models import pick
from jax.sharding import AxisType

from nnscaler_jax import op_assign, op_order, op_trans
from nnscaler_jax.ir.anno import DimKind
from nnscaler_jax.ir.graph import Role
from nnscaler_jax.plan.plan import Plan
from nnscaler_jax.rules.linear import VALUE_SPLIT_LINEAR

BUILTINS = ("dp", "zero3", "megatron", "auto", "alpa")
# ops a co-sharded chunk cannot run locally (lower/local.py) and region ops
_NO_CHUNKS = {"dynamic_slice", "slice", "pad", "gather", "scatter", "scatter-add",
              "concatenate", "dynamic_update_slice", "rng_bit_generator", "random_bits",
              "scan", "while", "cond", "iota"}


# ---------------------------------------------------------------------------------- meshes


_MESH_SHAPES = ((8,), (2, 4), (4, 2), (2, 2, 2))
_NAME_SETS = {
    1: (("data",), ("model",), ("fsdp",), ("tp",), ("seq",)),
    2: (("data", "model"), ("data", "model"), ("model", "data"), ("dp", "tp"),
        ("fsdp", "model"), ("data", "seq"), ("batch", "expert")),
    3: (("data", "fsdp", "model"), ("data", "model", "seq"), ("dp", "tp", "mp"),
        ("model", "data", "fsdp")),
}


def gen_mesh(rng: random.Random) -> dict:
    shape = pick(rng, _MESH_SHAPES)
    names = pick(rng, _NAME_SETS[len(shape)])
    explicit = rng.random() < 0.5
    return {"shape": list(shape), "names": list(names),
            "types": "explicit" if explicit else "auto",
            "typed_inputs": explicit and rng.random() < 0.5}


def build_mesh(desc: dict) -> jax.sharding.Mesh:
    kind = AxisType.Explicit if desc["types"] == "explicit" else AxisType.Auto
    n = int(np.prod(desc["shape"]))
    return jax.make_mesh(tuple(desc["shape"]), tuple(desc["names"]),
                         axis_types=(kind,) * len(desc["shape"]), devices=jax.devices()[:n])


# ---------------------------------------------------------------------------------- plans


def gen_plan(rng: random.Random) -> dict:
    """A built-in policy (40%) or a random policy written with the primitives (60%)."""
    if rng.random() < 0.4:
        return {"kind": "builtin", "name": pick(rng, BUILTINS)}
    return {"kind": "random", "seed": rng.randrange(2 ** 31), "touch": pick(rng, (0.3, 0.6, 0.9)),
            "via_json": rng.random() < 0.2}


def _axis_options(op: Any, axes: dict[str, int], done: dict[str, int] | None = None,
                  used: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """(dim, axis) pairs ``op`` can split: splittable dims an unused axis divides (``done``:
    ways each dim is already split)."""
    sizes = op.dim_sizes()
    done = done or {}
    out = []
    for dim in op.annotation.splittable():
        for a, n in axes.items():
            if a not in used and n > 1 and sizes[dim] % (n * done.get(dim, 1)) == 0:
                out.append((dim, a))
    return out


def random_actions(graph: Any, desc: dict) -> list[dict]:
    """Seeded random decisions for the ops of ``graph`` (a ``Draft``), as actions
    (:func:`apply_action`): each touched op gets a dim split (one or two levels), a replica, a
    co-sharding or a value-split chain; a few ``op_order`` pairs along program order; some
    variables a storage split (``Draft.store_variable``)."""
    rng = random.Random(desc["seed"])
    axes = graph.mesh_axes
    actions: list[dict] = []
    decided: set[int] = set()
    for op in graph.walk():
        if op.id in decided or not op.annotated or rng.random() > desc["touch"]:
            continue
        decided.add(op.id)
        kind = pick(rng, ("split", "split2", "replicate", "coshard", "value", "value")
                     if op.primitive == "dot_general" else
                     ("split", "split", "split2", "replicate", "coshard"))
        if kind == "replicate":
            actions.append({"op": op.id, "do": "replicate", "axis": pick(rng, list(axes))})
            continue
        act = _coshard(op, axes, rng) if kind == "coshard" else None
        act = act or (_value_chain(graph, op, axes, rng, decided) if kind == "value" else None)
        act = act or _dim_split(op, axes, rng, levels=2 if kind == "split2" else 1)
        actions += act if isinstance(act, list) else [act] if act else []
    for _ in range(rng.randrange(3)):  # a few orders along program order
        if len(graph.ops) > 1:
            i, j = sorted(rng.sample(range(len(graph.ops)), 2))
            actions.append({"do": "order", "a": graph.ops[i].id, "b": graph.ops[j].id})
    for t in graph.graph.variables:  # some variables stored split (read through a relayout)
        options = [(i, a) for i, n in enumerate(t.shape) for a, m in axes.items() if n % m == 0]
        if options and rng.random() < 0.15:
            i, a = pick(rng, options)
            actions.append({"do": "store", "var": t.name,
                            "spec": [a if k == i else None for k in range(t.ndim)]})
    return actions


def _dim_split(op: Any, axes: dict[str, int], rng: random.Random, levels: int) -> dict | None:
    """(dim, axis), then possibly (the same or another dim, another axis)."""
    options = _axis_options(op, axes)
    if not options:
        return None
    steps = [pick(rng, options)]
    if levels > 1:
        dim, axis = steps[0]
        more = _axis_options(op, axes, {dim: axes[axis]}, (axis,))
        if more:
            steps.append(pick(rng, more))
    return {"op": op.id, "do": "split", "steps": [list(x) for x in steps]}


def _coshard(op: Any, axes: dict[str, int], rng: random.Random) -> dict | None:
    """More sub-ops than devices: k chunks per device (ops that can run in chunks only)."""
    if op.primitive in _NO_CHUNKS or op.regions:
        return None
    sizes = op.dim_sizes()
    options = [(dim, a, k) for dim, a in _axis_options(op, axes) for k in (2, 4)
               if sizes[dim] % (k * axes[a]) == 0]
    if not options:
        return None
    dim, axis, k = pick(rng, options)
    return {"op": op.id, "do": "coshard", "dim": dim, "axis": axis, "k": k}


def _reduce_split(op: Any, axes: dict[str, int], rng: random.Random,
                  axis: str | None = None) -> dict | None:
    """A split of a contracted (``+``, in no output) dim of ``op`` (over ``axis`` if given)."""
    anno = op.annotation
    out_names = {n for o in anno.outputs for n in o.names()}
    reduce = {d for d, k in anno.kinds().items() if k is DimKind.REDUCE and d not in out_names}
    options = [(d, a) for d, a in _axis_options(op, axes) if d in reduce
               and (axis is None or a == axis)]
    if not options:
        return None
    dim, a = pick(rng, options)
    return {"op": op.id, "do": "split", "steps": [[dim, a]]}


def _value_chain(graph: Any, op: Any, axes: dict[str, int], rng: random.Random,
                 decided: set[int]) -> list[dict] | None:
    """A contraction split along a reduce dim, then a chain of linear readers value-split over
    the same axis (partial sums kept through them); an ``add`` / ``sub`` of two contractions
    splits the other one's reduce dim over that axis too."""
    first = _reduce_split(op, axes, rng)
    body = _graph_of(graph.graph, op.id)
    if first is None or body is None:
        return None
    axis = first["steps"][0][1]
    out, cur = [first], op
    for _ in range(rng.randint(1, 3)):
        nxt = _linear_reader(body, cur, out, axes, rng, axis, decided)
        if nxt is None:
            break
        out.append({"op": nxt.id, "do": "value", "axis": axis})
        decided.add(nxt.id)
        cur = nxt
    return out


def _graph_of(graph: Any, op_id: int) -> Any:
    """The graph (top level or a region body) whose ops include ``op_id``."""
    if any(op.id == op_id for op in graph.ops):
        return graph
    for op in graph.ops:
        for region in op.regions:
            found = _graph_of(region, op_id)
            if found is not None:
                return found
    return None


def _linear_reader(graph: Any, cur: Any, out: list[dict], axes: dict[str, int],
                   rng: random.Random, axis: str, decided: set[int]) -> Any:
    """The sole reader of ``cur``'s output if it is linear in it (its other operands constants,
    or for ``add`` / ``sub`` a contraction whose reduce split over ``axis`` is appended to
    ``out``); None otherwise."""
    if len(cur.outputs) != 1 or cur.outputs[0].id in {t.id for t in graph.outputs}:
        return None
    readers = graph.consumers.get(cur.outputs[0].id, ())
    if len(readers) != 1 or not readers[0].annotated:
        return None
    nxt = readers[0]
    kind = VALUE_SPLIT_LINEAR.get(nxt.primitive)
    pos = [i for i, t in enumerate(nxt.inputs) if t.id == cur.outputs[0].id]
    others = [t for i, t in enumerate(nxt.inputs) if i not in pos and t.role is not Role.CONST]
    if kind is None or len(pos) != 1 or (kind == "first" and pos != [0]):
        return None
    if kind == "all" and others:
        prod = graph.producer.get(others[0].id) if len(others) == 1 else None
        if prod is None or prod.id in decided or nxt.primitive not in ("add", "sub") or \
                len(graph.consumers.get(others[0].id, ())) != 1:
            return None
        split = _reduce_split(prod, axes, rng, axis)
        if split is None:
            return None
        out.append(split)
        decided.add(prod.id)
    return nxt


def apply_action(graph: Any, act: dict) -> None:
    """One decision with the primitives (what :func:`random_actions` wrote)."""
    axes = graph.mesh_axes
    if act["do"] == "order":
        op_order(graph, graph.graph.op(act["a"]), graph.graph.op(act["b"]))
        return
    if act["do"] == "store":
        graph.store_variable(act["var"], act["spec"])
        return
    op = graph.graph.op(act["op"])
    if act["do"] == "replicate":
        op_assign(graph, op_trans(graph, op, "replicate", axes[act["axis"]]), act["axis"])
    elif act["do"] == "value":
        op_assign(graph, op_trans(graph, op, "value", axes[act["axis"]]), act["axis"])
    elif act["do"] == "coshard":
        subs = op_trans(graph, op, act["dim"], act["k"] * axes[act["axis"]])
        op_assign(graph, subs, act["axis"])
        for a, b in itertools.pairwise(subs):
            op_order(graph, a, b)
    else:
        subs: list[Any] = [op]
        for dim, axis in act["steps"]:
            new = []
            for sub in subs:
                pieces = op_trans(graph, sub, dim, axes[axis])
                op_assign(graph, pieces, axis)
                new += pieces
            subs = new


class FuzzPolicy:
    """A policy written with the primitives: seeded random actions (``{"kind": "random"}``) or
    given ones (``{"kind": "actions", "actions": [...]}``); ``actions`` keeps what it did."""

    def __init__(self, desc: dict):
        self.desc = desc
        self.actions: list[dict] = []

    def __call__(self, graph: Any, mesh: Any) -> Plan:
        if self.desc["kind"] == "actions":
            self.actions = list(self.desc["actions"])
        else:
            self.actions = random_actions(graph, self.desc)
        for act in self.actions:
            apply_action(graph, act)
        graph.policy = "fuzz"
        return graph.finish()


def make_policy(desc: dict) -> Any:
    return desc["name"] if desc["kind"] == "builtin" else FuzzPolicy(desc)
