"""The SPMD planning entry: the policy registry and one function that plans a graph on a mesh.

Every SPMD plan is made here, for ``auto_parallel``, the CLI, the benchmarks and the pipeline's
in-stage plans: check the constraints, run the policy (a built-in, the search, or the user's
function) on a :class:`~nnscaler_jax.primitives.Draft`, record the ZeRO stage, price the result.
Recompute groups forced by the constraints are remat boundaries of the graph every policy plans;
the searches also add layers to them when no plan fits the budget otherwise
(:mod:`nnscaler_jax.search.recompute`), and ours also tries co-sharding every layer's block
with large intermediates (:mod:`nnscaler_jax.search.coshard`), keeping the faster plan.
A search's plan lists the ops whose batch dim a data axis does not divide (``Plan.unsplit``, as
the built-in policies record for every dim they could not split).
The mesh may be a ``Mesh``, an ``AbstractMesh`` or ``{axis: size}``: no devices are needed, so
benchmarks plan for 512 devices on a laptop. Pipelined plans add stages on top of this
(:func:`nnscaler_jax.planner.make_plan`).

>>> sorted(POLICIES)
['alpa', 'auto', 'deepspeed', 'dp', 'megatron', 'megatron-lm', 'zero3']
"""

from __future__ import annotations

import gc
import math
import os
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

from nnscaler_jax.constraints import Constraints
from nnscaler_jax.cost.model import CostModel
from nnscaler_jax.errors import ConstraintError, NoFitError, PlanError, user_stacklevel
from nnscaler_jax.ir.attention import FUSED, fusable_blocks, with_fused_attention
from nnscaler_jax.ir.coshard import with_boundaries
from nnscaler_jax.ir.graph import Graph
from nnscaler_jax.mesh.axes import mesh_axes
from nnscaler_jax.plan.plan import Plan, graph_fingerprint
from nnscaler_jax.plan.policies import batch_unsplit, dp, megatron, zero3
from nnscaler_jax.plan.zero import apply_zero
from nnscaler_jax.primitives import Draft
from nnscaler_jax.search.coshard import coshard_choice
from nnscaler_jax.search.ilp import SearchReport, search_policy
from nnscaler_jax.search.recompute import (
    Best,
    Outpriced,
    choose_recompute,
    recompute_candidates,
)

__all__ = ["POLICIES", "Planned", "plan_spmd", "resolve_policy"]

#: The hand-written built-in policies.
BUILTIN: dict[str, Callable[..., Any]] = {"dp": dp, "zero3": zero3, "megatron": megatron}
#: The searches: ours and the Alpa-style planner.
SEARCHES = ("auto", "alpa")
#: The baselines of the comparisons as those systems train: a built-in policy with every
#: repeated block recomputed (DeepSpeed: ZeRO-3 + activation checkpointing; Megatron-LM: tensor
#: parallel + full recompute).
BASELINES: dict[str, str] = {"deepspeed": "zero3", "megatron-lm": "megatron"}
#: Every policy name.
POLICIES: tuple[str, ...] = (*BUILTIN, *SEARCHES, *BASELINES)


@dataclass(frozen=True)
class Planned:
    """A plan with what planning it took: wall seconds and the search's report (or None)."""

    plan: Plan
    seconds: float
    report: SearchReport | None


def resolve_policy(policy: str | Callable | None, *, cost_model: CostModel | None = None,
                   time_limit: float | None = None) -> Callable[[Draft, Any], Any]:
    """The policy function for a name (``"auto"`` when None) or a user's function.

    Raises:
        PlanError: an unknown name.
    """
    if policy is None:
        policy = "auto"
    if callable(policy):
        return policy
    if policy in SEARCHES:
        return search_policy(policy, cost_model=cost_model, time_limit=time_limit)
    if policy in BUILTIN:
        return BUILTIN[policy]
    if policy in BASELINES:
        return BUILTIN[BASELINES[policy]]
    raise PlanError(f"unknown policy {policy!r}; choose one of {sorted(POLICIES)}, or pass a "
                    "function policy(graph, mesh) -> Plan written with op_trans / op_assign")


def _as_plan(result: Any, label: str) -> Plan:
    """A policy's answer as a plan (a draft finished), else the policy's error."""
    if isinstance(result, Draft):
        result = result.finish()
    if not isinstance(result, Plan):
        raise PlanError(f"policy {label!r} returned {type(result).__name__}, not a Plan: "
                        "end the policy with `return graph.finish()`")
    return result


def plan_spmd(graph: Graph, mesh: Any, *, policy: str | Callable | None = "auto",
              constraints: Constraints | None = None, partitioning: dict | None = None,
              cost_model: CostModel | None = None, time_limit: float | None = None) -> Planned:
    """Plan ``graph`` on ``mesh`` with ``policy`` under ``constraints``; the plan is priced.

    Args:
        graph: the annotated graph.
        mesh: a ``Mesh``, ``AbstractMesh`` or ``{axis: size}``.
        policy: a name in :data:`POLICIES` or ``policy(draft, mesh) -> Plan``.
        constraints: validated against the graph and mesh first; rules and the memory budget
            bind the searches; ``zero`` is recorded (stage 3 shards the storage).
        partitioning: ``{variable path: mesh axes per dim}`` from Flax metadata; the searches
            pin those variables' storage, other policies find it on ``draft.partitioning``.
        cost_model: prices the search and the plan (default: the local CPU model of the mesh).
        time_limit: the searches' solver budget in seconds.

    Raises:
        PlanError: a constraint that cannot be met, an unknown policy, a policy that returns
            something other than a plan, or (searches) no plan within the memory budget.
    """
    axes = mesh_axes(mesh)
    constraints = constraints or Constraints()
    name = policy if policy is not None else "auto"
    model_graph, (fused, graph) = graph, _fused_attention(graph, constraints)
    constraints.check(graph, axes)
    t0 = time.perf_counter()
    fn = resolve_policy(name, cost_model=cost_model, time_limit=time_limit)
    label = name if isinstance(name, str) else getattr(fn, "__name__", "custom")

    def run(groups: tuple[str, ...], blocks: tuple = (), beat: float | None = None
            ) -> tuple[Plan, Draft]:
        draft = Draft(with_boundaries(graph, blocks, groups), axes, constraints=constraints,
                      partitioning=partitioning or None, beat_s=beat)
        draft.policy = label
        result = _as_plan(fn(draft, mesh), label)
        # the draft's graph has the boundaries; the plan is for the model's graph (reuse)
        return replace(result, recompute=groups, coshard=blocks, fused_attention=fused,
                       ring_layouts=_ring_layouts(graph, result, cost_model, axes),
                       fingerprint=graph_fingerprint(model_graph)), draft

    def finish(result: Plan) -> Plan:
        # a budgeted search priced its plan on the same graph (the draft's boundaries are the
        # plan's recompute / co-sharding) and cost model; ZeRO-3 storage changes the plan
        priced = result.cost if cost_model is not None and name in SEARCHES and \
            constraints.zero != 3 else None
        result = apply_zero(result, graph, constraints.zero)
        cm = cost_model or CostModel.for_axes(axes, zero=result.zero)
        return replace(result, cost=priced or cm.plan_cost(result, graph))

    def run_priced(groups: tuple[str, ...], blocks: tuple = (), beat: float | None = None
                   ) -> tuple[Plan, Draft]:
        result, draft = run(groups, blocks, beat)
        return finish(result), draft

    forced, forbidden = constraints.recompute_groups()
    if name in BASELINES:  # full recompute
        forced = forced + recompute_candidates(graph, forced, forbidden)
    if name in SEARCHES:  # recompute (ours: and co-sharding) are the searches' decisions
        blocks = (lambda: coshard_choice(
            graph, axes, constraints.max_memory_per_device, forbidden,
            cost_model.microbatches if cost_model is not None else 1)) \
            if name == "auto" else None
        with _steady_heap():
            result, draft = _choose(run_priced, graph, forced, forbidden, blocks)
            # the rules' groups, no more: did they pay? (not for a pipeline's whole-model
            # plan: its stages recompute per layer as the rules say, priced by the stages)
            if forced and result.recompute == forced and not constraints.pipeline_stages:
                cm = cost_model or CostModel.for_axes(axes, zero=result.zero)
                result, draft = _unless_rules_cost(
                    (result, draft), forced, run_priced,
                    lambda p: replace(p, cost=cm.plan_cost(p, graph)))
        # the search offers only splits that divide: say what it could not (for the plan kept
        # only: the recompute probes' plans are priced, not shown)
        result = replace(result, unsplit=result.unsplit + batch_unsplit(graph, result, axes))
    else:
        result, draft = run_priced(forced)
    return Planned(result, time.perf_counter() - t0, getattr(draft, "search_report", None))


def _ring_layouts(graph: Graph, plan: Plan, cost_model: CostModel | None,
                  axes: dict[str, int]) -> tuple[tuple[int, str], ...]:
    """How each fused attention op ``plan`` splits on its sequence runs (ring or zigzag), by
    ``cost_model`` (default: the mesh's)."""
    cost_model = cost_model or CostModel.for_axes(axes)
    out = []
    for op in graph.ops:
        p = plan.op_plan(op.id) if op.primitive == FUSED else None
        if p is not None and any(name == "s" for _, name in p.split):
            out.append((op.id, cost_model.ring_layout(op, p.split)))
    return tuple(out)


def _fused_attention(graph: Graph, constraints: Constraints) -> tuple[tuple[int, ...], Graph]:
    """``Constraints(attention="fused" | "ring" | "zigzag")``: the blocks fused (their scores op
    ids) and the graph the search plans, with each block one op (:mod:`nnscaler_jax.ir.attention`)."""
    if constraints.attention is None:
        return (), graph
    if constraints.pipeline_stages not in (None, 1):
        raise ConstraintError(f"Constraints(attention={constraints.attention!r}) plans SPMD "
                              "programs; a pipeline's stages run attention as written (leave "
                              "pipeline_stages unset, or attention None)")
    fused = fusable_blocks(graph)
    layout = constraints.attention if constraints.attention != "fused" else ""
    return fused, with_fused_attention(graph, fused, layout)


def _choose(run_priced: Callable, graph: Graph, forced: tuple[str, ...],
            forbidden: tuple[str, ...], blocks_of: Callable[[], tuple] | None
            ) -> tuple[Plan, Draft]:
    """The searches' recompute decision, and ours (``blocks_of``: the blocks to co-shard)
    co-sharding: the forced groups alone first; when that does not fit, the count of recomputed
    layers is searched without co-sharding and with the blocks co-sharded, the two at once
    (HiGHS releases the GIL: its solves, most of a probe's time, run on two cores; the blocks
    are found while the first search starts), each probe of either only has to beat the
    faster plan found by both (:class:`~nnscaler_jax.search.recompute.Best`), and the faster
    plan that fits is kept. The
    co-sharded search bisects: its fitting plans spend the memory co-sharding frees on faster
    layouts, so their memory does not say how many layers fewer would fit (Swin at its 8-GPU
    preset on V100s: interpolating took 9 probes where bisecting takes 7)."""
    price = (lambda r: r[0].cost.step_time_s) if blocks_of is not None else None
    try:
        return run_priced(forced)  # fits as asked: no recompute or co-sharding to add
    except NoFitError as e:
        first = e

    def plain_run(groups: tuple[str, ...], beat: float | None = None) -> tuple[Plan, Draft]:
        if groups == forced:  # (tried above)
            raise first
        return run_priced(groups, beat=beat)

    best = Best()  # both searches' probes have to beat the faster plan of the two

    def search(run: Callable, memory: Callable | None) -> tuple[Any, NoFitError | None]:
        try:
            return choose_recompute(run, graph, forced, forbidden, price=price,
                                    memory=memory, best=best), None
        except NoFitError as e:
            return None, e
        except Outpriced:  # the other search's plan is faster than any of this one's
            return None, None

    if blocks_of is None:
        return choose_recompute(plain_run, graph, forced, forbidden, price=price)
    workers = 2 if (os.cpu_count() or 1) > 1 else 1
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="nnscaler-search") as pool:
        plain_f = pool.submit(search, plain_run, None)
        blocks = blocks_of()
        chunked_f = pool.submit(search, lambda g, beat=None: run_priced(g, blocks, beat),
                                _bisect) \
            if blocks else None
        (plain, err), (chunked, c_err) = plain_f.result(), \
            chunked_f.result() if chunked_f else (None, None)
    found = [r for r in (plain, chunked) if r is not None]
    if not found:  # (a search is outpriced only by the other's plan) the smaller miss
        if c_err is not None and (err is None or (c_err.smallest_bytes or math.inf) <
                                  (err.smallest_bytes or math.inf)):
            raise NoFitError(f"{c_err} (With {len(blocks)} blocks co-sharded.)",
                             smallest_bytes=c_err.smallest_bytes,
                             budget_bytes=c_err.budget_bytes) from None
        raise err
    return min(found, key=price)


def _unless_rules_cost(ruled: tuple[Plan, Draft], forced: tuple[str, ...],
                       run_priced: Callable, reprice: Callable[[Plan], Plan]
                       ) -> tuple[Plan, Draft]:
    """The plan under the recompute rules (``ruled``, groups ``forced``), unless it needs more
    memory than the plan without them: a user recomputes to save memory, but the layouts the
    search picks under the rule can cost more (their time is what it minimises), and a
    recomputed module whose output the next op keeps anyway saves nothing. Then the layouts
    found without the rules, recomputed as they say, if that saves memory; else the plan
    without the rules, with a warning that they did not pay. Rules a budget needs stay."""
    try:
        free = run_priced(())
    except NoFitError:
        return ruled  # nothing fits without them
    mem = lambda plan: plan.cost.memory_bytes_per_device
    if mem(ruled[0]) <= mem(free[0]):
        return ruled
    relaid = reprice(replace(free[0], recompute=forced))
    if mem(relaid) < mem(free[0]):
        return relaid, free[1]
    shown = ", ".join(forced[:4]) + (", ..." if len(forced) > 4 else "")
    warnings.warn(
        f"recompute rules for {shown} did not pay: the plan under them needs "
        f"{mem(ruled[0]) / 2**20:.2f} MiB per device (step {ruled[0].cost.step_time_s * 1e3:.3f} "
        f"ms), the plan without them {mem(free[0]) / 2**20:.2f} MiB "
        f"({free[0].cost.step_time_s * 1e3:.3f} ms); planned without them. Recompute saves "
        "memory on modules whose activations nothing else keeps (whole layers, "
        "Rule(module='h_*')), not on a single matmul whose output the next op stores",
        UserWarning, stacklevel=user_stacklevel())
    return free


@contextmanager
def _steady_heap() -> Iterator[None]:
    """Keep the collector off the objects alive when the search starts (the graph, jax's
    caches) while it runs: the search makes many short-lived objects, and each full collection
    would walk that large heap again (AF2 at its 8-GPU preset: 29.2 s to plan instead of 31.8 s;
    gc.freeze's objects go back to the collector after)."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _bisect(result: Any) -> None:
    """No memory signal: :func:`choose_recompute` bisects the count."""
