"""Which forward values a training step keeps for the backward pass (the *residuals*).

Two facts decide what stays in memory between the forward and the backward of one jitted step:

1. **Autodiff saves only what each primitive's transpose needs** (JAX's linearize + partial
   eval): linear ops (``add``, ``reduce_sum``, reshapes, ``concatenate``, ``gather`` of values)
   save nothing; ``mul`` / ``dot_general`` / ``conv`` save the *other* operand of each operand
   that needs a gradient; ``exp`` / ``tanh`` / ``logistic`` / ``sqrt`` save their output;
   ``log`` / ``integer_pow`` / ``erf`` / ``max``... save their inputs; ``select_n`` its
   predicate, ``gather`` / ``scatter-add`` their indices.
2. **XLA fuses cheap elementwise producers into their backward consumers** (it duplicates cheap
   ops across fusions but not expensive ones: ``exp``, ``log``, ``tanh``, ``div``, ``sqrt``,
   ``erf``, ``pow``...). A residual an *elementwise* transpose reads, computed by free layout
   ops (reshape, broadcast, transpose, convert) or cheap elementwise ops, is recomputed inside
   the backward fusion from *its* inputs; what is materialised are the *roots*: outputs of
   matmuls, convolutions, reductions, gathers, expensive elementwise ops — or graph inputs and
   weights, which are held anyway. A residual a *matmul / convolution* transpose reads is an
   operand of that matmul and is materialised itself (only bitcast reshapes fold in).
3. **Ops whose outputs reach the loss only through ``stop_gradient`` save nothing**: no
   cotangent reaches them, so JAX drops their transposes (softmax's row max would otherwise keep
   the attention scores it reads: measured on one H100, GPT-3 350M at batch 8 in bf16, the
   allocator's peak was 0.68 of the estimate that counted them).

:func:`residual_outputs` gives, per op, the output indices that are roots of some residual; the
cost model keeps exactly those (``CostModel.activation_bytes``). Ops inside remat boundaries are
handled by the cost model (their boundary's inputs are kept instead).

>>> import jax.numpy as jnp, flax.linen as nn
>>> from nnscaler_jax import trace
>>> g = trace(nn.Dense(4), jnp.ones((2, 3)))
>>> sorted(residual_outputs(g).values())  # the input x is saved for dW, but it is an input
[]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from nnscaler_jax.cost.compute import MATMUL, TRAINABLE, grad_tensors, is_float
from nnscaler_jax.ir.graph import DataflowMemo, Graph, Op
from nnscaler_jax.ir.regions import weight_origins

__all__ = [
    "CHEAP",
    "COMBINE_BYTES",
    "REGATHERED_COPIES",
    "accumulated_gradients",
    "combines_all_reductions",
    "copies_cotangent",
    "copies_read_once",
    "residual_forms",
    "residual_outputs",
    "residual_readers",
    "residual_reads",
    "saved_operands",
    "weight_views",
]


def _names(text: str) -> frozenset[str]:
    return frozenset(text.split())


#: Transposes need nothing from the forward (linear in the operands that carry gradients).
LINEAR = _names("""
add sub neg add_any reduce_sum broadcast_in_dim reshape transpose squeeze expand_dims
convert_element_type concatenate pad slice rev copy copy_p reduce_precision real imag conj
cumsum stop_gradient zeros_like name psum all_gather reduce_scatter ppermute all_to_all
dynamic_slice dynamic_update_slice gather scatter-add scatter_add select_n iota
""")

#: Save their output (their derivative is a function of it).
SAVE_OUTPUT = _names("exp exp2 tanh logistic sqrt cbrt")

#: Save their output and their inputs.
SAVE_BOTH = _names("rsqrt reduce_max reduce_min cummax cummin cumprod cumlogsumexp "
                   "fused_attention")  # (flash attention: q, k, v, out and its row statistics)

#: Bilinear: an operand's gradient needs the other operands.
BILINEAR = _names("mul dot_general conv_general_dilated")

#: Ops XLA fuses into their consumers (duplicating them when several consumers read them), so a
#: residual they compute is rebuilt inside the backward fusion from their inputs.
CHEAP = _names("""
reshape broadcast_in_dim squeeze expand_dims transpose convert_element_type copy copy_p
reduce_precision add sub neg mul max min abs sign select_n clamp add_any eq ne lt le gt ge
and or not xor square integer_pow floor ceil round iota stop_gradient
""")


#: 16-bit floats (see residual_forms).
HALF = frozenset({"bfloat16", "float16"})

#: Elementwise arithmetic whose bf16 results a GPU without bf16 arithmetic computes, and
#: XLA keeps, in float32 (see residual_forms).
ARITHMETIC = _names("add sub neg mul add_any max min abs integer_pow square exp exp2 tanh "
                    "logistic sqrt cbrt rsqrt")

#: Reductions (a softmax's exp read by one is never written in the forward, see _widens).
REDUCTIONS = _names("reduce_sum reduce_max reduce_min argmax argmin")

#: Transposes that read their saved operands as materialised buffers (see residual_outputs).
MASKED = MATMUL | {"max", "min"}

#: Copies of an operand a recomputed block's matmul gathers on its way in that are live in the
#: block's backward: the gathered copy rebuilt by the block's forward, and the operand's
#: cotangent, a partial sum as large until it is reduced back to the operand's layout
#: (measured: XLA:CPU's live set at the peak of a recomputed Swin block's backward).
REGATHERED_COPIES = 2

#: Layout ops that are bitcasts in XLA (fold into any consumer, even a matmul operand).
BITCAST = _names("reshape squeeze expand_dims")

#: Layout ops a weight's view is made of (see weight_views).
VIEWS = BITCAST | _names("transpose copy copy_p")


def saved_operands(op: Op, needs_grad: tuple[bool, ...]) -> tuple[list[int], list[int]]:
    """``(input indices, output indices)`` of ``op`` its transpose reads, given which inputs
    need a gradient (nothing when none does)."""
    if not any(needs_grad) or op.regions:
        return [], []
    p = op.primitive
    n = len(op.inputs)
    ints = [j for j, t in enumerate(op.inputs) if not is_float(t)]  # indices, predicates
    if p in LINEAR:
        return ints if p in ("gather", "scatter-add", "scatter_add", "select_n",
                             "dynamic_slice", "dynamic_update_slice") else [], []
    if p in SAVE_OUTPUT:
        return [], [0]
    if p in SAVE_BOTH:
        return [j for j in range(n) if j not in ints] + ints, [0]
    if p in BILINEAR:
        return sorted({j for i in range(n) if needs_grad[i] for j in range(n) if j != i}), []
    if p == "div":  # d/dx needs y; d/dy needs x and y
        return ([0, 1] if needs_grad[1] else [1]), []
    return list(range(n)), []  # log, pow, erf, sin, max, sort...: their inputs


_MEMO = DataflowMemo(6)


def _no_cotangent(graph: Graph) -> set[int]:
    """Ids of top-level ops no cotangent reaches: none of their outputs leads to a graph output
    but through ``stop_gradient`` (softmax's max: ``exp(x - stop_gradient(max(x)))``). JAX's
    linearization drops their transposes, so they save nothing (region bodies: kept, unread)."""
    live = {t.id for t in graph.outputs}
    dead: set[int] = set()
    for op in reversed(graph.ops):
        if not any(t.id in live for t in op.outputs):
            dead.add(op.id)
        elif op.primitive != "stop_gradient":
            live.update(t.id for t in op.inputs)
    return dead


def residual_outputs(graph: Graph, grads: set[int] | None = None) -> Mapping[int, tuple[int, ...]]:
    """op id -> indices of its outputs materialised for the backward pass (roots of residuals,
    see the module docstring), region bodies included. ``grads``: ids of tensors that need a
    gradient (default: trainable-variable descendants, as ``CostModel`` computes them)."""
    return _traced(graph, grads)[0]


def residual_reads(graph: Graph, grads: set[int] | None = None) -> frozenset[tuple[int, int]]:
    """``(op id, input index)`` of each cheap op a residual is traced through into that input
    (``z + delta`` read by a LayerNorm's backward: the add's inputs). The backward fusion reads
    that input as the op read it: where a relayout grows it on the way in (an all-gather), the
    grown copy is what stays (``plan_walk``)."""
    return _traced(graph, grads)[1]


def residual_readers(graph: Graph, grads: set[int] | None = None
                     ) -> Mapping[tuple[int, int], frozenset[int]]:
    """``(op id, output index)`` of each residual root (:func:`residual_outputs`) -> the ids of
    the ops whose transposes read it: whether a remat boundary's own backward needs a value, or
    only ops after it do (they read the boundary's output, kept as such: a saved matmul output
    that only the next layer's LayerNorm reaches through the residual add is not kept)."""
    return _traced(graph, grads)[2]


def _traced(graph: Graph, grads: set[int] | None
            ) -> tuple[Mapping[int, tuple[int, ...]], frozenset[tuple[int, int]],
                       Mapping[tuple[int, int], frozenset[int]]]:
    if grads is None:  # (boundaries and op order change nothing: once per dataflow)
        return _MEMO.get(graph, None, lambda: _traced(graph, grad_tensors(graph)))
    producer, readers_of = graph.writers, graph.readers
    out: dict[int, set[int]] = {}
    reads: set[tuple[int, int]] = set()
    readers: dict[tuple[int, int], set[int]] = {}  # root -> the ops whose transposes read it
    dead = _no_cotangent(graph)
    views = weight_views(graph)
    memo: dict[tuple[str, int], bool] = {}  # (rule, op id): each op's checks, once

    def stored(op: Op) -> bool:
        key = ("sum", op.id)
        if key not in memo:
            memo[key] = _stored_sum(op, readers_of)
        return memo[key]

    def widens(op: Op) -> bool:
        key = ("widens", op.id)
        if key not in memo:
            memo[key] = _widens(graph, op, readers_of)
        return memo[key]

    def keep(reader: Op, tids: list[int], through: frozenset[str]) -> None:
        stack, seen = tids, set()
        while stack:
            t = stack.pop()
            if t in seen:
                continue
            seen.add(t)
            if t not in producer:
                continue  # a graph input, weight or region body input: held anyway
            op, k = producer[t]
            if t in views:  # made from the weight where it is read: only a relayout growing
                for j, x in enumerate(op.inputs):  # the weight on its way in is kept
                    reads.add((op.id, j))
                    stack.append(x.id)
                continue
            if through is CHEAP and stored(op):
                pass  # XLA writes it in the forward and keeps it: a root
            elif (op.primitive in through or (through is CHEAP and widens(op))) \
                    and not op.regions:
                for j, x in enumerate(op.inputs):
                    if x.ndim or not is_float(x):
                        reads.add((op.id, j))
                        stack.append(x.id)
                continue
            out.setdefault(op.id, set()).add(k)
            readers.setdefault((op.id, k), set()).add(reader.id)

    for op in graph.walk():
        if op.id in dead:
            continue
        ins, outs = saved_operands(op, tuple(t.id in grads for t in op.inputs))
        # a matmul / convolution transpose reads the saved operand as a matmul operand: XLA
        # materialises it (only bitcasts fold in); so it does the operands of max / min (ReLU's
        # mask: measured on WRN, XLA keeps BatchNorm's output rather than recomputing it);
        # other elementwise transposes fuse the saved value's producers. A weight's view (a
        # tied LM head's transposed table) is held as the weight is (weight_views).
        through = BITCAST if op.primitive in MASKED else CHEAP
        keep(op, [op.inputs[j].id for j in ins] + [op.outputs[k].id for k in outs], through)
    return ({i: tuple(sorted(ks)) for i, ks in out.items()}, frozenset(reads),
            {key: frozenset(v) for key, v in readers.items()})


def weight_views(graph: Graph) -> frozenset[int]:
    """Ids of the tensors computed from one weight by layout ops alone (``VIEWS``: a tied LM
    head's transposed embedding table), held as the weight is: XLA reads the weight through
    the dot's dimension numbers or a layout of its own, so a view keeps no copy of its own
    from the forward to the backward. A residual is traced through a view to the weight
    (``residual_reads``): the copy a relayout growing the weight on its way into the view
    makes is kept (``plan_walk``'s gathered operands), as is a relayout growing the view on
    its way into the matmul. (Measured with XLA:GPU: GPT-3 1.3B on V100s, its tied head
    reading the table as stored, keeps no transposed table, 400 MiB a device the residual
    priced; T5-8 all-to-alls and transposes its table just before the LM head, 1.5 GiB
    freed at once, keeping the head's gathered copy.)"""
    def build() -> frozenset[int]:
        out = {v.id for v in graph.variables}
        for op in graph.walk():
            if op.primitive in VIEWS and not op.regions and len(op.inputs) == 1 and \
                    op.inputs[0].id in out:
                out.update(t.id for t in op.outputs)
        return frozenset(out - {v.id for v in graph.variables})
    return _MEMO.get(graph, "weight_views", build)


def copies_read_once(graph: Graph, grads: set[int] | None = None
                     ) -> Mapping[int, tuple[int, frozenset[int]]]:
    """Residual roots that one op's transpose reads and nothing else's, not even their
    producer's: root tensor id -> (that op's id, the root and its bitcast views). Where the
    relayout on the way into that op grows the root (an all-gather), the gathered copy is what
    stays for the backward and the root's own shard is dead once gathered (``plan_walk``
    keeps the gathered copy alone, the search's tables price it so: ``search.edges``).
    Measured with XLA:GPU: GPT-3 6.7B in bf16 on A100, its weights stored split over both
    axes: the bf16 casts' shards, 1.5 GiB a device, were priced next to their gathered copies;
    XLA's buffer assignment and its rematerialization pass hold the gathered copies alone
    (estimate / XLA:GPU 0.914 -> 0.967). Activations alike: GPT-3 1.3B on 2 x 4 V100s, the
    search's plan splitting the hidden dim over ``data`` (2026-12-04): the attention's
    output and the second LayerNorm's, each gathered for the one projection reading it, are
    held gathered alone at XLA's peak (16 MiB a layer priced twice; 0.947 -> 0.966). (A value
    several ops read gathered, as q, k and v read the first LayerNorm's output, keeps its
    shard in the estimate: pricing it needs the readers' layouts jointly in the search; XLA
    holds the gathered copy alone there too, 8 MiB a layer.)"""
    def build() -> Mapping[int, tuple[int, frozenset[int]]]:
        ops = {op.id: op for op in graph.ops}  # (a region body's copies are its stacks' own)
        readers_of = graph.readers
        out = {}
        for (op_id, k), readers in residual_readers(graph, grads).items():
            if op_id not in ops:
                continue
            root = ops[op_id].outputs[k]
            if len(readers) != 1 or op_id in readers:
                continue
            views, stack = {root.id}, [root.id]
            while stack:
                for r in readers_of.get(stack.pop(), ()):
                    if r.primitive in BITCAST and not r.regions:
                        new = [x.id for x in r.outputs if x.id not in views]
                        views.update(new)
                        stack += new
            out[root.id] = (next(iter(readers)), frozenset(views))
        return out
    return build() if grads is not None else _MEMO.get(graph, "copies_read_once", build)


def _leaves(graph: Graph, op: Op) -> list:
    """The tensors ``op`` is computed from through cheap ops (graph inputs and weights among
    them): what XLA's backward fusion reads to rebuild it."""
    stack, seen, leaves = list(op.inputs), set(), []
    while stack:
        x = stack.pop()
        if x.id in seen:
            continue
        seen.add(x.id)
        w = graph.writers.get(x.id)
        if w is not None and w[0].primitive in CHEAP and not w[0].regions:
            stack.extend(w[0].inputs)
        else:
            leaves.append(x)
    return leaves


def _widens(graph: Graph, op: Op, readers: Mapping[int, Sequence[Op]]) -> bool:
    """A softmax's exp (an exp / tanh... read by a reduction) whose output is wider than what
    it is computed from by cheap ops (float32 exponentials of bf16 scores): XLA never writes it
    in the forward (the reduction's fusion and the normalising division each compute it), and
    the backward fusion rebuilds it from those sources (measured: GPT-3 1.3B in bf16 on H100s
    keeps the bf16 scores and probabilities of each layer's softmax, not its float32
    exponentials). A GELU's float32 tanh of bf16 values, read by elementwise ops only, is
    written by a multi-output forward fusion and kept (measured: GPT-3 6.7B in bf16)."""
    if op.primitive not in SAVE_OUTPUT or op.regions or len(op.outputs) != 1:
        return False
    if not any(r.primitive in REDUCTIONS for r in readers.get(op.outputs[0].id, ())):
        return False
    return sum(x.nbytes for x in _leaves(graph, op)) < op.outputs[0].nbytes


def _stored_sum(op: Op, readers: Mapping[int, Sequence[Op]]) -> bool:
    """A 16-bit sum a reduction reads (the residual stream ``x + attn(x)`` a LayerNorm's
    statistics read, through a cast): XLA writes it from the multi-output fusion of the add and
    the statistics, and the backward reads that buffer; the estimate keeps it rather than
    tracing it through to the matmul output it adds (measured: GPT-3 1.3B and 6.7B in bf16 on
    H100s and A100s keep the sums, not the out projections' outputs)."""
    if op.primitive not in ("add", "sub", "add_any") or op.regions or len(op.outputs) != 1 \
            or op.outputs[0].dtype not in HALF:
        return False
    stack, seen = [op.outputs[0].id], set()
    while stack:
        t = stack.pop()
        if t in seen:
            continue
        seen.add(t)
        for r in readers.get(t, ()):
            if r.primitive in REDUCTIONS:
                return True
            if r.primitive in ("convert_element_type", "reshape") and not r.regions:
                stack.extend(x.id for x in r.outputs)
    return False


def residual_forms(graph: Graph, grads: set[int] | None = None
                   ) -> Mapping[tuple[int, int], str]:
    """``{(op id, output index): form}`` of the residual roots a GPU keeps otherwise than as
    the graph types them (``CostModel.residual_bytes`` prices each form per device):

    - ``"float32"``: a bf16 root of elementwise arithmetic (a residual sum, a GELU's tanh)
      that only elementwise transposes read. On a GPU that computes bf16 elementwise
      arithmetic in float32 (``DeviceSpec.bf16_arithmetic`` False: A100, V100), XLA's fusions
      write them, and the backward reads them, in float32 (measured: GPT-3 1.3B and 6.7B in
      bf16 on A100s keep the residual sums and the tanh in float32, on H100s in bf16). A root
      a matmul reads stays 16-bit (the matmul reads it so).
    - ``"rebuilt"``: a float32 tanh computed from float32 values (a GELU's) that only
      elementwise transposes read, from values kept anyway: XLA:GPU rebuilds it in the
      backward fusion from the GELU's input (``DeviceSpec.rebuilds_tanh``; measured: GPT-3
      1.3B in float32 on V100s keeps each GELU's input and output, not its tanh); XLA:CPU
      keeps it.
    """
    if grads is None:
        return _MEMO.get(graph, "residual_forms",
                         lambda: residual_forms(graph, grad_tensors(graph)))
    roots, _, readers = _traced(graph, grads)
    ops = {op.id: op for op in graph.walk()}
    kept = {ops[i].outputs[k].id for i, ks in roots.items() for k in ks}
    out: dict[tuple[int, int], str] = {}
    for i, ks in roots.items():
        op = ops[i]
        if op.regions or op.primitive not in ARITHMETIC:
            continue
        for k in ks:
            if any(ops[r].primitive in MASKED for r in readers.get((i, k), ())):
                continue
            if op.outputs[k].dtype == "bfloat16":
                out[(i, k)] = "float32"
            elif op.primitive == "tanh" and op.outputs[k].dtype == "float32" and all(
                    x.dtype == "float32" and (x.id in kept or x.id not in graph.writers)
                    for x in _leaves(graph, op)):
                out[(i, k)] = "rebuilt"
    return out


COMBINE_BYTES = 30 * 2**20
"""XLA:GPU's all-reduce combiner threshold (``kDefaultAllReduceCombineThreshold``): gradient
reductions are merged into collectives of up to this size, each gradient live until its
combined reduction runs."""


def combines_all_reductions(graph: Graph) -> bool:
    """Whether XLA:GPU reduces all of ``graph``'s weight gradients in one combined collective
    after the backward, so that every gradient is live at its peak: their weights take at most
    :data:`COMBINE_BYTES` (measured: the tiny zoo's data-parallel steps peak at the estimate
    plus every gradient; a replicated plan reduces nothing and frees them, on the safe side
    of the estimate)."""
    return sum(v.nbytes for v in graph.variables
               if v.collection in TRAINABLE and is_float(v)) <= COMBINE_BYTES


def accumulated_gradients(graph: Graph) -> frozenset[int]:
    """Ids of the variables whose gradient is built up over the backward pass, and so is live
    at its peak.

    The training step updates each weight elementwise (Adam, SGD: ``optax`` per leaf) once its
    gradient is reduced; XLA:GPU's scheduler runs that update as soon as the gradient is
    complete and frees it, so a weight read by one op holds no gradient buffer at the peak
    (measured: GPT-3 1.3B, Megatron on 2 x 4 V100s at batch 8, the compiled step's peak is the
    estimate less the gradients to 0.2%; Swin-8 likewise). A weight whose gradient gets several
    contributions (read by more than one op, as tied embeddings are at both ends of the
    model, directly or through casts and reshapes) or is accumulated inside a loop (a ``scan``
    over stacked layers) keeps its gradient from the first contribution to the last.
    """
    origin = weight_origins(graph)
    reads: dict[int, int] = {}
    for op in graph.ops:
        if not op.regions and any(t.id in origin for t in op.outputs):  # a cast, a reshape
            continue
        for v in {origin[t.id] for t in op.inputs if t.id in origin}:
            reads[v] = reads.get(v, 0) + (2 if op.regions else 1)
    return frozenset(v for v, n in reads.items() if n > 1)


def copies_cotangent(op: Op, graph: Graph) -> bool:
    """Whether XLA copies the cotangent of ``op``'s input in the backward: ``op`` transposes
    a ``dot_general``'s output so that the free dims one operand contributes (two or more:
    grouped-query attention's queries and head groups) are no longer adjacent and in order.
    The backward contracts the cotangent with that operand over those dims, which a GEMM reads
    only adjacent and in the operand's order: the cotangent is transposed back by a copy of
    its size (measured with XLA:GPU, Llama-3-8B's co-sharded attention at 128K: a third
    score-sized buffer, live with the probabilities and their gradient)."""
    if op.primitive != "transpose" or not op.inputs:
        return False
    dot = graph.producer.get(op.inputs[0].id)
    if dot is None or dot.primitive != "dot_general" or len(dot.inputs) != 2:
        return False
    (lc, rc), (lb, _rb) = dot.params["dimension_numbers"]
    lhs, rhs = dot.inputs
    nb, nl = len(lb), lhs.ndim - len(lc) - len(lb)
    nr = rhs.ndim - len(rc) - len(lb)
    where = {d: i for i, d in enumerate(op.params["permutation"])}
    for start, n in ((nb, nl), (nb + nl, nr)):
        pos = [where[d] for d in range(start, start + n)]
        if n >= 2 and pos != list(range(pos[0], pos[0] + n)):
            return True
    return False
