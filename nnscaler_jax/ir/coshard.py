"""Co-sharded blocks: a run of ops computed chunk by chunk along one dim, each chunk recomputed.

nnScaler's co-sharding splits an operator into k x (devices) sub-operators and runs a device's k
one after another; applied to a *block* of ops (window attention's scores, softmax and
weighted sum; the MLP behind it) the block's large intermediates exist one chunk at a time and
are recomputed in the backward pass, so the block costs the memory of its inputs plus one
chunk's intermediates, and one more forward.

A block is grown from a *seed* op and one identifier of its annotation (``q`` of the attention
scores ``b h q d+, b h k d+ -> b h q k``): forward along the tensors it makes, an op joins when
the axes it reads from the block all carry one of its identifiers, that identifier is spatial
(not reduced, not frozen, leading its axis alone) and in every output; backward, the producers
of what it reads along the dim join when only the block reads their results (q's projection, a
causal mask broadcast to the scores' shape). Inputs from outside the
block that carry the identifier at the block's size are split into chunks as well; the rest
(weights, keys and values) are read whole by every chunk. Ops stay inside the seed's repeated
layer (:func:`nnscaler_jax.ir.layers.block_paths`); an op that reads something computed from the
block by an op outside it leaves the block (it would have to run before and after the block).
Outside the repeated layers, a block may only be the *head* after the last one (an LM head and,
in a training step's graph, its loss: the chunked loss, whose ``take_along_axis`` of each
token's label runs per chunk, :func:`gather_on_batch`).

:func:`with_coshard` gives the graph with each block's ops moved next to each other (a valid
topological order: ops of the span that do not depend on the block go before it, those that do
go after) inside one ``"coshard"`` boundary whose equation records the chunk count and axes. The
boundary is a remat kind, so the search tables and the cost model keep only its inputs and add
its forward again, as for the plan's recompute groups; the transient of its ops is one chunk's
(:data:`COSHARD`); the lowering runs it as a ``lax.scan`` over chunks of ``jax.checkpoint``-ed
bodies (``lower/coshard.py``).

>>> import jax, jax.numpy as jnp, flax.linen as nn
>>> from nnscaler_jax import trace
>>> class Attn(nn.Module):
...     @nn.compact
...     def __call__(self, x):
...         q, k, v = (nn.Dense(8, name=n)(x) for n in "qkv")
...         p = jax.nn.softmax(jnp.einsum("bqd,bkd->bqk", q, k), axis=-1)
...         return nn.Dense(8, name="o")(jnp.einsum("bqk,bkd->bqd", p, v))
>>> class Net(nn.Module):
...     @nn.compact
...     def __call__(self, x):
...         return Attn(name="blk_1")(Attn(name="blk_0")(x))
>>> g = trace(Net(), jnp.ones((2, 16, 8)))
>>> [(c.layer, c.seed_path, c.dim, c.size) for c in coshard_candidates(g)]
[('blk_0', 'blk_0', 'b0', 2), ('blk_1', 'blk_1', 'b0', 2)]
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, replace
from types import SimpleNamespace

from nnscaler_jax.errors import PlanError
from nnscaler_jax.ir.anno import DimKind
from nnscaler_jax.ir.graph import Boundary, Graph, Op, Role, Tensor
from nnscaler_jax.ir.layers import block_paths
from nnscaler_jax.ir.remat import in_group, with_recompute
from nnscaler_jax.ir.repeats import span_key

__all__ = ["COSHARD", "PARAM_SHAPED", "Block", "Candidate", "block_of", "chunk_counts",
           "chunks_of", "coshard_candidates", "gather_on_batch", "whole_reads",
           "with_boundaries", "with_coshard"]

#: The boundary kind of a co-sharded block (also in ``ir.graph.REMAT_KINDS``).
COSHARD = "coshard"

#: Primitives whose params spell shapes in ways a piece or chunk cannot rewrite
#: (``lower/local.py``); they never join a block, nor do iota and convolutions.
PARAM_SHAPED = frozenset({"dynamic_slice", "slice", "pad", "gather", "scatter", "scatter-add",
                          "concatenate", "dynamic_update_slice", "rng_bit_generator",
                          "random_bits"})
_OUTSIDE = PARAM_SHAPED | {"iota", "conv_general_dilated", "fused_attention"}  # never in a
# block (forward)

_INLINE = frozenset({"custom_jvp_call"})  # boundaries a block may contain whole (replayed)


@dataclass(frozen=True)
class Block:
    """A co-sharded block of ``graph``.

    Attributes:
        seed / dim: the op it grew from and the identifier of the seed's annotation chunked.
        ops: the block's op ids, in program order.
        idents: ``(op id, identifier)``: what each op splits into chunks.
        axes: ``(tensor id, axis)`` of every tensor the block reads or makes along the chunks.
        size: the chunked dim's size.
    """

    seed: int
    dim: str
    ops: tuple[int, ...]
    idents: tuple[tuple[int, str], ...]
    axes: tuple[tuple[int, int], ...]
    size: int


@dataclass(frozen=True)
class Candidate:
    """A block worth co-sharding: its seed, dim, size and the bytes of its intermediates
    (what it stops keeping for the backward pass)."""

    seed: int
    dim: str
    size: int
    internal_bytes: int
    largest_bytes: int
    seed_path: str
    layer: str


def _batch_gather(op: Op) -> bool:
    """A gather with operand batching dims (``take_along_axis``: a loss reading each token's
    label logit), which may run on pieces of them (:func:`gather_on_batch`)."""
    return op.primitive == "gather" and bool(
        getattr(op.params.get("dimension_numbers"), "operand_batching_dims", ()))


def gather_on_batch(op: Op, names: Iterable[str]) -> bool:
    """Whether gather ``op`` runs unchanged on pieces of the dims ``names``: each is an
    operand batching dim (slice size 1) or not an operand dim at all; its parameters carry no
    size of them (a chunk of a co-sharded block, a device's piece in a region)."""
    if not _batch_gather(op):
        return False
    batching = op.params["dimension_numbers"].operand_batching_dims
    axes = [op.annotation.inputs[0].axis_of(n) for n in names]
    return all(a is None or a in batching for a in axes)


def _ident(op: Op, known: dict[int, int]) -> str | None:
    """The identifier ``op`` would chunk given the chunked axes of the tensors it reads
    (``known``), or None when it cannot join a block."""
    if op.regions or (op.primitive in _OUTSIDE and not _batch_gather(op)):
        return None
    anno = op.annotation
    names = set()
    for j, t in enumerate(op.inputs):
        if t.id in known:
            axes = anno.inputs[j].axes
            if axes is None or known[t.id] >= len(axes) or len(axes[known[t.id]].dims) != 1:
                return None
            names.add(axes[known[t.id]].dims[0].name)
    if len(names) != 1:
        return None
    (name,) = names
    if op.primitive in _OUTSIDE and not gather_on_batch(op, [name]):
        return None
    return name if _chunkable(op, name) else None


def _chunkable(op: Op, name: str) -> bool:
    anno = op.annotation
    if anno.kinds().get(name) is not DimKind.SPATIAL or name not in anno.splittable():
        return False
    size = op.dim_sizes()[name]
    for operand in anno.outputs:
        p = operand.axis_of(name)
        if p is None or len(operand.axes[p].dims) != 1:
            return False
    for operand, t in zip(anno.inputs, op.inputs, strict=True):
        p = operand.axis_of(name)
        if p is not None and (len(operand.axes[p].dims) != 1 or t.shape[p] != size):
            return False
    return True


def _axes_of(op: Op, name: str) -> list[tuple[int, int]]:
    anno = op.annotation
    out = [(t.id, operand.axis_of(name)) for operand, t in zip(anno.inputs, op.inputs,
                                                                strict=True)]
    out += [(t.id, operand.axis_of(name)) for operand, t in zip(anno.outputs, op.outputs,
                                                                 strict=True)]
    return [(t, p) for t, p in out if p is not None]


class _Index:
    """What block growth asks of a graph again and again, computed once per graph."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.index = {op.id: i for i, op in enumerate(graph.ops)}
        self.kinds = {b.id: b.kind for b in graph.boundaries}
        self.outputs = {t.id for t in graph.outputs}
        self.layers = block_paths(op.module_path for op in graph.ops) or list(dict.fromkeys(
            op.module_path.split("/")[0] for op in graph.ops if op.module_path))
        self.layer_of: dict[str, str] = {}
        self.first: dict[str, int] = {}  # layer -> index of its first op
        self.last: dict[str, int] = {}  # layer -> index of its last op
        for i, op in enumerate(graph.ops):
            layer = self.layer(op.module_path)
            if layer:
                self.first.setdefault(layer, i)
                self.last[layer] = i
        # where the head begins: the ops after the last repeated layer (an LM head, the loss)
        self.head = max(self.last.values()) + 1 if self.last else len(graph.ops)

    def layer(self, path: str) -> str:
        """The repeated layer (else top module) ``path`` lies in, '' for none."""
        out = self.layer_of.get(path)
        if out is None:
            out = self.layer_of[path] = next((x for x in self.layers if in_group(path, x)), "")
        return out


_LAST: list[_Index] = []  # the last graph's index (planning asks about one graph at a time)


def _indexed(graph: Graph) -> _Index:
    if not _LAST or _LAST[0].graph is not graph:
        _LAST[:] = [_Index(graph)]
    return _LAST[0]


def block_of(graph: Graph, seed: int, dim: str, *, back: bool = True) -> Block:
    """The block grown from op ``seed`` along its identifier ``dim`` (see the module docs);
    ``back``: also backwards, to the producers of what it reads along the dim (dropped when
    that leaves the seed outside a convex block).

    Raises:
        PlanError: no top-level op ``seed``, or ``dim`` is not a chunkable identifier of it.
    """
    ix = _indexed(graph)
    index = ix.index
    if seed not in index:
        raise PlanError(f"co-sharding: no top-level op {seed} in the graph")
    root = graph.ops[index[seed]]
    if root.regions or root.primitive in _OUTSIDE or root.boundary or \
            not _chunkable(root, dim):
        raise PlanError(f"co-sharding: op {seed} '{root.primitive}' at "
                        f"'{root.module_path or '<top>'}' (annotation '{root.anno}') cannot run "
                        f"in chunks along '{dim}' (a spatial identifier in every output)")
    layer = ix.layer(root.module_path)
    if not layer and ix.layers and index[seed] < ix.head:
        raise PlanError(f"co-sharding: op {seed} '{root.primitive}' at "
                        f"'{root.module_path or '<top>'}' lies outside the repeated layers and "
                        "before them; a block outside them is the head after the last one "
                        "(an LM head and its loss)")
    kinds = ix.kinds
    member = {seed: dim}
    known = dict(_axes_of(root, dim))
    span: Sequence[Op] = ()
    for _ in range(8):  # backward and forward until neither adds an op
        size = len(member)
        if back:
            _grow_back(graph, layer, member, known)
        start = min(index[i] for i in member)
        span = graph.ops[start:ix.last[layer] + 1] if layer else graph.ops[start:]
        _grow_forward(graph, span, kinds, member, known)
        if len(member) == size:
            break
    member = _convex(graph, span, member)
    member = _whole_boundaries(span, member)
    member = _convex(graph, span, member)
    if seed not in member:
        if back:
            return block_of(graph, seed, dim, back=False)
        member = {seed: dim}
    axes: dict[int, int] = {}
    by_id = {op.id: op for op in span}
    for i, name in member.items():
        axes.update(_axes_of(by_id[i], name))
    ordered = tuple(sorted(member, key=index.__getitem__))
    return Block(seed, dim, ordered, tuple((i, member[i]) for i in ordered),
                 tuple(sorted(axes.items())), root.dim_sizes()[dim])


def _fits(graph: Graph, op: Op, name: str, member: dict[int, str],
          known: dict[int, int]) -> bool:
    """Whether ``op`` chunking ``name`` agrees with the block: every tensor the two share is
    chunked along one axis by all its members, or read whole by all of them."""
    axes = dict(_axes_of(op, name))
    if any(known.get(t, p) != p for t, p in axes.items()):
        return False
    if any(t.id not in axes and t.id in known for t in op.inputs):
        return False
    for t in op.inputs + op.outputs:
        for c in graph.consumers.get(t.id, ()):
            if c.id in member and dict(_axes_of(c, member[c.id])).get(t.id) != axes.get(t.id):
                return False
    return True


def _grow_forward(graph: Graph, span: Sequence[Op], kinds: dict[int, str],
                  member: dict[int, str], known: dict[int, int]) -> None:
    """Add the ops of ``span`` that read the block's tensors along the chunked axis."""
    for op in span:
        if op.id in member or not any(t.id in known and _made_inside(graph, t, member)
                                      for t in op.inputs):
            continue
        if any(kinds.get(b) not in _INLINE for b in op.boundary):
            continue
        name = _ident(op, known)
        if name is None or not _fits(graph, op, name, member, known):
            continue
        member[op.id] = name
        known.update(_axes_of(op, name))


def _grow_back(graph: Graph, layer: str, member: dict[int, str], known: dict[int, int]) -> None:
    """Add to the block the producers (inside the layer, in no boundary) of the tensors it
    reads along the chunked axis whose results only the block reads, as long as they run
    along the axis too: ``q``'s projection and the reshapes before window attention's
    scores; a causal mask broadcast to the scores' shape (computed per chunk, never whole).
    An iota joins too, along any of its dims, the one it counts along included (a causal
    mask's positions: cut into chunks from outside, its whole ``[S, S]`` int32 would be kept,
    2 x 8 GiB per device for Llama-3-8B at 128K); the lowering offsets a chunk's count
    (``lower/coshard.py``)."""
    changed = True
    while changed:
        changed = False
        for tid, axis in list(known.items()):
            op = graph.producer.get(tid)
            counts = op is not None and op.primitive == "iota"  # no inputs: made per chunk
            if op is None or op.id in member or op.boundary or op.regions or \
                    (op.primitive in _OUTSIDE and not counts) or \
                    (layer and not in_group(op.module_path, layer)) or \
                    (not layer and _indexed(graph).index[op.id] < _indexed(graph).head):
                continue
            if any(c.id not in member for t in op.outputs
                   for c in graph.consumers.get(t.id, ())) or \
                    any(t.id in _indexed(graph).outputs for t in op.outputs):
                continue
            k = [t.id for t in op.outputs].index(tid)
            axes = op.annotation.outputs[k].axes
            if axes is None or axis >= len(axes) or len(axes[axis].dims) != 1:
                continue
            name = axes[axis].dims[0].name
            if not (counts or _chunkable(op, name)) or not _fits(graph, op, name, member, known):
                continue
            member[op.id] = name
            known.update(_axes_of(op, name))
            changed = True


def _made_inside(graph: Graph, t: Tensor, member: dict[int, str]) -> bool:
    op = graph.producer.get(t.id)
    return op is not None and op.id in member


def _convex(graph: Graph, span: Sequence[Op], member: dict[int, str]) -> dict[int, str]:
    """``member`` less the ops that read something computed from the block outside it."""
    member = dict(member)
    while True:
        tainted: set[int] = set()  # tensors computed from the block by ops outside it
        bad = []
        at = [i for i, op in enumerate(span) if op.id in member]
        for op in span[at[0]:at[-1] + 1] if at else ():  # nothing outside can taint a member
            if op.id in member:
                if any(t.id in tainted for t in op.inputs):
                    bad.append(op.id)
            elif any(t.id in tainted or _made_inside(graph, t, member) for t in op.inputs):
                tainted.update(t.id for t in op.outputs)
        if not bad:
            return member
        for i in bad:
            member.pop(i, None)


def _whole_boundaries(span: Sequence[Op], member: dict[int, str]) -> dict[int, str]:
    """``member`` less the ops of inline boundaries (``custom_jvp``) it holds only in part
    (the seed stays: it is in no boundary)."""
    inside: dict[int, list[int]] = {}
    for op in span:
        for b in op.boundary:
            inside.setdefault(b, []).append(op.id)
    out = dict(member)
    for ids in inside.values():
        if any(i in member for i in ids) and not all(i in member for i in ids):
            for i in ids:
                out.pop(i, None)
    return out


def coshard_candidates(graph: Graph, *, min_ratio: float = 2.0, seeds: int = 4,
                       ways: int = 1, per_layer: int = 2) -> list[Candidate]:
    """Blocks worth co-sharding, at most ``per_layer`` disjoint ones per repeated layer (else
    per top module): grown from each of the layer's ``seeds`` ops with the largest outputs
    along each of their chunkable identifiers, the blocks whose intermediates are largest
    first (ties: the longer dim); kept when a block's largest intermediate is at least
    ``min_ratio`` times its largest input (attention scores; a wide MLP). Only dims that split
    ``ways`` ways and then into at least 2 chunks are tried. A layer that is a copy of an earlier
    one (:func:`~nnscaler_jax.ir.repeats.span_key`) takes the earlier one's, moved."""
    ix = _indexed(graph)
    by_layer: dict[str, list[Op]] = {}
    for op in graph.ops:
        if not op.regions and not op.boundary and op.primitive not in _OUTSIDE:
            by_layer.setdefault(ix.layer(op.module_path), []).append(op)
    out: list[Candidate] = []
    copies: dict[Hashable, str] = {}  # a layer's span key -> the first layer with it
    # the repeated layers, then the head after them (an LM head and the loss after it, run in
    # chunks of tokens: the logits of a long sequence never exist whole)
    head = [op for op in graph.ops[ix.head:] if ix.layer(op.module_path) == ""
            and not op.regions and not op.boundary and op.primitive not in _OUTSIDE]
    by_layer[""] = head
    for layer in [*ix.layers, *([""] if ix.layers and head else [])]:
        if layer in ix.first:  # a copy of an earlier layer: its candidates, moved
            key = span_key(graph, ix.first[layer], ix.last[layer], layer)
            if key in copies:
                shift = ix.first[layer] - ix.first[copies[key]]
                for c in [c for c in out if c.layer == copies[key]]:
                    op = graph.ops[ix.index[c.seed] + shift]
                    out.append(replace(c, seed=op.id, seed_path=op.module_path, layer=layer))
                continue
            copies[key] = layer
        ops = by_layer.get(layer, [])
        ops.sort(key=lambda o: -sum(t.nbytes for t in o.outputs))
        found = []
        for seed in ops[:seeds]:
            for name in seed.annotation.splittable():
                if _chunkable(seed, name) and chunk_counts(seed.dim_sizes()[name], ways):
                    cand = _candidate(graph, seed, name, layer)
                    if cand is not None and cand[0].largest_bytes >= min_ratio * cand[1]:
                        found.append(cand)
        found.sort(key=lambda c: (-c[0].internal_bytes, -c[0].size))
        taken: set[int] = set()
        for cand, _, ids in found[:]:
            if len([c for c in out if c.layer == layer]) < per_layer and not ids & taken:
                out.append(cand)
                taken |= ids
    return out


def _candidate(graph: Graph, seed: Op, name: str, layer: str
               ) -> tuple[Candidate, int, set[int]] | None:
    """The block of ``seed`` along ``name``: its candidate, largest input bytes and op ids."""
    try:
        block = block_of(graph, seed.id, name)
    except PlanError:
        return None
    ids = set(block.ops)
    ops = [graph.ops[i] for i in sorted(_indexed(graph).index[j] for j in ids)]
    made = {t.id for op in ops for t in op.outputs}
    sizes = [t.nbytes for op in ops for t in op.outputs]
    largest_in = max([t.nbytes for op in ops for t in op.inputs
                      if t.id not in made and t.role is not Role.VARIABLE] or [1])
    return (Candidate(seed.id, name, block.size, sum(sizes), max(sizes), seed.module_path,
                      layer), largest_in, ids)


def chunk_counts(size: int, ways: int, limit: int = 256) -> list[int]:
    """Chunk counts ``k > 1`` with ``size`` divisible by ``k * ways`` (each device's part of
    the dim splits into k equal chunks), ascending, at most ``limit``."""
    return [k for k in range(2, min(limit, size) + 1) if size % (k * ways) == 0]


def with_coshard(graph: Graph, blocks: Sequence[tuple[int, str, int]]) -> Graph:
    """``graph`` with one ``"coshard"`` boundary per ``(seed op id, dim, chunks)``: the block's
    ops contiguous (see the module docs), op ids, tensors and other boundaries unchanged; the
    new boundary is the outermost of its ops. Blocks are grown on ``graph`` as given; one that
    overlaps an earlier one is skipped. The last few results are kept (the search and the cost
    model ask for the same blocks of the same graph many times)."""
    blocks = tuple(blocks)
    if not blocks:
        return graph
    for g0, b0, out in _MADE:
        if g0 is graph and b0 == blocks:
            return out
    grown = [(block_of(graph, seed, dim), k) for seed, dim, k in blocks]
    ops = list(graph.ops)
    pos = {op.id: i for i, op in enumerate(ops)}
    readers: dict[int, set[int]] = {t.id: {-1} for t in graph.outputs}  # -1: the caller
    for op in ops:  # tensor id -> ids of the (top-level) ops reading it
        for t in op.inputs:
            readers.setdefault(t.id, set()).add(op.id)
    next_id = max((b.id for b in graph.boundaries), default=-1) + 1
    new: list[Boundary] = []
    taken: set[int] = set()
    for block, k in grown:
        ids = set(block.ops)
        if taken & ids or k < 2:
            continue
        taken |= ids
        _contiguous(ops, pos, ids)
        new.append(_boundary(ops, pos, readers, block, k, next_id))
        for i in ids:
            ops[pos[i]] = replace(ops[pos[i]], boundary=(next_id,) + ops[pos[i]].boundary)
        next_id += 1
    result = graph.derive(tuple(ops), graph.boundaries + tuple(new))
    _MADE[:] = [(graph, blocks, result)] + _MADE[:3]
    return result


_MADE: list[tuple[Graph, tuple, Graph]] = []


def _contiguous(ops: list[Op], pos: dict[int, int], ids: set[int]) -> None:
    """Make block ``ids`` contiguous in ``ops`` (its readers after it; ``pos`` kept)."""
    lo, hi = min(pos[i] for i in ids), max(pos[i] for i in ids)
    before, inside, after = [], [], []
    made = set()
    for op in ops[lo:hi + 1]:
        if op.id in ids:
            inside.append(op)
            made.update(t.id for t in op.outputs)
        elif any(t.id in made for t in op.inputs):
            after.append(op)
            made.update(t.id for t in op.outputs)
        else:
            before.append(op)
    ops[lo:hi + 1] = before + inside + after
    for i in range(lo, hi + 1):
        pos[ops[i].id] = i


def _boundary(ops: list[Op], pos: dict[int, int], readers: dict[int, set[int]], block: Block,
              k: int, bid: int) -> Boundary:
    ids = set(block.ops)
    axes = dict(block.axes)
    members = [ops[pos[i]] for i in block.ops]
    made = {t.id for op in members for t in op.outputs}
    ins: dict[int, Tensor] = {}
    for op in members:
        for t in op.inputs:
            if t.id not in made and (t.role is not Role.CONST or t.id in axes):
                ins.setdefault(t.id, t)
    outs = [t for op in members for t in op.outputs if not readers.get(t.id, set()) <= ids]
    eqn = SimpleNamespace(
        params={"chunks": k, "seed": block.seed, "idents": dict(block.idents),
                "size": block.size,
                "in_axes": tuple(axes.get(t.id) for t in ins.values()),
                "out_axes": tuple(axes[t.id] for t in outs)},
        primitive=SimpleNamespace(name=COSHARD))
    return Boundary(bid, COSHARD, tuple(ins.values()), tuple(outs), eqn)


def chunks_of(graph: Graph) -> dict[int, int]:
    """op id -> the chunk count of the co-sharded block it runs in (ops of no block absent)."""
    return {op: k for op, (k, _) in whole_reads(graph).items()}


def whole_reads(graph: Graph) -> dict[int, tuple[int, frozenset[int]]]:
    """op id -> ``(chunks, ids of the tensors its block reads whole)`` for the ops of
    co-sharded blocks: the inputs every chunk reads entire (weights, keys and values), whose
    gradient each chunk's backward makes in full. XLA reduce-scatters such a gradient in
    every chunk when it is stored split (it keeps no partial sum across a loop's iterations;
    an all-reduce it moves out of the loop): measured with XLA:GPU on Llama-3-8B at 128K, 64
    chunks a layer, a reduce-scatter of the MLP's weights' and the keys' and values'
    gradients in each."""
    whole = {b.id: (b.eqn.params["chunks"], frozenset(
        t.id for t, a in zip(b.inputs, b.eqn.params["in_axes"], strict=True) if a is None))
        for b in graph.boundaries if b.kind == COSHARD}
    return {op.id: whole[b] for op in graph.walk() for b in op.boundary if b in whole}


def chunk_bytes(nbytes: Iterable[int], k: int) -> int:
    """Bytes of one chunk of tensors of ``nbytes`` (rounded up)."""
    return sum(math.ceil(n / k) for n in nbytes)


def with_boundaries(graph: Graph, coshard: Sequence[tuple[int, str, int]],
                    recompute: Sequence[str]) -> Graph:
    """``graph`` with a plan's co-sharded blocks and recompute groups as boundaries (the
    recompute boundaries outermost, a block nested inside its recomputed layer)."""
    return with_recompute(with_coshard(graph, coshard), recompute)
