"""A traced model cut into pipeline units (prefix, each layer, suffix), priced per sample.

The layers are the graph's layer stack (:func:`nnscaler_jax.pipeline.stages.graph_layers`:
numbered ``<prefix>_<i>`` modules or one ``nn.scan``); each unit is priced per sample by the
:class:`~nnscaler_jax.cost.model.CostModel` (``op_time`` forward + backward,
``activation_bytes`` of what autodiff keeps) plus its parameter bytes. The stage DP
(:mod:`nnscaler_jax.pipeline.stage_dp`) and the runtime pricing
(:mod:`nnscaler_jax.pipeline.pricing`) place stage boundaries between units.

>>> import models
>>> from nnscaler_jax.capture.trace import trace
>>> spec = models.get("gpt", "tiny", n_layers=4)
>>> [u.name for u in layer_units(trace(spec.module, *spec.make_args()), batch=2)]
['<prefix>', 'h_0', 'h_1', 'h_2', 'h_3', '<suffix>']
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

from nnscaler_jax.cost.compute import FREE
from nnscaler_jax.cost.devices import H100_80G
from nnscaler_jax.cost.fusion import fused_bytes
from nnscaler_jax.cost.model import CostModel, itemsize
from nnscaler_jax.cost.residuals import residual_outputs
from nnscaler_jax.errors import PlanError
from nnscaler_jax.ir.graph import Graph
from nnscaler_jax.ir.layers import block_paths, graph_layers, variable_casts

__all__ = ["TP_COLLECTIVES", "Unit", "kept_for_weights", "largest_output", "layer_units",
           "sent_bytes", "unit_parts"]

TP_COLLECTIVES = 4
"""All-reduces of a layer's output per forward + backward under Megatron tensor parallelism."""


@dataclass(frozen=True, slots=True)
class Unit:
    """One indivisible piece of the model, priced for one sample on one device.

    Attributes:
        name: ``'<prefix>'``, a layer (``h_3``, ``h[3]``), or ``'<suffix>'``.
        time_s: forward + backward seconds.
        act_bytes: activations kept for the backward pass.
        param_bytes: parameter bytes (without gradient / optimizer state).
        out_bytes: bytes of the activation sent to the next unit.
        tp_collectives: all-reduces of ``out_bytes`` per pass under tensor parallelism
            (Megatron: 2 per layer forward, 2 backward).
        layer_in_bytes / layer_act_bytes: with every layer inside its chunk recomputed
            (``PipelineSettings.recompute='layer'``): the bytes the unit keeps (its layers'
            inputs) and the largest of its layers' activations, per sample; None: the unit
            is not recomputed layer by layer (it keeps ``act_bytes``).
        transient_bytes: the largest of its ops' outputs per sample (:func:`largest_output`):
            live, with its cotangent, beside the kept activations while the backward runs.
        chunk_again_s / layer_again_s: forward seconds per sample recomputed once more inside
            the chunk's backward (layers a recompute rule asks for, :mod:`~nnscaler_jax.
            pipeline.rules`) with ``recompute='chunk'`` / ``'layer'`` (None: the unit's whole
            forward, ``time_s / 3``). A cut chunk with such layers has them priced into
            ``act_bytes`` / ``layer_in_bytes`` too.
        wgrad_bytes: what a split backward keeps from its ``B`` for its weight gradients
            (``G``, :mod:`~nnscaler_jax.pipeline.split_backward`), per sample: the inputs
            of the ops reading a parameter (other than parameters) and the cotangents of
            their outputs, each tensor once.
        shared_bytes: of a cut chunk, the bytes of the shared parameters (several chunks
            read them; the prefix carries them in ``param_bytes``) its own ops read too: a
            copy on its stage where the prefix's parameters live elsewhere (interlaced's
            all-device blocks on tensor-parallel stages).
        whole_param_bytes: of a cut model's prefix on tensor-parallel stages: its parameter
            bytes before the in-stage plan's storage (``param_bytes`` counts a parameter the
            plan stores whole ``tp`` times, as the runtime pricing divides by ``tp``), which
            interlaced's all-device blocks split over every device themselves; None: equal.
        tied_bytes: of the suffix, the bytes of its parameters the prefix reads too (GPT's
            head tied to its token embedding): one leaf, which a runtime keeping the prefix's
            and suffix's leaves together (the in-graph programs' shared leaves) holds once.
    """

    name: str
    time_s: float
    act_bytes: float
    param_bytes: float
    out_bytes: float
    tp_collectives: int = 0
    layer_in_bytes: float | None = None
    layer_act_bytes: float | None = None
    transient_bytes: float = 0.0
    chunk_again_s: float = 0.0
    layer_again_s: float | None = None
    wgrad_bytes: float = 0.0
    shared_bytes: float = 0.0
    whole_param_bytes: float | None = None
    tied_bytes: float = 0.0


def largest_output(ops) -> float:
    """The largest bytes one op (not a layout op, not a region) writes, among ``ops``."""
    return float(max((sum(math.prod(t.shape) * itemsize(t) for t in o.outputs) for o in ops
                      if not o.regions and o.primitive not in FREE), default=0))


def kept_for_weights(ops, params: set[int]) -> float:
    """Bytes a split backward keeps from its ``B`` for its weight gradients over ``ops``
    (:attr:`Unit.wgrad_bytes`): per op reading a parameter (``params``: parameter ids; what is
    computed from parameters alone, casts, reshapes, broadcasts, counts as one), its other
    inputs (``x`` of ``x^T dy``; none for a bias ``add`` / ``sub``) and the cotangent of its
    output (``dy``; one for a bias added to another such op's output: the same cotangent),
    each tensor once."""
    size = lambda t: math.prod(t.shape) * itemsize(t)
    kept, params, made = {}, set(params), set()
    for o in ops:
        if o.regions or not o.inputs:
            continue
        if all(t.id in params for t in o.inputs):  # (a parameter's reshape, cast)
            params.update(t.id for t in o.outputs)
            continue
        if not any(t.id in params for t in o.inputs):
            continue
        xs = [t for t in o.inputs if t.id not in params]
        if o.primitive in ("add", "sub"):
            if all(t.id in made for t in xs):  # a bias: its dy is the producer's
                made.update(t.id for t in o.outputs)
                continue
            xs = []
        kept.update((t.id, size(t)) for t in (*xs, *o.outputs))
        made.update(t.id for t in o.outputs)
    return float(sum(kept.values()))


def _with_casts(graph: Graph, casts: dict[int, int], ranges: list[tuple[int, int]]
                ) -> list[list]:
    """The ops of each range of ``graph.ops``, a weight's precision cast moved from where it
    was traced (the program's start) to the first range reading it."""
    moved = {op.outputs[0].id: op for op in graph.ops if op.id in casts}
    out = []
    for a, b in ranges:
        part = [o for o in graph.ops[a:b] if o.id not in casts]
        read = {t.id for o in part for t in o.inputs}
        out.append([moved.pop(i) for i in list(moved) if i in read] + part)
    return out


def sent_bytes(graph: Graph, parts: list[list]) -> list[float]:
    """Per unit ``k`` of ``parts`` (:func:`unit_parts`' ops, in order), the bytes of the values
    units ``0..k`` make that a unit after ``k`` reads: what a stage ending at unit ``k`` sends
    on (the cut program's boundary values), each value once. Beside the last unit's output:
    what later units read from further back (T5's encoder output and position bias, which
    every decoder block reads). Not the graph's inputs (every stage reads the batch), nor a
    weight's cast (made where it is read)."""
    casts = variable_casts(graph)
    made: dict[int, int] = {}
    for k, ops in enumerate(parts):
        made.update((t.id, k) for o in ops if o.id not in casts for t in o.outputs)
    size: dict[int, float] = {}
    last: dict[int, int] = {}
    for k, ops in enumerate(parts):
        for t in (t for o in ops for t in o.inputs if made.get(t.id, k) < k):
            last[t.id] = max(last.get(t.id, k), k)
            size[t.id] = float(math.prod(t.shape) * itemsize(t))
    out = [0.0] * len(parts)
    for i, end in last.items():
        for k in range(made[i], end):
            out[k] += size[i]
    return out


def unit_parts(graph: Graph, blocks: bool = False) -> list[tuple[str, list]]:
    """``(name, ops)`` of each of :func:`layer_units`' units: what a stage running units
    ``a..b`` runs (a weight's precision cast in the first unit reading it). ``blocks``: cut
    before every repeated block at its finest level (:func:`~nnscaler_jax.ir.layers.
    block_paths`: Swin's ``layers_2/blocks_7``, T5's ``encoder/block_3`` and
    ``decoder/block_3``), each block's unit running to the next block's first op, the last
    one's to its last op; else the layer stack's layers (:func:`~nnscaler_jax.ir.layers.
    graph_layers`). Both with a ``<prefix>`` (before the first) and a ``<suffix>``.

    Raises:
        PlanError: no repeated layers or blocks, blocks whose ops interleave, or a stack that
            is one ``nn.scan`` (its layers are one op).
    """
    casts = variable_casts(graph)
    n = len(graph.ops)
    if blocks:
        names, ranges = _block_ranges(graph, casts)
    else:
        where = graph_layers(graph)
        if where.stack.scanned:
            raise PlanError(f"the layers of '{where.stack.module}' are one nn.scan: no stage "
                            "boundary falls between them; number the layers (h_0, h_1, ...) "
                            "instead of scanning them")
        names = ["<prefix>", *where.names, "<suffix>"]
        ranges = [(0, where.start), *where.bounds, (where.end, n)]
    return list(zip(names, _with_casts(graph, casts, ranges), strict=True))


def _block_ranges(graph: Graph, casts: dict[int, int]) -> tuple[list[str], list[tuple]]:
    paths = ["" if op.id in casts else op.module_path for op in graph.ops]
    blocks = block_paths(p for p in paths if p)
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for i, p in enumerate(paths):
        b = next((b for b in blocks if p == b or p.startswith(b + "/")), None) if p else None
        if b is not None:
            first.setdefault(b, i)
            last[b] = i
    order = sorted(first, key=first.get)
    if len(order) < 2:
        raise PlanError(f"no repeated blocks in the graph (module paths "
                        f"{sorted(set(paths))[:12]}); it needs numbered modules "
                        "('block_0', 'block_1', ...)")
    for x, y in itertools.pairwise(order):
        if first[y] <= last[x]:
            raise PlanError(f"blocks '{x}' and '{y}' interleave (an op of '{x}' runs after "
                            f"'{y}' starts): no stage boundary falls between them")
    starts = [first[b] for b in order]
    end = last[order[-1]] + 1
    ranges = [(0, starts[0]), *itertools.pairwise(starts), (starts[-1], end),
              (end, len(paths))]
    return ["<prefix>", *order, "<suffix>"], ranges


def layer_units(graph: Graph, batch: int = 1, model: CostModel | None = None, *,
                blocks: bool = False) -> list[Unit]:
    """Cut ``graph`` (traced at batch ``batch``) into prefix / layers / suffix units per sample
    (``blocks``: prefix / each repeated block / suffix, :func:`unit_parts`).

    ``model``: the pricing (default: one H100, :data:`nnscaler_jax.cost.devices.H100_80G`).

    Raises:
        PlanError: the graph has no repeated layer stack (``blocks``: no repeated blocks).
    """
    model = model or CostModel.for_axes({"x": 1}, device=H100_80G)
    try:
        where = None if blocks else graph_layers(graph)
        named = unit_parts(graph, blocks=True) if blocks else None
    except PlanError as e:
        raise PlanError(f"stage search: {e}") from None
    saved = residual_outputs(graph)  # the activations autodiff keeps, after fusion
    traffic = fused_bytes(graph)
    var_bytes = {t.id: math.prod(t.shape) * itemsize(t) for t in graph.variables}
    casts = variable_casts(graph)  # (a weight's cast to the compute precision: its own)
    alias = {op.outputs[0].id: casts[op.id] for op in graph.ops if op.id in casts}

    def params_of(ops) -> float:
        ids = {alias.get(t.id, t.id) for o in ops for t in o.inputs} & var_bytes.keys()
        return float(sum(var_bytes[i] for i in ids))

    def unit(name, ops, tp_coll=0, param_bytes=None, layer=False) -> Unit:
        flat = [o for o in ops if not o.regions]
        t = sum(model.op_time(o, (), None, traffic) for o in flat) / batch
        act = sum(model.activation_bytes(o, (), saved.get(o.id, ())) for o in flat) / batch
        out = flat[-1].outputs[0] if flat and flat[-1].outputs else None
        ob = (math.prod(out.shape) * itemsize(out) / batch) if out is not None else 0.0
        p = params_of(ops) if param_bytes is None else param_bytes
        # a layer recomputed inside its chunk keeps its input (the previous layer's output)
        return Unit(name, t, act, p, ob, tp_coll, *((ob, act) if layer else (None, None)),
                    largest_output(flat) / batch,
                    wgrad_bytes=kept_for_weights(flat, set(var_bytes) | set(alias)) / batch)

    if named is not None:
        parts = [part for _, part in named]
        last = len(named) - 1
        units = [unit(name, part, TP_COLLECTIVES if 0 < k < last else 0, layer=0 < k < last)
                 for k, (name, part) in enumerate(named)]
        return _ends(units, parts, alias, var_bytes)
    ops, stack = graph.ops, where.stack
    parts = _with_casts(graph, casts, [(0, where.start), *where.bounds,
                                       (where.end, len(ops))])
    units = [unit("<prefix>", parts[0])]
    if stack.scanned:
        scan = ops[where.start]
        body = [o for region in scan.regions for o in region.walk()]
        per_layer = params_of([scan])
        one = unit("", body, TP_COLLECTIVES, per_layer / stack.count, layer=True)
        units += [replace(one, name=name) for name in where.names]
    else:
        units += [unit(name, part, TP_COLLECTIVES, layer=True)
                  for name, part in zip(where.names, parts[1:-1], strict=True)]
    units.append(unit("<suffix>", parts[-1]))
    return _ends(units, parts, alias, var_bytes)


def _ends(units: list[Unit], parts: list[list], alias: dict[int, int],
          var_bytes: dict[int, int]) -> list[Unit]:
    """The suffix's weights the prefix reads too (a tied head); the prefix handing the first
    layer the same activation a layer hands the next."""
    read = lambda part: {alias.get(t.id, t.id) for o in part for t in o.inputs} & var_bytes.keys()
    units[-1] = replace(units[-1], tied_bytes=float(sum(
        var_bytes[i] for i in read(parts[-1]) & read(parts[0]))))
    units[0] = replace(units[0], out_bytes=units[1].out_bytes, tp_collectives=0)
    return units
