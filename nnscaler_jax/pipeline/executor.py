"""Which runtime runs a pipelined plan: the one decision, made where the step is built.

A plan's pipeline settings (:class:`~nnscaler_jax.plan.plan.PipelineSettings`) say how the
planner priced its stages: ``executor`` ``'in-graph'`` (every stage in one jitted program over
the stage axis: :mod:`~nnscaler_jax.pipeline.in_graph`) or ``'per-stage'`` (one program per
stage dispatched from the host: :mod:`~nnscaler_jax.pipeline.mpmd`), and whether the model
runs as its stack of identical layers or cut at module boundaries
(:func:`~nnscaler_jax.pipeline.program.why_cut`, the planner's rule too). :func:`build_runtime`
builds what was priced:

- in-graph, nothing asking for a cut, a stack of identical layers:
  :class:`~nnscaler_jax.pipeline.stacked.PipelineProgram` (tensor parallel inside stages too:
  no branch on the chunk holds GSPMD's collectives);
- otherwise the model cut into chunks: :class:`~nnscaler_jax.pipeline.mpmd.MpmdProgram` where
  the plan runs per stage, else :class:`~nnscaler_jax.pipeline.cut_program.CutProgram` (its
  tensor-parallel stages on each device's blocks, their collectives explicit: GSPMD's inside
  one ``lax.switch`` branch may wait for every device of the mesh).

An optimizer coupling leaves across stages (``optax.clip_by_global_norm``) runs in either: on
the module's whole tree, spread over the mesh.
"""

from __future__ import annotations

from typing import Any

from nnscaler_jax.errors import PlanError
from nnscaler_jax.pipeline.cut_program import CutProgram
from nnscaler_jax.pipeline.mpmd import MpmdProgram
from nnscaler_jax.pipeline.program import PipelineRuntime, why_cut
from nnscaler_jax.pipeline.split import NotALayerStack
from nnscaler_jax.pipeline.stacked import PipelineProgram

__all__ = ["build_runtime", "cut_runtime"]


def cut_runtime(executor: str = "in-graph") -> type:
    """The runtime of a model cut into chunks, as the plan was priced
    (``PipelineSettings.executor``): :class:`~nnscaler_jax.pipeline.mpmd.MpmdProgram` for
    ``'per-stage'``, else the one-program :class:`~nnscaler_jax.pipeline.cut_program.
    CutProgram`."""
    return MpmdProgram if executor == "per-stage" else CutProgram


def build_runtime(args: tuple, kw: dict, pipe: Any, *, pivots: bool, precision: str | None,
                  collections: bool, keys: bool) -> PipelineRuntime:
    """The runtime of a pipelined plan (the module's docstring says which).

    Args:
        args: the runtimes' positional arguments ``(module, loss_fn, mesh, schedule, params,
            batch)``.
        kw: their keyword arguments besides the cut's (``policy``, ``rules``, ``call``,
            ``recompute``, ``budget``, ``overlap``).
        pipe: the plan's :class:`~nnscaler_jax.plan.plan.PipelineSettings`.
        pivots, precision, collections, keys: what
            :func:`~nnscaler_jax.pipeline.program.why_cut` reads besides the schedule.

    Raises:
        PlanError: the model cannot run as priced (from the cut runtime; a stack the identical-
            layer runtime could not split is its cause).
    """
    stack_error: NotALayerStack | None = None
    if pipe.executor == "in-graph" and why_cut(pivots=pivots, schedule=args[3],
                                               precision=precision,
                                               collections=collections, keys=keys) is None:
        try:
            return PipelineProgram(*args, **kw)
        except NotALayerStack as e:  # (other errors of the stacked program are the user's)
            stack_error = e
    try:
        return cut_runtime(pipe.executor)(*args, **kw, stage_of=pipe.stage_of,
                                          layer_rules=pipe.layer_rules,
                                          stage_plans=pipe.stage_plans)
    except PlanError as cut_error:
        raise cut_error from stack_error
