#!/usr/bin/env python
"""Fuzz plans: random small Flax models x random meshes x random plans, each checked against the
single-device program (forward outputs and gradients w.r.t. the params).

    python scripts/fuzz_plans.py --cases 500 --seed 0 [--json] [--out results/fuzz.json]
    python scripts/fuzz_plans.py --seed 0 --cases 500 --only 13 --shrink   # one case, reduced
    python scripts/fuzz_plans.py --case reproducer.json                     # replay a finding

A case is a model description (a chain of blocks: dense / matmul, attention (scores, softmax,
weighted sum), convolutions (grouped too), layer norm, reshape / transpose, ``nn.scan`` stacks
and RNNs, ``lax.cond`` / ``fori_loop``; dims from {2, 4, 8, 16}), a mesh over 8 CPU devices
(1-D, 2-D or 3-D, axis names from data / model / fsdp / ..., Auto or Explicit axis types,
inputs plain or typed) and a plan: a built-in policy (``dp``, ``zero3``, ``megatron``, ``auto``,
``alpa``) or a random policy written with ``op_trans`` / ``op_assign`` / ``op_order`` (dim
splits, 2-D and same-dim multi-axis splits, value-split chains (partial sums), replicas,
co-sharding, orders, variable storage), sometimes reused through ``plan.to_json()``. Everything
derives from ``--seed``: the same seed gives the same cases, plans and numbers.

Each case runs through the public API: ``auto_parallel(mesh, policy=...)(module)``, ``pm.init``,
``pm.apply`` and ``jax.grad`` of a loss over ``pm.apply``. Outcomes:

- ``ok``: forward outputs, init values and gradients equal the single-device program's within
  float32 ``|a - b| <= ATOL * scale + RTOL |b|`` elementwise (fixed: RTOL 1e-5, ATOL 1e-6;
  ``scale``: the largest magnitude in the compared tree, at least 1);
- ``rejected``: a ``PlanError`` for a plan the generator made that the library refuses;
- ``mismatch``: a numeric difference; ``error``: any other exception (or the process dying: cases
  run in worker processes unless ``--in-process``). Both print a reproducer (the case, a random
  plan as the actions it took, the plan JSON); ``--shrink`` drops the actions that do not
  matter.

Cases whose programs make XLA fall back to "Involuntary full rematerialization" (a relayout it
can only do by gathering the tensor: slow, not wrong) are listed as ``full_remat_cases``.
``--json`` prints ``{"cases", "mismatches", "errors", "rejected", "seconds"}`` as the last line.
"""

from __future__ import annotations

import os

from nnscaler_jax.mesh.cpu import COUNT_FLAG, cpu_xla_flags  # starts no JAX backend

_flags = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = cpu_xla_flags(_flags, None if COUNT_FLAG in _flags else 8)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import itertools
import json
import random
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fuzz_models import build_model, gen_model, pick

from nnscaler_jax import PlanError, auto_parallel, op_assign, op_order, op_trans
from nnscaler_jax.ir.anno import DimKind
from nnscaler_jax.ir.graph import Role
from nnscaler_jax.lower.hlo import xla_stderr
from nnscaler_jax.plan.plan import Plan
from nnscaler_jax.rules.linear import VALUE_SPLIT_LINEAR

RTOL = 1e-5
ATOL = 1e-6
BUILTINS = ("dp", "zero3", "megatron", "auto", "alpa")
STATUSES = ("ok", "rejected", "mismatch", "error")
FALLBACK = "Involuntary full rematerialization"  # XLA: a relayout it could only do by gathering
PLANS_PER_MODEL = 3  # cases sharing one model (and its single-device reference)
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


# ---------------------------------------------------------------------------------- cases


def gen_cases(n: int, seed: int, max_blocks: int = 4,
              per_model: int = PLANS_PER_MODEL) -> list[dict]:
    """``n`` case descriptions from ``seed`` (deterministic); ``per_model`` consecutive cases
    share one model (of 1 to ``max_blocks`` blocks). Every case checks the outputs and gradients of a jitted
    ``jax.grad`` through ``pm.apply``; ``checks`` adds ``pm.init``'s variables and an eager
    ``pm.apply`` (each a compile of its own, so in some cases only)."""
    rng = random.Random(seed)
    cases, model = [], None
    for i in range(n):
        if i % per_model == 0:
            model = gen_model(rng, max_blocks)
            model_seed = rng.randrange(2 ** 31)
        cases.append({"index": i, "model": model, "model_seed": model_seed,
                      "mesh": gen_mesh(rng), "plan": gen_plan(rng),
                      "checks": {"init": rng.random() < 0.3, "eager": rng.random() < 0.3}})
    return cases


def _close(a: Any, b: Any) -> tuple[bool, str]:
    """Whether every element of ``a`` is within ``ATOL * scale + RTOL |b|`` of ``b``'s, where
    ``scale`` is the largest ``|b|`` of the whole tree (at least 1): values are O(1) up to the
    tree's scale, and a value that is zero in theory (an attention key bias's gradient: softmax
    cancels it) is rounding noise of that scale. Returns (close, where not)."""
    la = jax.tree_util.tree_flatten_with_path(a)[0]
    lb = [np.asarray(y, np.float64) for y in jax.tree_util.tree_leaves(b)]
    if len(la) != len(lb):
        return False, f"{len(la)} leaves vs {len(lb)}"
    scale = max([1.0] + [float(np.max(np.abs(y))) for y in lb if y.size])
    for (path, x), y in zip(la, lb, strict=True):
        x = np.asarray(x, np.float64)
        if x.shape != y.shape:
            return False, f"{jax.tree_util.keystr(path)}: shape {x.shape} vs {y.shape}"
        err = np.abs(x - y) - (ATOL * scale + RTOL * np.abs(y))
        if np.any(err > 0):
            k = int(np.argmax(err))
            return False, (f"{jax.tree_util.keystr(path)}: |{x.flat[k]:.8g} - {y.flat[k]:.8g}| "
                           f"= {abs(x.flat[k] - y.flat[k]):.3g} (tree scale {scale:.3g})")
    return True, ""


class Reference:
    """Single-device results per model, computed once per model (cases share models)."""

    def __init__(self) -> None:
        self._cache: dict[str, tuple] = {}

    def get(self, case: dict) -> tuple:
        key = json.dumps([case["model"], case["model_seed"]], sort_keys=True)
        if key not in self._cache:
            self._cache.clear()
            self._cache[key] = _reference(case)
        return self._cache[key]


def _inputs(case: dict) -> tuple[Any, np.ndarray]:
    """(module, example input) of a case's model."""
    rng = np.random.default_rng(case["model_seed"] + 1)
    return build_model(case["model"]), \
        rng.standard_normal(case["model"]["input"]).astype(np.float32)


def _loss_fn(apply: Callable, x: Any, cts: Any) -> Callable:
    def loss(params, rest):
        out = apply({"params": params, **rest}, x)
        val = sum(jnp.sum(o * c) for o, c in zip(jax.tree_util.tree_leaves(out), cts,
                                                    strict=True))
        return val, out
    return loss


def _reference(case: dict) -> tuple:
    """The single-device results of a case's model: (variables, outputs, output cotangents,
    gradients). The variables are drawn with numpy in the shapes ``module.init`` gives (an
    init program compiles slower than the model; ``pm.init`` is checked against
    ``module.init`` on its own); outputs and gradients come from one jitted ``jax.grad``
    (the outputs as its aux)."""
    module, x = _inputs(case)
    rng = np.random.default_rng(case["model_seed"])
    shapes = jax.eval_shape(module.init, jax.random.key(0), x)
    variables = jax.tree_util.tree_map(lambda s: _draw(rng, s.shape), shapes)
    out_shapes = jax.tree_util.tree_leaves(jax.eval_shape(module.apply, variables, x))
    cts = [rng.standard_normal(o.shape).astype(np.float32) for o in out_shapes]
    with jax.default_device(jax.devices()[0]):
        rest = {k: v for k, v in variables.items() if k != "params"}
        grad = jax.jit(jax.grad(_loss_fn(module.apply, x, cts), has_aux=True))
        grads, out = grad(variables["params"], rest)
    return variables, jax.device_get(out), cts, jax.device_get(grads)


def _draw(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """A weight (``1 / sqrt(fan in)`` normal: activations stay O(1)) or a vector (biases,
    scales)."""
    scale = 0.5 if len(shape) < 2 else float(np.prod(shape[:-1])) ** -0.5
    return (scale * rng.standard_normal(shape)).astype(np.float32)


def _typed(x: np.ndarray, mesh: Any, desc: dict) -> Any:
    """The input as the caller passes it: plain, or typed with an Explicit sharding."""
    if not desc["typed_inputs"]:
        return x
    first = desc["names"][0]
    spec = P(first) if x.shape[0] % desc["shape"][0] == 0 else P()
    return jax.device_put(x, NamedSharding(mesh, spec))


def _wrap(case: dict, module: Any, mesh: Any, x: Any) -> tuple[Any, Any]:
    """The wrapper and the policy object (a ``RandomPolicy`` records its actions); ``via_json``:
    planned first (on the untyped input), then reused from the plan's JSON."""
    policy = make_policy(case["plan"])
    if case["plan"].get("via_json"):
        plan = auto_parallel(mesh, policy=policy)(module).make_plan(np.asarray(x))
        return auto_parallel(mesh, plan=Plan.from_json(plan.to_json()))(module), policy
    return auto_parallel(mesh, policy=policy)(module), policy


def run_case(case: dict, ref: Reference) -> dict:
    """Run one case; returns ``{"status": ok|rejected|mismatch|error, "detail", ...}``."""
    module, x_np = _inputs(case)
    mesh = build_mesh(case["mesh"])
    x = _typed(x_np, mesh, case["mesh"])
    pm, policy = None, None
    try:
        expected = ref.get(case)
        pm, policy = _wrap(case, module, mesh, x)
        where = _compare(case, pm, x, expected)
        status, detail = ("ok", "") if where is None else ("mismatch", where)
    except PlanError as e:
        status, detail = "rejected", f"{type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001 - an internal error is a finding
        status = "error"
        detail = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-6)}"
    result = {"status": status, "detail": detail}
    if status in ("mismatch", "error"):
        result["reproducer"] = reproducer(case, pm, policy)
    return result


def _compare(case: dict, pm: Any, x: Any, expected: tuple) -> str | None:
    """Where the wrapped module's results differ from ``expected`` (None: nowhere): the
    variables of ``pm.init`` (some cases), an eager ``pm.apply`` (some cases), and the outputs
    and parameter gradients of a jitted ``jax.grad`` through ``pm.apply``."""
    variables, out_ref, cts, grads_ref = expected
    checks = case.get("checks", {"init": True, "eager": True})
    pvars = variables
    if checks["init"]:
        key = jax.random.key(case["model_seed"])
        with jax.default_device(jax.devices()[0]):
            want = jax.jit(pm.module.init)(key, np.asarray(x))
        ok, where = _close(pm.init(key, x), want)
        if not ok:
            return f"init: {where}"
    if checks["eager"]:
        ok, where = _close(pm.apply(pvars, x), out_ref)
        if not ok:
            return f"forward (pm.apply): {where}"
    rest = {k: v for k, v in pvars.items() if k != "params"}
    grads, out = jax.jit(jax.grad(_loss_fn(pm.apply, x, cts), has_aux=True))(
        pvars["params"], rest)
    ok, where = _close(out, out_ref)
    if not ok:
        return f"forward (under jax.grad): {where}"
    ok, where = _close(grads, grads_ref)
    return None if ok else f"gradients: {where}"


def reproducer(case: dict, pm: Any, policy: Any) -> dict:
    """What reproduces a case: its description (a random plan as the actions it took, so
    ``--case`` replays it), and the plan JSON (``plan.to_json()``)."""
    plan = None
    try:
        plan = json.loads(pm.plan.to_json()) if pm is not None else None
    except PlanError:
        pass
    case = dict(case)
    if isinstance(policy, FuzzPolicy) and case["plan"]["kind"] == "random":
        case["plan"] = {"kind": "actions", "actions": policy.actions,
                        "via_json": case["plan"]["via_json"], "from": case["plan"]}
    return {"case": case, "plan": plan}


def shrink(case: dict, status: str) -> dict:
    """A smaller case with the same outcome ``status``: actions of a replayed plan dropped one
    at a time while the outcome stays (greedy delta debugging)."""
    if case["plan"]["kind"] != "actions":
        return case
    actions = list(case["plan"]["actions"])
    i = 0
    while i < len(actions):
        trial = {**case, "plan": {**case["plan"], "actions": actions[:i] + actions[i + 1:]}}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = run_case(trial, Reference())
        if res["status"] == status:
            actions = trial["plan"]["actions"]
        else:
            i += 1
    return {**case, "plan": {**case["plan"], "actions": actions}}


# ---------------------------------------------------------------------------------- main


def run_cases(cases: list[dict], *, budget_s: float | None = None,
              log: Callable[[str], None] | None = None) -> Iterator[tuple[dict, dict]]:
    """Run ``cases`` in turn (no new one after ``budget_s`` seconds); yields (case, result)."""
    start = time.perf_counter()
    ref = Reference()
    for case in cases:
        if budget_s is not None and time.perf_counter() - start > budget_s:
            return
        t0 = time.perf_counter()
        with warnings.catch_warnings(), xla_stderr() as err:
            warnings.simplefilter("ignore")
            res = run_case(case, ref)
        res["full_remat"] = err[0].count(FALLBACK)
        if log:
            first = res["detail"].splitlines()[0][:160] if res["detail"] else ""
            remat = f" [{res['full_remat']} full remat]" if res["full_remat"] else ""
            log(f"case {case['index']:4d} {res['status']:9s} {time.perf_counter() - t0:5.1f}s "
                f"{_case_line(case)}{remat} {first}")
        yield case, res


def summarize(results: list[tuple[int, dict]], seconds: float, seed: int) -> dict:
    """The summary of (case index, result) pairs, with the findings and the rejections."""
    count = {s: sum(r["status"] == s for _, r in results) for s in STATUSES}
    return {"cases": len(results), "mismatches": count["mismatch"], "errors": count["error"],
            "rejected": count["rejected"], "seconds": round(seconds, 1), "seed": seed,
            "full_remat_cases": sorted(i for i, r in results if r.get("full_remat")),
            "findings": [{"index": i, **r} for i, r in results
                         if r["status"] in ("mismatch", "error")],
            "rejections": [{"index": i, "detail": r["detail"][:300]} for i, r in results
                           if r["status"] == "rejected"]}


def fuzz(n: int, seed: int, *, log: Callable[[str], None] | None = None,
         budget_s: float | None = None, only: list[int] | None = None,
         cases: list[dict] | None = None, **gen: Any) -> dict:
    """Run ``n`` cases from ``seed`` in this process (``only``: these indices; ``cases``: these
    case descriptions instead; no new case after ``budget_s`` seconds; ``gen``: options of
    :func:`gen_cases`); returns the summary."""
    start = time.perf_counter()
    if cases is None:
        cases = [c for c in gen_cases(n, seed, **gen) if only is None or c["index"] in only]
    results = [(c["index"], r) for c, r in run_cases(cases, budget_s=budget_s, log=log)]
    return summarize(results, time.perf_counter() - start, seed)


def fuzz_isolated(n: int, seed: int, *, budget_s: float | None = None,
                  only: list[int] | None = None, quiet: bool = False) -> dict:
    """:func:`fuzz` in worker processes: a case that kills its process (an XLA abort) is an
    ``error`` and the next worker goes on after it."""
    start = time.perf_counter()
    todo = [c["index"] for c in gen_cases(n, seed) if only is None or c["index"] in only]
    results: list[tuple[int, dict]] = []
    while todo:
        left = None if budget_s is None else budget_s - (time.perf_counter() - start)
        if left is not None and left <= 0:
            break
        with tempfile.NamedTemporaryFile("r", suffix=".jsonl") as sink:
            cmd = [sys.executable, __file__, "--worker", sink.name, "--cases", str(n),
                   "--seed", str(seed), "--only", *map(str, todo)]
            cmd += (["--budget-s", str(left)] if left is not None else []) + \
                (["--quiet"] if quiet else [])
            rc = subprocess.run(cmd, check=False).returncode
            got = [json.loads(line) for line in sink.read().splitlines() if line.strip()]
        results += [(g["index"], g["result"]) for g in got]
        done = {g["index"] for g in got}
        todo = [i for i in todo if i not in done]
        if rc == 0 or not todo:
            break
        crashed = todo.pop(0)
        case = gen_cases(crashed + 1, seed)[crashed]
        results.append((crashed, {"status": "error", "detail": f"the process died (exit "
                                  f"{rc}) running this case", "reproducer": {"case": case}}))
        print(f"case {crashed:4d} error     (process died, exit {rc}) {_case_line(case)}",
              flush=True)
    return summarize(results, time.perf_counter() - start, seed)


def _worker(path: str, n: int, seed: int, only: list[int], budget_s: float | None,
            quiet: bool) -> int:
    cases = [c for c in gen_cases(n, seed) if c["index"] in set(only)]
    log = None if quiet else (lambda s: print(s, flush=True))
    with open(path, "a", encoding="utf-8") as sink:
        for case, res in run_cases(cases, budget_s=budget_s, log=log):
            sink.write(json.dumps({"index": case["index"], "result": res}) + "\n")
            sink.flush()
    return 0


def _case_line(case: dict) -> str:
    blocks = "+".join(b["kind"] for b in case["model"]["blocks"])
    mesh = "x".join(map(str, case["mesh"]["shape"])) + "(" + ",".join(case["mesh"]["names"]) \
        + f" {case['mesh']['types'][:3]})"
    plan = case["plan"].get("name") or (f"random/{case['plan']['seed']}" if "seed" in
                                        case["plan"] else f"{len(case['plan']['actions'])} "
                                        "actions")
    return f"[{blocks}|{case['model']['head']}] {mesh} {plan}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print the summary JSON last")
    ap.add_argument("--out", help="also write the summary (with findings) to this file")
    ap.add_argument("--budget-s", type=float, help="start no case after this many seconds")
    ap.add_argument("-q", "--quiet", action="store_true", help="no per-case lines")
    ap.add_argument("--only", type=int, nargs="*", help="run only these case indices")
    ap.add_argument("--case", help="run the case of a reproducer (its JSON, or a file)")
    ap.add_argument("--shrink", action="store_true",
                    help="shrink the findings' plans to the actions that matter")
    ap.add_argument("--in-process", action="store_true",
                    help="no worker processes (an XLA abort ends the run)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    log = None if args.quiet else (lambda s: print(s, flush=True))
    if args.worker:
        return _worker(args.worker, args.cases, args.seed, args.only or [], args.budget_s,
                       args.quiet)
    if args.case:
        text = args.case
        if os.path.exists(args.case):
            with open(args.case, encoding="utf-8") as fh:
                text = fh.read()
        case = json.loads(text)
        summary = fuzz(0, args.seed, cases=[case.get("case", case)], log=log)
    elif args.in_process:
        summary = fuzz(args.cases, args.seed, budget_s=args.budget_s, only=args.only, log=log)
    else:
        summary = fuzz_isolated(args.cases, args.seed, budget_s=args.budget_s, only=args.only,
                                quiet=args.quiet)
    _report(summary, args.shrink)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump(summary, fh, indent=1, sort_keys=True)
    head = {k: summary[k] for k in ("cases", "mismatches", "errors", "rejected", "seconds")}
    print(json.dumps(head) if args.json else head)
    return 1 if summary["mismatches"] or summary["errors"] else 0


def _report(summary: dict, shrink_them: bool) -> None:
    """Print every finding's reproducer (and, asked, a shrunk one)."""
    for f in summary["findings"]:
        print(f"\n=== {f['status']} in case {f['index']}: {f['detail']}")
        print("reproducer:", json.dumps(f["reproducer"], sort_keys=True))
        if shrink_them and "plan" in f["reproducer"]["case"] and \
                f["reproducer"]["case"]["plan"]["kind"] == "actions":
            f["shrunk"] = shrink(f["reproducer"]["case"], f["status"])
            print("shrunk:", json.dumps(f["shrunk"], sort_keys=True))


if __name__ == "__main__":
    sys.exit(main())
