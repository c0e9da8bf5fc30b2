"""Training programs for any plan: the SPMD training step, orbax checkpoints, multi-process start.

Public (docs/api.md): :class:`Checkpointer` and the :class:`CheckpointInfo` a restore returns;
:func:`initialize` (join a multi-host job) and :func:`launch_local` (K local processes);
:func:`check_step` (a training step compiled by XLA's GPU compiler: :class:`XlaCheck`),
:func:`check_stages` (a pipelined step on tensor-parallel stages, program by program),
:func:`check_mixed_stages` (a pipeline over several GPU kinds, each stage for its own) and
:func:`xla_gpu_missing` (why XLA:GPU cannot compile here, or None). The training step itself is
``pm.train_step(loss_fn, optimizer)``, a :class:`TrainStep` (the interface of the SPMD and the
pipelined step), and :class:`GroupStep` its implementation for ``Constraints(batch_shares=...)``
(one SPMD step per group of devices, each on its own rows).
"""

from nnscaler_jax.mesh.gpu import xla_gpu_missing as xla_gpu_missing
from nnscaler_jax.train.checkpoint import Checkpointer as Checkpointer
from nnscaler_jax.train.checkpoint import CheckpointInfo as CheckpointInfo
from nnscaler_jax.train.distributed import initialize as initialize
from nnscaler_jax.train.distributed import launch_local as launch_local
from nnscaler_jax.train.grouped_step import GroupStep as GroupStep
from nnscaler_jax.train.step import TrainStep as TrainStep
from nnscaler_jax.train.xla_gpu import XlaCheck as XlaCheck
from nnscaler_jax.train.xla_gpu import check_mixed_stages as check_mixed_stages
from nnscaler_jax.train.xla_gpu import check_stages as check_stages
from nnscaler_jax.train.xla_gpu import check_step as check_step

__all__ = ["CheckpointInfo", "Checkpointer", "GroupStep", "TrainStep", "XlaCheck", "check_mixed_stages",
           "check_stages", "check_step", "initialize", "launch_local", "xla_gpu_missing"]
