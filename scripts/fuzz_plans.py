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
from nnscaler_jax.lower.hlo import xla_stderr
from nnscaler_jax.plan.plan import Plan

RTOL = 1e-5
ATOL = 1e-6
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
