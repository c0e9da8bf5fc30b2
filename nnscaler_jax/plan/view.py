"""Looking at a plan: repeated layers collapsed, split dims in words, the notebook view.

- :func:`layout_rows`: the plan's modules as a tree in program order, where consecutive
  numbered siblings (``h_0``, ``h_1``, ... / ``layers_2/blocks_0``, ...) whose layouts are the
  same (every op's primitive, splits and chunks, every variable's spec, recompute) collapse
  into one group (``h_*``, 24 layers);
- :func:`~nnscaler_jax.plan.dim_words.dim_words`: what each split identifier is, in words
  (``batch (8)``, ``heads (4)``, with the graph the plan was made for; else the identifier);
- :func:`plan_summary` (``plan.summary()``) and :func:`plan_html` (``plan._repr_html_()``).

>>> from nnscaler_jax.plan.plan import OpPlan, Plan
>>> ops = tuple(OpPlan(i, "dot_general", f"h_{i}/fc", (("model", "n0"),)) for i in range(3))
>>> plan = Plan(mesh=(("model", 4),), fingerprint="x", ops=ops)
>>> [(r.path, r.count) for r in layout_rows(plan)]
[('h_*', 3), ('h_*/fc', 3)]
"""

from __future__ import annotations

import dataclasses
import fnmatch
import html
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from nnscaler_jax.errors import fmt_bytes
from nnscaler_jax.ir.graph import Graph
from nnscaler_jax.ir.layers import LAYER_NAME
from nnscaler_jax.plan.dim_words import dim_words

__all__ = ["LayoutRow", "PlanView", "dim_words", "layout_rows", "ops_text", "plan_html",
           "plan_summary", "row_cells"]

# Plans are duck-typed here: ``plan.py`` imports this module for ``Plan.summary`` / ``view`` /
# ``_repr_html_``, so this one does not import it back.
PlanLike = Any
OpLike = Any
COLLECTIONS = ("params", "batch_stats", "cache", "intermediates")
MAX_DETAIL_OPS = 2000  # per-op rows in the html's collapsed detail


@dataclass(frozen=True, slots=True)
class LayoutRow:
    """One module (or group of repeated modules) of a plan, in program order.

    Attributes:
        path: the module path, collapsed groups written with ``*`` (``h_*/attn/query``) or
            ``{1..3}`` when not every layer of the stack is in the group; ``''``: the top.
        label: the last component of ``path`` (``attn/query`` rows print indented).
        depth: nesting below the top.
        count: how many modules the row stands for (layers of the enclosing groups).
        ops: the plan's ops of the (first) module at exactly this path.
        members: for a collapsed group: the module paths it stands for.
        variables: ``(full name, spec)`` of the module's own variables (first member's, the
            name written with the collapsed path).
        first: the module path of the (first) module the row stands for.
        notes: ``'recompute'`` (the module's activations are recomputed), ``'stage 1'`` /
            ``'stages 0..3'`` (the pipeline stages of the layers).
    """

    path: str
    label: str
    depth: int
    count: int
    ops: tuple[OpLike, ...]
    members: tuple[str, ...] = ()
    variables: tuple[tuple[str, tuple[Any, ...]], ...] = ()
    first: str = ""
    notes: tuple[str, ...] = ()


# ---- collapsing repeated layers ------------------------------------------------------------------


def _var_module(name: str, roots: set[str]) -> tuple[str, list[str], str]:
    """(collection prefix, module path parts, leaf) of a variable path."""
    parts = name.split("/")
    coll = ""
    if len(parts) > 1 and (parts[0] in COLLECTIONS or (parts[0] not in roots and len(parts) > 2
                                                      and parts[1] in roots)):
        coll, parts = parts[0], parts[1:]
    return coll, parts[:-1], parts[-1]


def _items(plan: PlanLike, shapes: dict[str, tuple[int, ...]]) -> list[tuple[tuple[str, ...], Any]]:
    """``(module path parts, payload)`` for every op and variable of the plan, in order."""
    items: list[tuple[tuple[str, ...], Any]] = [
        (tuple(p for p in op.module_path.split("/") if p), op) for op in plan.ops]
    roots = {parts[0] for parts, _ in items if parts}
    for name, spec in plan.variables:
        coll, mod, leaf = _var_module(name, roots)
        items.append((tuple(mod), ("var", coll, leaf, tuple(spec), shapes.get(name))))
    return items


def _signature(items: list[tuple[tuple[str, ...], Any]]) -> tuple:
    return tuple((parts, (x.primitive, x.split, x.chunks, x.keep_partial)
                  if not isinstance(x, tuple) else x) for parts, x in items)


def _units(children: dict[str, list], sig: Any) -> list[tuple[str, list[str]]]:
    """``(display name, member names)`` per child in order of first appearance: runs of
    consecutive numbered siblings with equal signatures ``sig(name)`` become one unit (runs
    of modules with sub-modules, or of at least three leaves: ``ln_1, ln_2`` stay apart)."""
    numbered: dict[str, dict[int, str]] = {}
    for name in children:
        m = LAYER_NAME.match(name)
        if m or name.isdigit():  # linen's h_3, nnx lists' h/3
            numbered.setdefault(m.group(1) + "_" if m else "", {})[
                int(m.group(2) if m else name)] = name
    unit_of: dict[str, tuple[str, list[str]]] = {}
    for prefix, by_n in numbered.items():
        if len(by_n) < 2:
            continue
        nums = sorted(by_n)
        runs: list[list[int]] = []
        for n in nums:
            if runs and sig(by_n[n]) == sig(by_n[runs[-1][-1]]):
                runs[-1].append(n)
            else:
                runs.append([n])
        for run in runs:
            deep = any(parts for parts, _ in children[by_n[run[0]]])
            if len(run) < (2 if deep else 3):
                continue
            if len(run) == len(nums):
                shown = f"{prefix}*"
            elif run == list(range(run[0], run[-1] + 1)):
                shown = f"{prefix}{{{run[0]}..{run[-1]}}}"
            else:
                shown = f"{prefix}{{{','.join(map(str, run))}}}"
            unit = (shown, [by_n[n] for n in run])
            for n in run:
                unit_of[by_n[n]] = unit
    out, seen = [], set()
    for name in children:
        unit = unit_of.get(name, (name, [name]))
        if unit[0] not in seen:
            seen.add(unit[0])
            out.append(unit)
    return out


def _collapse(items: list, path: str, full: str, depth: int, count: int,
              members: tuple[str, ...], recompute: tuple[str, ...], out: list[LayoutRow]) -> None:
    """Append the rows of the module at display path ``path`` (first member ``full``)."""
    own = [x for parts, x in items if not parts]
    children: dict[str, list] = {}
    for parts, x in items:
        if parts:
            children.setdefault(parts[0], []).append((parts[1:], x))
    variables = tuple((f"{x[1] + '/' if x[1] else ''}{path + '/' if path else ''}{x[2]}", x[3])
                      for x in own if isinstance(x, tuple))
    ops = tuple(x for x in own if not isinstance(x, tuple))
    if path or ops or variables:
        label = path.rsplit("/", 1)[-1] if path else "<top>"
        if label[:1] in "*{" and "/" in path:  # an nnx list's items: 'h/*'
            label = "/".join(path.rsplit("/", 2)[-2:])
        out.append(LayoutRow(path, label, depth, count, ops, members, variables, full))

    def join(a: str, b: str) -> str:
        return f"{a}/{b}" if a else b

    def sig(name: str) -> tuple:
        redo = any(fnmatch.fnmatchcase(join(full, name), g) for g in recompute)
        return redo, _signature(children[name])

    for shown, names in _units(children, sig):
        n = len(names)
        _collapse(children[names[0]], join(path, shown), join(full, names[0]),
                  depth + (1 if path else 0), count * n,
                  tuple(join(full, m) for m in names) if n > 1 else (), recompute, out)


def layout_rows(plan: PlanLike, graph: Graph | None = None) -> list[LayoutRow]:
    """The plan's modules in program order, consecutive repeated layers with the same layout
    collapsed into one row each (see the module docstring). ``graph``: variable shapes then
    count in the layout (layers of other sizes do not collapse)."""
    shapes = {t.name: tuple(t.shape) for t in graph.variables} if graph is not None else {}
    out: list[LayoutRow] = []
    _collapse(_items(plan, shapes), "", "", 0, 1, (), tuple(plan.recompute), out)
    stage_of = dict(plan.pipeline.stage_of) if plan.pipeline is not None else {}
    for i, r in enumerate(out):
        notes = ["recompute"] if any(fnmatch.fnmatchcase(r.first, g) for g in plan.recompute) \
            else []
        stages = sorted({stage_of[m] for m in r.members or (r.first,) if m in stage_of})
        if stages:
            notes.append(f"stage {stages[0]}" if len(stages) == 1 else
                         f"stages {stages[0]}..{stages[-1]}")
        out[i] = dataclasses.replace(r, notes=tuple(notes))
    return out


def row_cells(row: LayoutRow, axes: Sequence[str], words: dict[tuple[int, str], str]
              ) -> list[tuple[str, str]]:
    """Per mesh axis: (the distinct words of the dims the row's ops split over it, or ``-``;
    the identifiers)."""
    cells = []
    for a in axes:
        said = {words.get((p.op, d), d): None for p in row.ops if (d := p.axis_dim(a))}
        idents = {d: None for p in row.ops if (d := p.axis_dim(a))}
        cells.append((", ".join(said) or "-", ", ".join(idents)))
    return cells


def ops_text(ops: Sequence[OpLike], limit: int = 4) -> str:
    """``'dot_general, reshape, addx2'`` (the first ``limit`` primitives, then a count)."""
    prims = [p.primitive for p in ops]
    counts = {q: prims.count(q) for q in dict.fromkeys(prims)}
    shown = [f"{q}x{c}" if c > 1 else q for q, c in counts.items()]
    more = f" +{len(shown) - limit} more" if len(shown) > limit else ""
    return ", ".join(shown[:limit]) + more


# ---- text and html -------------------------------------------------------------------------------


def head_line(plan: PlanLike) -> str:
    return (f"Plan[{plan.policy or 'custom'}] mesh {dict(plan.mesh)} zero={plan.zero}"
            + (f" precision={plan.precision}" if plan.precision else ""))


def fused_attention_rows(plan: PlanLike) -> list[tuple[str, str]]:
    """Per fused attention op of ``plan``: its module path and how it runs: ``"ring over seq"``
    / ``"zigzag over seq"`` (split on its sequence: ring attention), else its split
    (``"b1 over model"``: each device's heads, the sequences whole) or ``"replicated"``."""
    by_id = {p.op: p for p in plan.ops}
    rings = dict(getattr(plan, "ring_layouts", ()) or ())
    out = []
    for i in getattr(plan, "fused_attention", ()) or ():
        p = by_id.get(i)
        if p is None:
            out.append((f"op {i}", "?"))
            continue
        seq = [a for a, d in p.split if d == "s"]
        rest = ", ".join(f"{d} over {a}" for a, d in p.split if d != "s")
        how = f"{rings.get(i, 'ring')} over {'x'.join(seq)}" if seq else ""
        out.append((p.module_path or "<top>",
                    ", ".join(x for x in (how, rest) if x) or "replicated"))
    return out


def feature_lines(plan: PlanLike) -> list[str]:
    """Beyond layouts: recompute, co-sharding, value-split chains, pipeline, unsplit dims."""
    lines = []
    if plan.recompute:
        lines.append(f"recompute ({len(plan.recompute)} groups): "
                     + ", ".join(plan.recompute[:8])
                     + (f" and {len(plan.recompute) - 8} more" if len(plan.recompute) > 8 else ""))
    chunked = [p for p in plan.ops if p.chunks]
    if chunked:
        desc = {f"{p.module_path or '<top>'} {p.primitive} x{p.chunks[1]} along {p.chunks[0]}": 0
                for p in chunked}
        lines.append(f"co-sharded ({len(chunked)} ops run as sequential chunks): "
                     + "; ".join(list(desc)[:6]) + (" ..." if len(desc) > 6 else ""))
    if plan.coshard:
        by_id = plan._by_id()
        desc = {f"{by_id[i].module_path or '<top>'} x{k} along {d}" if i in by_id else
                f"op {i} x{k} along {d}": 0 for i, d, k in plan.coshard}
        lines.append(f"co-sharded blocks ({len(plan.coshard)}, each run as sequential "
                     "recomputed chunks): " + "; ".join(list(desc)[:6])
                     + (" ..." if len(desc) > 6 else ""))
    fused = fused_attention_rows(plan)
    if fused:
        desc: dict[str, list[str]] = {}
        for path, how in fused:
            desc.setdefault(how, []).append(path)
        lines.append(f"fused attention ({len(fused)} blocks, each one kernel): " + "; ".join(
            f"{', '.join(paths[:3])}{' ...' if len(paths) > 3 else ''} ({how})"
            for how, paths in desc.items()))
    partial = sum(p.keep_partial for p in plan.ops)
    if partial:
        lines.append(f"value-split chains: {partial} ops keep partial sums")
    micro = plan.pipeline.microbatches if plan.pipeline is not None else plan.microbatches
    lines.append(f"micro-batches: {micro}; ZeRO stage {plan.zero}; precision: "
                 f"{plan.precision or 'as the model (no cast)'}")
    if plan.pipeline is not None:
        lines += plan.pipeline.lines()
    if plan.unsplit:
        lines.append(f"left replicated (size does not divide): {len(plan.unsplit)} op dims")
    return lines


def estimate_line(plan: PlanLike) -> str:
    c = plan.cost
    if c is None:
        return "estimate: none (plan.cost is None)"
    return (f"estimate: step {c.step_time_s * 1e3:.3f} ms (compute {c.compute_time_s * 1e3:.3f}"
            f", comm {c.comm_time_s * 1e3:.3f}), memory/device {fmt_bytes(c.memory_bytes_per_device)}"
            f", comm {fmt_bytes(c.comm_bytes)}")


def plan_summary(plan: PlanLike, graph: Graph | None = None) -> str:
    """The plan as a short table: one row per module, repeated layers with the same layout
    collapsed into one group row (``h_* (x24)``); per mesh axis the dims its ops split, in
    words (with ``graph``) or as annotation identifiers; the sharded variables, grouped the
    same way; features and the estimate."""
    axes = [a for a, _ in plan.mesh]
    rows = layout_rows(plan, graph)
    words = dim_words(plan, graph)
    body = []
    for r in rows:
        label = "  " * r.depth + r.label + (f" (x{len(r.members)})" if r.members else "") + (
            f" [{'; '.join(r.notes)}]" if r.notes else "")
        body.append([label] + [c for c, _ in row_cells(r, axes, words)]
                    + [ops_text(r.ops) if r.ops else ""])
    head = ["module"] + axes + ["ops"]
    widths = [max(len(x[i]) for x in [head] + body) for i in range(len(head))]
    lines = [head_line(plan) + f" - {len(plan.ops)} ops in {len(rows)} rows"]
    lines += ["  ".join(c.ljust(w) for c, w in zip(x, widths, strict=True)).rstrip()
              for x in [head] + body]
    sharded = [(n, s) for r in rows for n, s in r.variables if any(e is not None for e in s)]
    if sharded:
        lines.append("variables stored sharded:")
        lines += [f"  {n}: P{tuple(s)}" for n, s in sharded]
    return "\n".join(lines + feature_lines(plan) + [estimate_line(plan)])


_STYLE = ("<style>.nnscaler-plan table{border-collapse:collapse;margin:4px 0}"
          ".nnscaler-plan td,.nnscaler-plan th{padding:1px 8px;text-align:left}"
          ".nnscaler-plan .rep{color:#999}</style>")


def plan_html(plan: PlanLike, graph: Graph | None = None) -> str:
    """The notebook view: header, estimate and features, the module x mesh axis layout (split
    dims in words), the stored variables, and every op in a collapsed ``<details>``."""
    e = html.escape
    rows = layout_rows(plan, graph)
    words = dim_words(plan, graph)
    parts = [_STYLE, f"<div class='nnscaler-plan'><b>{e(head_line(plan))}</b>",
             _estimate_html(plan),
             "<ul>" + "".join(f"<li>{e(x)}</li>" for x in feature_lines(plan)) + "</ul>"]
    if graph is None:
        parts.append("<p><i>Split dims are the annotation identifiers of each op (a plan "
                     "records no shapes); plan.view(pm.graph) names them (batch, heads, ...) "
                     "with sizes.</i></p>")
    parts.append(_layout_html(plan, rows, words))
    shapes = {t.name: tuple(t.shape) for t in graph.variables} if graph is not None else {}
    variables = [(n, s) for r in rows for n, s in r.variables]
    if variables:
        body = "".join(f"<tr><td>{e(n)}</td><td>{e(str(_shape_of(n, shapes) or '?'))}</td>"
                       f"<td>{e(_spec_text(s))}</td></tr>" for n, s in variables)
        parts.append(f"<details open><summary>variables ({len(plan.variables)}; repeated "
                     f"layers once)</summary><table><tr><th>name</th><th>shape</th>"
                     f"<th>stored as</th></tr>{body}</table></details>")
    parts.append(_detail_html(plan, words))
    return "\n".join(parts) + "</div>"


def _spec_text(spec: Sequence[Any]) -> str:
    return f"P{tuple(spec)}" if any(x is not None for x in spec) else "replicated"


def _estimate_html(plan: PlanLike) -> str:
    c = plan.cost
    if c is None:
        return "<p>estimate: none (plan.cost is None)</p>"
    cells = [("step time", f"{c.step_time_s * 1e3:.3f} ms"),
             ("compute / comm time",
              f"{c.compute_time_s * 1e3:.3f} / {c.comm_time_s * 1e3:.3f} ms"),
             ("memory per device", fmt_bytes(c.memory_bytes_per_device)),
             ("comm bytes", f"{fmt_bytes(c.comm_bytes)} ({c.comm_bytes:,} B)")]
    return ("<table><tr>" + "".join(f"<th>{html.escape(k)}</th>" for k, _ in cells)
            + "</tr><tr>" + "".join(f"<td>{html.escape(v)}</td>" for _, v in cells)
            + "</tr></table>")


def _layout_html(plan: PlanLike, rows: list[LayoutRow],
                 words: dict[tuple[int, str], str]) -> str:
    """module x mesh axis -> the dims split (identifiers in each cell's tooltip)."""
    e = html.escape
    axes = [a for a, _ in plan.mesh]
    body = []
    for r in rows:
        small = ([f"x{len(r.members)}: {_members(r.members)}"] if r.members else []) + list(
            r.notes)
        label = e(r.label) + (f" <small>({e('; '.join(small))})</small>" if small else "")
        cells = "".join(f"<td title='{e(ids, quote=True)}'>{e(w)}</td>" if ids
                        else "<td class='rep'>-</td>" for w, ids in row_cells(r, axes, words))
        body.append(f"<tr><td style='padding-left:{r.depth * 1.2 + 0.5:.1f}em'>{label}</td>"
                    f"{cells}<td>{e(ops_text(r.ops))}</td></tr>")
    head = "".join(f"<th>{e(a)} ({n})</th>" for a, n in plan.mesh)
    return (f"<table><thead><tr><th>module</th>{head}<th>ops</th></tr></thead><tbody>"
            + "".join(body) + "</tbody></table>")


def _members(members: Sequence[str]) -> str:
    return f"{members[0]} .. {members[-1]}" if len(members) > 2 else ", ".join(members)


def _shape_of(name: str, shapes: dict[str, tuple[int, ...]]) -> tuple[int, ...] | None:
    """The shape of a (possibly collapsed: ``h_*``) variable name, from its first layer."""
    if name in shapes:
        return shapes[name]
    pat = re.sub(r"\\\{[^}]*\\\}", r"\\d+", re.escape(name).replace(r"\*", r"\d+"))
    return next((s for n, s in shapes.items() if re.fullmatch(pat, n)), None)


def _detail_html(plan: PlanLike, words: dict[tuple[int, str], str]) -> str:
    e = html.escape
    axes = [a for a, _ in plan.mesh]
    rows = []
    for p in plan.ops[:MAX_DETAIL_OPS]:
        cells = "".join(f"<td>{e(words.get((p.op, d), d) if (d := p.axis_dim(a)) else '-')}</td>"
                        for a in axes)
        extra = (f"x{p.chunks[1]} along {p.chunks[0]}" if p.chunks else "") + (
            " keep partial" if p.keep_partial else "")
        rows.append(f"<tr><td>{p.op}</td><td>{e(p.primitive)}</td><td style='text-align:left'>"
                    f"{e(p.module_path or '<top>')}</td>{cells}<td>{e(extra)}</td></tr>")
    more = len(plan.ops) - MAX_DETAIL_OPS
    note = f"<p>... {more} more ops: str(plan) lists them all</p>" if more > 0 else ""
    head = "".join(f"<th>{e(a)}</th>" for a in axes)
    return (f"<details><summary>per-op detail ({len(plan.ops)} ops)</summary><table><tr>"
            f"<th>op</th><th>primitive</th><th>module path</th>{head}<th>chunks</th></tr>"
            + "".join(rows) + f"</table>{note}</details>")


@dataclass(frozen=True)
class PlanView:
    """A plan with the graph it was made for: ``plan.view(pm.graph)``; a notebook shows it
    with split dims in words (``_repr_html_``), ``str`` is the summary."""

    plan: PlanLike
    graph: Graph | None = None

    def _repr_html_(self) -> str:
        return plan_html(self.plan, self.graph)

    def summary(self) -> str:
        return plan_summary(self.plan, self.graph)

    def rows(self) -> list[LayoutRow]:
        return layout_rows(self.plan, self.graph)

    def words(self) -> dict[tuple[int, str], str]:
        return dim_words(self.plan, self.graph)

    def __str__(self) -> str:
        return self.summary()

    def __repr__(self) -> str:
        return (f"PlanView({self.plan.policy or 'custom'} plan, {len(self.plan.ops)} ops, "
                f"{'with' if self.graph is not None else 'without'} its graph)")
