"""A plan's training step compiled by XLA's GPU compiler, on compile-only devices: the judge of
the cost model's memory.

:func:`check_step` lowers what ``step(state, *batch)`` runs (forward, backward, the optax update,
the state donated) over a mesh of compile-only GPUs
(:func:`~nnscaler_jax.cost.devices.compile_only_mesh`) and reads back:

- ``peak_bytes``: ``memory_analysis()``'s argument + output + temp - alias per device (on GPU
  the buffer assignment's peak: the state, the batch, and the largest set of live temporaries
  the scheduler leaves; what a real H100's allocator peaked at within 0.5% on the two jobs of
  ``results/bench_gpu.md``);
- ``fits``: that peak is at most the device's memory;
- ``xla_remat``: XLA's own rematerialization ran because the program exceeded the device's
  memory (its "Can't reduce memory use below" warning, or instructions it renamed ``.remat``):
  the plan did not fit by XLA's measure;
- ``involuntary_remat``: "Involuntary full rematerialization" warnings of the SPMD partitioner
  (a layout change it could only make by gathering a whole tensor);
- ``collectives``: ``{kind: {count, bytes}}`` of the compiled HLO, after XLA:GPU's combiners.

No device means no autotuning: GEMM configurations are XLA's defaults (Triton split-K
workspaces show in small programs).
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from nnscaler_jax.cost.devices import default_budget_of
from nnscaler_jax.lower.hlo import hlo_collectives, hlo_traffic, xla_stderr

__all__ = ["XlaCheck", "check_compiled", "check_mixed_stages", "check_stages", "check_step",
           "collective_totals"]

# the suite's XLA:CPU remat flag (mesh/cpu.py) has no meaning on GPU, where it breaks the
# compile ("Unsupported instruction opcode: opt-barrier"): every GPU compile runs all passes
GPU_COMPILER_OPTIONS = {"xla_disable_hlo_passes": ""}
_NO_TILING = "Couldn't find output tile sizes"

_INVOLUNTARY = "Involuntary full rematerialization"
_XLA_REMAT = re.compile(r"Can't reduce memory use below")
_REMAT_NAME = re.compile(r"^\s*(?:ROOT\s+)?%[\w.\-]*\.remat\d*\b", re.MULTILINE)


@dataclass(frozen=True)
class XlaCheck:
    """What XLA's GPU compiler made of one training step (per device)."""

    device: str
    peak_bytes: int
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    device_memory_bytes: int
    fits: bool
    xla_remat: bool
    involuntary_remat: int
    collectives: dict[str, dict[str, int]] = field(default_factory=dict)
    comm_bytes: int = 0  # the collectives' plan_bytes: comparable with a plan's comm_bytes
    compile_s: float = 0.0
    notes: tuple[str, ...] = ()
    # asked for (``traffic_min_bytes``): the bytes of large buffers its kernels move
    # (:func:`~nnscaler_jax.lower.hlo.hlo_traffic`): ``{"min_bytes", "bytes", "kernels",
    # "by_kind"}``
    traffic: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["notes"] = list(self.notes)
        if self.traffic is None:
            del out["traffic"]
        return out


def collective_totals(hlo_text: str, mesh: Any) -> dict[str, dict[str, int]]:
    """``{kind: {"count", "bytes", "plan_bytes"}}`` of the collectives in compiled HLO text,
    each counted as often as it runs (a loop body's, its trip count) (``bytes``: result bytes; ``plan_bytes``: as a plan's ``comm_bytes`` counts them, result
    bytes for all-reduce, all-gather and permutes, group size x result bytes for
    reduce-scatter and all-to-all)."""
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape, strict=True))
    out: dict[str, dict[str, int]] = {}
    for c in hlo_collectives(hlo_text, mesh):
        e = out.setdefault(c.kind, {"count": 0, "bytes": 0, "plan_bytes": 0})
        e["count"] += c.times
        e["bytes"] += c.bytes * c.times
        group = 1
        for a in c.axes:
            group *= sizes.get(a, 1)
        e["plan_bytes"] += c.bytes * c.times * (
            group if c.kind in ("reduce_scatter", "all_to_all") else 1)
    return dict(sorted(out.items()))


def check_compiled(compiled: Any, log: str, mesh: Any, compile_s: float = 0.0,
                   traffic_min_bytes: int | None = None) -> XlaCheck:
    """An :class:`XlaCheck` of a compiled program and what XLA logged compiling it;
    ``traffic_min_bytes``: also the traffic of its buffers of at least that size."""
    m = compiled.memory_analysis()
    peak = int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
               - m.alias_size_in_bytes)
    text = compiled.as_text()
    kind = str(mesh.devices.flat[0].device_kind)
    budget = default_budget_of(mesh)  # the device's memory (a preset's, by its kind)
    memory = budget.memory_bytes if budget is not None else 0
    collectives = collective_totals(text, mesh)
    notes = []
    renamed = len(_REMAT_NAME.findall(text))
    if renamed:
        notes.append(f"XLA rematerialized {renamed} instructions")
    warned = bool(_XLA_REMAT.search(log))
    if warned:
        notes.append(next(line.strip() for line in log.splitlines()
                          if _XLA_REMAT.search(line))[:300])
    return XlaCheck(
        device=kind, peak_bytes=peak, argument_bytes=int(m.argument_size_in_bytes),
        output_bytes=int(m.output_size_in_bytes), temp_bytes=int(m.temp_size_in_bytes),
        alias_bytes=int(m.alias_size_in_bytes), device_memory_bytes=memory,
        fits=bool(memory == 0 or peak <= memory), xla_remat=bool(renamed or warned),
        involuntary_remat=log.count(_INVOLUNTARY), collectives=collectives,
        comm_bytes=sum(e["plan_bytes"] for e in collectives.values()), compile_s=compile_s,
        notes=tuple(notes), traffic=None if traffic_min_bytes is None else _traffic(
            text, traffic_min_bytes))


def _traffic(text: str, min_bytes: int) -> dict[str, Any]:
    t = hlo_traffic(text, min_bytes)
    return {"min_bytes": min_bytes, "bytes": t.bytes, "kernels": t.kernels, "by_kind": t.by_kind}


def check_step(step: Any, variables: Any, batch: Sequence[Any], *, rng: Any = None,
               echo: bool = False, traffic_min_bytes: int | None = None) -> XlaCheck:
    """Compile ``step`` (an SPMD ``pm.train_step(...)`` of a wrapper over a compile-only mesh)
    for its GPU and check it: nothing is allocated, ``variables`` and ``batch`` may be
    ``jax.ShapeDtypeStruct`` values. ``echo``: also write XLA's log to stderr.
    ``traffic_min_bytes``: also count the traffic of buffers of at least that size.

    Raises:
        PlanError: a pipelined step (its stages are separate programs), or an nnx module.
    """
    import jax

    from nnscaler_jax.errors import PlanError

    if not hasattr(step, "abstract_init"):
        raise PlanError(f"check_step compiles an SPMD train step; got {type(step).__name__} (a "
                        "pipelined plan's stages compile as separate programs)")
    state, laid = step.abstract_init(variables, *batch, rng=rng)
    t0 = time.perf_counter()
    options = {**(step.compiler_options or {}), **GPU_COMPILER_OPTIONS}
    note = None
    with xla_stderr(echo=echo) as log:
        lowered = step.jitted.lower(state, laid)
        try:
            compiled = lowered.compile(options)
        except jax.errors.JaxRuntimeError as e:
            if _NO_TILING not in str(e):
                raise
            # XLA's Triton GEMM emitter finds no tiling for a matmul (jax 0.10.2; MoE's
            # expert matmuls): compile with cuBLAS GEMMs instead, and say so
            compiled = lowered.compile({**options, "xla_gpu_enable_triton_gemm": False})
            note = "compiled with xla_gpu_enable_triton_gemm=false (no Triton tiling found)"
    check = check_compiled(compiled, log[0], step.mesh, time.perf_counter() - t0,
                           traffic_min_bytes)
    return check if note is None else replace(check, notes=(*check.notes, note))



def _boundary_bytes(prog: Any, g: int) -> int:
    """Bytes a device of stage ``g`` keeps of its chunks' inputs (the boundary values the
    previous stage sent) for their backwards: the schedule's peak micro-batch chunks in
    flight on the stage times its largest chunk input."""
    import numpy as np

    from nnscaler_jax.pipeline.steps import peak_in_flight

    def nbytes(a: Any) -> int:
        return int(np.prod(a.sharding.shard_shape(a.shape))) * np.dtype(a.dtype).itemsize

    sizes = [sum(nbytes(a) for a in prog.abstract_args(c, "F")[1])
             for c in range(prog.cut.chunks) if prog.seg_stage[c] == g]
    return peak_in_flight(prog.schedule)[g] * max(sizes, default=0)


def check_stages(step: Any, variables: Any, batch: Sequence[Any], *,
                 rng: Any = None) -> dict[str, Any]:
    """Compile every program of a pipelined step that runs one program per stage
    (``pm.train_step`` of a plan whose executor is ``'per-stage'``: tensor-parallel cut
    stages, :class:`~nnscaler_jax.pipeline.mpmd.MpmdProgram`, over a compile-only mesh) for its
    GPU, and judge each stage: nothing is allocated (``variables`` and ``batch`` may be
    abstract).

    Per stage: the :class:`XlaCheck` figures of the programs on its devices (its blocks and
    optax update; with ``interlaced`` also those of every device, ``'all H 3'``...) and
    ``peak_bytes``: the largest of an optax update's peak (parameters, gradients, optimizer
    state, scratch) beside the other group's state, and, per block program, what the devices
    hold (``state_bytes``: parameters, optimizer state and gradient accumulators of the stage
    and of the all-device blocks, and the chunk inputs it keeps for its backwards: the
    schedule's peak micro-batches in flight times its largest chunk input: ``inputs_bytes``)
    with the block's scratch and new results (temp + output - alias). The entry:
    ``{"stages": [...], "peak_bytes", "fits", "xla_remat", "involuntary_remat", "device",
    "device_memory_bytes", "compile_s"}``.

    Raises:
        PlanError: a step whose program is not per stage (the in-graph runtimes compile as
            one program: ``step.lower``), or whose optimizer couples leaves across stages
            (its update runs on the whole mesh, not per stage).
    """
    import numpy as np

    from nnscaler_jax.errors import PlanError

    step.build(variables, *batch, rng=rng)
    prog = step.program
    if not hasattr(prog, "block_programs"):
        raise PlanError(f"check_stages compiles the per-stage programs of tensor-parallel cut "
                        f"stages; this step runs {type(prog).__name__} (one program: "
                        "step.lower(...).compile())")
    size = lambda j, sh: int(np.prod(sh.shard_shape(prog.param_avals[j].shape))) \
        * np.dtype(prog.param_avals[j].dtype).itemsize
    groups: dict[int, dict[str, Any]] = {}
    t0 = time.perf_counter()
    for g, name, lowered in prog.block_programs(step.optimizer):
        with xla_stderr() as log:
            compiled = lowered.compile(GPU_COMPILER_OPTIONS)
        check = check_compiled(compiled, log[0], prog.sub[g])
        groups.setdefault(g, {})[name] = check
    S = prog.schedule.stages

    def state(g: int) -> int:  # parameters, optimizer state, gradient accumulators
        params = sum(size(j, prog.leaf_sharding(g, j)) for j in prog.stage_leaves[g])
        acc = sum(size(j, prog.leaf_sharding(g, j)) for j in prog.acc_leaves(g))
        return groups[g]["update"].argument_bytes - params + acc  # (update: params, grads,
        # optimizer state)

    extra = lambda c: c.temp_bytes + c.output_bytes - c.alias_bytes
    inputs = {g: _boundary_bytes(prog, g) if g < S else 0 for g in groups}
    held = {g: state(g) + inputs[g] for g in groups}
    every = {g: held[g] for g in groups if g >= S}  # (on the stages' devices too)
    out = []
    for g in range(S):
        mine = {**groups[g], **{f"all {n}": c for a in every for n, c in groups[a].items()}}
        resident = held[g] + sum(every.values())
        peak = max([groups[g]["update"].peak_bytes + sum(every.values())]
                   + [groups[a]["update"].peak_bytes + held[g] for a in every]
                   + [resident + extra(c) for n, c in mine.items() if "update" not in n])
        memory = groups[g]["update"].device_memory_bytes
        out.append({"stage": g, "device": groups[g]["update"].device, "peak_bytes": peak,
                    "state_bytes": resident, "inputs_bytes": inputs[g],
                    "fits": memory == 0 or peak <= memory,
                    "programs": {n: {k: v for k, v in c.to_json().items()
                                     if k in ("peak_bytes", "temp_bytes", "argument_bytes",
                                              "output_bytes", "alias_bytes", "xla_remat",
                                              "involuntary_remat", "notes")}
                                 for n, c in mine.items()}})
    flat = [c for checks in groups.values() for c in checks.values()]
    return {"stages": out, "peak_bytes": max(s["peak_bytes"] for s in out),
            "fits": all(s["fits"] for s in out), "xla_remat": any(c.xla_remat for c in flat),
            "involuntary_remat": sum(c.involuntary_remat for c in flat),
            "device": flat[0].device, "device_memory_bytes": flat[0].device_memory_bytes,
            "compile_s": time.perf_counter() - t0}


def check_mixed_stages(plan: Any, graph_at: Any) -> dict[str, Any]:
    """Compile each stage of a pipeline over several device kinds
    (:func:`~nnscaler_jax.pipeline.hetero.realize`'s plan: every stage has its in-stage plan)
    for its own GPU kind, on compile-only devices of that kind (``tp`` of them: one
    data-parallel replica; meshes of several kinds in one process), and judge each stage
    against its kind's budget.

    Per stage the program is one micro-batch's backward of the stage's ops (its part of
    ``graph_at(rows)``, the model traced at the stage's rows per micro-batch
    ``microbatch_size / dp``, the stage's plan renumbered onto it), its forward recomputed from
    its input as the pipeline runtime runs it (a group of a grouped plan, data parallel across
    the kinds: the whole model on its rows per micro-batch, as its plan runs it); its XLA peak (arguments + outputs +
    temporaries - aliases: the weights as stored, the stage input and the output cotangent,
    the gradients) plus what lives beside it in a step: Adam's two moments and, over several
    micro-batches, the gradient accumulator (each the stage's weights as stored, float32) and
    the inputs of the other micro-batches 1F1B keeps in flight. Returns ``{"stages": [{"kind", "device" (the ``device_kind`` it
    compiled for), "xla_bytes", "state_bytes", "inflight_bytes", "peak_bytes",
    "budget_bytes", "estimate_bytes" (the plan's), "fits", "xla_remat", "involuntary_remat",
    "compile_s"}], "fits"}``.

    Raises:
        PlanError: a stage without its in-stage plan (not realized), or whose plan does not
            match the traced stage's ops.
    """
    import jax
    import numpy as np

    from nnscaler_jax.cost.devices import compile_only_mesh, device_preset
    from nnscaler_jax.errors import PlanError
    from nnscaler_jax.ir.graph import Role
    from nnscaler_jax.lower.replay import Lowering
    from nnscaler_jax.pipeline.in_stage import part_graph
    from nnscaler_jax.pipeline.units import unit_parts
    from nnscaler_jax.plan.reuse import renumbered

    S, M = len(plan.stages), plan.microbatches
    out = []
    for k, st in enumerate(plan.stages):
        if st.plan is None:
            raise PlanError(f"stage {k} of the {plan.planner} plan has no in-stage plan: "
                            "realize(plan, ...) it first")
        rows = plan.rows(k)
        graph = graph_at(rows)
        parts = unit_parts(graph, blocks=True)
        part = part_graph(graph, {op.id for _, ops in parts[slice(*st.units)] for op in ops})
        sp = renumbered(st.plan, part)
        if sp is None:
            raise PlanError(f"stage {k}: its plan does not match the model traced at {rows} "
                            "rows (another model or batch layout?)")
        mesh = compile_only_mesh(device_preset(st.kind.split(" ")[0]), (st.slot.tp,),
                                 ("model",))
        low = Lowering(part, sp, mesh)
        shard = low.input_shardings()
        # differentiated: the weights and the earlier stages' activations (not the batch)
        diff = [t.role not in (Role.RNG, Role.INPUT)
                and np.issubdtype(np.dtype(t.dtype), np.floating) for t in part.inputs]
        avals = [jax.ShapeDtypeStruct(t.shape, np.dtype(t.dtype), sharding=s)
                 for t, s in zip(part.inputs, shard, strict=True)]
        out.append(_mixed_stage(k, S, M, st, low, part, avals, diff, mesh,
                                grouped=plan.grouped))
    return {"stages": out, "fits": all(s["fits"] for s in out)}


def _mixed_stage(k, S, M, st, low, part, avals, diff, mesh, grouped: bool = False
                 ) -> dict[str, Any]:
    """One stage of :func:`check_mixed_stages`: its forward + backward compiled and judged
    (``grouped``: a group of data parallelism across kinds, running its plan as it is, one
    micro-batch at a time)."""
    import jax

    from nnscaler_jax.ir.graph import Role

    inputs = [a for a, d in zip(avals, diff, strict=True) if d]
    fixed = [a for a, d in zip(avals, diff, strict=True) if not d]

    def run(xs, ys):
        return low(*_merge(xs, ys, diff))

    # (the forward again from the stage input, in the backward)
    body = run if grouped else jax.checkpoint(run)
    outs = jax.eval_shape(run, inputs, fixed)
    cts = [jax.ShapeDtypeStruct(o.shape, o.dtype) for o in outs]

    def fwd_bwd(xs, ys, cts):
        _, vjp = jax.vjp(lambda a: body(a, ys), xs)
        return vjp([c.astype(o.dtype) for c, o in zip(cts, outs, strict=True)])[0]

    t0 = time.perf_counter()
    with jax.set_mesh(mesh), xla_stderr() as log:
        compiled = jax.jit(fwd_bwd).lower(inputs, fixed, cts).compile(GPU_COMPILER_OPTIONS)
    check = check_compiled(compiled, log[0], mesh, time.perf_counter() - t0)
    weights = sum(_stored_bytes(a) for a, t in zip(avals, part.inputs, strict=True)
                  if t.role is Role.VARIABLE)
    stage_in = sum(_stored_bytes(a) for a, t in zip(avals, part.inputs, strict=True)
                   if t.role is not Role.VARIABLE)  # (what the stage keeps to recompute)
    # Adam's two moments, and the gradient accumulator over several micro-batches (the
    # program's arguments hold the weights, its outputs one micro-batch's gradients)
    state = (2 + (M > 1)) * weights
    inflight = 0 if grouped else (min(S - k, M) - 1) * stage_in
    peak = check.peak_bytes + state + inflight
    return {"kind": st.kind, "device": check.device, "xla_bytes": check.peak_bytes,
            "state_bytes": state,
            "inflight_bytes": inflight, "peak_bytes": peak, "budget_bytes": st.budget_bytes,
            "estimate_bytes": st.memory_bytes, "fits": peak <= st.budget_bytes,
            "xla_remat": check.xla_remat, "involuntary_remat": check.involuntary_remat,
            "compile_s": check.compile_s}


def _merge(xs, ys, diff):
    it, jt = iter(xs), iter(ys)
    return [next(it) if d else next(jt) for d in diff]


def _stored_bytes(aval: Any) -> int:
    """Bytes one device stores of ``aval`` (its sharding's shard)."""
    import numpy as np

    shape = aval.sharding.shard_shape(aval.shape) if aval.sharding is not None else aval.shape
    return int(np.prod(shape)) * np.dtype(aval.dtype).itemsize
