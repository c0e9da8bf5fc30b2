#!/usr/bin/env python
"""Fuzz plans: random small Flax models x random meshes x random plans, each checked against the
single-device program (forward outputs and gradients w.r.t. the params).

    python scripts/fuzz_plans.py --cases 500 --seed 0 [--json] [--out results/fuzz.json]
    python scripts/fuzz_plans.py --seed 0 --cases 500 --only 13 --shrink   # one case, reduced
    python scripts/fuzz_plans.py --case reproducer.json                     # replay a finding
    python scripts/fuzz_plans.py --cases 334 --seed 7 8 9 --out results/fuzz.json  # 3 seeds
    python scripts/fuzz_plans.py --cases 100 --seed 7 --break psum   # the oracle must fail

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

- ``ok``: every forward output and parameter gradient passes the float64 oracle (below), and
  ``pm.init``'s values equal ``module.init``'s within float32 ``|a - b| <= ATOL * scale + RTOL
  |b|`` (RTOL 1e-5, ATOL 1e-6, ``scale``: the tree's largest magnitude, at least 1: an init
  draws every element from the same random bits, no reordered sums);
- ``rejected``: a ``PlanError`` for a plan the generator made that the library refuses;
- ``mismatch``: a numeric difference; ``error``: any other exception (or the process dying: cases
  run in worker processes unless ``--in-process``). Both print a reproducer (the case, a random
  plan as the actions it took, the plan JSON); ``--shrink`` drops the actions that do not
  matter.

The oracle. Each model's single-device program runs twice: in float32 (``plain``, what a user
runs) and in float64 (``ref64``: the same params, inputs and cotangents, cast exactly, under
``jax.enable_x64``). Per output / gradient leaf, ``err_planned = max |planned - ref64|`` and
``err_plain = max |plain - ref64|``; a leaf mismatches iff

    err_planned > RATIO * err_plain + FLOOR_ULPS * eps32 * max |ref64 tree|

(``tree``: all the outputs, or all the gradients, the leaf is one of). A planned program sums
in another order (pieces per device, then an all-reduce; chunks in a loop), so its rounding
differs from the plain program's by a small factor, not by orders of magnitude: RATIO = 16
leaves room for that (the largest ratio over 1,000 passing cases is in results/fuzz.json),
while a real error (a dropped partial sum, a wrong slice) is O(1) of the leaf. A leaf whose
float32 result is far from float64 (an ill-conditioned one) thus allows the planned program
as much, and any error larger than 16x float32's own counts. The floor (FLOOR_ULPS = 64 units
of float32 eps of the tree's largest magnitude: 7.6e-6 of it) covers a leaf the plain program
computes exactly by chance (``err_plain`` 0). It scales with the tree, not the leaf: a leaf
that is a sum of cancelling terms (a bias gradient summed over batch and time) rounds at the
terms' magnitude, not its own. With a floor of 64 eps of the leaf, seed 7's cases 222 and 223
failed so: an MLP's output-bias gradient of magnitude 0.089 that the plain program got exactly
and the planned one 1.28e-6 off, 121 eps of the leaf but 8.4 of the tree (1.28). The price:
an error below 7.6e-6 of the tree's largest value passes on any leaf, so a bug (O(1) of its
leaf) could hide only on a leaf 1e-5 the size of its tree's largest (a gradient zero in
theory).

``--break psum|chunks`` runs the planned programs with a deliberately broken lowering (the
oracle must report it): ``psum`` drops the partial-sum reductions of the ``shard_map`` regions
(value-split chains, co-sharded and run-on-pieces ops), ``chunks`` puts a co-sharded op's
chunk results one chunk off. Each case then says whether it ran the broken code
(``broken_ran``); one that did and passed runs again with the real lowering, to tell a miss
from a break that changed nothing beyond rounding (``break_changed``); the summary counts the
cases caught, unchanged and missed.

Cases whose programs make XLA fall back to "Involuntary full rematerialization" (a relayout it
can only do by gathering the tensor: slow, not wrong) are listed as ``full_remat_cases``.
``--json`` prints ``{"cases", "mismatches", "errors", "rejected", "seconds", "seeds", "oracle",
"score_max_passing", "ratio_max_passing", "mismatch_details"}`` (and ``"break"``) as the last
line; ``--out`` writes the summary with the findings (each with the oracle's numbers), the oracle's
parameters and the margin it left on the passing cases.
"""

from __future__ import annotations

import os

from nnscaler_jax.mesh.cpu import COUNT_FLAG, cpu_xla_flags  # starts no JAX backend

_flags = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = cpu_xla_flags(_flags, None if COUNT_FLAG in _flags else 8)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import contextlib
import dataclasses
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
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fuzz_models import build_model, gen_model
from fuzz_policies import (
    FuzzPolicy,
    build_mesh,
    gen_mesh,
    gen_plan,
    make_policy,
    random_actions,  # noqa: F401 - the tests reach it through this script
)

from nnscaler_jax import PlanError, auto_parallel
from nnscaler_jax.lower import regions
from nnscaler_jax.lower.hlo import xla_stderr
from nnscaler_jax.plan.plan import Plan

RTOL = 1e-5  # pm.init against module.init (the same random bits: no reordered sums)
ATOL = 1e-6
RATIO = 16.0  # the oracle: a planned error may be this many times the plain program's ...
FLOOR_ULPS = 64  # ... plus this many float32 eps of the tree's largest magnitude
EPS32 = float(np.finfo(np.float32).eps)
BREAKS = ("psum", "chunks")  # --break: deliberately broken lowerings the oracle must catch
STATUSES = ("ok", "rejected", "mismatch", "error")
FALLBACK = "Involuntary full rematerialization"  # XLA: a relayout it could only do by gathering
PLANS_PER_MODEL = 3  # cases sharing one model (and its single-device reference)
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


def _oracle(got: Any, plain: Any, ref64: Any) -> dict:
    """The float64 oracle on one tree of results: the numbers of the leaf with the largest
    score ``err_planned / (RATIO * err_plain + floor)`` (above 1: a mismatch), where
    ``floor = FLOOR_ULPS * EPS32 * max |ref64|`` over the whole tree.

    Args:
        got: the planned program's results (float32).
        plain: the plain single-device float32 program's.
        ref64: the float64 program's.

    Returns:
        ``{"leaf", "score", "err_planned", "err_plain", "floor", "ratio"}`` (``ratio``:
        ``err_planned / err_plain``, None where ``err_plain`` is 0), and
        ``"ratio_beyond_floor"``: the largest ``ratio`` of the leaves whose ``err_planned``
        exceeds the floor (where the ratio decides; None: no such leaf); a structure, shape or
        dtype difference or a NaN gives score ``inf`` and a ``why``.

    >>> ref, plain = {"w": np.array([1.0, 2.0])}, {"w": np.array([1.0, 2.0 + 1e-6])}
    >>> _oracle({"w": np.array([1.0, 2.0 - 4e-6])}, plain, ref)["score"] < 1  # rounding
    True
    >>> _oracle({"w": np.array([1.0, 2.5])}, plain, ref)["score"] > 1  # a wrong value
    True
    """
    la = jax.tree_util.tree_flatten_with_path(got)[0]
    lp, lr = jax.tree_util.tree_leaves(plain), jax.tree_util.tree_leaves(ref64)
    if not len(la) == len(lp) == len(lr):
        return {"leaf": "", "score": np.inf, "why": f"{len(la)} leaves vs {len(lr)}"}
    worst: dict = {"leaf": "", "score": 0.0}
    beyond: list[float] = []
    floor = FLOOR_ULPS * EPS32 * max([0.0] + [float(np.max(np.abs(r))) for r in lr if r.size])
    for (path, x), p, r in zip(la, lp, lr, strict=True):
        leaf = jax.tree_util.keystr(path) or "(the array)"
        x, p, r = np.asarray(x), np.asarray(p), np.asarray(r, np.float64)
        if x.shape != r.shape:
            return {"leaf": leaf, "score": np.inf, "why": f"shape {x.shape} vs {r.shape}"}
        if x.dtype != p.dtype:  # e.g. 64-bit types leaking into the planned program
            return {"leaf": leaf, "score": np.inf, "why": f"dtype {x.dtype} vs {p.dtype}"}
        if not x.size:
            continue
        err_planned = float(np.max(np.abs(x.astype(np.float64) - r)))
        err_plain = float(np.max(np.abs(p.astype(np.float64) - r)))
        bound = RATIO * err_plain + floor
        if np.isnan(err_planned):
            score = np.inf
        else:
            score = err_planned / bound if bound > 0 else (np.inf if err_planned else 0.0)
        ratio = err_planned / err_plain if err_plain else None
        if ratio is not None and err_planned > floor:
            beyond.append(ratio)
        if score >= worst["score"]:
            worst = {"leaf": leaf, "score": score, "err_planned": err_planned,
                     "err_plain": err_plain, "floor": floor, "ratio": ratio}
    return {**worst, "ratio_beyond_floor": max(beyond, default=None)}


def _oracle_detail(o: dict) -> str:
    """A failing leaf's numbers in words."""
    if "why" in o:
        return f"{o['leaf']}: {o['why']}"
    times = f"{o['ratio']:.3g}x" if o["ratio"] is not None else "(plain exact)"
    return (f"{o['leaf']}: max |planned - float64| = {o['err_planned']:.3g} > {RATIO:g} x "
            f"{o['err_plain']:.3g} (the plain float32 program's) + {o['floor']:.3g} (floor): "
            f"{times} the plain program's error")


@dataclasses.dataclass(frozen=True)
class Expected:
    """A model's single-device results: the variables and output cotangents every case uses,
    the plain float32 program's outputs and gradients, and the float64 program's (numpy)."""

    variables: Any
    cts: list[np.ndarray]
    out32: Any
    grads32: Any
    out64: Any
    grads64: Any


class Reference:
    """Single-device results per model, computed once per model (cases share models)."""

    def __init__(self) -> None:
        self._cache: dict[str, Expected] = {}

    def get(self, case: dict) -> Expected:
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


def _grad_run(module: Any, variables: Any, x: np.ndarray, cts: list) -> tuple[Any, Any]:
    """(outputs, parameter gradients) of one jitted ``jax.grad`` on one device, as numpy."""
    with jax.default_device(jax.devices()[0]):
        rest = {k: v for k, v in variables.items() if k != "params"}
        grad = jax.jit(jax.grad(_loss_fn(module.apply, x, cts), has_aux=True))
        grads, out = grad(variables["params"], rest)
    return jax.device_get(out), jax.device_get(grads)


def _reference(case: dict) -> Expected:
    """The single-device results of a case's model. The variables are drawn with numpy in the
    shapes ``module.init`` gives (an init program compiles slower than the model; ``pm.init``
    is checked against ``module.init`` on its own); outputs and gradients come from one
    jitted ``jax.grad`` (the outputs as its aux), in float32 and again in float64 (the same
    numbers cast exactly, under ``jax.enable_x64``: a context, so nothing after it, the
    planned float32 program included, runs with 64-bit types)."""
    module, x = _inputs(case)
    rng = np.random.default_rng(case["model_seed"])
    shapes = jax.eval_shape(module.init, jax.random.key(0), x)
    variables = jax.tree_util.tree_map(lambda s: _draw(rng, s.shape), shapes)
    out_shapes = jax.tree_util.tree_leaves(jax.eval_shape(module.apply, variables, x))
    cts = [rng.standard_normal(o.shape).astype(np.float32) for o in out_shapes]
    out32, grads32 = _grad_run(module, variables, x, cts)
    with jax.enable_x64(True):
        out64, grads64 = _grad_run(module, _f64(variables), _f64(x), _f64(cts))
    for leaf in jax.tree_util.tree_leaves((out64, grads64)):
        if np.asarray(leaf).dtype != np.float64:
            raise TypeError(f"the float64 reference of {_case_line(case)} has a "
                            f"{np.asarray(leaf).dtype} result: an op in the model casts to "
                            "a narrower type; the oracle needs every op in float64")
    return Expected(variables, cts, out32, grads32, out64, grads64)


def _f64(tree: Any) -> Any:
    """``tree``'s floating leaves as float64 numpy arrays (exact: float32 widens losslessly)."""
    return jax.tree_util.tree_map(
        lambda a: np.asarray(a, np.float64) if np.issubdtype(np.asarray(a).dtype, np.floating)
        else a, tree)


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
    pm, policy, oracle = None, None, None
    try:
        expected = ref.get(case)
        pm, policy = _wrap(case, module, mesh, x)
        where, oracle = _compare(case, pm, x, expected)
        status, detail = ("ok", "") if where is None else ("mismatch", where)
    except PlanError as e:
        status, detail = "rejected", f"{type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001 - an internal error is a finding
        status = "error"
        detail = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-6)}"
    result = {"status": status, "detail": detail}
    if oracle is not None:
        result["oracle"] = _rounded(oracle)
    if status in ("mismatch", "error"):
        result["reproducer"] = reproducer(case, pm, policy)
    return result


def _compare(case: dict, pm: Any, x: Any, expected: Expected) -> tuple[str | None, dict]:
    """Where the wrapped module's results differ from ``expected`` (None: nowhere), and the
    oracle's numbers of the leaf closest to failing: the variables of ``pm.init`` (some
    cases, against ``module.init`` with :func:`_close`), an eager ``pm.apply`` (some cases),
    and the outputs and parameter gradients of a jitted ``jax.grad`` through ``pm.apply``
    (these with :func:`_oracle`)."""
    checks = case.get("checks", {"init": True, "eager": True})
    worst: dict = {"leaf": "", "score": 0.0}
    beyond: list[float] = []
    if checks["init"]:
        key = jax.random.key(case["model_seed"])
        with jax.default_device(jax.devices()[0]):
            want = jax.jit(pm.module.init)(key, np.asarray(x))
        ok, where = _close(pm.init(key, x), want)
        if not ok:
            return f"init: {where}", worst
    for what, got, plain, ref64 in _planned(case, pm, x, expected):
        o = _oracle(got, plain, ref64)
        o["leaf"] = f"{what}: {o['leaf']}"
        if o.get("ratio_beyond_floor") is not None:
            beyond.append(o["ratio_beyond_floor"])
        if o["score"] >= worst["score"]:
            worst = o
        worst["ratio_beyond_floor"] = max(beyond, default=None)
        if o["score"] > 1:
            return _oracle_detail(o), worst
    return None, worst


def _planned(case: dict, pm: Any, x: Any, expected: Expected) -> list[tuple]:
    """(what, planned, plain float32, float64) per tree of results the oracle checks: an
    eager ``pm.apply``'s outputs (some cases), and the outputs and parameter gradients of a
    jitted ``jax.grad`` through ``pm.apply``."""
    pvars, trees = expected.variables, []
    if case.get("checks", {"eager": True})["eager"]:
        trees.append(("forward (pm.apply)", pm.apply(pvars, x), expected.out32, expected.out64))
    rest = {k: v for k, v in pvars.items() if k != "params"}
    grads, out = jax.jit(jax.grad(_loss_fn(pm.apply, x, expected.cts), has_aux=True))(
        pvars["params"], rest)
    return trees + [("forward (under jax.grad)", out, expected.out32, expected.out64),
                    ("gradients", grads, expected.grads32, expected.grads64)]


def _rounded(o: dict) -> dict:
    """The oracle's numbers for JSON (3 significant digits; inf as None)."""
    return {k: (float(f"{v:.3g}") if np.isfinite(v) else None) if isinstance(v, float) else v
            for k, v in o.items()}


# ------------------------------------------------------------------- a broken lowering


class _Patched:
    """``base`` (a module) with some of its attributes replaced."""

    def __init__(self, base: Any, **replaced: Any) -> None:
        self._base, self._replaced = base, replaced

    def __getattr__(self, name: str) -> Any:
        return self._replaced[name] if name in self._replaced else getattr(self._base, name)


@contextlib.contextmanager
def broken_lowering(kind: str | None) -> Iterator[list[str]]:
    """A deliberately wrong lowering while the block runs (None: the real one), for checking
    that the oracle catches bugs; yields a list that gets an entry each time the broken code
    is traced (so a case says whether it ran it).

    - ``"psum"``: the ``shard_map`` regions of :mod:`nnscaler_jax.lower.regions` (value-split
      chains, co-sharded ops, ops run on pieces) skip their partial-sum reduction: each
      device goes on with its own partial sum.
    - ``"chunks"``: a co-sharded op (:func:`nnscaler_jax.lower.regions.run_cosharded`) puts
      each chunk's results where the next chunk's go (the chunk loop's stacked results
      rolled by one: a wrong slice). Ops chunked along a reduced dim (chunks summed, order
      irrelevant) do not reach it.
    """
    hits: list[str] = []
    if kind is None:
        yield hits
        return
    if kind == "psum":
        def dropped(x: Any, axis_name: Any, **_: Any) -> Any:
            hits.append("psum")
            return x
        patch = mock.patch.object(regions, "jax", _Patched(jax, lax=_Patched(jax.lax,
                                                                            psum=dropped)))
    elif kind == "chunks":
        real = regions.chunk_loop

        def rolled(one: Callable, k: int, *args: Any) -> Callable:
            loop = real(one, k, *args)

            def broken(whole: Any, chunked: Any) -> Any:
                ys = loop(whole, chunked)
                if k != 1:
                    hits.append("chunks")
                return [jnp.roll(y, 1, axis=0) for y in ys]
            return broken
        patch = mock.patch.object(regions, "chunk_loop", rolled)
    else:
        raise ValueError(f"--break {kind!r}: not one of {BREAKS}")
    with patch:
        yield hits


def break_changed(case: dict, ref: Reference, kind: str) -> bool:
    """Whether the broken lowering ``kind`` changes a case's results beyond rounding: the
    oracle on the broken program's results with the real planned program's as the float32
    reference (a break can be a no-op: a chunk order permuted along a dim the model then
    averages over, a reduction whose other partial sums are zero)."""
    module, x_np = _inputs(case)
    mesh = build_mesh(case["mesh"])
    x = _typed(x_np, mesh, case["mesh"])
    expected = ref.get(case)
    runs = []
    for b in (None, kind):
        with broken_lowering(b):
            runs.append(_planned(case, _wrap(case, module, mesh, x)[0], x, expected))
    return any(_oracle(broken, real, ref64)["score"] > 1 for (_, real, _, ref64), (_, broken, _, _)
               in zip(*runs, strict=True))


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
              log: Callable[[str], None] | None = None,
              breaks: str | None = None) -> Iterator[tuple[dict, dict]]:
    """Run ``cases`` in turn (no new one after ``budget_s`` seconds; ``breaks``: under
    :func:`broken_lowering`); yields (case, result)."""
    start = time.perf_counter()
    ref = Reference()
    for case in cases:
        if budget_s is not None and time.perf_counter() - start > budget_s:
            return
        t0 = time.perf_counter()
        with warnings.catch_warnings(), xla_stderr() as err, broken_lowering(breaks) as hits:
            warnings.simplefilter("ignore")
            res = run_case(case, ref)
        res["full_remat"] = err[0].count(FALLBACK)
        if breaks:
            res["broken_ran"] = bool(hits)
            if hits and res["status"] == "ok":  # not caught: did the break change anything?
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    res["break_changed"] = break_changed(case, ref, breaks)
        if log:
            first = res["detail"].splitlines()[0][:160] if res["detail"] else ""
            remat = f" [{res['full_remat']} full remat]" if res["full_remat"] else ""
            broken = " [ran the broken code]" if res.get("broken_ran") else ""
            if res.get("break_changed") is False:
                broken = " [ran the broken code: no change beyond rounding]"
            score = f" score {res['oracle']['score']:.2g}" if res.get("oracle", {}).get(
                "score") is not None and res["status"] == "ok" else ""
            log(f"case {case['index']:4d} {res['status']:9s} {time.perf_counter() - t0:5.1f}s "
                f"{_case_line(case)}{remat}{broken}{score} {first}")
        yield case, res


ORACLE = {"reference": "the single-device program in float64 (jax.enable_x64)",
          "rule": "per output / gradient leaf: mismatch iff max|planned - ref64| > ratio * "
                  "max|plain32 - ref64| + floor_ulps * eps32 * max|ref64 over the leaf's "
                  "tree (the outputs, or the gradients)|",
          "ratio": RATIO, "floor_ulps": FLOOR_ULPS, "eps32": EPS32,
          "init": f"pm.init vs module.init: |a - b| <= {ATOL} * scale + {RTOL} |b|"}
SCORE_BINS = (1e-3, 1e-2, 0.1, 0.5, 1.0)  # histogram of the passing cases' oracle scores


def summarize(results: list[tuple[int, dict]], seconds: float, seed: int,
              breaks: str | None = None) -> dict:
    """The summary of (case index, result) pairs: counts, the findings and the rejections,
    the oracle's parameters and the margin it left on the passing cases (``score``: the
    worst leaf's ``err_planned / (RATIO * err_plain + floor)``, 1 the limit); under
    ``breaks``, which cases ran the broken code, how many the oracle caught, which did not
    change the results beyond rounding (``unchanged``) and which it missed."""
    count = {s: sum(r["status"] == s for _, r in results) for s in STATUSES}
    out = {"cases": len(results), "mismatches": count["mismatch"], "errors": count["error"],
           "rejected": count["rejected"], "seconds": round(seconds, 1), "seed": seed,
           "oracle": ORACLE, "margin": _margin([(seed, i, r) for i, r in results]),
           "full_remat_cases": sorted(i for i, r in results if r.get("full_remat")),
           "findings": [{"seed": seed, "index": i, **r} for i, r in results
                        if r["status"] in ("mismatch", "error")],
           "rejections": [{"index": i, "detail": r["detail"][:300]} for i, r in results
                          if r["status"] == "rejected"]}
    if breaks:
        ran = [(i, r) for i, r in results if r.get("broken_ran")]
        passed = [(i, r) for i, r in ran if r["status"] not in ("mismatch", "error")]
        out["break"] = {"kind": breaks, "ran_broken_code": len(ran),
                        "caught": len(ran) - len(passed),
                        "unchanged": [i for i, r in passed if r.get("break_changed") is False],
                        "missed": [i for i, r in passed if r.get("break_changed") is not False]}
    return out


def _margin(results: list[tuple[int, int, dict]]) -> dict:
    """How close the passing cases came to the oracle's limit: a histogram of their scores
    (upper bin edges), the largest, the five closest cases with their numbers, and the largest
    planned / plain error ratio of a leaf whose error exceeded the floor."""
    ok = [(seed, i, r["oracle"]) for seed, i, r in results
          if r["status"] == "ok" and r.get("oracle", {}).get("score") is not None]
    hist = {f"<={b:g}": sum(o["score"] <= b and (k == 0 or o["score"] > SCORE_BINS[k - 1])
                            for _, _, o in ok) for k, b in enumerate(SCORE_BINS)}
    closest = sorted(ok, key=lambda t: -t[2]["score"])[:5]
    ratios = [(o["ratio_beyond_floor"], seed, i) for seed, i, o in ok
              if o.get("ratio_beyond_floor") is not None]
    top = max(ratios, default=None)
    return {"passing": len(ok), "score_hist": hist,
            "score_max": max((o["score"] for _, _, o in ok), default=None),
            "closest": [{"seed": seed, "index": i, **o} for seed, i, o in closest],
            "ratio_beyond_floor": None if top is None else
            {"max": top[0], "seed": top[1], "index": top[2], "cases": len(ratios)}}


def combine(runs: list[dict]) -> dict:
    """One summary of several seeds' (counts added; findings and the margin merged)."""
    out = {k: sum(r[k] for r in runs) for k in ("cases", "mismatches", "errors", "rejected")}
    out["seconds"] = round(sum(r["seconds"] for r in runs), 1)
    hists = [r["margin"]["score_hist"] for r in runs]
    closest = sorted((c for r in runs for c in r["margin"]["closest"]),
                     key=lambda c: -c["score"])[:5]
    scores = [r["margin"]["score_max"] for r in runs if r["margin"]["score_max"] is not None]
    ratios = [r["margin"]["ratio_beyond_floor"] for r in runs
              if r["margin"]["ratio_beyond_floor"] is not None]
    out.update({
        "seeds": [r["seed"] for r in runs], "oracle": ORACLE,
        "margin": {"passing": sum(r["margin"]["passing"] for r in runs),
                   "score_hist": {k: sum(h[k] for h in hists) for k in hists[0]},
                   "score_max": max(scores, default=None), "closest": closest,
                   "ratio_beyond_floor": None if not ratios else
                   {**max(ratios, key=lambda r: r["max"]),
                    "cases": sum(r["cases"] for r in ratios)}},
        "findings": [f for r in runs for f in r["findings"]],
        "runs": [{k: v for k, v in r.items() if k not in ("findings", "oracle")}
                 for r in runs]})
    return out


def fuzz(n: int, seed: int, *, log: Callable[[str], None] | None = None,
         budget_s: float | None = None, only: list[int] | None = None,
         cases: list[dict] | None = None, breaks: str | None = None, **gen: Any) -> dict:
    """Run ``n`` cases from ``seed`` in this process (``only``: these indices; ``cases``: these
    case descriptions instead; no new case after ``budget_s`` seconds; ``breaks``: with a
    broken lowering (:func:`broken_lowering`); ``gen``: options of :func:`gen_cases`);
    returns the summary."""
    start = time.perf_counter()
    if cases is None:
        cases = [c for c in gen_cases(n, seed, **gen) if only is None or c["index"] in only]
    results = [(c["index"], r) for c, r in run_cases(cases, budget_s=budget_s, log=log,
                                                     breaks=breaks)]
    return summarize(results, time.perf_counter() - start, seed, breaks)


def fuzz_isolated(n: int, seed: int, *, budget_s: float | None = None,
                  only: list[int] | None = None, quiet: bool = False,
                  breaks: str | None = None) -> dict:
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
                (["--quiet"] if quiet else []) + (["--break", breaks] if breaks else [])
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
    return summarize(results, time.perf_counter() - start, seed, breaks)


def _worker(path: str, n: int, seed: int, only: list[int], budget_s: float | None,
            quiet: bool, breaks: str | None) -> int:
    cases = [c for c in gen_cases(n, seed) if c["index"] in set(only)]
    log = None if quiet else (lambda s: print(s, flush=True))
    with open(path, "a", encoding="utf-8") as sink:
        for case, res in run_cases(cases, budget_s=budget_s, log=log, breaks=breaks):
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
    ap.add_argument("--seed", type=int, nargs="+", default=[0],
                    help="a seed, or several (--cases cases each, one summary)")
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
    ap.add_argument("--break", dest="breaks", choices=BREAKS,
                    help="run with a deliberately broken lowering (the oracle must catch it)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    log = None if args.quiet else (lambda s: print(s, flush=True))
    if args.worker:
        return _worker(args.worker, args.cases, args.seed[0], args.only or [], args.budget_s,
                       args.quiet, args.breaks)
    start = time.perf_counter()
    if args.case:
        text = args.case
        if os.path.exists(args.case):
            with open(args.case, encoding="utf-8") as fh:
                text = fh.read()
        case = json.loads(text)
        runs = [fuzz(0, args.seed[0], cases=[case.get("case", case)], log=log,
                     breaks=args.breaks)]
    else:
        runs = []
        for k, seed in enumerate(args.seed):  # the budget shared out among the seeds left
            left = None if args.budget_s is None else \
                (args.budget_s - (time.perf_counter() - start)) / (len(args.seed) - k)
            run = fuzz if args.in_process else fuzz_isolated
            opts = {"log": log} if args.in_process else {"quiet": args.quiet}
            runs.append(run(args.cases, seed, budget_s=left, only=args.only,
                            breaks=args.breaks, **opts))
    summary = runs[0] if len(runs) == 1 else combine(runs)
    _report(summary, args.shrink)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump(summary, fh, indent=1, sort_keys=True)
    print(json.dumps(_head(summary)) if args.json else _head(summary))
    return 1 if summary["mismatches"] or summary["errors"] else 0


def _head(summary: dict) -> dict:
    """The summary's last line: the counts, the oracle's parameters, each mismatch's numbers
    (and under ``--break``, how many cases ran the broken code and were caught)."""
    head = {k: summary[k] for k in ("cases", "mismatches", "errors", "rejected", "seconds")}
    head["seeds"] = summary.get("seeds", [summary.get("seed")])
    head["oracle"] = {k: ORACLE[k] for k in ("ratio", "floor_ulps")}
    head["score_max_passing"] = summary["margin"]["score_max"]
    beyond = summary["margin"]["ratio_beyond_floor"]
    head["ratio_max_passing"] = beyond and beyond["max"]
    head["mismatch_details"] = [
        {"seed": f["seed"], "index": f["index"], "detail": f["detail"].splitlines()[0][:300],
         "oracle": f.get("oracle")} for f in summary["findings"] if f["status"] == "mismatch"]
    if "break" in summary:
        head["break"] = summary["break"]
    return head


def _report(summary: dict, shrink_them: bool) -> None:
    """Print every finding's reproducer (and, asked, a shrunk one)."""
    for f in summary["findings"]:
        print(f"\n=== {f['status']} in case {f['index']} (seed {f['seed']}): {f['detail']}")
        print("reproducer:", json.dumps(f["reproducer"], sort_keys=True))
        if shrink_them and "plan" in f["reproducer"]["case"] and \
                f["reproducer"]["case"]["plan"]["kind"] == "actions":
            f["shrunk"] = shrink(f["reproducer"]["case"], f["status"])
            print("shrunk:", json.dumps(f["shrunk"], sort_keys=True))


if __name__ == "__main__":
    sys.exit(main())
