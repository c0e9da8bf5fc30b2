"""``nnscaler-jax compare``: several planners on one model and mesh, under one memory budget.

Each planner's JSON entry (``{"planners": {name: entry}}``)::

    {"fits": bool, "step_time_s", "memory_bytes_per_device", "comm_bytes", "search_s",
     "features": {"recompute": [...], "cosharded": [[module_path, primitive, dim, chunks]],
                  "microbatches": int, "stages": int}}

The budget: ``--budget`` (bytes or a size string such as ``32GiB``), else with ``--cluster`` the
cluster device's memory less the reserve (:func:`nnscaler_jax.cost.devices.default_budget`),
else none (on CPU; every plan then fits). A planner that finds nothing within it reports
``fits: false`` and its smallest estimate as ``memory_bytes_per_device`` (``step_time_s``,
``comm_bytes`` and ``features`` are then null) instead of failing the command; any other
planning failure is an entry with ``fits: null`` and ``error``.

``--precision`` (``bfloat16``, ``float16``, ``float32``) captures the model once at that compute
precision (the zoo config's ``dtype`` set to it, params and inputs cast on entry, float32 master
weights and optimizer state), so every planner is priced at the same precision.

``--xla`` (with ``--cluster``) compiles each plan's training step for the cluster's GPU with
XLA's GPU compiler on compile-only devices: the entry gains ``xla`` (:mod:`nnscaler_jax.cli.xla`).

``--plan FILE`` (a plan saved by ``plan --out FILE``) adds one row, ``plan:FILE``: the saved plan
checked against this model and mesh (one for another model or mesh: exit 2 saying why) and
priced on the same cost model, under the same budget as the planners (over it: ``fits: false``).

``--plot out.png`` writes :func:`nnscaler_jax.cli.plots.planner_bars` of the results (step time,
memory per device with the budget line, communication per planner); the JSON gains ``"plot"``.
"""

from __future__ import annotations

import argparse
import math
import re
import time
from typing import Any

from nnscaler_jax.cli.common import (
    DEFAULT_AXES,
    UsageError,
    capture_model,
    check_policy,
    cli_terms,
    emit,
    fmt_bytes,
    load_plan,
    model_spec,
    parse_budget,
    parse_mesh,
    policy_names,
    settings_spec,
    spec_mutable,
    table,
)
from nnscaler_jax.cli.xla import check_cluster, xla_entry, xla_text
from nnscaler_jax.mesh.axes import mesh_axes, stage_axis
from nnscaler_jax.plan.view import fused_attention_rows

__all__ = ["cluster_arg", "cmd_compare", "compare_mesh", "compare_mixed", "mixed_entry",
           "one_planner", "plan_features",
           "smallest_estimate"]


def plan_features(plan: Any) -> dict[str, Any]:
    """What a plan uses beyond layouts: recompute groups, co-sharded ops, micro-batches, stages.

    ``recompute``: the plan's recomputed groups (module paths; a pipelined plan: the layers
    recomputed on their own inside their chunks, ``PipelineSettings.recomputed``);
    ``cosharded``: ``[module path,
    primitive, dim, chunks]`` per op run as ``chunks`` sequential pieces, and per co-sharded
    block (``Plan.coshard``) its seed op's; a pipelined plan's come from the in-stage plans
    it priced its stages with (``PipelineSettings.stage_plans``: tensor-parallel cut stages
    under a budget), as do its recompute groups beyond the layers; ``microbatches``: the
    pipeline's (or the plan's gradient accumulation), 1 without; ``stages``: pipeline stages;
    ``schedule`` / ``executor``: the pipeline's schedule and runtime (``'in-graph'`` or
    ``'per-stage'``; a pipelined plan only).
    """
    def jsonable(x: Any) -> Any:
        if isinstance(x, str | int | float) or x is None:
            return x
        if isinstance(x, tuple | list):
            return [jsonable(y) for y in x]
        return str(x)

    micro = (plan.pipeline.microbatches if plan.pipeline is not None
             else getattr(plan, "microbatches", 1))
    # (a pipelined plan runs its own recompute and its stages' in-stage plans, not its SPMD
    # part's groups and chunked ops)
    if plan.pipeline is None:
        groups, cosharded = list(getattr(plan, "recompute", ()) or ()), _cosharded(plan)
    else:
        stage_plans = plan.pipeline.stage_plans
        groups = plan.pipeline.recomputed() + [g for sp in stage_plans for g in sp.recompute]
        cosharded = [row for sp in stage_plans for row in _cosharded(sp)]
    fused = [list(row) for row in fused_attention_rows(plan)]
    return {"recompute": [jsonable(g) for g in groups],
            "fused_attention": fused,
            "cosharded": cosharded,
            "microbatches": int(micro or 1), "stages": int(plan.stages),
            **({"schedule": plan.pipeline.schedule, "executor": plan.pipeline.executor}
               if plan.pipeline is not None else {})}


def _cosharded(plan: Any) -> list[list[Any]]:
    """``[module path, primitive, dim, chunks]`` per op of ``plan`` run in sequential chunks,
    and per co-sharded block its seed op's."""
    by_id = {p.op: p for p in plan.ops}
    blocks = [[by_id[s].module_path, by_id[s].primitive, d, int(k)] if s in by_id else
              [f"op {s}", "", d, int(k)] for s, d, k in getattr(plan, "coshard", ()) or ()]
    return [[p.module_path, p.primitive, p.chunks[0], int(p.chunks[1])]
            for p in plan.ops if p.chunks] + blocks


_SMALLEST = re.compile(r"(?:smallest estimate(?: found)? is|needs(?: an estimated)?)\s+~?"
                       r"([0-9][0-9,]*(?:\.[0-9]+)?)\s*(bytes|MiB|GiB)")


def smallest_estimate(e: Exception) -> int | None:
    """The smallest per-device estimate a no-fit error carries (``NoFitError.smallest_bytes``),
    else the first one its message states; None when it says none.

    >>> smallest_estimate(ValueError("the smallest estimate found is 1,024 bytes (0 GiB)"))
    1024
    """
    got = getattr(e, "smallest_bytes", None)
    if got is not None:
        return int(got)
    m = _SMALLEST.search(str(e))
    if m is None:
        return None
    scale = {"bytes": 1, "MiB": 2**20, "GiB": 2**30}[m.group(2)]
    return int(float(m.group(1).replace(",", "")) * scale)


def compare_mesh(args: argparse.Namespace) -> Any:
    """A real mesh when there are devices enough (compiled figures); else axis sizes only."""
    import jax

    try:
        return parse_mesh(args.mesh, args.axes)
    except UsageError:
        if not re.fullmatch(r"\d+(x\d+)*", args.mesh or ""):
            raise
        shape = tuple(int(n) for n in args.mesh.split("x"))
        names = (tuple(a.strip() for a in args.axes.split(",")) if args.axes
                 else DEFAULT_AXES.get(len(shape)))
        if not names or len(names) != len(shape):
            raise
        return jax.sharding.AbstractMesh(shape, names)


def _budget(args: argparse.Namespace, mesh: Any, cluster: Any) -> tuple[int | None, str, str]:
    """The budget for every planner, where it comes from (``--budget``, the cluster's device,
    none) in a sentence and in a few words."""
    from nnscaler_jax.cost.devices import default_budget_of

    if args.budget is not None:
        budget = parse_budget(args.budget)
        return budget, "--budget", f"{fmt_bytes(budget)} (--budget)"
    default = default_budget_of(mesh, cluster)
    if default is None:
        why = "none (no --budget, no --cluster: CPU devices have no memory limit here)"
        return None, why, "none"
    return default.bytes, default.describe(), default.short()


def cluster_arg(args: argparse.Namespace, mixed: bool = False) -> Any:
    """``--cluster``: a preset (:data:`~nnscaler_jax.cost.devices.CLUSTERS`), or with
    ``mixed`` (``compare``) also groups of several kinds joined with ``+``."""
    if not args.cluster:
        return None
    from nnscaler_jax.cost.devices import CLUSTERS, cluster_preset
    from nnscaler_jax.errors import PlanError

    if "+" in args.cluster and not mixed:
        raise UsageError(f"--cluster {args.cluster}: a cluster of several device kinds is "
                         "planned by compare (--planners auto,metis,uniform)")
    if "+" not in args.cluster and args.cluster.lower() not in CLUSTERS:
        raise UsageError(f"unknown --cluster {args.cluster!r}; presets: {', '.join(CLUSTERS)}"
                         + (", or groups of several kinds joined with '+' (e.g. "
                            "a100-80g-4x+v100-32g-4x)" if mixed else ""))
    try:
        return cluster_preset(args.cluster)
    except PlanError as e:
        raise UsageError(str(e)) from None


def _saved_graph(saved: Any, args: argparse.Namespace, spec: Any, graph: Any,
                 precision: str | None) -> Any:
    """The graph a saved plan prices on: the training step's at its precision, or the module
    alone's for a plan of the module (``plan``'s, ``pm.make_plan``'s: ``train_step`` runs its
    loss outside the plan)."""
    from nnscaler_jax.plan.plan import graph_fingerprint

    if saved.precision != precision:
        spec = model_spec(args.model, args.preset, saved.precision)
        graph = capture_model(spec, mutable=spec_mutable(spec), precision=saved.precision,
                              loss=True).graph
    if saved.fingerprint == graph_fingerprint(graph):
        return graph
    return capture_model(spec, mutable=spec_mutable(spec), precision=saved.precision).graph


def one_planner(name: str, graph: Any, mesh: Any, cluster: Any, budget: int | None,
                pipelined: bool = False, *, constraints: Any = None,
                saved: Any = None) -> tuple[Any, dict]:
    """Plan with one planner: (the plan or None, its JSON entry). ``budget``: the user's
    (``--budget``); None leaves the default to the planner (which says where it came from).
    ``pipelined``: ``mesh`` (``{axis: size}``) has a stage axis; the stage DP picks schedule,
    micro-batches and cuts (``Constraints(pipeline_stages="auto")``). ``constraints``: the
    other plan settings (``plan --cluster``; ``budget`` replaces theirs). ``saved``: a saved
    plan (``--plan FILE``) checked and priced instead of planning (``name`` only labels it)."""
    from dataclasses import replace

    from nnscaler_jax.constraints import Constraints
    from nnscaler_jax.cost.model import CostModel
    from nnscaler_jax.errors import NoFitError, PlanError, PlanFormatError
    from nnscaler_jax.mesh.axes import mesh_axes
    from nnscaler_jax.planner import make_plan, plan_and_report
    from nnscaler_jax.search.entry import Planned

    cm = None
    zero3 = saved.zero == 3 if saved is not None else name == "zero3"
    if cluster is not None:
        cm = CostModel.for_cluster(cluster, mesh_axes(mesh), zero=3 if zero3 else 0)
    cons = replace(constraints or Constraints(), max_memory_per_device=budget,
                   pipeline_stages="auto" if pipelined else getattr(constraints,
                                                                      "pipeline_stages", None))
    none = {"step_time_s": None, "comm_bytes": None, "features": None}
    t0 = time.perf_counter()
    try:
        if saved is not None:
            planned = Planned(make_plan(graph, mesh, plan=saved, constraints=cons, cost_model=cm),
                              time.perf_counter() - t0, None)
        else:
            planned = plan_and_report(graph, mesh, policy=name, cost_model=cm, constraints=cons)
    except PlanError as e:
        if saved is not None and isinstance(e, PlanFormatError):
            raise  # a saved plan for another model or mesh: the command says why (exit 2)
        first = cli_terms(str(e).splitlines()[0])
        if isinstance(e, NoFitError) or first.startswith("no plan fits"):
            return None, {"fits": False, "memory_bytes_per_device": smallest_estimate(e),
                          "search_s": time.perf_counter() - t0, **none, "error": first}
        return None, {"fits": None, "memory_bytes_per_device": None,
                      "search_s": time.perf_counter() - t0, **none, "error": first}
    plan, c = planned.plan, planned.plan.cost
    return plan, {"fits": True, "step_time_s": c.step_time_s,
                  "memory_bytes_per_device": c.memory_bytes_per_device,
                  "comm_bytes": c.comm_bytes, "search_s": planned.seconds,
                  "features": plan_features(plan)}


PIPELINED = ("auto", "alpa")  # the searches; --pipelines lets them use stage x data x model


def best_over_meshes(name: str, graph: Any, mesh: Any, cluster: Any,
                     budget: int | None) -> tuple[Any, dict]:
    """``--pipelines``: the planner on the flat mesh and on every pipelined shape of its devices
    (:func:`~nnscaler_jax.pipeline.stage_dp.stage_meshes`; stages cut and scheduled by the stage
    DP under the same budget), the fastest that fits kept (none fitting: the smallest
    estimate). The entry gains ``mesh`` (the shape chosen) and ``candidates`` (per shape:
    ``mesh``, ``fits``, ``step_time_s``, ``memory_bytes_per_device``, ``error``); the plan
    returned is the chosen one's (None when none fits), for a mesh of that shape. Planners
    other than :data:`PIPELINED` plan the flat mesh only. Pipelined shapes are priced by the
    stage DP, which prices tensor parallelism inside stages as Megatron's (a stack of identical
    layers) or under the planner's in-stage plan of the graph on the tensor axes (a cut model).
    """
    from nnscaler_jax.mesh.axes import mesh_axes
    from nnscaler_jax.pipeline.stage_dp import stage_meshes

    flat = mesh_axes(mesh)
    tried = [(flat, *one_planner(name, graph, mesh, cluster, budget))]
    if name in PIPELINED:
        tried += [(axes, *one_planner(name, graph, axes, cluster, budget, pipelined=True))
                  for axes in stage_meshes(flat)]

    def rank(t: tuple) -> tuple:
        r = t[2]
        order = {True: 0, False: 1, None: 2}[r["fits"]]
        value = r["step_time_s"] if r["fits"] else (r["memory_bytes_per_device"] or float("inf"))
        return order, value

    axes, plan, entry = min(tried, key=rank)
    entry = dict(entry, mesh=axes, search_s=sum(t[2]["search_s"] for t in tried),
                 candidates=[{"mesh": a, "fits": r["fits"], "step_time_s": r["step_time_s"],
                              "memory_bytes_per_device": r["memory_bytes_per_device"],
                              **({"error": r["error"]} if "error" in r else {}),
                              **({"schedule": p.pipeline.schedule,
                                  "microbatches": p.pipeline.microbatches,
                                  "executor": p.pipeline.executor}
                                 if p is not None and p.pipeline is not None else {})}
                             for a, p, r in tried])
    return plan, entry


def _features_text(f: dict[str, Any] | None) -> str:
    if not f:
        return "-"
    parts = [f"recompute {len(f['recompute'])}" if f["recompute"] else "",
             f"co-shard {len(f['cosharded'])}" if f["cosharded"] else "",
             f"{f['microbatches']} micro-batches" if f["microbatches"] > 1 else "",
             f"{f['stages']} stages" if f["stages"] > 1 else "",
             f"fused attention {len(f['fused_attention'])}" if f.get("fused_attention") else ""]
    return ", ".join(p for p in parts if p) or "-"


def _row(name: str, r: dict[str, Any]) -> list[str]:
    fits = {True: "yes", False: "NO", None: "-"}[r["fits"]]
    mem = r["memory_bytes_per_device"]
    mem_text = "-" if mem is None else (">= " if r["fits"] is False else "") + fmt_bytes(mem)
    return [name, fits, f"{r['search_s']:.3f}",
            "-" if r["step_time_s"] is None else f"{r['step_time_s'] * 1e3:.3f}", mem_text,
            "-" if r["comm_bytes"] is None else fmt_bytes(r["comm_bytes"]),
            fmt_bytes(r["compiled_memory_bytes"]) if "compiled_memory_bytes" in r else "-",
            fmt_bytes(r["hlo_comm_bytes"]) if "hlo_comm_bytes" in r else "-",
            *xla_text(r.get("xla")),
            _features_text(r["features"]) + _shape_text(r.get("mesh")), r.get("error", "")[:60]]


def _shape_text(axes: dict[str, int] | None) -> str:
    """`` on stage 2 x data 4`` for a pipelined shape chosen by --pipelines, else empty."""
    if not axes or stage_axis(axes) is None:
        return ""
    return " on " + " x ".join(f"{a} {k}" for a, k in axes.items())


def _precision(args: argparse.Namespace) -> str | None:
    from nnscaler_jax.capture.precision import precision_name
    from nnscaler_jax.errors import PlanError

    try:
        return precision_name(getattr(args, "precision", None))
    except PlanError:
        raise UsageError(f"bad --precision {args.precision!r}; choose bfloat16, float16 or "
                         "float32 (default: the model's own dtypes)") from None


def _attention(args: argparse.Namespace) -> Any:
    """``--attention fused|ring|zigzag``: the constraints every planner plans under (None:
    none)."""
    if getattr(args, "attention", None) is None:
        return None
    if getattr(args, "pipelines", False):
        raise UsageError(f"--attention {args.attention} plans SPMD programs: drop --pipelines, "
                         "or --attention")
    from nnscaler_jax.constraints import Constraints

    return Constraints(attention=args.attention)


def cmd_compare(args: argparse.Namespace) -> int:
    import jax

    precision = _precision(args)
    spec = settings_spec(args, precision)
    mesh = compare_mesh(args)
    planners = [p.strip() for p in args.planners.split(",") if p.strip()]
    if not planners:
        raise UsageError(f"--planners is empty; choose from: {', '.join(policy_names())}")
    check_cluster(args)
    cluster = cluster_arg(args, mixed=True)
    if hasattr(cluster, "groups"):  # several device kinds: the stage planners
        return compare_mixed(args, spec, mesh, cluster, planners, precision)
    planners = [check_policy(p) for p in planners]
    budget, source, short = _budget(args, mesh, cluster)
    explicit = budget if args.budget is not None else None
    # the training step's graph (the module and its loss): what train_step plans and runs
    graph = capture_model(spec, mutable=spec_mutable(spec), precision=precision,
                          loss=True).graph
    compile_here = isinstance(mesh, jax.sharding.Mesh) and spec.kind == "linen" and \
        args.preset.startswith("tiny")
    results: dict[str, dict[str, Any]] = {}
    saved = load_plan(args.plan) if getattr(args, "plan", None) else None
    attention = _attention(args)
    for name in planners + ([f"plan:{args.plan}"] if saved is not None else []):
        if name.startswith("plan:"):  # the saved plan, priced under the same budget
            here = _saved_graph(saved, args, spec, graph, precision)
            plan, results[name] = one_planner(name, here, mesh, cluster, budget, saved=saved)
        elif getattr(args, "pipelines", False):
            plan, results[name] = best_over_meshes(name, graph, mesh, cluster, explicit)
        else:
            plan, results[name] = one_planner(name, graph, mesh, cluster, explicit,
                                              constraints=attention)
        if plan is not None and compile_here and plan.pipeline is None:
            results[name].update(_compiled_figures(spec, mesh, plan))
        if plan is not None and getattr(args, "xla", False):
            results[name]["xla"] = xla_entry(spec, plan, cluster,
                                             results[name].get("mesh") or mesh_axes(mesh))
    obj = {"ok": True, "model": args.model, "preset": args.preset, "mesh": args.mesh,
           "cluster": args.cluster, "budget_bytes": budget, "budget": source,
           "precision": precision, "planners": results}
    if getattr(args, "plot", None):
        obj["plot"] = _write_plot(obj, args.plot)
    text = ""
    if not args.json:
        headers = ["planner", "fits", "plan s", "step ms", "memory/device", "comm",
                   "XLA memory", "HLO comm", "XLA:GPU peak", "XLA/est", "features", "note"]
        rows = [_row(n, r) for n, r in results.items()]
        keep = [i for i, h in enumerate(headers) if i < 6 or h == "features"
                or any(r[i] not in ("", "-") for r in rows)]  # drop empty extra columns
        headers, rows = [headers[i] for i in keep], [[r[i] for i in keep] for r in rows]
        text = (f"{args.model} [{args.preset}] on mesh {args.mesh}"
                f"{f' ({args.cluster})' if args.cluster else ''}: estimated per training step"
                f"{' (XLA memory / HLO comm: the compiled forward)' if compile_here else ''}; "
                f"memory budget per device {short}"
                f"{f'; compute precision {precision}' if precision else ''}\n"
                + table(headers, rows) + (f"\nwrote {obj['plot']}" if "plot" in obj else ""))
    emit(args, text, obj)
    return 0


def _write_plot(results: dict[str, Any], path: str) -> str:
    """``--plot``: :func:`nnscaler_jax.cli.plots.planner_bars` of ``results`` as a PNG."""
    from nnscaler_jax.cli.plots import planner_bars

    try:
        planner_bars(results).savefig(path, dpi=120)
    except OSError as e:
        raise UsageError(f"cannot write --plot {path!r}: {e.strerror or e}") from None
    return path


def _compiled_figures(spec: Any, mesh: Any, plan: Any) -> dict[str, Any]:
    """XLA's per-device memory and collective bytes of the training step compiled under
    ``plan`` (here, on the CPU devices): the step ``train`` runs, AdamW, the state donated."""
    import jax
    import optax

    from nnscaler_jax.api import auto_parallel
    from nnscaler_jax.lower.hlo import hlo_collectives

    try:
        args = spec.make_args(abstract=False)
        pm = auto_parallel(mesh, plan=plan)(spec.module)
        step = pm.train_step(spec.loss_fn, optax.adamw(1e-4),
                             rng_streams=spec.rng_streams or ("dropout",))
        state, laid = step.abstract_init(spec.init_abstract(), *args,
                                         rng=jax.random.key(0) if spec.rng_streams else None)
        compiled = step.jitted.lower(state, laid).compile()
        m = compiled.memory_analysis()
        memory = (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                  - m.alias_size_in_bytes)
        comm = sum(c.bytes for c in hlo_collectives(compiled.as_text(), mesh))
        return {"compiled_memory_bytes": int(memory), "hlo_comm_bytes": int(comm)}
    except Exception as e:  # noqa: BLE001 - the figures are extras; say why they are missing
        return {"compiled_error": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"}


def mixed_entry(plan: Any, error: Exception | None = None) -> dict[str, Any]:
    """A mixed-cluster planner's JSON entry: the flat entries' keys, ``stages`` (per stage its
    kind, devices, tp x dp, units and layers, in-stage policy, recompute groups and co-sharded
    ops of its plan, time and memory against its kind's budget) and ``microbatches``."""
    if plan is None:
        from nnscaler_jax.errors import NoFitError

        return {"fits": False if isinstance(error, NoFitError) else None,
                "step_time_s": None, "comm_bytes": None,
                "memory_bytes_per_device": getattr(error, "smallest_bytes", None),
                "search_s": 0.0, "features": None,
                "error": cli_terms(str(error).splitlines()[0])}
    body = plan.to_json()
    for st, js in zip(plan.stages, body["stages"], strict=True):
        js["policy"] = st.policy
        js["recompute_groups"] = list(st.plan.recompute) if st.plan is not None else []
        js["cosharded"] = _cosharded(st.plan) if st.plan is not None else []
    features = {"recompute": sorted({g for js in body["stages"] for g in js["recompute_groups"]}),
                "cosharded": [c for js in body["stages"] for c in js["cosharded"]],
                "microbatches": plan.microbatches, "stages": len(plan.stages),
                "schedule": "groups" if plan.grouped else "1f1b"}
    return {"fits": plan.fits, "step_time_s": plan.step_time_s,
            "memory_bytes_per_device": plan.memory_bytes_per_device, "comm_bytes": None,
            "search_s": plan.search_s, "features": features, "stages": body["stages"],
            "microbatch_size": plan.microbatch_size, "shares": body["shares"]}


def _mixed_xla(plan: Any, graph_at: Any) -> dict[str, Any]:
    """``--xla`` on a mixed cluster: each stage compiled by XLA:GPU for its own kind
    (:func:`~nnscaler_jax.train.xla_gpu.check_mixed_stages`), the judge of each planner's
    choices; ``{"error", "fits": False}`` where it cannot."""
    import jax

    from nnscaler_jax.errors import PlanError
    from nnscaler_jax.train.xla_gpu import check_mixed_stages

    try:
        return check_mixed_stages(plan, graph_at)
    except (PlanError, jax.errors.JaxRuntimeError) as e:  # (a stage XLA:GPU cannot compile)
        return {"error": cli_terms(str(e).splitlines()[0]), "fits": False}


def _xla_text(r: dict[str, Any]) -> str:
    """``XLA:GPU 32.4 / 67.1 | 9.7 / 28.8 GiB`` (each stage's peak of its kind's budget)."""
    x = r.get("xla")
    if not x:
        return ""
    if "error" in x:
        return f"XLA:GPU: {x['error'][:60]}"
    g = 2**30
    return "XLA:GPU " + " | ".join(f"{st['peak_bytes'] / g:.1f} / {st['budget_bytes'] / g:.1f}"
                                   for st in x["stages"]) + " GiB"


def _stages_text(r: dict[str, Any]) -> str:
    """``A100-80G x4 tp4: <prefix>..h_22 | V100-32G x4 tp4: h_23..<suffix>``; groups side by
    side (``shares``): ``A100-80G x4 tp4: 46 rows | V100-32G x4 tp4: 18 rows``."""
    shares = r.get("shares")
    return " | ".join(f"{st['kind']} x{st['devices'][1] - st['devices'][0] + 1} tp{st['tp']}"
                      f"{' dp' + str(st['dp']) if st['dp'] > 1 else ''}: "
                      + (f"{shares[k]} rows" if shares else
                         f"{st['layers'][0]}..{st['layers'][1]}")
                      + f"{' (recompute)' if st['recompute_groups'] else ''}"
                      for k, st in enumerate(r.get("stages") or []))


def compare_mixed(args: argparse.Namespace, spec: Any, mesh: Any, cluster: Any,
                  planners: list[str], precision: str | None) -> int:
    """``compare --cluster a100-80g-4x+v100-32g-4x``: pipelines over groups of several device
    kinds (:mod:`~nnscaler_jax.pipeline.hetero`), by ours (``auto``), the Metis-style planner
    (``metis``) and the heterogeneity-unaware one (``uniform``): each planner's first choice
    whose stages, planned and priced for their own kinds, fit
    (:func:`~nnscaler_jax.pipeline.hetero.plan_realized`)."""
    from nnscaler_jax.errors import PlanError
    from nnscaler_jax.mesh.axes import mesh_axes
    from nnscaler_jax.pipeline.hetero import PLANNERS, kind_units, plan_realized

    wrong = [p for p in planners if p not in PLANNERS]
    if wrong:
        raise UsageError(f"--cluster {cluster.name} mixes device kinds: planners "
                         f"{', '.join(PLANNERS)} (not {', '.join(wrong)})")
    devices = math.prod(mesh_axes(mesh).values())
    if devices != cluster.devices:
        raise UsageError(f"--mesh {args.mesh} has {devices} devices, --cluster {cluster.name} "
                         f"{cluster.devices}: give --mesh {cluster.devices}")
    if getattr(args, "pipelines", False) or getattr(args, "plan", None):
        raise UsageError("--pipelines and --plan plan one-kind clusters; a cluster of "
                         "several kinds is planned as pipelines by its own planners")
    budget = parse_budget(args.budget) if args.budget is not None else None
    graph = capture_model(spec, mutable=spec_mutable(spec), precision=precision,
                          loss=True).graph
    batch = next((t.shape[0] for t in graph.inputs if t.role.name == "INPUT" and t.shape), None)
    if batch is None:
        raise UsageError(f"--model {args.model}: no batched input to pipeline over micro-batches")
    traced = {batch: graph}

    def graph_at(rows: int) -> Any:  # (the model at a stage's rows per micro-batch)
        if rows not in traced:
            at = model_spec(args.model, args.preset, precision, batch_size=rows)
            traced[rows] = capture_model(at, mutable=spec_mutable(at), precision=precision,
                                         loss=True).graph
        return traced[rows]

    try:
        units = kind_units(graph, cluster, batch)
    except PlanError as e:
        raise UsageError(f"--cluster {cluster.name}: {cli_terms(str(e))}") from None
    results: dict[str, dict[str, Any]] = {}
    for name in planners:
        t0 = time.perf_counter()
        try:
            judge = (lambda p: _mixed_xla(p, graph_at)) if getattr(args, "xla", False) \
                else None  # (XLA:GPU judges each plan: one over a stage's budget is not one)
            plan = plan_realized(units, cluster, batch, graph_at, planner=name,
                                 budget=budget, judge=judge)
            results[name] = dict(mixed_entry(plan), search_s=time.perf_counter() - t0)
            if plan.xla is not None:
                results[name]["xla"] = plan.xla
        except PlanError as e:
            results[name] = dict(mixed_entry(None, e), search_s=time.perf_counter() - t0)
    budgets = {g.name: b for g, b in zip(cluster.groups, cluster.budgets(budget), strict=True)}
    obj = {"ok": True, "model": args.model, "preset": args.preset, "mesh": args.mesh,
           "cluster": cluster.name, "budget_bytes": budgets,
           "budget": "--budget" if budget is not None else
           "each kind's memory less a 10% reserve", "precision": precision,
           "global_batch": batch, "planners": results}
    text = ""
    if not args.json:
        rows = [[n, {True: "yes", False: "NO", None: "-"}[r["fits"]], f"{r['search_s']:.2f}",
                 "-" if r["step_time_s"] is None else f"{r['step_time_s'] * 1e3:.1f}",
                 "-" if r["memory_bytes_per_device"] is None
                 else fmt_bytes(r["memory_bytes_per_device"]),
                 _stages_text(r) or r.get("error", "")[:80], _xla_text(r)]
                for n, r in results.items()]
        text = (f"{args.model} [{args.preset}] on {cluster.name} ({cluster.devices} devices), "
                f"global batch {batch}, pipelines 1F1B (or rows: data-parallel groups on uneven "
                "shares); budgets "
                + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in budgets.items())
                + (f"; compute precision {precision}" if precision else "") + "\n"
                + table(["planner", "fits", "plan s", "step ms", "memory/device",
                         "stages (kind x devices, tp x dp: layers or rows)",
                         "XLA:GPU peak / budget per stage"][:6 + any(r[6] for r in rows)],
                        [r[:6 + any(r[6] for r in rows)] for r in rows]))
    emit(args, text, obj)
    return 0
