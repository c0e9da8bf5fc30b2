"""Cutting a traced training program into prefix, one layer template and suffix (pipelines).

Used by :mod:`nnscaler_jax.pipeline.stacked`: the micro-batch loss program is split by module path
into the ops before the layer stack (embeddings), one layer (``h_i`` or the ``nn.scan`` body) and
the ops after it (final norm, head, loss), so that each stage can run its chunk of layers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from jax.extend import core as jcore

from nnscaler_jax.errors import PlanError
from nnscaler_jax.ir.layers import LayerStack, numbered_layers, variable_top

__all__ = ["NotALayerStack", "ProgramSplit", "split_program"]


class NotALayerStack(PlanError):
    """Raised when the model is not a stack of identical layers (the pipelined step then cuts
    it at module boundaries instead: :mod:`nnscaler_jax.pipeline.cut_program`)."""


def _unsupported(what: str) -> PlanError:
    return NotALayerStack(
        f"pipeline stages: {what}. Stage splitting supports GPT-like models: a prefix, then a "
        "stack of identical layers named '<prefix>_0', '<prefix>_1', ... (or one nn.scan over "
        "them), then a suffix, each layer taking exactly one activation from the previous one. "
        "Fix: use pipeline_stages=None, or structure the model that way")


# ---- cutting the traced program ------------------------------------------------------------


@dataclass(frozen=True)
class ProgramSplit:
    """The traced micro-batch program cut into prefix / layer template / suffix.

    Attributes:
        jaxpr: the closed jaxpr of ``(params_leaves..., batch_leaves...) -> loss``.
        n_params: number of parameter leaves (the first invars).
        pre / post: prefix and suffix equations.
        layer_eqns: the equations of one layer (the template).
        layer_params: the template's parameter variables (per layer leaf).
        layer_x / layer_y: the template's input and output activation variables.
        layer_consts: ``(template var, outer var)`` bindings of scan consts.
        layer_leaves: ``layer_leaves[i][j]`` = flat param index of layer ``i``'s ``j``-th leaf,
            or for a scanned stack one row of the stacked leaves' indices (``stacked=True``).
        stacked: the layer params are stacked leaves (``nn.scan``) of leading size ``n_layers``.
        n_layers: L.
        x0: the prefix's output var feeding layer 0; ``xl``: the var the suffix reads.
    """

    jaxpr: Any
    n_params: int
    pre: tuple
    post: tuple
    layer_eqns: tuple
    layer_params: tuple
    layer_x: Any
    layer_y: Any
    layer_consts: tuple
    layer_leaves: tuple
    stacked: bool
    n_layers: int
    x0: Any
    xl: Any
    shared: tuple[int, ...]


def _root_part(stack: str, root: str) -> str | None:
    parts = [p for p in str(stack).split("/") if p and not any(c in p for c in "(,>")]
    parts = [p.split(".")[0] for p in parts]
    if parts and parts[0] == root:
        parts = parts[1:]
    return parts[0] if parts else None


def _ext_inputs(eqns, defined_outside: bool = True) -> list:
    inner, ext = set(), []
    for e in eqns:
        for v in e.invars:
            if isinstance(v, jcore.Literal) or v in inner or v in ext:
                continue
            ext.append(v)
        inner.update(e.outvars)
    return ext


def split_program(closed: Any, param_paths: list[str], root: str) -> ProgramSplit:
    """Cut the traced loss program at the layer stack (see the module docstring).

    Raises:
        PlanError: the program has no repeated layer stack or the layers are not a chain.
    """
    jaxpr = closed.jaxpr
    tops = [_root_part(e.source_info.name_stack, root) for e in jaxpr.eqns]
    stack = numbered_layers(tops)
    if stack is not None:
        split = _split_numbered(closed, param_paths, tops, stack)
    else:
        split = _split_scanned(closed, param_paths, tops)
    layer_set = {j for lv in split.layer_leaves for j in lv}
    shared = tuple(j for j in range(split.n_params) if j not in layer_set)
    # The suffix may only read the stack's output, parameters, batch and constants.
    allowed = set(jaxpr.invars) | set(jaxpr.constvars) | {split.xl}
    bad = [v for v in _ext_inputs(split.post) if v not in allowed]
    if bad:
        raise _unsupported(f"the suffix after the layers reads {len(bad)} values computed before "
                           f"them ({[str(v.aval) for v in bad]})")
    return replace(split, shared=shared)


def _read_after(eqns, outvars) -> set:
    """Variables read by ``eqns`` or returned (``outvars``)."""
    read = {v for e in eqns for v in e.invars if not isinstance(v, jcore.Literal)}
    return read | {v for v in outvars if not isinstance(v, jcore.Literal)}


def _split_numbered(closed: Any, param_paths: list[str], tops: list,
                    stack: LayerStack) -> ProgramSplit:
    """The split of numbered layers ``<prefix>_0 .. <prefix>_{L-1}``."""
    jaxpr, prefix, n = closed.jaxpr, stack.module, stack.count
    if stack.numbers != tuple(range(n)):
        raise _unsupported(f"layers '{prefix}_i' are not numbered 0..{n - 1}")
    which = [stack.number_of(t) for t in tops]
    idx = [i for i, w in enumerate(which) if w is not None]
    first, last = idx[0], idx[-1]
    seq = which[first:last + 1]
    if any(w is None for w in seq) or seq != sorted(seq):
        raise _unsupported(f"ops of the layers '{prefix}_i' are interleaved with other ops")
    segs = [[e for e, w in zip(jaxpr.eqns, which, strict=True) if w == i] for i in range(n)]
    param_tops = [variable_top(p) for p in param_paths]
    leaves = [[(j, p) for j, p in enumerate(param_paths) if param_tops[j] == f"{prefix}_{i}"]
              for i in range(n)]

    def signature(i):
        return ([(p.replace(f"{prefix}_{i}/", "/", 1), jaxpr.invars[j].aval.shape)
                 for j, p in leaves[i]], [e.primitive for e in segs[i]])

    for i in range(1, n):
        if signature(i) != signature(0):
            raise _unsupported(f"layer '{prefix}_{i}' differs from '{prefix}_0' (parameters or "
                               "ops)")
    tmpl = segs[0]
    pvars = [jaxpr.invars[j] for j, _ in leaves[0]]
    acts = [v for v in _ext_inputs(tmpl) if v not in set(jaxpr.constvars) and v not in pvars]
    if len(acts) != 1:
        raise _unsupported(f"layer '{prefix}_0' reads {len(acts)} activations from outside "
                           f"({[str(v.aval) for v in acts]}), expected 1")
    later = _read_after(jaxpr.eqns[first + len(tmpl):], jaxpr.outvars)
    outs = [v for e in tmpl for v in e.outvars if v in later]
    if len(outs) != 1:
        raise _unsupported(f"layer '{prefix}_0' passes {len(outs)} values on, expected 1")
    later_post = _read_after(jaxpr.eqns[last + 1:], jaxpr.outvars)
    xl = [v for e in segs[-1] for v in e.outvars if v in later_post]
    if len(xl) != 1:
        raise _unsupported(f"the last layer passes {len(xl)} values on, expected 1")
    layer_leaves = tuple(tuple(j for j, _ in lv) for lv in leaves)
    return ProgramSplit(closed, len(param_paths), tuple(jaxpr.eqns[:first]),
                        tuple(jaxpr.eqns[last + 1:]), tuple(tmpl), tuple(pvars), acts[0], outs[0],
                        (), layer_leaves, False, n, acts[0], xl[0], ())


def _split_scanned(closed: Any, param_paths: list[str], tops: list) -> ProgramSplit:
    """The split of one ``scan`` over stacked layer parameters (``nn.scan``)."""
    jaxpr, n_params = closed.jaxpr, len(param_paths)
    params_in = set(jaxpr.invars[:n_params])
    scans = [i for i, e in enumerate(jaxpr.eqns) if e.primitive.name == "scan"
             and any(v in params_in for v in e.invars)]
    if len(scans) != 1:
        raise _unsupported("no stack of repeated layers found (module paths "
                           f"{sorted({t for t in tops if t})})")
    k = scans[0]
    e = jaxpr.eqns[k]
    name = tops[k] or next(variable_top(param_paths[j])
                           for j, v in enumerate(jaxpr.invars[:n_params]) if v in e.invars)
    nc, ncarry = e.params["num_consts"], e.params["num_carry"]
    body = e.params["jaxpr"]
    if ncarry != 1:
        raise _unsupported(f"the scanned stack '{name}' carries {ncarry} values, expected 1")
    xs = e.invars[nc + 1:]
    pos = {v: j for j, v in enumerate(jaxpr.invars[:n_params])}
    if not all(v in pos for v in xs):
        raise _unsupported(f"the scanned stack '{name}' scans over values that are not "
                           "parameters")
    consts = set(jaxpr.constvars)
    if any(not isinstance(v, jcore.Literal) and v not in consts and v not in pos
           for v in e.invars[:nc]):
        raise _unsupported(f"the scanned stack '{name}' closes over computed values")
    if body.consts:
        raise _unsupported("the scan body has constants")
    bj = body.jaxpr
    if len(bj.outvars) != 1:
        raise _unsupported(f"the scanned stack '{name}' stacks outputs")
    return ProgramSplit(closed, n_params, tuple(jaxpr.eqns[:k]), tuple(jaxpr.eqns[k + 1:]),
                        tuple(bj.eqns), tuple(bj.invars[nc + 1:]), bj.invars[nc], bj.outvars[0],
                        tuple(zip(bj.invars[:nc], e.invars[:nc], strict=True)),
                        (tuple(pos[v] for v in xs),), True, int(e.params["length"]),
                        e.invars[nc], e.outvars[0], ())
