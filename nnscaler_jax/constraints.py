"""``Constraints``: what users fix or forbid; validated against the graph and mesh."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from nnscaler_jax.errors import PlanError
from nnscaler_jax.ir.graph import Graph

__all__ = ["Constraints", "Rule"]


@dataclass(frozen=True)
class Rule:
    """A per-op rule, selecting ops by module path glob and/or primitive.

    Attributes:
        module: glob over module paths (``'blk*/mlp/*'``), None for any.
        primitive: primitive name, None for any.
        dims: the op may be split only along these annotated dims.
        axes: ... and only over these mesh axes.
        replicate: the op is not split at all.
        recompute: activations of these ops are recomputed in the backward pass.
    """

    module: str | None = None
    primitive: str | None = None
    dims: tuple[str, ...] | None = None
    axes: tuple[str, ...] | None = None
    replicate: bool = False
    recompute: bool = False

    def matches(self, op) -> bool:
        if self.primitive is not None and op.primitive != self.primitive:
            return False
        return self.module is None or fnmatch.fnmatchcase(op.module_path, self.module)

    def __str__(self) -> str:
        parts = [f"{k}={v!r}" for k, v in vars(self).items() if v not in (None, False)]
        return f"Rule({', '.join(parts)})"


@dataclass(frozen=True)
class Constraints:
    """What a plan must satisfy. All fields optional (see the contract).

    ``logical_rules``: ``(logical name, mesh axis or None)`` pairs mapping the names of
    ``nn.with_logical_partitioning`` params to mesh axes (default: the rules in the box).
    """

    max_memory_per_device: int | None = None
    pipeline_stages: int | Literal["auto"] | None = None
    microbatches: int | None = None
    schedule: Literal["1f1b", "gpipe", "interleaved"] | None = None
    zero: int | None = None
    rules: tuple[Rule, ...] = field(default_factory=tuple)
    logical_rules: tuple[tuple[str, str | None], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "rules", tuple(self.rules))
        object.__setattr__(self, "logical_rules", tuple(tuple(r) for r in self.logical_rules))
        if self.zero is not None and self.zero not in (0, 1, 2, 3):
            raise PlanError(f"Constraints(zero={self.zero!r}): ZeRO stage is 0, 1, 2 or 3")
        if self.schedule not in (None, "1f1b", "gpipe", "interleaved"):
            raise PlanError(f"Constraints(schedule={self.schedule!r}): use '1f1b', 'gpipe' or "
                            "'interleaved'")
        if self.max_memory_per_device is not None and self.max_memory_per_device <= 0:
            raise PlanError("Constraints(max_memory_per_device=...) must be a positive byte count")
        for r in self.rules:
            if not isinstance(r, Rule):
                raise PlanError(f"Constraints(rules=...) takes Rule values, got {r!r}")

    def check(self, graph: Graph, mesh_axes: dict[str, int], policy: Any = None) -> None:
        """Raise ``PlanError`` for a rule or field that cannot be met on this graph and mesh.

        ``policy``: the planning policy (it decides which axes are tensor-parallel inside
        pipeline stages, see :func:`nnscaler_jax.lower.pipeline_tp.tensor_axes`).
        """
        if self.pipeline_stages not in (None, 1):
            self._stage_of(graph, mesh_axes, policy)
        for r in self.rules:
            for a in r.axes or ():
                if a not in mesh_axes:
                    raise PlanError(f"{r}: mesh axis '{a}' is not in the mesh {mesh_axes}")
            ops = [op for op in graph.walk() if r.matches(op)]
            if not ops:
                raise PlanError(f"{r} matches no op; module paths include "
                                f"{sorted(graph.module_paths)[:12]}")
            if r.dims:
                for op in ops:
                    missing = set(r.dims) - set(op.annotation.kinds())
                    if missing == set(r.dims):
                        raise PlanError(
                            f"{r}: op '{op.primitive}' at '{op.module_path}' (annotation "
                            f"'{op.anno}', shapes {[t.shape for t in op.inputs]}) has none of the "
                            f"dims {list(r.dims)}")
        for i, a in enumerate(self.rules):
            for b in self.rules[i + 1:]:
                both = [op for op in graph.walk() if a.matches(op) and b.matches(op)]
                if both and ((a.replicate and (b.dims or b.axes)) or
                             (b.replicate and (a.dims or a.axes))):
                    raise PlanError(f"{a} and {b} contradict on op '{both[0].primitive}' at "
                                    f"'{both[0].module_path}': one replicates, one splits")

    def _stage_of(self, graph: Graph, mesh_axes: dict[str, int],
                  policy: Any = None) -> tuple[tuple[str, int], ...]:
        """Check the pipeline fields; the layer -> stage assignment."""
        return self._pipeline(graph, mesh_axes, policy)[-1]

    def _pipeline(self, graph: Graph, mesh_axes: dict[str, int], policy: Any = None) -> tuple:
        """``(stages, microbatches, schedule, virtual, report, stage_of)`` (checks the fields).

        ``pipeline_stages="auto"``: the stages are the mesh's ``stage``/``pipe`` axis; the stage
        DP restricted to what the runtime executes picks micro-batches and schedule, pricing
        the non-stage axes as the runtime runs them under ``policy`` (data- or tensor-parallel).
        """
        from nnscaler_jax.plan.schedule import stage_layers

        stages = self.pipeline_stages
        axis = next((a for a in ("stage", "pipe") if a in mesh_axes), None)
        if self.microbatches is not None and self.microbatches < 1:
            raise PlanError(f"Constraints(microbatches={self.microbatches}): use a positive int")
        if stages == "auto":
            if axis is None:
                raise PlanError(
                    "Constraints(pipeline_stages='auto') chooses micro-batches and schedule for "
                    "the stages of the mesh's 'stage' (or 'pipe') axis; the mesh has "
                    f"{mesh_axes}. Add one, e.g. jax.make_mesh((4, 2), ('stage', 'data')), or "
                    "run nnscaler_jax.search.pipeline_dp.search_stages to choose a stage count")
            choice, report = self._auto_pipeline(graph, mesh_axes, policy)
            virtual = choice.virtual
            stages, micro, sched = mesh_axes[axis], choice.microbatches, choice.schedule
        else:
            if not isinstance(stages, int) or stages < 1:
                raise PlanError(f"Constraints(pipeline_stages={stages!r}): use a positive int or "
                                "'auto'")
            if axis is None or mesh_axes[axis] != stages:
                raise PlanError(
                    f"Constraints(pipeline_stages={stages}) needs a mesh axis 'stage' (or 'pipe') "
                    f"of size {stages}; the mesh has {mesh_axes}. E.g. "
                    f"jax.make_mesh(({stages}, 2), ('stage', 'data'))")
            virtual = 2 if self.schedule == "interleaved" else 1
            micro, sched, report = self.microbatches or stages, self.schedule or "1f1b", ""
        stage_of = stage_layers([(v.name, v.shape) for v in graph.variables], stages, virtual)
        return stages, micro, sched, virtual, report, stage_of

    def _auto_pipeline(self, graph: Graph, mesh_axes: dict[str, int], policy: Any = None):
        """The runtime-restricted stage DP's choice and its report."""
        from nnscaler_jax.search.pipeline_dp import runtime_setup

        setup = runtime_setup(graph, mesh_axes, policy)
        S, dp, tp, batch = setup.stages, setup.dp, setup.tp, setup.batch
        budget = self.max_memory_per_device
        rows = setup.choices(budget, microbatches=self.microbatches, schedule=self.schedule)
        par = f"{dp} data-parallel" + (f" x {tp} tensor-parallel ({', '.join(setup.tensor)})" if tp > 1
                                       else "")
        best = rows[0]
        if not best.fits:
            low = min(max(r.memory_bytes) for r in rows)
            raise PlanError(
                f"Constraints(pipeline_stages='auto', max_memory_per_device={budget}): no "
                f"schedule x micro-batch count fits {budget / 2**20:.2f} MiB per device on "
                f"{S} stages x {par}; the smallest estimate is "
                f"{low / 2**20:.2f} MiB. Use more stages or devices, a smaller batch, or more "
                "memory")
        head = (f"stage DP (runtime: {len(setup.units) - 2} layers in equal chunks over {S} "
                f"stages x {par}, batch {batch}"
                + (f", budget {budget / 2**20:.2f} MiB" if budget else "") + "): chose "
                f"{best.schedule} x {best.microbatches} micro-batches of {best.microbatch_size}, "
                f"predicted {best.step_time_s * 1e3:.3f} ms/step (bubble "
                f"{best.bubble_s * 1e3:.3f} ms), peak {max(best.memory_bytes) / 2**20:.2f} MiB")
        table = [(f"  {'schedule':<14} {'M':>4} x mb   {'step ms':>10} {'bubble ms':>9} "
                  f"{'MiB/device':>10}")] + [f"  {r.row()}" for r in rows[:8]]
        if len(rows) > 8:
            table.append(f"  ... {len(rows) - 8} more")
        return best, "\n".join([head] + table)

    def apply_pipeline(self, plan, graph: Graph, mesh_axes: dict[str, int]):
        """Record stages, schedule and the layer -> stage assignment on the plan."""
        if self.pipeline_stages in (None, 1):
            return plan
        stages, micro, sched, virtual, report, stage_of = self._pipeline(
            graph, mesh_axes, plan.policy or None)
        if stages == 1:
            return plan
        return replace(plan, stages=stages, microbatches=micro, schedule=sched,
                       virtual=virtual, stage_of=stage_of, pipeline_report=report)

    def apply_zero(self, plan, graph: Graph, mesh_axes: dict[str, int]):
        """Record the ZeRO stage on the plan (stage 3 also shards variable storage)."""
        if self.zero is None:
            return plan
        if self.zero == 3 and plan.zero != 3:
            from nnscaler_jax.plan.policies import DATA_AXES, zero3_storage

            axes = [a for a in mesh_axes if a in DATA_AXES] or list(mesh_axes)
            return zero3_storage(plan, graph, axes)
        return replace(plan, zero=self.zero)
