"""A traced training program cut into chunk sub-programs, and the flat vectors they travel in.

:func:`cut_program` cuts the micro-batch loss program (``(params..., batch...) -> loss``) into
contiguous equation ranges at given starts (:func:`nnscaler_jax.pipeline.cut.chunk_starts`):
chunk ``c`` reads the values of boundary ``c - 1`` (every value made before it and read at or
after it: activations, and values forwarded through it for later chunks, e.g. T5's encoder
output for every decoder chunk) and makes boundary ``c``'s. Parameters read by one chunk are
that chunk's; parameters read by several (tied embeddings) or none are *shared*. A *carried*
input (a mutable collection, passed like the parameters) is owned the same way, and the program
output holding its new value is emitted by its owner: it crosses boundaries only up to it.

A :class:`Packing` places a list of arrays in one flat vector per dtype (parameters of a chunk,
the values of a boundary), so that chunks of different shapes fit one buffer of the widest.

>>> import jax.numpy as jnp, numpy as np
>>> pk = packing([jnp.zeros((2, 3)), jnp.zeros(4, jnp.int32), jnp.zeros(2)])
>>> pk.sizes
{'float32': 8, 'int32': 4}
>>> [x.shape for x in unpack(pack([jnp.ones((2, 3)), jnp.arange(4), jnp.ones(2)], pk,
...                                {'float32': 10, 'int32': 4}), pk)]
[(2, 3), (4,), (2,)]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from nnscaler_jax.lower.eqns import NO_CONSTRAINTS

__all__ = ["Packing", "ProgramCut", "cut_program", "layered", "pack", "packing", "param_casts",
           "run_chunk", "unpack", "vars_of", "widths"]


@dataclass(frozen=True)
class Packing:
    """Where each of a list of arrays lives in flat vectors, one per dtype (or per row key).

    Attributes:
        slots: per array ``(its vector's key: the dtype name, or the key given, offset,
            shape)``.
        sizes: per key, the elements used.
        dtypes: the dtype of each key that is not a dtype name.
    """

    slots: tuple[tuple[str, int, tuple[int, ...]], ...]
    sizes: dict[str, int]
    dtypes: dict[str, str] = field(default_factory=dict)


def packing(avals: Sequence[Any], keys: Sequence[str | None] | None = None) -> Packing:
    """The packing of arrays with these shapes and dtypes (anything with ``.shape``/``.dtype``),
    each in the vector of its dtype, or of ``keys[i]`` (arrays of one dtype only)."""
    sizes: dict[str, int] = {}
    slots, dtypes = [], {}
    for a, key in zip(avals, keys or [None] * len(avals), strict=True):
        dt, shape = np.dtype(a.dtype).name, tuple(int(d) for d in a.shape)
        key = key or dt
        if key != dt and dtypes.setdefault(key, dt) != dt:
            raise ValueError(f"packing: key {key!r} holds {dtypes[key]} and {dt}")
        slots.append((key, sizes.get(key, 0), shape))
        sizes[key] = sizes.get(key, 0) + math.prod(shape)
    return Packing(tuple(slots), dict(sorted(sizes.items())), dtypes)


def widths(packings: Sequence[Packing]) -> dict[str, int]:
    """Per dtype, the widest of ``packings`` (at least 1 element)."""
    out: dict[str, int] = {}
    for p in packings:
        for dt, n in p.sizes.items():
            out[dt] = max(out.get(dt, 1), n)
    return dict(sorted(out.items()))


def pack(values: Sequence[Any], pk: Packing, width: dict[str, int],
         dtypes: dict[str, str] | None = None) -> dict[str, Any]:
    """``values`` as one zero-padded vector of ``width[key]`` elements per dtype (or key:
    its dtype ``dtypes[key]``, else ``pk``'s)."""
    dtype = lambda k: (dtypes or {}).get(k) or pk.dtypes.get(k, k)
    parts: dict[str, list] = {k: [] for k in width}
    for x, (k, _, _) in zip(values, pk.slots, strict=True):
        parts[k].append(jnp.ravel(x).astype(dtype(k)))
    out = {}
    for k, n in width.items():
        used = pk.sizes.get(k, 0)
        pad = [jnp.zeros((n - used,), dtype(k))] if n > used else []
        out[k] = (jnp.concatenate(parts[k] + pad) if parts[k] or pad
                  else jnp.zeros((0,), dtype(k)))
    return out


def unpack(vectors: dict[str, Any], pk: Packing) -> list[Any]:
    """The arrays :func:`pack` put into ``vectors``."""
    return [vectors[dt][off:off + math.prod(shape)].reshape(shape)
            for dt, off, shape in pk.slots]


@dataclass(frozen=True)
class ProgramCut:
    """A closed jaxpr cut into chunks.

    Attributes:
        jaxpr: the closed jaxpr ``(params..., batch...) -> loss``.
        n_params: parameter leaves (the first invars).
        segments: per chunk, its equations.
        bounds: per boundary ``c`` (between chunks ``c`` and ``c + 1``), the values crossing it.
        owned: per chunk, the parameter leaf indices only it reads.
        shared: the parameter leaf indices read by several chunks or none.
        out_made: per program output, the chunk making it (-1: an input or a literal).
    """

    jaxpr: Any
    n_params: int
    segments: tuple[tuple[Any, ...], ...]
    bounds: tuple[tuple[Any, ...], ...]
    owned: tuple[tuple[int, ...], ...]
    shared: tuple[int, ...]
    out_made: tuple[int, ...] = ()

    @property
    def chunks(self) -> int:
        return len(self.segments)


def _with_casts(seg: Sequence[Any], casts: dict, extra: Sequence[Any] = ()) -> tuple:
    """``seg`` after the casts it reads (those of ``extra`` too), each once."""
    if not casts:
        return tuple(seg)
    need = {v: None for e in seg for v in e.invars if not isinstance(v, jcore.Literal)
            and v in casts}
    need.update((v, None) for v in extra if not isinstance(v, jcore.Literal) and v in casts)
    return tuple(casts[v] for v in need) + tuple(seg)


def vars_of(xs: Sequence[Any]) -> list[Any]:
    """The jaxpr variables among ``xs`` (literals left out)."""
    return [v for v in xs if not isinstance(v, jcore.Literal)]


def param_casts(closed: Any, n_params: int) -> tuple[list[Any], dict[Any, Any]]:
    """``closed``'s equations without the casts of parameters (a compute precision casts every
    float parameter on entry), and those casts by the variable they make."""
    params = set(closed.jaxpr.invars[:n_params])
    casts, rest = {}, []
    for e in closed.jaxpr.eqns:
        if (e.primitive.name == "convert_element_type" and len(e.invars) == 1
                and not isinstance(e.invars[0], jcore.Literal) and e.invars[0] in params):
            casts[e.outvars[0]] = e
        else:
            rest.append(e)
    return rest, casts


def cut_program(closed: Any, n_params: int, starts: Sequence[int],
                made_first: Sequence[Any] = (),
                carried: Sequence[tuple[int, int]] = ()) -> ProgramCut:
    """Cut ``closed``'s equations at ``starts`` (``starts[0] == 0``; positions in the
    equations without parameter casts, :func:`param_casts`) into chunks.

    ``made_first``: input variables chunk 0 provides (a recycling program's module inputs,
    which chunk 0 reads from the batch or from the last pass): later chunks get them through
    the boundaries instead of reading them directly. A parameter's cast (compute precision) is
    made again by every chunk reading it, first thing, so the chunk reads the parameter itself
    (it owns it) and no 16-bit copy crosses a boundary.

    ``carried``: ``(input, output)`` index pairs: output ``output`` is the new value of the
    parameter-like input ``input`` (both among the first ``n_params``); it is needed up to the
    chunk owning that input (other outputs: up to the last chunk).
    """
    jaxpr = closed.jaxpr
    eqns, casts = param_casts(closed, n_params)
    ends = list(starts[1:]) + [len(eqns)]
    segments = tuple(_with_casts(eqns[a:b], casts) for a, b in zip(starts, ends, strict=True))
    if any(v in casts for v in jaxpr.outvars):  # (a program returning a cast parameter)
        segments = segments[:-1] + (_with_casts(segments[-1], casts, jaxpr.outvars),)
    C = len(segments)
    made: dict[Any, int] = dict.fromkeys(made_first, 0)
    last: dict[Any, int] = {}
    readers: dict[Any, set[int]] = {}
    for c, seg in enumerate(segments):
        for e in seg:
            for v in vars_of(e.invars):
                last[v] = max(last.get(v, c), c)
                readers.setdefault(v, set()).add(c)
            made.update((v, c) for v in e.outvars)
    for v in casts:
        made.pop(v, None)  # made where read, never sent
    params = jaxpr.invars[:n_params]
    users = [readers.get(v, set()) for v in params]
    emit = {o: min(users[j]) for j, o in carried if len(users[j]) == 1}
    for o, v in enumerate(jaxpr.outvars):
        if not isinstance(v, jcore.Literal):
            last[v] = max(last.get(v, -1), emit.get(o, C))
    order = {v: i for i, v in enumerate(made)}
    bounds = tuple(tuple(sorted((v for v, c0 in made.items() if c0 <= c < last.get(v, -1)),
                                key=order.__getitem__)) for c in range(C - 1))
    owned = tuple(tuple(j for j, u in enumerate(users) if u == {c}) for c in range(C))
    shared = tuple(j for j, u in enumerate(users) if len(u) != 1)
    out_made = tuple(-1 if isinstance(v, jcore.Literal) else made.get(v, -1)
                     for v in jaxpr.outvars)
    return ProgramCut(closed, n_params, segments, bounds, owned, shared, out_made)


def layered(eqns: Any, env: dict, starts: dict, needed: Any, lead: bool = True,
            evaluate: Callable = NO_CONSTRAINTS.evaluate) -> None:
    """Evaluate ``eqns`` into ``env`` as layers (a new layer at each equation whose id is in
    ``starts``), those ``starts`` flags (``lead``: the layer before the first start) under
    ``jax.checkpoint``: differentiated, such a layer keeps only the values it reads and is
    recomputed in the backward. ``needed``: the variables read after ``eqns``; ``evaluate``:
    how equations run (tensor-parallel stages: through the in-stage plan's lowering)."""
    layers: list[list[Any]] = [[]]
    checkpointed = [lead]
    for e in eqns:
        if id(e) in starts and layers[-1]:
            layers.append([])
            checkpointed.append(starts[id(e)])
        elif id(e) in starts:
            checkpointed[-1] = starts[id(e)]
        layers[-1].append(e)
    later = [set(needed)]
    for lay in reversed(layers[1:]):
        later.append(later[-1] | {v for e in lay for v in vars_of(e.invars)})
    for lay, read_after, ck in zip(layers, reversed(later), checkpointed, strict=True):
        if not ck:
            evaluate(lay, env)
            continue
        made = {v: None for e in lay for v in e.outvars}
        ins = list({v: None for e in lay for v in vars_of(e.invars) if v not in made})
        outs = [v for v in made if v in read_after]

        def run(*xs, lay=lay, ins=ins, outs=outs):
            local = dict(zip(ins, xs, strict=True))
            evaluate(lay, local)
            return [local[v] for v in outs]

        env.update(zip(outs, jax.checkpoint(run)(*[env[v] for v in ins]), strict=True))


def run_chunk(cut: ProgramCut, seg: int, params: Iterable[tuple[Any, Any]], batch: Sequence[Any],
              xin: Sequence[Any], *, x_vars: Sequence[Any] = (), layer_starts: dict,
              recompute_layers: bool, evaluate: Callable = NO_CONSTRAINTS.evaluate) -> dict:
    """Segment ``seg`` of ``cut`` run on one micro-batch: the environment of every value it
    reads and makes. The one chunk evaluator of the pipeline runtimes: the cut ones (in-graph
    and per-stage) and the stacked one (its prefix, layer template and suffix as three
    segments).

    ``params``: ``(input variable, value)`` pairs of the parameter-like inputs it reads
    (parameters, carried collections); ``batch``: the program's batch inputs after the
    module inputs ``x_vars`` a recycling program's chunk 0 provides; ``xin``: the values of
    boundary ``seg - 1``, or for segment 0 those of ``x_vars``. Layers start at the equations
    ``layer_starts`` names, each under ``jax.checkpoint`` as its flag says
    (``recompute_layers``: the one before the first start); ``evaluate`` runs equations (the
    in-stage plan's :class:`~nnscaler_jax.lower.eqns.EqnEvaluator`).
    """
    jx = cut.jaxpr.jaxpr
    env = dict(zip(jx.constvars, cut.jaxpr.consts, strict=True))
    env.update(params)
    env.update(zip(jx.invars[cut.n_params + len(x_vars):], batch, strict=True))
    if seg:
        env.update(zip(cut.bounds[seg - 1], xin, strict=True))
    elif x_vars:
        env.update(zip(x_vars, xin, strict=True))
    eqns = cut.segments[seg]
    if recompute_layers or any(layer_starts.values()):
        needed = [*vars_of(jx.outvars), *(cut.bounds[seg] if seg < cut.chunks - 1 else ())]
        layered(eqns, env, layer_starts, needed, recompute_layers, evaluate)
    else:
        evaluate(eqns, env)
    return env
