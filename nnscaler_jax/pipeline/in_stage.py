"""Tensor parallelism inside pipeline stages: the in-stage plan replayed as sharding constraints.

The pipelined step (:mod:`nnscaler_jax.pipeline.runtime`) runs one ``jax.shard_map``. With a
tensor-parallel policy (``policy='megatron'``, ``'auto'``, ``'alpa'``, ``'zero3'`` or a function)
that ``shard_map`` is *partial-manual*: manual over the stage axis and the data-parallel axes
(named like :data:`~nnscaler_jax.mesh.axes.DATA_AXES`), while the remaining axes (e.g.
``'model'``) stay in GSPMD's auto mode inside the body. The policy plans the micro-batch training
program (``loss_fn(module.apply(...))`` on one data shard's micro-batch) on the mesh of those
tensor-parallel axes only; the chunk functions then evaluate the cut program with every op's
inputs and outputs constrained (``with_sharding_constraint``) to the layouts the plan gives that
op (:func:`nnscaler_jax.plan.layouts.op_layouts`, partial sums resolved to what their consumer
needs, as :class:`~nnscaler_jax.lower.replay.Lowering` does), so GSPMD inserts the Megatron
collectives (an all-reduce over ``'model'`` after each row-parallel matmul, forward and
backward). Layer parameters are stored ``P(stage, None, None, *plan spec)``: each device holds its
stage's chunk of layers and its slice over ``'model'``.

Why partial-manual and not a fully manual ``shard_map`` with explicit ``psum`` over ``'model'``:
checked on jax 0.10 CPU, ``with_sharding_constraint`` over the auto axes works inside
``shard_map(axis_names={'stage', 'data'})`` through ``lax.fori_loop`` / ``lax.switch`` /
``jax.vjp`` and ``ppermute`` over the manual stage axis, and the results equal the single-device
program. A manual body would need every op rewritten to local shapes (reshape / broadcast params
spell global shapes) and the plan's collectives written by hand in forward and backward; GSPMD
derives both. Constraints need Auto axis types, so the TP program runs on an Auto view of the
mesh (same devices, names and specs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import Mesh

from nnscaler_jax.capture.jaxpr import InputInfo, graph_from_jaxpr
from nnscaler_jax.constraints import Constraints
from nnscaler_jax.errors import PlanError
from nnscaler_jax.ir.graph import Graph, Role
from nnscaler_jax.layout import Layout
from nnscaler_jax.lower.eqns import EqnConstraints
from nnscaler_jax.lower.replay import Lowering
from nnscaler_jax.mesh.axes import DATA_AXES, auto_view, mesh_axes
from nnscaler_jax.plan.plan import VALUE, Plan
from nnscaler_jax.search.entry import SEARCHES, plan_spmd

__all__ = ["InStagePlan", "plan_in_stage", "tensor_axes"]



def tensor_axes(mesh_axes: dict[str, int], stage: str, policy: Any) -> tuple[str, ...]:
    """The mesh axes that are tensor-parallel inside stages (auto in the ``shard_map``).

    ``policy`` None or ``'dp'``: none (every non-stage axis is data-parallel, as before).
    Otherwise the non-stage axes of size > 1 not named like a data axis (``'data'``,
    ``'dp'``, ...); an axis of size 1 splits nothing (it is data-parallel, trivially).
    """
    if policy is None or policy == "dp":
        return ()
    return tuple(a for a in mesh_axes if a != stage and a not in DATA_AXES and mesh_axes[a] > 1)


def _policy_name(policy: Any) -> str:
    return policy if isinstance(policy, str) else getattr(policy, "__name__", "custom")


def _stage_error(policy: Any, tp: dict[str, int], what: str, fix: str) -> PlanError:
    return PlanError(f"pipeline stages with policy {_policy_name(policy)!r}: the in-stage plan "
                     f"(micro-batch program on the tensor-parallel axes {tp}) {what}. {fix}")


@dataclass(frozen=True)
class InStagePlan:
    """The in-stage plan and what the chunk functions need from it.

    Attributes:
        axes: the tensor-parallel mesh axes (auto inside the ``shard_map``).
        graph / plan: the micro-batch program's graph and the policy's plan for it.
        constraints: the plan's sharding constraints keyed by equation (what the chunk
            functions evaluate under).
        var_specs: per parameter leaf (flat index), its storage ``PartitionSpec`` entries.
        body_specs: ``scan`` body input var -> the layout its first consumer wants (the
            per-layer storage of an ``nn.scan`` stack, whose stacked variable the policies may
            leave unsplit).
    """

    axes: tuple[str, ...]
    graph: Graph
    plan: Plan
    constraints: EqnConstraints
    var_specs: tuple[tuple, ...]
    body_specs: dict

    def layer_spec(self, leaf: int, var: Any, stacked: bool) -> tuple:
        """Storage spec entries of one layer's parameter (without the stacked layer dim)."""
        spec = self.var_specs[leaf][1:] if stacked else self.var_specs[leaf]
        if any(e is not None for e in spec) or var not in self.body_specs:
            return spec
        return tuple(self.body_specs[var]) + (None,) * (len(spec) - len(self.body_specs[var]))

    def evaluate(self, eqns: Any, env: dict) -> None:
        """Evaluate ``eqns`` into ``env`` with the plan's sharding constraints."""
        self.constraints.evaluate(eqns, env)


def _sub_mesh(mesh: Mesh, axes: tuple[str, ...]) -> Mesh:
    """The mesh of ``axes`` over the devices at index 0 of every other axis."""
    idx = tuple(slice(None) if a in axes else 0 for a in mesh.axis_names)
    return auto_view(Mesh(mesh.devices[idx], axes, axis_types=(jax.sharding.AxisType.Auto,) *
                          len(axes)))


def plan_in_stage(closed: Any, param_paths: list[str], n_params: int, mesh: Mesh, stage: str,
                  policy: Any, *, root: str = "", rules: tuple = ()) -> InStagePlan:
    """Plan the micro-batch program ``closed`` with ``policy`` on the tensor-parallel axes.

    Args:
        closed: ``(param leaves..., batch leaves...) -> loss`` of one data shard's micro-batch.
        param_paths: the parameter leaves' paths (``'h_0/attn/query/kernel'``).
        n_params: number of parameter leaves (the first inputs).
        mesh: the whole mesh; stage: its stage axis; policy: the module's policy.
        root: the root module's name in name stacks (stripped from module paths).
        rules: ``Constraints.rules`` for the in-stage search.

    Raises:
        PlanError: the policy fails on the in-stage mesh (e.g. it assigns ops to the stage
            axis), leaves a tensor-parallel axis unused (no dim it splits divides), or uses
            value-split / co-sharding (not supported inside stages).
    """
    sizes = mesh_axes(mesh)
    axes = tensor_axes(sizes, stage, policy)
    tp = {a: sizes[a] for a in axes}
    infos = [InputInfo(Role.VARIABLE, f"params/{p}", "params") for p in param_paths]
    infos += [InputInfo(Role.INPUT, f"args/{i}") for i in range(len(closed.jaxpr.invars) -
                                                                 n_params)]
    graph, _ = graph_from_jaxpr(closed, infos, root=root)
    sub = _sub_mesh(mesh, axes)
    try:
        plan = plan_spmd(graph, sub, policy=policy,
                         constraints=Constraints(rules=tuple(rules))).plan
    except PlanError as e:
        raise _stage_error(policy, tp, f"failed: {e}", f"In-stage policies see only the "
                           f"tensor-parallel axes {list(tp)}: the stage axis '{stage}' and the "
                           "data axes are pipelined / data-parallel by the pipeline itself") from e
    used = {a for p in plan.ops for a, _ in p.split}
    for a in axes:
        if a not in used:
            if policy in SEARCHES:  # the search's choice: no split pays for its collectives
                raise _stage_error(
                    policy, tp, f"splits no op over mesh axis '{a}' (size {tp[a]}): at these "
                    "sizes every split the search priced costs more in communication than it "
                    "saves in compute, so each device of the axis would compute the same",
                    f"Name the axis 'data' to run it data-parallel, use fewer devices on "
                    f"'{a}', or policy='megatron' to split the heads and MLP over it anyway")
            raise _stage_error(
                policy, tp, f"splits no op over mesh axis '{a}' (size {tp[a]}): no dim the "
                "policy would split (attention heads, MLP hidden, ...) divides by it",
                f"Use a '{a}' size that divides the heads and hidden sizes, e.g. 2, or name "
                f"the axis 'data' to make it data-parallel")
    bad = [p for p in plan.ops if p.chunks or p.keep_partial or any(d == VALUE
                                                                     for _, d in p.split)]
    if bad:
        raise _stage_error(policy, tp, f"value-splits or co-shards op '{bad[0].primitive}' at "
                           f"'{bad[0].module_path}'", "Inside pipeline stages only dim splits "
                           "run; use policy='megatron' or 'auto'")
    low = Lowering(graph, plan, sub)
    var_specs = []
    for t in graph.inputs[:n_params]:
        spec = plan.variable_spec(t.name)
        var_specs.append(tuple(spec) + (None,) * (t.ndim - len(spec)) if spec is not None
                         else (None,) * t.ndim)
    return InStagePlan(axes, graph, plan, EqnConstraints.of(low), tuple(var_specs),
                       _body_specs(low))


def _body_specs(low: Lowering) -> dict:
    """``scan`` body input var -> the layout its first consumer reads (no partial sums)."""
    out = {}
    for op in low.graph.walk():
        if op.eqn is None or op.primitive != "scan":
            continue
        (body,) = op.regions
        for v, t in zip(op.eqn.params["jaxpr"].jaxpr.invars, body.inputs, strict=True):
            lay = low.consumer_layout(t.id)
            if lay is not None and t.ndim:
                out[v] = tuple(Layout(lay.dims).to_pspec())
    return out
