"""``pm.train_step(loss_fn, optimizer)`` with ``Constraints(batch_shares=...)``: data
parallelism over groups of devices of different speed, each taking its own share of the batch.

A cluster of several GPU kinds (:class:`~nnscaler_jax.cost.devices.MixedCluster`: 4 A100s
beside 4 V100s) trains a model that fits one group whole faster as data-parallel groups than as
a pipeline when each group takes rows in proportion to its speed (Poplar, AAAI'25; the
heterogeneous DP of Metis and FlashFlex). One SPMD program cannot do that: its data axis
splits the batch evenly. Here the mesh's first data axis indexes the groups
(:meth:`~nnscaler_jax.constraints.Constraints.share_axis`), and group ``i``:

- is the wrapper's module on its own sub-mesh (that axis kept at size 1, the other axes
  as they are), planned by the wrapper's policy for its ``batch_shares[i]`` rows under its own
  devices' budget: an :class:`~nnscaler_jax.train.step.SpmdStep` of its own (ZeRO, gradient
  accumulation, precision and loss scaling as that step runs them);
- takes rows ``[sum(shares[:i]), sum(shares[:i + 1]))`` of each step's batch (copied to its
  devices, then sliced and laid out inside its program) and computes its mean loss's
  gradients (:meth:`~nnscaler_jax.train.step.SpmdStep.local`);
- receives every other group's gradients (``jax.device_put`` between the sub-meshes, each
  leaf onto its own layout) and sums them all, weighted by rows (``shares[h] / batch``, in
  group order, so every group adds the same numbers alike): the gradient of the whole batch's
  mean loss, as one device computes it;
- applies the same optax update to its copy of the parameters and optimizer state
  (:meth:`~nnscaler_jax.train.step.SpmdStep.apply_grads`).

Dispatch is asynchronous: the groups' programs run side by side, the slower group's on fewer
rows. Dropout keys: one key a step, folded with the group's index (``init(..., rng=key)``;
an nnx module without one draws from its own streams, alike in every group). Not run (a
:class:`PlanError`): mutable state a step updates from its rows (linen collections, nnx
``BatchStat``: each group's statistics would differ), saved plans (a plan is one program).

>>> # mesh = jax.make_mesh((2, 4), ("data", "model"))   # row 0: the A100s, row 1: the V100s
>>> # pm = auto_parallel(mesh, Constraints(batch_shares=(10, 6)))(model)
>>> # step = pm.train_step(loss_fn, optax.adamw(1e-3))
>>> # state = step.init(variables, tokens)        # tokens: 16 rows, 10 to the A100s
>>> # state, metrics = step(state, tokens)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from nnscaler_jax.capture.module_call import typed_key
from nnscaler_jax.errors import PlanError
from nnscaler_jax.mesh.axes import mesh_axes
from nnscaler_jax.pipeline.update import per_device_bytes
from nnscaler_jax.train.step import SpmdStep, TrainStep, fresh

__all__ = ["GroupStep", "group_meshes"]


def group_meshes(mesh: Mesh, axis: str) -> list[Mesh]:
    """Per index of ``axis``, the sub-mesh of its devices: ``axis`` kept at size 1, the other
    axes (names and types) as in ``mesh``."""
    k = mesh.axis_names.index(axis)
    return [Mesh(np.take(mesh.devices, [i], axis=k), mesh.axis_names,
                 axis_types=mesh.axis_types) for i in range(mesh.devices.shape[k])]


def _statistics(collections: Any) -> list:
    """The module's mutable state a step updates from its rows (linen collections, nnx
    variables other than its rng streams' keys and counts)."""
    from flax import nnx

    leaves = jax.tree.leaves(collections, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return [x for x in leaves if not isinstance(x, nnx.RngState)]


def _rows(x: Any) -> int | None:
    return int(np.shape(x)[0]) if np.ndim(x) else None


class GroupStep(TrainStep):
    """The :class:`TrainStep` of ``Constraints(batch_shares=...)``: one
    :class:`~nnscaler_jax.train.step.SpmdStep` per group of the mesh's first data axis, each on
    its rows, their gradients averaged weighted by rows (module docstring). Options as
    :class:`TrainStep`'s.

    The state is ``{'groups': [each group's SpmdStep state]}`` (+ ``'rng'``: the key
    every step's dropout keys come from); every group holds the same parameters.

    Attributes:
        steps: the groups' steps. shares: each group's rows. axis: the mesh axis of the
            groups. meshes: their sub-meshes.
    """

    def __init__(self, pm: Any, loss_fn: Callable, optimizer: Any, *, core: Any = None,
                 return_grads: bool = False, growth_interval: int | None = None,
                 **options: Any):
        super().__init__(pm, loss_fn, optimizer, return_grads=return_grads,
                         growth_interval=growth_interval, **options)
        core = pm if core is None else core  # (an nnx wrapper's settings: its core's)
        cons = core.constraints
        if core.fixed_plan is not None:
            raise PlanError("train_step: Constraints(batch_shares=...) plans each group for its "
                            "own rows; a saved plan is one program. Drop plan=, or the shares")
        self.axis = cons.share_axis(mesh_axes(core.mesh))
        self.shares = cons.batch_shares
        self.meshes = group_meshes(core.mesh, self.axis)
        inner = dataclasses.replace(cons, batch_shares=None)
        self.steps = [SpmdStep(pm.on_mesh(m, inner), loss_fn, optimizer,
                               return_grads=return_grads, growth_interval=growth_interval,
                               **options) for m in self.meshes]
        self._rep = [NamedSharding(m, P()) for m in self.meshes]
        self.starts = tuple(int(s) for s in np.cumsum((0,) + self.shares[:-1]))

    # ---- set-up --------------------------------------------------------------------------------

    def _check_batch(self, batch: Sequence[Any]) -> None:
        total = sum(self.shares)
        bad = [tuple(np.shape(x)) for x in batch if _rows(x) not in (None, total)]
        if bad or not batch:
            raise PlanError(f"train_step: Constraints(batch_shares={self.shares}) shares "
                            f"{total} rows a step among the groups of mesh axis "
                            f"{self.axis!r}; the batch has shapes "
                            f"{[tuple(np.shape(x)) for x in batch]}. Give batches of {total} "
                            "rows, or shares summing to the batch")

    def _part(self, g: int, batch: Sequence[Any]) -> tuple:
        """Group ``g``'s rows of ``batch`` as abstract values (what its step plans for)."""
        r = self.shares[g]
        return tuple(jax.ShapeDtypeStruct((r, *np.shape(x)[1:]) if np.ndim(x) else (),
                                          jax.numpy.result_type(x)) for x in batch)

    def init(self, variables: Any, *batch: Any, rng: Any = None) -> dict:
        """Plan each group for its rows (under its devices' budget) and lay out its state.

        Raises:
            PlanError: a batch whose rows are not the shares' sum; a module whose steps
                update statistics from their rows (batch_stats, nnx BatchStat); whatever a
                group's plan raises (naming its budget)."""
        self._check_batch(batch)
        groups = []
        for g, st in enumerate(self.steps):
            state = dict(st.init(variables, *self._part(g, batch), rng=rng))
            if _statistics(state["collections"]):
                raise PlanError(
                    "train_step: Constraints(batch_shares=...) runs each group on its own "
                    "rows, so the statistics a step updates from them (linen's mutable "
                    "collections, BatchNorm's batch_stats; nnx BatchStat) would differ "
                    "between groups. Use even data parallelism (no batch_shares), or a "
                    "model without them")
            self._keyed = state.pop("rng", None)
            groups.append(state)
        top = {"groups": groups}
        if self._keyed is not None:
            top["rng"] = jax.jit(lambda k: k, out_shardings=self._rep[0])(typed_key(rng))
        self._build()
        return top

    def _build(self) -> None:
        """The jitted programs: per group its rows' gradients and its update."""
        B = sum(self.shares)
        weights = [r / B for r in self.shares]

        def local(g: int) -> Callable:
            st, a, r = self.steps[g], self.starts[g], self.shares[g]

            def run(state: dict, batch: tuple, key: Any) -> tuple:
                part = tuple(lax.slice_in_dim(x, a, a + r) if x.ndim else x for x in batch)
                part = tuple(lax.with_sharding_constraint(x, s) for x, s in
                             zip(part, st.batch_shardings(part), strict=True))
                return st.local(state, part, key)
            return jax.jit(run)

        def update(g: int) -> Callable:
            st = self.steps[g]
            sh = {k: v for k, v in st.state_shardings.items() if k != "rng"}

            def run(state: dict, losses: list, grads: list, colls: Any) -> tuple:
                loss = sum(w * x for w, x in zip(weights, losses, strict=True))
                total = jax.tree.map(lambda *gs: sum(w * x for w, x in
                                                     zip(weights, gs, strict=True)), *grads)
                return st.apply_grads(state, loss, total, colls)
            return jax.jit(run, out_shardings=(sh, None), donate_argnums=0)

        self._local = [local(g) for g in range(len(self.steps))]
        self._update = [update(g) for g in range(len(self.steps))]
        self.jitted = tuple(self._local)

    # ---- the step ------------------------------------------------------------------------------

    def _inputs(self, g: int, batch: Sequence[Any], key: Any) -> tuple:
        """The whole batch and the group's key, on group ``g``'s devices."""
        b = tuple(jax.device_put(x, self._rep[g]) for x in batch)
        k = None if key is None else jax.device_put(jax.random.fold_in(key, g), self._rep[g])
        return b, k

    def _grads(self, state: dict, batch: Sequence[Any], key: Any) -> list[tuple]:
        return [self._local[g](state["groups"][g], *self._inputs(g, batch, key))
                for g in range(len(self.steps))]

    def __call__(self, state: dict, *batch: Any) -> tuple[dict, dict]:
        self._check()
        self._check_batch(batch)
        state = dict(state)
        key = None
        if "rng" in state:
            state["rng"], key = jax.random.split(state["rng"])
        outs = self._grads(state, batch, key)
        new, metrics = [], None
        for g in range(len(self.steps)):
            mine = outs[g]
            # every group's gradients and loss moved onto this group's layout of them
            grads = [o[1] if h == g else jax.tree.map(
                lambda x, like: jax.device_put(x, like.sharding), o[1], mine[1])
                for h, o in enumerate(outs)]
            losses = [jax.device_put(o[0], self._rep[g]) for o in outs]
            st, m = self._update[g](state["groups"][g], losses, grads, mine[2])
            new.append(st)
            metrics = m if metrics is None else metrics
        state["groups"] = new
        return state, metrics

    def lower(self, state: dict, *batch: Any) -> list:
        """Per group, its gradient program lowered (``.compile().memory_analysis()``): the
        program that holds its activations; the update runs beside it."""
        self._check()
        key = state.get("rng")
        return [self._local[g].lower(state["groups"][g], *self._inputs(g, batch, key))
                for g in range(len(self.steps))]

    def loss_and_grads(self, variables: Any, *batch: Any, rng: Any = None) -> tuple[Any, Any]:
        """The whole batch's mean loss and gradients as the step computes them: each group's
        on its rows (its plan; its keys from ``rng`` folded with its index), weighted by rows,
        on group 0's devices."""
        self._check_batch(batch)
        B = sum(self.shares)
        loss, grads = 0.0, None
        for g, st in enumerate(self.steps):
            a, r = self.starts[g], self.shares[g]
            part = [x[a:a + r] if np.ndim(x) else x for x in batch]
            key = None if rng is None else jax.random.fold_in(typed_key(rng), g)
            lg, gg = jax.device_put(st.loss_and_grads(variables, *part, rng=key), self._rep[0])
            w = r / B
            loss = loss + w * lg
            grads = jax.tree.map(lambda x, w=w: w * x, gg) if grads is None else jax.tree.map(
                lambda acc, x, w=w: acc + w * x, grads, gg)
        return loss, grads

    # ---- use -----------------------------------------------------------------------------------

    @property
    def plan(self) -> Any:
        """Group 0's plan (every group's: :attr:`plans`)."""
        return self.steps[0].plan

    @property
    def plans(self) -> tuple:
        """Each group's plan of its rows."""
        return tuple(st.plan for st in self.steps)

    def params(self, state: dict) -> Any:
        """The module's params tree (group 0's copy; every group holds the same)."""
        return self.steps[0].params(state["groups"][0])

    def variables(self, state: dict) -> Any:
        return self.steps[0].variables(state["groups"][0])

    def update(self, state: dict) -> None:
        self.steps[0].update(state["groups"][0])

    def memory(self, state: dict) -> dict[str, int]:
        """Per-device bytes measured from the arrays, the most any device holds."""
        per = [st.memory(s) for st, s in zip(self.steps, state["groups"], strict=True)]
        return {k: max(m[k] for m in per) for k in per[0]} | {
            "params": per_device_bytes([s["params"] for s in state["groups"]])}

    def predicted_memory(self) -> dict[str, int]:
        """Each kind's largest estimate over the groups' plans (each priced with its own
        devices' cost model)."""
        per = [st.predicted_memory() for st in self.steps]
        return {k: max(m[k] for m in per) for k in per[0]}

    def checkpoint_state(self, state: dict) -> dict:
        """Group 0's state as the SPMD step's checkpoint form (every group holds the same),
        with the step's key: it restores under any plan."""
        out = dict(self.steps[0].checkpoint_state(state["groups"][0]))
        if "rng" in state:
            out["rng"] = state["rng"]
        return out

    def restore_state(self, saved: dict) -> dict:
        """``saved`` laid out on every group as its step keeps it."""
        self._check()
        groups = []
        for st in self.steps:
            s = dict(st.restore_state(saved))
            s.pop("rng", None)
            groups.append(s)
        out: dict = {"groups": groups}
        if self._keyed is not None:
            if "rng" not in saved:
                raise PlanError("step.restore_state: the saved state has no 'rng'; pass what "
                                "step.checkpoint_state(state) returns")
            out["rng"] = fresh(jax.device_put(saved["rng"], self._rep[0]))
        return out
