"""``nnscaler-jax graph``, ``plan``, ``compare`` and ``profile``."""

from __future__ import annotations

import argparse
import json
import math
import re
import time
from typing import Any

from nnscaler_jax.cli.common import (
    DEFAULT_AXES,
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
    policy_names,
    spec_mutable,
    spec_rng_names,
    table,
)


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
    mesh = parse_mesh(args.mesh, args.axes)
    policy = check_policy(args.policy)
    t0 = time.perf_counter()
    plan = make_plan(spec, mesh, policy)
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
    if args.pipeline:
        ptext, obj["pipeline"] = _pipeline_schedule(args, spec)
        text += "\n" + ptext if not args.json else ""
    emit(args, text, obj)
    return 0


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


def cmd_compare(args: argparse.Namespace) -> int:
    import jax

    from nnscaler_jax.cost.model import CostModel
    from nnscaler_jax.errors import PlanError
    from nnscaler_jax.planner import plan_and_report

    spec = model_spec(args.model, args.preset)
    try:  # a real mesh when there are devices enough (compiled figures); else axis sizes only
        mesh = parse_mesh(args.mesh, args.axes)
    except UsageError:
        if not re.fullmatch(r"\d+(x\d+)*", args.mesh or ""):
            raise
        shape = tuple(int(n) for n in args.mesh.split("x"))
        names = (tuple(a.strip() for a in args.axes.split(",")) if args.axes
                 else DEFAULT_AXES.get(len(shape)))
        if not names or len(names) != len(shape):
            raise
        mesh = jax.sharding.AbstractMesh(shape, names)
    axes = dict(mesh.shape)
    planners = [p.strip() if p.strip() == "alpa" else check_policy(p.strip())
                for p in args.planners.split(",") if p.strip()]
    if not planners:
        raise UsageError(f"--planners is empty; choose from: {', '.join(policy_names())}, alpa")
    cluster = None
    if args.cluster:
        from nnscaler_jax.cost.devices import CLUSTERS, cluster_preset

        if args.cluster not in CLUSTERS:
            raise UsageError(f"unknown --cluster {args.cluster!r}; presets: {', '.join(CLUSTERS)}")
        cluster = cluster_preset(args.cluster)
    graph = capture_model(spec, mutable=spec_mutable(spec)).graph
    compile_here = isinstance(mesh, jax.sharding.Mesh) and spec.kind == "linen" and \
        args.preset.startswith("tiny")
    results: dict[str, dict[str, Any]] = {}
    rows = []
    for name in planners:
        try:
            cm = None
            if cluster is not None:
                cm = CostModel.for_cluster(cluster, axes, zero=3 if name == "zero3" else 0)
            planned = plan_and_report(graph, mesh, policy=name, cost_model=cm)
            plan, search_s = planned.plan, planned.seconds
        except PlanError as e:
            results[name] = {"error": str(e).splitlines()[0]}
            rows.append([name, "-", "-", "-", "-", "-", "-",
                         f"error: {str(e).splitlines()[0][:60]}"])
            continue
        c = plan.cost
        res = {"search_s": search_s, "step_time_s": c.step_time_s,
               "memory_bytes_per_device": c.memory_bytes_per_device, "comm_bytes": c.comm_bytes}
        if compile_here:
            res.update(_compiled_figures(spec, mesh, plan))
        results[name] = res
        rows.append([name, f"{search_s:.3f}", f"{c.step_time_s * 1e3:.3f}",
                     mib(c.memory_bytes_per_device), mib(c.comm_bytes),
                     mib(res["compiled_memory_bytes"]) if "compiled_memory_bytes" in res
                     else "-",
                     mib(res["hlo_comm_bytes"]) if "hlo_comm_bytes" in res else "-", ""])
    obj = {"model": args.model, "preset": args.preset, "mesh": args.mesh,
           "cluster": args.cluster, "planners": results}
    text = ""
    if not args.json:
        headers = ["planner", "plan s", "step ms", "memory/device", "comm", "XLA memory",
                   "HLO comm", "note"]
        if not any(r[-1] for r in rows):
            headers, rows = headers[:-1], [r[:-1] for r in rows]
        text = (f"{args.model} [{args.preset}] on mesh {args.mesh}"
                f"{f' ({args.cluster})' if args.cluster else ''}: estimated per training step "
                "(XLA memory / HLO comm: the compiled forward)\n" + table(headers, rows))
    emit(args, text, obj)
    return 0


def _compiled_figures(spec: Any, mesh: Any, plan: Any) -> dict[str, int]:
    """XLA's per-device memory and collective bytes of the compiled forward under ``plan``."""
    import jax

    from nnscaler_jax.api import auto_parallel
    from nnscaler_jax.lower.hlo import hlo_collectives

    try:
        args = spec.make_args(abstract=False)
        pm = auto_parallel(mesh, plan=plan)(spec.module)
        variables = pm.init(jax.random.key(0), *args)
        compiled = pm.compiled(variables, *args, rngs=spec_rng_names(spec),
                               mutable=spec_mutable(spec))
        m = compiled.memory_analysis()
        memory = (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                  - m.alias_size_in_bytes)
        comm = sum(c.bytes for c in hlo_collectives(compiled.as_text(), mesh))
        return {"compiled_memory_bytes": int(memory), "hlo_comm_bytes": int(comm)}
    except Exception as e:  # noqa: BLE001 - the figures are extras; say why they are missing
        return {"compiled_error": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"}


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
