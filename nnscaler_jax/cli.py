"""``nnscaler-jax``: the command line (also ``python -m nnscaler_jax``). Thin: argparse + printing.

Subcommands: ``graph``, ``plan``, ``verify``, ``compare``, ``demo``. Each prints tables for a
person, or with ``--json`` one JSON object on the last line of its output. Errors a user can cause
(unknown model / preset / policy, a bad mesh) print one line and exit 2.

Before JAX starts its backends, :func:`main` sets ``XLA_FLAGS`` to ask for ``--devices`` virtual
CPU devices (default 8 when the flags name no device count).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["main"]

DEFAULT_DEVICES = 8
DEFAULT_AXES = {1: ("data",), 2: ("data", "model"), 3: ("data", "fsdp", "model")}
DEFAULT_PLANNERS = "dp,zero3,megatron,auto,alpa"
_COUNT_FLAG = "--xla_force_host_platform_device_count"


class UsageError(Exception):
    """A bad value on the command line: one line, exit 2."""


# ---- environment ---------------------------------------------------------------------------------


def _backends_started() -> bool:
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):
        return True


def _request_devices(n: int | None) -> None:
    """Ask XLA for ``n`` virtual CPU devices (default 8 if the flags name no count), unless JAX's
    backends are already running (XLA_FLAGS is read when they start, not at ``import jax``)."""
    if _backends_started():
        return
    flags = os.environ.get("XLA_FLAGS", "")
    if n is None:
        if _COUNT_FLAG in flags:
            return
        n = DEFAULT_DEVICES
    flags = re.sub(rf"{_COUNT_FLAG}=\S*", "", flags)
    os.environ["XLA_FLAGS"] = f"{flags} {_COUNT_FLAG}={n}".strip()


# ---- small helpers ---------------------------------------------------------------------------------


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Plain aligned text: first column left, others right."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), sep] + [line(r) for r in cells[1:]])


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def _emit(args: argparse.Namespace, text: str, obj: dict[str, Any]) -> None:
    if text:
        print(text)
    if args.json:
        print(json.dumps(obj, sort_keys=False, default=str))


def _available_models() -> list[str]:
    import models

    out = []
    for name in models.names():
        try:
            models.presets(name)
        except ImportError:
            continue  # registered, not written yet
        out.append(name)
    return out


def _spec(name: str, preset: str, **overrides: Any) -> Any:
    """``models.get`` with the user's mistakes turned into one-line ``UsageError``s."""
    import models

    if name not in models.names():
        raise UsageError(f"unknown model {name!r}; choose one of: "
                         f"{', '.join(_available_models())}")
    try:
        presets = models.presets(name)
    except ImportError as e:
        raise UsageError(f"model {name!r} is not implemented yet ({e}); choose one of: "
                         f"{', '.join(_available_models())}") from e
    if preset not in presets:
        raise UsageError(f"model {name!r} has no preset {preset!r}; choose one of: "
                         f"{', '.join(presets)}")
    return models.get(name, preset, **overrides)


def _mesh(text: str, axes: str | None, devices: int | None = None) -> Any:
    """``'2x4'`` (+ optional ``'data,model'``) -> a ``jax.sharding.Mesh`` on the first devices."""
    import jax

    if not re.fullmatch(r"\d+(x\d+)*", text or ""):
        raise UsageError(f"bad mesh {text!r}: write axis sizes joined by 'x', e.g. 8, 2x4, 2x2x2")
    shape = tuple(int(s) for s in text.split("x"))
    if any(s < 1 for s in shape):
        raise UsageError(f"bad mesh {text!r}: every axis size must be at least 1")
    if axes:
        names = tuple(a.strip() for a in axes.split(","))
        if len(names) != len(shape) or len(set(names)) != len(names) or not all(names):
            raise UsageError(f"--axes {axes!r} must name the {len(shape)} axes of mesh {text!r} "
                             "once each, e.g. --axes data,model")
    elif len(shape) in DEFAULT_AXES:
        names = DEFAULT_AXES[len(shape)]
    else:
        raise UsageError(f"mesh {text!r} has {len(shape)} axes: name them with --axes "
                         "(default names exist for 1 to 3 axes)")
    have = len(jax.devices())
    need = math.prod(shape)
    if need > have:
        raise UsageError(f"mesh {text!r} needs {need} devices, but {have} are available; use a "
                         f"smaller mesh or --devices {need} (virtual CPU devices)")
    return jax.make_mesh(shape, names, devices=jax.devices()[:need])


def _mesh_str(mesh: Any) -> str:
    return "x".join(str(n) for n in mesh.devices.shape)


def _policy_names() -> list[str]:
    from nnscaler_jax.plan.policies import BUILTIN

    return sorted(BUILTIN) + ["auto"]


def _check_policy(name: str) -> str:
    if name not in _policy_names():
        raise UsageError(f"unknown policy {name!r}; choose one of: {', '.join(_policy_names())}")
    return name


def _rngs(spec: Any) -> dict[str, Any] | None:
    from nnscaler_jax.capture.trace import spec_rngs

    return spec_rngs(spec)


def _mutable(spec: Any) -> Any:
    return list(spec.mutable) if spec.mutable else False


def _abstract_inputs(spec: Any) -> tuple[tuple[Any, ...], Any]:
    from nnscaler_jax.capture.trace import spec_inputs

    return spec_inputs(spec)


def _capture_spec(spec: Any, **kw: Any) -> Any:
    from nnscaler_jax.capture.trace import capture_spec

    return capture_spec(spec, **kw)


def _make_plan(spec: Any, mesh: Any, policy: str) -> Any:
    """``AutoParallel.make_plan`` on abstract args."""
    from nnscaler_jax import auto_parallel

    args, variables = _abstract_inputs(spec)
    pm = auto_parallel(mesh, policy=policy)(spec.module)
    if spec.kind == "nnx":
        return pm.make_plan(*args)
    return pm.make_plan(*args, variables=variables, rngs=_rngs(spec), mutable=_mutable(spec))


def _cost_dict(plan: Any) -> dict[str, Any] | None:
    import dataclasses

    return dataclasses.asdict(plan.cost) if plan.cost is not None else None


# ---- verification (shared by verify and demo) --------------------------------------------------


def _cmd_graph(args: argparse.Namespace) -> int:
    from nnscaler_jax.ir.graph import Role

    spec = _spec(args.model, args.preset)
    t0 = time.perf_counter()
    captured = _capture_spec(spec)  # unannotated primitives are listed below
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
                f"parameters: {n_params:,} ({_mib(param_bytes)})",
                "",
                _table(["module", "ops", "annotated"],
                       [[k, v[0], v[1]] for k, v in modules.items()]),
            ]
            if unannotated:
                lines += ["", "unannotated primitives (planned replicated; see register_rule):"]
                lines += [f"  {p}: {', '.join(sorted(w))}" for p, w in sorted(unannotated.items())]
        text = "\n".join(lines)
    _emit(args, text, obj)
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    spec = _spec(args.model, args.preset)
    mesh = _mesh(args.mesh, args.axes)
    policy = _check_policy(args.policy)
    t0 = time.perf_counter()
    plan = _make_plan(spec, mesh, policy)
    plan_s = time.perf_counter() - t0
    if args.out:
        with open(args.out, "w") as f:
            f.write(plan.to_json())
    obj = {"model": args.model, "preset": args.preset, "mesh": args.mesh, "policy": policy,
           "plan": json.loads(plan.to_json()), "cost": _cost_dict(plan), "plan_s": plan_s}
    text = ""
    if not args.json:
        text = str(plan) + f"\nplanned in {plan_s:.2f} s (trace + policy)"
        if args.out:
            text += f"\nwrote {args.out}"
    if args.pipeline:
        ptext, obj["pipeline"] = _pipeline_schedule(args, spec)
        text += "\n" + ptext if not args.json else ""
    _emit(args, text, obj)
    return 0


def _pipeline_schedule(args: argparse.Namespace, spec: Any) -> tuple[str, dict[str, Any]]:
    """``plan --pipeline N``: the layer -> stage assignment and the per-device schedule."""
    import jax

    from nnscaler_jax.plan import schedule as sch

    micro = args.microbatches or 2 * args.pipeline
    sched = sch.build(args.schedule, args.pipeline, micro, args.virtual)
    _, variables = _abstract_inputs(spec)
    flat = jax.tree_util.tree_flatten_with_path(variables)[0] if variables is not None else []
    names = [("/".join(str(getattr(k, "key", k)) for k in path), tuple(x.shape))
             for path, x in flat]
    stage_of = sch.stage_layers(names, args.pipeline, sched.virtual)
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


def _cmd_compare(args: argparse.Namespace) -> int:
    import jax

    from nnscaler_jax.cost.model import CostModel
    from nnscaler_jax.errors import PlanError
    from nnscaler_jax.search.abstract import plan_on_axes

    spec = _spec(args.model, args.preset)
    try:  # a real mesh when there are devices enough (compiled figures); else axis sizes only
        mesh = _mesh(args.mesh, args.axes)
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
    planners = [p.strip() if p.strip() == "alpa" else _check_policy(p.strip())
                for p in args.planners.split(",") if p.strip()]
    if not planners:
        raise UsageError(f"--planners is empty; choose from: {', '.join(_policy_names())}, alpa")
    cluster = None
    if args.cluster:
        from nnscaler_jax.cost.devices import CLUSTERS, cluster_preset

        if args.cluster not in CLUSTERS:
            raise UsageError(f"unknown --cluster {args.cluster!r}; presets: {', '.join(CLUSTERS)}")
        cluster = cluster_preset(args.cluster)
    graph = _capture_spec(spec, mutable=_mutable(spec)).graph
    compile_here = isinstance(mesh, jax.sharding.Mesh) and spec.kind == "linen" and \
        args.preset.startswith("tiny")
    results: dict[str, dict[str, Any]] = {}
    rows = []
    for name in planners:
        try:
            cm = None
            if cluster is not None:
                cm = CostModel.for_cluster(cluster, axes, zero=3 if name == "zero3" else 0)
            plan, search_s, _ = plan_on_axes(graph, mesh, name, cost_model=cm)
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
                     _mib(c.memory_bytes_per_device), _mib(c.comm_bytes),
                     _mib(res["compiled_memory_bytes"]) if "compiled_memory_bytes" in res
                     else "-",
                     _mib(res["hlo_comm_bytes"]) if "hlo_comm_bytes" in res else "-", ""])
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
                "(XLA memory / HLO comm: the compiled forward)\n" + _table(headers, rows))
    _emit(args, text, obj)
    return 0


def _compiled_figures(spec: Any, mesh: Any, plan: Any) -> dict[str, int]:
    """XLA's per-device memory and collective bytes of the compiled forward under ``plan``."""
    import jax

    from nnscaler_jax import auto_parallel
    from nnscaler_jax.lower.hlo import hlo_collectives

    try:
        args = spec.make_args(abstract=False)
        pm = auto_parallel(mesh, plan=plan)(spec.module)
        variables = pm.init(jax.random.key(0), *args)
        compiled = pm.compiled(variables, *args, rngs=_rngs(spec), mutable=_mutable(spec))
        m = compiled.memory_analysis()
        memory = (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                  - m.alias_size_in_bytes)
        comm = sum(c.bytes for c in hlo_collectives(compiled.as_text(), mesh))
        return {"compiled_memory_bytes": int(memory), "hlo_comm_bytes": int(comm)}
    except Exception as e:  # noqa: BLE001 - the figures are extras; say why they are missing
        return {"compiled_error": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"}


def _cmd_profile(args: argparse.Namespace) -> int:
    """Time every distinct op of a model on the local backend into a profile database."""
    from pathlib import Path

    import jax

    from nnscaler_jax.cost.profile import DEFAULT_PATH, ProfileDB, profile_ops

    spec = _spec(args.model, args.preset)
    graph = _capture_spec(spec).graph
    t0 = time.perf_counter()
    db = profile_ops(graph, ProfileDB.load(args.out, missing_ok=True), path=args.out,
                     runs=args.runs)
    path = str(Path(args.out or DEFAULT_PATH).expanduser())
    mine = db.keys_of(graph, jax.devices()[0].device_kind)
    rows = sorted(((k, db.entries[k]) for k in mine), key=lambda kv: -kv[1])
    text = "" if args.json else (
        _table(["primitive", "inputs", "outputs", "dtype", "device", "us"],
               [k.split("|") + [f"{v * 1e6:.1f}"] for k, v in rows[:40]])
        + f"\n{len(db)} entries in {path} ({time.perf_counter() - t0:.1f} s)")
    _emit(args, text, {"ok": True, "path": path, "entries": len(db),
                       "profiled": {k: v for k, v in rows}})
    return 0


# ---- parser ------------------------------------------------------------------------------------


def _lazy(name: str) -> Any:
    """A handler defined in :mod:`nnscaler_jax.cli_verify` (imported when it runs)."""
    def run(args: argparse.Namespace) -> int:
        from nnscaler_jax import cli_verify

        return getattr(cli_verify, name)(args)
    return run


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true",
                        help="print one JSON object on the last line")
    common.add_argument("--devices", type=int, default=None,
                        help=f"virtual CPU devices to request (default {DEFAULT_DEVICES}; "
                             "only before JAX starts)")
    model = argparse.ArgumentParser(add_help=False)
    model.add_argument("--model", required=True, help="model zoo name (e.g. gpt, mlp)")
    model.add_argument("--preset", default="tiny", help="model preset (default tiny)")
    mesh = argparse.ArgumentParser(add_help=False)
    mesh.add_argument("--mesh", default="2x4", help="mesh shape, e.g. 8, 2x4 (default 2x4)")
    mesh.add_argument("--axes", default=None,
                      help="mesh axis names, comma separated (default: data | data,model | "
                           "data,fsdp,model)")

    p = argparse.ArgumentParser(prog="nnscaler-jax",
                                description="Automatic parallelization of JAX/Flax models.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    g = sub.add_parser("graph", parents=[common, model], help="trace a model and summarise its graph")
    g.add_argument("--print-ir", action="store_true", help="print the annotated graph")
    g.add_argument("--depth", type=int, default=2, help="module path components per summary row")
    g.set_defaults(fn=_cmd_graph)

    pl = sub.add_parser("plan", parents=[common, model, mesh], help="make and print a plan")
    pl.add_argument("--policy", default="auto", help="dp, zero3, megatron or auto (default)")
    pl.add_argument("--out", default=None, help="write the plan JSON to this file")
    pl.add_argument("--pipeline", type=int, default=0, metavar="N",
                    help="also print the layer -> stage split and per-device schedule of N stages")
    pl.add_argument("--schedule", default="1f1b", choices=("1f1b", "gpipe", "interleaved"),
                    help="pipeline schedule (default 1f1b)")
    pl.add_argument("--microbatches", type=int, default=0, help="default 2 x stages")
    pl.add_argument("--virtual", type=int, default=2, help="chunks per stage (interleaved)")
    pl.add_argument("--gantt", default=None, metavar="PNG", help="write a Gantt chart PNG")
    pl.set_defaults(fn=_cmd_plan)

    v = sub.add_parser("verify", parents=[common, model, mesh],
                       help="compare forward and gradients with the single-device program")
    v.add_argument("--policy", default="auto", help="dp, zero3, megatron or auto (default)")
    v.set_defaults(fn=_lazy('cmd_verify'))

    c = sub.add_parser("compare", parents=[common, model, mesh],
                       help="plan with several planners and compare their cost estimates")
    c.add_argument("--planners", default=DEFAULT_PLANNERS,
                   help=f"comma separated (default {DEFAULT_PLANNERS})")
    c.add_argument("--cluster", default=None,
                   help="price on a cluster preset (e.g. h100-80g-8x) instead of the local CPU")
    c.set_defaults(fn=_cmd_compare)

    d = sub.add_parser("demo", parents=[common, mesh],
                       help="plan, verify and train a tiny GPT (the quickstart)")
    d.add_argument("--policy", default="megatron", help="default megatron")
    d.add_argument("--steps", type=int, default=5, help="training steps (default 5)")
    d.add_argument("--lr", type=float, default=1e-2, help="adamw learning rate (default 1e-2)")
    d.set_defaults(fn=_lazy('cmd_demo'))

    pr = sub.add_parser("profile", parents=[common, model],
                        help="time a model's ops on the local backend into a profile database")
    pr.add_argument("--out", default=None,
                    help="profile database JSON (default ~/.cache/nnscaler_jax/profile.json)")
    pr.add_argument("--runs", type=int, default=5, help="timed runs per op (median kept)")
    pr.set_defaults(fn=_cmd_profile)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (0 ok, 1 check failed, 2 usage error)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if getattr(args, "fn", None) is None:
        parser.print_help()
        return 2
    _request_devices(args.devices)

    from nnscaler_jax.errors import PlanError

    try:
        return args.fn(args)
    except (UsageError, PlanError) as e:
        kind = "error" if isinstance(e, UsageError) else "plan error"
        print(f"nnscaler-jax {args.command}: {kind}: {e}", file=sys.stderr)
        if args.json:
            print(json.dumps({"ok": False, "error": str(e)}))
        return 2
