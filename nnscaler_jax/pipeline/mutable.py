"""Mutable collections (BatchNorm statistics) in the pipelined training step.

The SPMD step (:class:`~nnscaler_jax.train.step.SpmdStep`) runs its micro-batches one after the
other and carries the collections from one to the next. The pipelined step
(:class:`~nnscaler_jax.pipeline.cut_program.CutProgram`, which runs every model with collections,
a stack of identical layers included) carries them as follows:

- **Rows.** Each device normalises over its own micro-batch rows: ``b = batch / (M x D)`` rows,
  block ``g = m * D + d`` of the batch for micro-batch ``m`` of data-parallel shard ``d`` (PyTorch
  DDP's BatchNorm without SyncBatchNorm, GPipe's micro-batch BatchNorm).
- **Owner.** A collection leaf belongs to the chunk that reads it and is laid out like that
  chunk's parameters: packed per dtype, stacked ``[stages, virtual, width]`` over the stage axis
  (``state['collections']``, :meth:`~nnscaler_jax.pipeline.cut_program.CutProgram.to_pipeline`).
  A leaf read by several chunks or by none is refused (:func:`shared_error`).
- **Updates.** A chunk's forward ``F`` of micro-batch ``m`` reads its collections and replaces
  them with the values the module returns; a stage's forwards of one chunk run in micro-batch
  order in every built-in schedule (:func:`require_forward_order` checks a schedule written
  with ``op_order``), so on shard ``d`` the statistics go through micro-batches ``0 .. M - 1``
  in order, as in the SPMD step. The backward ``B`` recomputes the forward from its saved input
  with the collection values that forward read (kept per micro-batch and chunk: ``M x virtual``
  copies of the stage's collections, small for BatchNorm) and discards the values it makes, so
  nothing is updated twice. In train mode BatchNorm's output does not depend on the running
  statistics, so the values a backward reads only matter for a module whose output reads them:
  it is differentiated at the output its forward computed. Gradients do not flow through the
  collections (the SPMD step's rule: they are constants of each micro-batch's gradient).
- **End of step.** The updated collections are averaged over the data axes (``pmean``;
  integer leaves, counters, are the same on every shard and kept) and stored in the new state.

Recycling (``nf1b``'s ``N`` passes) and the all-device blocks of ``interlaced`` do not carry
collections: :func:`schedule_error`.

>>> from nnscaler_jax.pipeline import schedule as sch
>>> require_forward_order(sch.one_f_one_b(2, 4)) is None
True
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from nnscaler_jax.errors import PlanError
from nnscaler_jax.pipeline.steps import Schedule

__all__ = ["average", "require_forward_order", "schedule_error", "shared_error"]


def require_forward_order(sched: Schedule) -> None:
    """Check that every stage runs the forwards of each of its chunks in micro-batch order.

    Raises:
        PlanError: a stage's forwards of one chunk are out of order (naming them).
    """
    for s, row in enumerate(sched.steps):
        for v in range(sched.virtual):
            got = [st.microbatch for st in row if st.kind == "F" and st.virtual == v]
            if got != sorted(got):
                raise PlanError(
                    f"schedule {sched.name!r}: stage {s} runs the forwards of its chunk {v} in "
                    f"the micro-batch order {got}; the pipelined step updates the model's "
                    "collections (BatchNorm statistics) in its forwards, in micro-batch order. "
                    "Order each stage's F blocks of a chunk by micro-batch (op_order), or use "
                    "a built-in schedule ('1f1b', 'gpipe', 'interleaved')")


def schedule_error(sched: Schedule, names: Sequence[str]) -> PlanError:
    what = "recycling passes ('N')" if sched.recycles else "all-device blocks ('E' / 'H' / 'W')"
    return PlanError(f"train_step: schedule {sched.name!r} has {what}, which do not carry the "
                     f"model's mutable collections ({_few(names)}: BatchNorm statistics); use "
                     "schedule='1f1b' (or 'gpipe', 'interleaved'), or normalise with "
                     "LayerNorm / GroupNorm")


def shared_error(names: Sequence[str]) -> PlanError:
    return PlanError(f"train_step: the collection leaves {_few(names)} are read by several "
                     "pipeline chunks or by none (or updated outside the chunk reading them); "
                     "the pipelined step carries each leaf in the one chunk that reads it. "
                     "Move the cut (Constraints(pipeline_pivots=...)) so that one stage holds "
                     "the module using them, or use the SPMD step (no pipeline_stages)")


def _few(names: Sequence[str]) -> str:
    names = sorted(names)
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def average(colls: dict[str, Any], axes: tuple[str, ...]) -> dict[str, Any]:
    """Packed collections averaged over the data ``axes`` (inside ``shard_map``); integer
    vectors kept as they are."""
    if not axes:
        return colls
    return {k: lax.pmean(x, axes) if jnp.issubdtype(np.dtype(k), jnp.inexact) else x
            for k, x in colls.items()}
