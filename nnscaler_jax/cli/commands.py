"""``nnscaler-jax graph``, ``plan`` and ``profile`` (``compare``: :mod:`nnscaler_jax.cli.compare`)."""

from __future__ import annotations

import argparse
import json
import math
import time
from typing import Any

from nnscaler_jax.cli.common import (
    UsageError,
    capture_model,
    check_policy,
    cost_dict,
    emit,
    fmt_bytes,
    model_spec,
    parse_mesh,
    plan_constraints,
    planned_model,
    settings_spec,
    spec_mutable,
    table,
)
from nnscaler_jax.cli.compare import cluster_arg, compare_mesh, one_planner
from nnscaler_jax.cli.xla import check_cluster, xla_entry, xla_text


def cmd_graph(args: argparse.Namespace) -> int:
    from nnscaler_jax.ir.graph import Role

    spec = model_spec(args.model, args.preset)
    t0 = time.perf_counter()
    captured = capture_model(spec)  # unannotated primitives are listed below
    trace_s = time.perf_counter() - t0
    graph = captured.graph
    ops = list(graph.walk())
    unannotated: dict[str, list[str]] = {}
    for op in ops:
        if not op.annotated:
            unannotated.setdefault(op.primitive, [])
            where = op.module_path or "<top>"
            if where not in unannotated[op.primitive]:
                unannotated[op.primitive].append(where)
    params = [t for t in graph.inputs if t.role is Role.VARIABLE and t.collection == "params"]
    if not params:  # nnx state paths need not start with the collection name
        params = list(graph.variables)
    n_params = sum(math.prod(t.shape) for t in params)
    param_bytes = sum(t.nbytes for t in params)
    modules: dict[str, list[int]] = {}
    for op in ops:
        key = "/".join(op.module_path.split("/")[: args.depth]) or "<top>"
        m = modules.setdefault(key, [0, 0])
        m[0] += 1
        m[1] += int(op.annotated)
    frac = sum(op.annotated for op in ops) / len(ops) if ops else 1.0
    obj = {"ok": True, "model": args.model, "preset": args.preset, "ops": len(ops),
           "top_level_ops": len(graph.ops), "annotated_fraction": frac,
           "unannotated": {k: sorted(v) for k, v in sorted(unannotated.items())},
           "params": int(n_params), "param_bytes": int(param_bytes), "trace_s": trace_s,
           "modules": {k: v[0] for k, v in modules.items()}}
    text = ""
    if not args.json or args.print_ir:
        lines = []
        if args.print_ir:
            lines.append(str(graph))
        if not args.json:
            lines += [
                (f"model {args.model} [{args.preset}]: {len(ops)} ops ({len(graph.ops)} top "
                 f"level), {frac:.1%} annotated, traced in {trace_s:.2f} s"),
                f"parameters: {n_params:,} ({fmt_bytes(param_bytes)})",
                "",
                table(["module", "ops", "annotated"],
                       [[k, v[0], v[1]] for k, v in modules.items()]),
            ]
            if unannotated:
                lines += ["", "unannotated primitives (planned replicated; see register_rule):"]
                lines += [f"  {p}: {', '.join(sorted(w))}" for p, w in sorted(unannotated.items())]
        text = "\n".join(lines)
    emit(args, text, obj)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    """Make the plan ``train`` would run with the same options (the same ``Constraints``, the
    same planning call): what ``train`` refuses, ``plan`` refuses with the same message."""
    constraints = plan_constraints(args)
    spec = settings_spec(args, constraints.precision)
    policy = check_policy(args.policy or "auto")
    check_cluster(args)
    if args.gantt and not args.pipeline:
        raise UsageError("--gantt draws a pipeline's schedule: add --pipeline S (with a 'stage' "
                         "mesh axis, e.g. --mesh 2x4 --axes stage,data)")
    t0 = time.perf_counter()
    if getattr(args, "cluster", None):  # priced on the cluster, its memory the budget
        plan, graph = _cluster_plan(args, spec, policy, constraints)
    else:
        pm = planned_model(spec, parse_mesh(args.mesh, args.axes), policy, constraints)
        plan, graph = pm.plan, pm.graph
    plan_s = time.perf_counter() - t0
    if args.out:
        try:
            with open(args.out, "w") as f:
                f.write(plan.to_json())
        except OSError as e:
            raise UsageError(f"cannot write --out {args.out!r}: {e.strerror or e}") from None
    obj = {"ok": True, "model": args.model, "preset": args.preset, "mesh": args.mesh,
           "policy": policy, "plan": json.loads(plan.to_json()), "cost": cost_dict(plan),
           "plan_s": plan_s}
    lines = [str(plan) if args.ops else plan.summary(graph),
             f"planned in {plan_s:.2f} s (trace + policy)"]
    if args.out:
        lines.append(f"wrote {args.out} (reuse it: train / verify / compare --plan "
                     f"{args.out})")
    if getattr(args, "plot", None):
        obj["plot"] = _plot_layout(graph, plan, args.plot)
        lines.append(f"wrote {args.plot}")
    if plan.pipeline is not None:
        ptext, obj["pipeline"] = _pipeline_schedule(args, plan.pipeline)
        lines.append(ptext)
    if getattr(args, "xla", False):
        obj["xla"] = xla_entry(spec, plan, cluster_arg(args), dict(plan.mesh))
        peak, ratio = xla_text(obj["xla"])
        lines.append(f"XLA:GPU ({args.cluster}): peak {peak} per device, {ratio} of the "
                     "estimate" + "".join(f"\n  {n}" for n in obj["xla"].get("notes", []))
                     + (f"\n  {obj['xla']['error']}" if "error" in obj["xla"] else ""))
    emit(args, "" if args.json else "\n".join(lines), obj)
    return 0


def _cluster_plan(args: argparse.Namespace, spec: Any, policy: str,
                  constraints: Any) -> tuple[Any, Any]:
    """``plan --cluster C``: the plan ``compare`` makes with ``policy`` (C's cost model, its
    device memory less the reserve as the budget unless ``--budget``), on the mesh's axis
    sizes, under the other plan settings: (plan, graph)."""
    from nnscaler_jax.errors import PlanError

    graph = capture_model(spec, mutable=spec_mutable(spec), precision=constraints.precision,
                          loss=True).graph  # the training step's, as compare plans it
    plan, entry = one_planner(policy, graph, compare_mesh(args), cluster_arg(args),
                              constraints.max_memory_per_device, constraints=constraints)
    if plan is None:
        raise PlanError(entry.get("error") or f"{policy} found no plan")
    return plan, graph


def _plot_layout(graph: Any, plan: Any, path: str) -> str:
    """``plan --plot``: the layout map PNG, the split dims named from the model's graph."""
    from nnscaler_jax.cli.plots import layout_map

    try:
        layout_map(plan, graph).savefig(path, dpi=120)
    except OSError as e:
        raise UsageError(f"cannot write --plot {path!r}: {e.strerror or e}") from None
    return path


def _pipeline_schedule(args: argparse.Namespace, pipe: Any) -> tuple[str, dict[str, Any]]:
    """A pipelined plan's per-device schedule (its stage split is in the plan's text): the
    schedule, micro-batches and chunks the plan chose, as ``train`` runs them."""
    from nnscaler_jax.pipeline import schedule as sch

    sched = sch.from_settings(pipe)
    lines = [sch.format_schedule(sched), "peak micro-batches in flight per stage: "
             + ", ".join(map(str, sch.peak_in_flight(sched)))]
    obj = {"stages": pipe.stages, "microbatches": pipe.microbatches, "schedule": pipe.schedule,
           "executor": pipe.executor, "virtual": sched.virtual,
           "stage_of": [list(x) for x in pipe.stage_of],
           "steps": sched.to_lists(), "peak_in_flight": list(sch.peak_in_flight(sched))}
    if args.gantt:
        try:
            sch.plot_gantt(sched, args.gantt)
        except OSError as e:
            raise UsageError(f"cannot write --gantt {args.gantt!r}: {e.strerror or e}") from None
        lines.append(f"wrote {args.gantt}")
        obj["gantt"] = args.gantt
    return "\n".join(lines), obj


def cmd_profile(args: argparse.Namespace) -> int:
    """Time every distinct op of a model on the local backend into a profile database."""
    from pathlib import Path

    import jax

    from nnscaler_jax.cost.profile import DEFAULT_PATH, ProfileDB, profile_ops

    spec = model_spec(args.model, args.preset)
    graph = capture_model(spec).graph
    t0 = time.perf_counter()
    db = profile_ops(graph, ProfileDB.load(args.out, missing_ok=True), path=args.out,
                     runs=args.runs)
    path = str(Path(args.out or DEFAULT_PATH).expanduser())
    mine = db.keys_of(graph, jax.devices()[0].device_kind)
    rows = sorted(((k, db.entries[k]) for k in mine), key=lambda kv: -kv[1])
    text = "" if args.json else (
        table(["primitive", "inputs", "outputs", "dtype", "device", "us"],
               [k.split("|") + [f"{v * 1e6:.1f}"] for k, v in rows[:40]])
        + f"\n{len(db)} entries in {path} ({time.perf_counter() - t0:.1f} s)")
    emit(args, text, {"ok": True, "path": path, "entries": len(db),
                       "profiled": {k: v for k, v in rows}})
    return 0


# ---- parser ------------------------------------------------------------------------------------
