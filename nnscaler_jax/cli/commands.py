"""``nnscaler-jax graph``, ``plan`` and ``profile`` (``compare``: :mod:`nnscaler_jax.cli.compare`)."""

from __future__ import annotations

import argparse
import json
import math
import time
from typing import Any

from nnscaler_jax.cli.common import (
    UsageError,
    abstract_inputs,
    capture_model,
    check_policy,
    cost_dict,
    emit,
    make_plan,
    mib,
    model_spec,
    parse_mesh,
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
    obj = {"model": args.model, "preset": args.preset, "ops": len(ops),
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
                f"parameters: {n_params:,} ({mib(param_bytes)})",
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
    spec = model_spec(args.model, args.preset)
    policy = check_policy(args.policy)
    check_cluster(args)
    t0 = time.perf_counter()
    if getattr(args, "cluster", None):  # priced on the cluster, its memory the budget
        plan = _cluster_plan(args, spec, policy)
    else:
        plan = make_plan(spec, parse_mesh(args.mesh, args.axes), policy)
    plan_s = time.perf_counter() - t0
    if args.out:
        with open(args.out, "w") as f:
            f.write(plan.to_json())
    obj = {"model": args.model, "preset": args.preset, "mesh": args.mesh, "policy": policy,
           "plan": json.loads(plan.to_json()), "cost": cost_dict(plan), "plan_s": plan_s}
    text = ""
    if not args.json:
        text = str(plan) + f"\nplanned in {plan_s:.2f} s (trace + policy)"
        if args.out:
            text += f"\nwrote {args.out}"
    if getattr(args, "plot", None):
        obj["plot"] = _plot_layout(spec, plan, args.plot)
        text += f"\nwrote {args.plot}" if not args.json else ""
    if args.pipeline:
        ptext, obj["pipeline"] = _pipeline_schedule(args, spec)
        text += "\n" + ptext if not args.json else ""
    if getattr(args, "xla", False):
        obj["xla"] = xla_entry(spec, plan, cluster_arg(args), dict(plan.mesh))
        peak, ratio = xla_text(obj["xla"])
        text += (f"\nXLA:GPU ({args.cluster}): peak {peak} per device, {ratio} of the estimate"
                 + "".join(f"\n  {n}" for n in obj["xla"].get("notes", []))
                 + (f"\n  {obj['xla']['error']}" if "error" in obj["xla"] else "")
                 if not args.json else "")
    emit(args, text, obj)
    return 0


def _cluster_plan(args: argparse.Namespace, spec: Any, policy: str) -> Any:
    """``plan --cluster C``: the plan ``compare`` makes with ``policy`` (C's cost model, its
    device memory less the reserve as the budget), on the mesh's axis sizes."""
    from nnscaler_jax.errors import PlanError

    graph = capture_model(spec, mutable=spec_mutable(spec)).graph
    plan, entry = one_planner(policy, graph, compare_mesh(args), cluster_arg(args), None)
    if plan is None:
        raise PlanError(entry.get("error") or f"{policy} found no plan")
    return plan


def _plot_layout(spec: Any, plan: Any, path: str) -> str:
    """``plan --plot``: the layout map PNG, the split dims named from the model's graph."""
    from nnscaler_jax.cli.plots import layout_map

    graph = capture_model(spec, mutable=spec_mutable(spec)).graph
    try:
        layout_map(plan, graph).savefig(path, dpi=120)
    except OSError as e:
        raise UsageError(f"cannot write --plot {path!r}: {e.strerror or e}") from None
    return path


def _pipeline_schedule(args: argparse.Namespace, spec: Any) -> tuple[str, dict[str, Any]]:
    """``plan --pipeline N``: the layer -> stage assignment and the per-device schedule."""
    import jax

    from nnscaler_jax.pipeline import schedule as sch
    from nnscaler_jax.pipeline.stages import stage_layers

    micro = args.microbatches or 2 * args.pipeline
    sched = sch.build(args.schedule, args.pipeline, micro, args.virtual)
    _, variables = abstract_inputs(spec)
    flat = jax.tree_util.tree_flatten_with_path(variables)[0] if variables is not None else []
    names = [("/".join(str(getattr(k, "key", k)) for k in path), tuple(x.shape))
             for path, x in flat]
    stage_of = stage_layers(names, args.pipeline, sched.virtual)
    by: dict[int, list[str]] = {}
    for name, st in stage_of:
        by.setdefault(st, []).append(name)
    lines = [f"pipeline: {args.pipeline} stages (first also runs the prefix, last the suffix)"]
    lines += [f"  stage {st}: {', '.join(ns)}" for st, ns in sorted(by.items())]
    lines.append(sch.format_schedule(sched))
    lines.append("peak micro-batches in flight per stage: "
                 + ", ".join(map(str, sch.peak_in_flight(sched))))
    obj = {"stages": args.pipeline, "microbatches": micro, "schedule": args.schedule,
           "virtual": sched.virtual, "stage_of": [list(x) for x in stage_of],
           "steps": sched.to_lists(), "peak_in_flight": list(sch.peak_in_flight(sched))}
    if args.gantt:
        sch.plot_gantt(sched, args.gantt)
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
