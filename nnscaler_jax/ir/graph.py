"""The annotated operator graph: frozen values for tensors, operators and graphs.

Tensors are edges, operators vertices. Every operator carries its dimension annotation
(see :mod:`nnscaler_jax.ir.anno`); graphs nest for control-flow regions (``scan``, ``while``,
``cond``), whose bodies are graphs of their own.
"""

from __future__ import annotations

import enum
import math
import threading
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Any

import networkx as nx
import numpy as np

from nnscaler_jax.ir.anno import Anno, AnnoSyntaxError, parse_anno

__all__ = ["Boundary", "DataflowMemo", "Graph", "Op", "Role", "Tensor", "follow_weight"]


class Role(enum.Enum):
    """Where a tensor comes from."""

    VARIABLE = "variable"  # a model variable (params, batch_stats, ...)
    INPUT = "input"  # an example argument
    RNG = "rng"  # an rng key passed to apply
    CONST = "const"  # a constant of the traced program (closed-over array or literal)
    VALUE = "value"  # produced by an op


@lru_cache(maxsize=256)
def dtype_itemsize(dtype: str) -> int:
    """Bytes per element of a dtype name (8 for extended dtypes such as rng keys)."""
    try:
        return np.dtype(dtype).itemsize
    except TypeError:
        return 8


@dataclass(frozen=True, slots=True)
class Tensor:
    """One edge of the graph.

    Attributes:
        id: unique within the graph and its regions.
        shape: static shape.
        dtype: numpy dtype name (``'float32'``, ``'key<fry>'``...).
        role: where it comes from.
        name: variable path (``'params/fc1/kernel'``), argument path (``'args[0]'``) or ``''``.
        collection: the variable collection (``'params'``, ``'batch_stats'``) for variables.
        value: the literal / constant value (not compared, not hashed).
    """

    id: int
    shape: tuple[int, ...]
    dtype: str
    role: Role = Role.VALUE
    name: str = ""
    collection: str | None = None
    value: Any = field(default=None, compare=False, hash=False, repr=False)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtype_itemsize(self.dtype)

    def __str__(self) -> str:
        dims = ",".join(map(str, self.shape))
        return f"%{self.id}:{self.dtype}[{dims}]"


#: Call primitives of ``jax.checkpoint`` (remat), and the plan's co-sharded blocks
#: (``ir/coshard.py``): their body keeps only its inputs and runs its forward again in the
#: backward pass.
REMAT_KINDS = frozenset({"checkpoint", "remat", "remat2", "coshard"})


@dataclass(frozen=True, slots=True)
class Boundary:
    """A call inlined for analysis whose boundary lowering must keep (remat, custom_jvp/vjp).

    Attributes:
        id: unique id; ops inside carry it in ``Op.boundary``.
        kind: the call primitive (``'checkpoint'``, ``'custom_jvp_call'``, ``'custom_vjp_call'``).
        inputs / outputs: the tensors the call consumes / produces in the enclosing graph.
        eqn: the original jaxpr equation, bound as a whole when lowering custom derivatives.
    """

    id: int
    kind: str
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]
    eqn: Any = field(compare=False, hash=False, repr=False)


# Op.dim_sizes by (annotation, input shapes, output shapes): the repeated layers of a model
# bind the same annotations to the same shapes, and planning asks for every op's sizes often
_BOUND: dict[tuple, dict[str, int]] = {}


@dataclass(frozen=True, slots=True)
class Op:
    """One operator (vertex).

    Attributes:
        id: unique within the graph and its regions.
        primitive: the jax primitive name (``'dot_general'``).
        inputs / outputs: operand tensors.
        anno: the annotation string (``'b m k+, k+ n -> b m n'``).
        annotated: False when no rule applied and the op is planned replicate-only.
        module_path: the Flax module path (``'blk0/attn/query'``), ``''`` at the top.
        boundary: ids of enclosing inlined calls (``Graph.boundaries``), outermost first.
        regions: bodies of control-flow ops (scan / while / cond branches) as graphs.
        eqn: the jaxpr equation (primitive and params) used when lowering; not compared.
    """

    id: int
    primitive: str
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]
    anno: str
    annotated: bool = True
    module_path: str = ""
    boundary: tuple[int, ...] = ()
    regions: tuple[Graph, ...] = ()
    eqn: Any = field(default=None, compare=False, hash=False, repr=False)

    @property
    def annotation(self) -> Anno:
        """The parsed annotation.

        Raises:
            AnnotationError: ``anno`` does not parse (the message names this op).
        """
        try:
            return parse_anno(self.anno)
        except AnnoSyntaxError as e:
            raise AnnoSyntaxError(
                f"op {self.id} '{self.primitive}' at '{self.module_path or '<top>'}': {e}",
                op=self.primitive, module_path=self.module_path,
            ) from None

    def dim_sizes(self) -> dict[str, int]:
        """The size of every identifier of the annotation, bound to this op's shapes.

        Raises:
            AnnotationError: the annotation does not bind; the message names this op and its
                module path.
        """
        key = (self.anno, tuple(t.shape for t in self.inputs),
               tuple(t.shape for t in self.outputs))
        sizes = _BOUND.get(key)
        if sizes is None:
            sizes = self.annotation.bind(key[1], key[2], op=self.primitive,
                                         module_path=self.module_path)
            if len(_BOUND) >= 1 << 16:
                _BOUND.clear()
            _BOUND[key] = sizes
        return dict(sizes)

    @property
    def params(self) -> Mapping[str, Any]:
        return self.eqn.params if self.eqn is not None else {}

    def __str__(self) -> str:
        ins = ", ".join(_operand_str(t) for t in self.inputs)
        outs = ", ".join(map(str, self.outputs))
        mark = "" if self.annotated else "  !unannotated"
        where = f"  @{self.module_path}" if self.module_path else ""
        inside = f"  in{list(self.boundary)}" if self.boundary else ""
        return f"{outs} = {self.primitive}({ins})  [{self.anno}]{where}{inside}{mark}"


def _operand_str(t: Tensor) -> str:
    """Scalar constants print as their value (``2.0:float32``), other tensors as ``%id:type``."""
    if t.role is Role.CONST and t.ndim == 0 and t.value is not None:
        try:
            return f"{np.asarray(t.value).item()!r}:{t.dtype}"
        except (TypeError, ValueError):
            pass
    return str(t)


@dataclass(frozen=True)  # no slots: cached_property indexes (producer, consumers)
class Graph:
    """An operator graph in topological order.

    Attributes:
        ops: operators in program order.
        inputs: graph inputs (variables, example args, rng keys), flattened.
        outputs: graph outputs, flattened.
        boundaries: inlined calls by id.
        meta: capture details used for lowering (trees, the ClosedJaxpr); not compared.
        dataflow: the graph this one was derived from by :meth:`derive` (the same ops and
            tensors, other boundaries, perhaps another topological order), else itself:
            analyses that read neither may memoise on it, once for every derived graph.
    """

    ops: tuple[Op, ...]
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]
    boundaries: tuple[Boundary, ...] = ()
    consts: tuple[Tensor, ...] = ()
    meta: Any = field(default=None, compare=False, hash=False, repr=False)
    # not an __init__ field: dataclasses.replace (any other change) starts a new dataflow
    _origin: Graph | None = field(default=None, init=False, compare=False, hash=False,
                                  repr=False)

    @property
    def dataflow(self) -> Graph:
        return self._origin if self._origin is not None else self

    def derive(self, ops: tuple[Op, ...], boundaries: tuple[Boundary, ...]) -> Graph:
        """This graph with ``ops`` (the same ops, in another topological order or with other
        boundaries) and ``boundaries``; it keeps this graph's :attr:`dataflow`."""
        out = Graph(ops, self.inputs, self.outputs, boundaries, self.consts, self.meta)
        object.__setattr__(out, "_origin", self.dataflow)
        return out

    def walk(self) -> Iterator[Op]:
        """All ops, including those inside regions (depth first, program order)."""
        for op in self.ops:
            yield op
            for region in op.regions:
                yield from region.walk()

    @property
    def variables(self) -> tuple[Tensor, ...]:
        return tuple(t for t in self.inputs if t.role is Role.VARIABLE)

    def op(self, key: int | str) -> Op:
        """An op by id, or the first op whose ``module_path`` equals ``key``."""
        for op in self.walk():
            if op.id == key or op.module_path == key:
                return op
        from nnscaler_jax.errors import PlanError

        raise PlanError(f"no op {key!r} in the graph; module paths: {sorted(self.module_paths)[:20]}")

    @property
    def module_paths(self) -> set[str]:
        return {op.module_path for op in self.walk()}

    def to_networkx(self) -> nx.MultiDiGraph:
        """A view with op ids (and ``'in:<tensor id>'`` for inputs) as nodes, tensors on edges."""
        g = nx.MultiDiGraph()
        producer: dict[int, Any] = {}
        sources = {t.id: t for t in self.inputs + self.consts}
        for op in self.ops:
            g.add_node(op.id, op=op)
            for t in op.inputs:
                if t.id not in producer and t.id in sources:  # inputs read by some op
                    producer[t.id] = f"in:{t.id}"
                    g.add_node(f"in:{t.id}", tensor=t)
                if t.id in producer:
                    g.add_edge(producer[t.id], op.id, tensor=t)
            for t in op.outputs:
                producer[t.id] = op.id
        return g

    @cached_property
    def consumers(self) -> Mapping[int, tuple[Op, ...]]:
        """Tensor id -> the top-level ops that read it."""
        out: dict[int, list[Op]] = {}
        for op in self.ops:
            for t in op.inputs:
                out.setdefault(t.id, []).append(op)
        return {k: tuple(v) for k, v in out.items()}

    @cached_property
    def producer(self) -> Mapping[int, Op]:
        """Tensor id -> the top-level op that writes it."""
        return {t.id: op for op in self.ops for t in op.outputs}

    @cached_property
    def readers(self) -> Mapping[int, tuple[Op, ...]]:
        """Tensor id -> the ops that read it, region bodies included (as :attr:`writers`)."""
        out: dict[int, list[Op]] = {}
        for op in self.walk():
            for t in op.inputs:
                out.setdefault(t.id, []).append(op)
        return {k: tuple(v) for k, v in out.items()}

    @cached_property
    def writers(self) -> Mapping[int, tuple[Op, int]]:
        """Tensor id -> (the op that writes it, its output index), region bodies included."""
        return {t.id: (op, k) for op in self.walk() for k, t in enumerate(op.outputs)}

    def __str__(self) -> str:
        return _print_graph(self, "")


def _print_graph(g: Graph, indent: str) -> str:
    lines = []
    for t in g.inputs:
        label = f" {t.role.value}" + (f" {t.name}" if t.name else "")
        lines.append(f"{indent}input {t}{label}")
    for b in g.boundaries:
        lines.append(f"{indent}boundary {b.id} {b.kind}(" + ", ".join(map(str, b.inputs))
                     + ") -> " + ", ".join(map(str, b.outputs)))
    for op in g.ops:
        lines.append(f"{indent}{op}")
        for i, region in enumerate(op.regions):
            lines.append(f"{indent}  region {i}:")
            lines.append(_print_graph(region, indent + "    "))
    lines.append(f"{indent}output " + ", ".join(map(str, g.outputs)))
    return "\n".join(lines)


class DataflowMemo:
    """The last few results of an analysis per :attr:`Graph.dataflow` and key: graphs derived
    by adding boundaries (the search's recompute probes) share one result. For analyses that
    read neither boundaries nor, unless ``key`` holds it, the op order."""

    def __init__(self, size: int = 4) -> None:
        self.size = size
        self._items: list[tuple[weakref.ref, Any, Any]] = []
        self._lock = threading.Lock()

    def get(self, graph: Graph, key: Any, make: Any) -> Any:
        """The result for ``(graph.dataflow, key)``, made by ``make()`` on a miss."""
        root = graph.dataflow
        with self._lock:
            for ref, k, value in self._items:
                if ref() is root and k == key:
                    return value
        value = make()
        with self._lock:
            self._items = [(weakref.ref(root), key, value)] + self._items[: self.size - 1]
        return value


def follow_weight(op: Op, origin: dict[int, int]) -> bool:
    """Whether ``op`` computes its outputs from one weight alone (``origin``: tensor -> the
    variable it is computed from; constants aside), as a cast or a reshape does; if so its
    outputs join ``origin``."""
    srcs = {origin[t.id] for t in op.inputs if t.id in origin}
    if len(srcs) != 1 or not all(t.id in origin or t.role is Role.CONST for t in op.inputs):
        return False
    origin.update({t.id: next(iter(srcs)) for t in op.outputs})
    return True

