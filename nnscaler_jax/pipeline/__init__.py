"""Pipeline parallelism: stages along the mesh's ``stage``/``pipe`` axis, on top of SPMD plans.

Modules (no import cycles among them; see docs/design.md for the layers):

- :mod:`~nnscaler_jax.pipeline.stages`: layer / stage detection, the one finder of a model's
  stack of repeated layers (numbered ``<prefix>_<i>`` modules or one ``nn.scan``) and of which
  stage holds which layer.
- :mod:`~nnscaler_jax.pipeline.steps`: blocks, step tables, their data dependencies and
  timeline; :mod:`~nnscaler_jax.pipeline.order`: schedules written with ``op_order``
  (``ScheduleDraft``); :mod:`~nnscaler_jax.pipeline.schedule`: the built-in ones written with
  it (GPipe, 1F1B, eager 1F1B, interleaved, interlaced, NF1B), printing and Gantt charts;
  :mod:`~nnscaler_jax.pipeline.loop_tables`: a step table as the runtime loop's
  per-(time step, stage) tables.
- :mod:`~nnscaler_jax.pipeline.units`: the model cut into prefix / layers / suffix, priced per
  sample; :mod:`~nnscaler_jax.pipeline.stage_dp`: the stage DP over unit boundaries;
  :mod:`~nnscaler_jax.pipeline.pricing`: what the runtime executes, priced (schedule x
  micro-batches).
- :mod:`~nnscaler_jax.pipeline.hetero`: pipelines over a cluster of several device kinds,
  stages sized to their devices (ours, Metis-style and heterogeneity-unaware planners).
- :mod:`~nnscaler_jax.pipeline.clustering` and :mod:`~nnscaler_jax.pipeline.inter_op`: Alpa's
  layer clustering and inter-operator pass (stage profiles by the intra-op ILP).
- :mod:`~nnscaler_jax.pipeline.configure`: pipeline settings chosen and priced onto a
  :class:`~nnscaler_jax.plan.plan.Plan` (``plan.pipeline``).
- :mod:`~nnscaler_jax.pipeline.program`: the micro-batch program traced once and the
  runtimes' interface (``PipelineRuntime``); :mod:`~nnscaler_jax.pipeline.in_stage`: tensor
  parallelism inside stages. Two executors run a pipelined step (``pm.train_step``):
  in-graph (:mod:`~nnscaler_jax.pipeline.in_graph`, one jitted program over the stage axis;
  its programs :mod:`~nnscaler_jax.pipeline.stacked`, a stack of identical layers split by
  :mod:`~nnscaler_jax.pipeline.split`, and :mod:`~nnscaler_jax.pipeline.cut_program`, any
  model cut at module boundaries) and host-dispatched (:mod:`~nnscaler_jax.pipeline.mpmd`,
  one program per stage); :mod:`~nnscaler_jax.pipeline.executor` decides which runs a plan.

Public (docs/api.md, ``__all__``): schedules -- :class:`Schedule`, :class:`ScheduleDraft` (write
one with ``op_order``), the built-ins :func:`gpipe`, :func:`one_f_one_b`,
:func:`eager_one_f_one_b`, :func:`interleaved`,
:func:`interlaced`, :func:`nf1b`, :func:`zb_h1` (zero bubble: split backwards) and
:func:`build` (one by name), :func:`format_schedule`,
:func:`plot_gantt`; :func:`microbatch_rngs` (the keys a micro-batch gets) and
:func:`reference_loss` (nf1b's recycling on one device); clusters of several device kinds --
:func:`kind_units`, :func:`plan_hetero`, :func:`plan_realized`, :func:`price_groups` (the
groups side by side on uneven batch shares) and the :class:`HeteroPlan` they return. Everything else here is internal.

Hardware defaults (H100 nodes, NVLink 4 / InfiniBand NDR) come from
:mod:`nnscaler_jax.cost.devices`, the one hardware table.
"""

from nnscaler_jax.capture.module_call import microbatch_rngs as microbatch_rngs
from nnscaler_jax.pipeline.hetero import HeteroPlan as HeteroPlan
from nnscaler_jax.pipeline.hetero import kind_units as kind_units
from nnscaler_jax.pipeline.hetero import plan_hetero as plan_hetero
from nnscaler_jax.pipeline.hetero import plan_realized as plan_realized
from nnscaler_jax.pipeline.hetero import price_groups as price_groups
from nnscaler_jax.pipeline.order import ScheduleDraft as ScheduleDraft
from nnscaler_jax.pipeline.recycle import reference_loss as reference_loss
from nnscaler_jax.pipeline.schedule import build as build
from nnscaler_jax.pipeline.schedule import eager_one_f_one_b as eager_one_f_one_b
from nnscaler_jax.pipeline.schedule import format_schedule as format_schedule
from nnscaler_jax.pipeline.schedule import gpipe as gpipe
from nnscaler_jax.pipeline.schedule import interlaced as interlaced
from nnscaler_jax.pipeline.schedule import interleaved as interleaved
from nnscaler_jax.pipeline.schedule import nf1b as nf1b
from nnscaler_jax.pipeline.schedule import one_f_one_b as one_f_one_b
from nnscaler_jax.pipeline.schedule import plot_gantt as plot_gantt
from nnscaler_jax.pipeline.schedule import zb_h1 as zb_h1
from nnscaler_jax.pipeline.steps import Schedule as Schedule

__all__ = ["HeteroPlan", "Schedule", "ScheduleDraft", "build", "eager_one_f_one_b",
           "format_schedule", "gpipe", "interlaced", "interleaved", "kind_units",
           "microbatch_rngs", "nf1b", "one_f_one_b", "plan_hetero", "plan_realized",
           "plot_gantt", "price_groups", "reference_loss", "zb_h1"]
