"""Figures of plans and planner comparisons (matplotlib, no pyplot: nothing is shown, nothing
global changes; save one with ``fig.savefig("out.png")``).

- :func:`planner_bars`: ``compare --json``'s result: per planner the predicted step time, memory
  per device (the budget as a line) and communication bytes;
- :func:`memory_breakdown`: stacked bars of params / grads / optimizer / activations /
  transient per plan;
- :func:`layout_map`: a plan over the model's modules (rows, repeated layers collapsed) and mesh
  axes (columns): which dim each axis splits.

>>> fig = planner_bars({"budget_bytes": 2**30, "planners": {
...     "dp": {"fits": False, "step_time_s": None, "memory_bytes_per_device": 3 * 2**30,
...            "comm_bytes": None},
...     "auto": {"fits": True, "step_time_s": 0.01, "memory_bytes_per_device": 2**29,
...              "comm_bytes": 2**20}}})
>>> [len(ax.patches) for ax in fig.axes], [ln.get_gid() for ln in fig.axes[1].lines]
([1, 2, 1], ['budget'])
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from matplotlib.figure import Figure

__all__ = ["KINDS", "layout_map", "memory_breakdown", "planner_bars"]

KINDS = ("params", "grads", "optimizer", "activations", "transient")
COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3",
          "#8c8c8c", "#ccb974", "#64b5cd")
NO_FIT = "#bbbbbb"


def _unit(values: list[float]) -> tuple[float, str]:
    """(scale, name): GiB when the largest value reaches 1 GiB, else MiB."""
    return (2**-30, "GiB") if max(values, default=0) >= 2**30 else (2**-20, "MiB")


def _planners(results: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    inner = results.get("planners", results)
    return {str(k): dict(v) for k, v in inner.items() if isinstance(v, Mapping)}


def planner_bars(results: Mapping[str, Any], budget_bytes: float | None = None) -> Figure:
    """Per planner: predicted step time, memory per device and communication bytes.

    Args:
        results: what ``nnscaler-jax compare --json`` prints (``{"planners": {name: {"fits",
            "step_time_s", "memory_bytes_per_device", "comm_bytes", ...}}}``; its
            ``budget_bytes`` too), or the inner ``{name: entry}`` dict.
        budget_bytes: the memory per device drawn as a horizontal line on the memory plot
            (gid ``'budget'``); default: ``results["budget_bytes"]``, none when that is null.

    Returns:
        A figure with three axes (step time, memory, communication), one bar per planner that
        has the number: planners that do not fit (``fits: false``, their smallest estimate as
        memory) hatched and grey, a planner without a number marked ``n/a`` (no bar).
    """
    planners = _planners(results)
    if budget_bytes is None and "planners" in results:
        budget_bytes = results.get("budget_bytes")
    names = list(planners)
    fig = Figure(figsize=(max(7.5, 1.1 * 3 * max(len(names), 1)), 3.6), layout="constrained")
    axes = fig.subplots(1, 3)
    mem = [r.get("memory_bytes_per_device") for r in planners.values()]
    comm = [r.get("comm_bytes") for r in planners.values()]
    mem_scale, mem_unit = _unit([m for m in mem if m is not None] + [budget_bytes or 0])
    comm_scale, comm_unit = _unit([c for c in comm if c is not None])
    panels = [("step_time_s", 1e3, "predicted step time (ms)"),
              ("memory_bytes_per_device", mem_scale, f"memory per device ({mem_unit})"),
              ("comm_bytes", comm_scale, f"communication ({comm_unit})")]
    for ax, (key, scale, title) in zip(axes, panels, strict=True):
        for i, (name, r) in enumerate(planners.items()):
            value = r.get(key)
            if value is None:
                ax.text(i, 0, "n/a", ha="center", va="bottom", fontsize=8, color="#666666")
                continue
            fits = r.get("fits")
            ax.bar(i, float(value) * scale, color=COLORS[i % len(COLORS)] if fits is not False
                   else NO_FIT, hatch="//" if fits is False else None, edgecolor="#333333",
                   label=name)
            if fits is False:
                ax.text(i, float(value) * scale, "no fit", ha="center", va="bottom", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
        ax.set_xlim(-0.6, max(len(names), 1) - 0.4)
    if budget_bytes is not None:
        axes[1].axhline(float(budget_bytes) * mem_scale, color="#c44e52", linestyle="--",
                        label=f"budget {float(budget_bytes) * mem_scale:.2f} {mem_unit}",
                        gid="budget")
        axes[1].legend(handles=[axes[1].lines[-1]], fontsize=8, loc="upper right")
    return fig


def _breakdowns(plan_or_costs: Any, graph: Any, cost_model: Any) -> dict[str, dict[str, float]]:
    """``{label: {kind: bytes}}`` from a breakdown dict, ``{label: breakdown or plan}`` or a
    plan (priced with ``cost_model``, default ``CostModel.for_axes(plan.mesh, zero=...)``)."""
    def price(plan: Any) -> dict[str, float]:
        from nnscaler_jax.cost.model import CostModel

        if graph is None:
            raise ValueError("memory_breakdown(plan) needs graph= (the graph the plan was made "
                             "for: pm.graph) to price the plan")
        cm = cost_model or CostModel.for_axes(dict(plan.mesh), zero=plan.zero)
        return cm.memory_breakdown(plan, graph)

    if isinstance(plan_or_costs, Mapping) and any(k in plan_or_costs for k in KINDS):
        return {"plan": dict(plan_or_costs)}
    if isinstance(plan_or_costs, Mapping):
        return {str(k): dict(v) if isinstance(v, Mapping) else price(v)
                for k, v in plan_or_costs.items()}
    return {getattr(plan_or_costs, "policy", "") or "plan": price(plan_or_costs)}


def memory_breakdown(plan_or_costs: Any, budget_bytes: float | None = None, *,
                     graph: Any = None, cost_model: Any = None) -> Figure:
    """Stacked bars of memory per device by kind (params, grads, optimizer, activations,
    transient), one bar per plan.

    Args:
        plan_or_costs: one breakdown (``CostModel.memory_breakdown``'s dict), several
            (``{planner name: breakdown}``), a ``Plan`` or ``{name: Plan}`` (priced with
            ``cost_model`` on ``graph``).
        budget_bytes: drawn as a horizontal line (gid ``'budget'``).
        graph / cost_model: to price plans (the graph they were made for).

    Returns:
        A figure with one axes: ``len(KINDS)`` bar containers of one bar per plan.
    """
    data = _breakdowns(plan_or_costs, graph, cost_model)
    names = list(data)
    totals = [sum(float(d.get(k, 0) or 0) for k in KINDS) for d in data.values()]
    scale, unit = _unit(totals + [budget_bytes or 0])
    fig = Figure(figsize=(max(4.5, 1.1 * len(names) + 2.5), 3.8), layout="constrained")
    ax = fig.subplots()
    bottom = [0.0] * len(names)
    for j, kind in enumerate(KINDS):
        vals = [float(d.get(kind, 0) or 0) * scale for d in data.values()]
        ax.bar(range(len(names)), vals, bottom=bottom, color=COLORS[j], label=kind,
               edgecolor="white")
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    if budget_bytes is not None:
        ax.axhline(float(budget_bytes) * scale, color="#c44e52", linestyle="--", gid="budget",
                   label=f"budget {float(budget_bytes) * scale:.2f} {unit}")
    ax.set_xticks(range(len(names)), names, rotation=30 if len(names) > 3 else 0, fontsize=8)
    ax.set_ylabel(f"memory per device ({unit})")
    ax.set_title("estimated memory per device by kind", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


def layout_map(plan: Any, graph: Any = None, *, max_rows: int = 60) -> Figure:
    """The plan over the model's modules: one row per module (repeated layers with the same
    layout collapsed, :func:`nnscaler_jax.plan.view.layout_rows`), one column per mesh axis,
    each cell coloured and labelled by the dims the axis splits there (in words with
    ``graph``, the graph the plan was made for), light grey where the module is replicated.

    Returns:
        A figure with one axes holding one image of ``(rows, mesh axes)`` cells (at most
        ``max_rows`` rows: the first ones).
    """
    from matplotlib.colors import ListedColormap

    from nnscaler_jax.plan.view import dim_words, layout_rows, row_cells

    axes = [a for a, _ in plan.mesh]
    rows = layout_rows(plan, graph)[:max_rows]
    words = dim_words(plan, graph)
    cells = [[w for w, _ in row_cells(r, axes, words)] for r in rows]
    keys = list(dict.fromkeys(_key(w) for line in cells for w in line if w != "-"))
    palette = ["#eeeeee"] + [COLORS[i % len(COLORS)] for i in range(len(keys))]
    grid = [[0 if w == "-" else 1 + keys.index(_key(w)) for w in line] for line in cells]
    fig = Figure(figsize=(3.5 + 2.3 * len(axes), 0.9 + 0.28 * max(len(rows), 1)),
                 layout="constrained")
    ax = fig.subplots()
    ax.imshow(grid or [[0] * len(axes)], cmap=ListedColormap(palette), vmin=0,
              vmax=len(palette) - 1, aspect="auto", interpolation="nearest")
    for i, line in enumerate(cells):
        for j, w in enumerate(line):
            ax.text(j, i, "replicated" if w == "-" else w, ha="center", va="center",
                    fontsize=7, color="#888888" if w == "-" else "black")
    labels = [(r.path or "<top>") + (f" (x{len(r.members)})" if r.members else "")
              for r in rows]
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.set_xticks(range(len(axes)), [f"{a} ({n})" for a, n in plan.mesh], fontsize=8)
    ax.xaxis.tick_top()
    ax.set_title(f"{plan.policy or 'custom'} plan: the dim each mesh axis splits", fontsize=10)
    return fig


def _key(word: str) -> str:
    """The colour of a cell: its first word without sizes (``'heads (4), batch (2)'`` ->
    ``'heads'``)."""
    return re.sub(r"\s*\(.*", "", word.split(",")[0]).strip()
