"""Check the compiled program, not only the numbers: collectives in HLO vs the plan's.

``xla_stderr()`` collects what XLA's C++ side logs while compiling (e.g. "Involuntary full
rematerialization", which never reaches Python's warnings).

``hlo_collectives(text, mesh)`` lists the collectives XLA put in a compiled module (kind, bytes of
the result, the mesh axes its replica groups span); ``expected_collectives(graph, plan)`` lists
the ones the plan implies between producer and consumer layouts (forward pass).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import jax
import numpy as np
from jax.experimental.compilation_cache.compilation_cache import reset_cache

from nnscaler_jax.ir.graph import Graph, Role
from nnscaler_jax.layout import Layout
from nnscaler_jax.plan.layouts import plan_layouts, sole_read_variables
from nnscaler_jax.plan.plan import Plan

__all__ = ["HloCollective", "HloTraffic", "expected_collectives", "hlo_collectives", "hlo_traffic", "summarize",
           "xla_stderr"]


@contextlib.contextmanager
def _compiled_here() -> Iterator[None]:
    """jax's persistent compilation cache off inside the block, where a user turned it on."""
    if not (jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir):
        yield
        return
    jax.config.update("jax_enable_compilation_cache", False)
    reset_cache()  # (jax decides once per process whether it reads the cache)
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", True)
        reset_cache()


@contextlib.contextmanager
def xla_stderr(*, echo: bool = False) -> Iterator[list[str]]:
    """What the process writes to fd 2 inside the block (XLA's C++ logging), in ``out[0]``;
    ``echo``: write it to ``sys.stderr`` afterwards as well. jax's persistent compilation
    cache is off inside the block: a program it served would be loaded, not compiled, and
    log nothing."""
    out = [""]
    with _compiled_here(), tempfile.TemporaryFile() as f:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(f.fileno(), 2)
        try:
            yield out
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            f.seek(0)
            out[0] = f.read().decode(errors="replace")
    if echo and out[0]:
        sys.stderr.write(out[0])


_KINDS = {"all-reduce": "all_reduce", "all-gather": "all_gather",
          "reduce-scatter": "reduce_scatter", "all-to-all": "all_to_all",
          "collective-permute": "ppermute"}
_LINE = re.compile(
    r"=\s*(?P<type>\(*[a-z0-9]+\[[0-9,]*\][^ ]*(?:, \(*[a-z0-9]+\[[0-9,]*\][^ ]*)*)\s+"
    r"(?P<op>all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
    r"(?P<start>-start)?\(")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.+?) ([\w\-]+)\((.*)$")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_SHAPE = re.compile(r"([a-z]+[0-9]*)\[([0-9,]*)\]")
_BYTES = {"f32": 4, "f64": 8, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s64": 8, "u64": 8,
          "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2}


@dataclass(frozen=True)
class HloCollective:
    """One collective of a compiled module."""

    kind: str
    bytes: int
    axes: tuple[str, ...]
    times: int = 1  # runs per execution of the module (a ``while`` body's trip count)


def _device_ids(spec: str | None, n: int) -> np.ndarray:
    """Flat device ids of a ``device_ids=(...)`` clause (``[2,4]T(1,0)`` or ``0,4,1,5,...``)."""
    if not spec:
        return np.arange(n)
    m = re.fullmatch(r"\s*\[([0-9,]+)\](?:T\(([0-9,]+)\))?\s*", spec)
    if m:
        ids = np.arange(n).reshape([int(x) for x in m.group(1).split(",")])
        if m.group(2):
            ids = ids.transpose([int(x) for x in m.group(2).split(",")])
        return ids.reshape(-1)
    return np.array([int(x) for x in re.findall(r"\d+", spec)])


def _groups(line: str) -> list[list[int]] | None:
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\((.*?)\))?\s*"
                  r"\{([^}]*)\}", line)
    if m:  # replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'} (device ids in iota order,
        # or as given by device_ids=([2,4]T(1,0)): an iota reshaped and transposed, or a list)
        axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
        names = [a for a, _ in axes]
        sizes = [int(n) for _, n in axes]
        chosen = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(3))]
        ids = _device_ids(m.group(2), int(np.prod(sizes))).reshape(sizes)
        rest = [i for i in range(len(sizes)) if i not in chosen]
        moved = ids.transpose(rest + chosen)
        width = int(np.prod([sizes[i] for i in chosen])) if chosen else 1
        return moved.reshape(-1, width).tolist()
    m = re.search(r"replica_groups=\{(\{[0-9,]*\}(?:,\{[0-9,]*\})*)\}", line)
    if m:
        return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([0-9,]*)\}",
                                                                        m.group(1))]
    m = re.search(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", line)
    if m:
        out_shape = [int(x) for x in m.group(1).split(",")]
        dims = [int(x) for x in m.group(2).split(",")]
        ids = np.arange(int(np.prod(dims))).reshape(dims)
        if m.group(3):
            ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        return ids.reshape(out_shape).tolist()
    m = re.search(r"source_target_pairs=\{([0-9,{}]*)\}", line)
    if m:
        return [[int(x) for x in p.split(",")] for p in re.findall(r"\{([0-9,]+)\}", m.group(1))]
    return None


def _axes_of(groups: list[list[int]] | None, mesh, pairs: bool = False) -> tuple[str, ...]:
    """The fewest mesh axes whose device groups are ``groups`` (``pairs``: a permute's
    (source, target) pairs, each inside one group). Groups name devices by id, or by position
    in the mesh's order (a program compiled for a sub-mesh, a pipeline stage's devices 4..7
    numbered 0..3; or for a mesh whose order is not the ids', as the all-device blocks' mesh
    with the stage axis folded into a tensor axis): ids first, then positions."""
    if groups is None:
        return ()
    ids = np.vectorize(lambda d: d.id)(mesh.devices).reshape(-1)
    for pos in ({int(d): i for i, d in enumerate(ids)}, {i: i for i in range(ids.size)}):
        if not all(i in pos for g in groups for i in g):
            continue
        want = {frozenset(pos[i] for i in g) for g in groups if len(g) > 1}
        if not want:
            return ()
        found = _axes_grouping(want, mesh, pairs)
        if found is not None:
            return found
    return ("?",)


def _axes_grouping(want: set, mesh, pairs: bool) -> tuple[str, ...] | None:
    """The fewest mesh axes whose groups of flat positions are ``want``, or None."""
    names = list(mesh.axis_names)
    flat = np.arange(mesh.devices.size).reshape(mesh.devices.shape)
    for r in range(1, len(names) + 1):
        for subset in itertools.combinations(range(len(names)), r):
            moved = np.moveaxis(flat, subset, range(len(names) - r, len(names)))
            parts = {frozenset(x.reshape(-1).tolist()) for x in
                     moved.reshape(-1, int(np.prod([flat.shape[i] for i in subset])))}
            if want <= parts or pairs and all(any(w <= p for p in parts) for w in want):
                return tuple(names[i] for i in subset)
    return None


def _result_type(text: str, op: str, start: bool) -> str:
    """The result part of a collective's type: an async ``-start`` of XLA:GPU types itself
    ``((operands), results)`` (reduce-scatter, all-to-all) or ``(operand, result)``
    (all-gather, collective-permute, whose trailing ``u32[]`` contexts carry no data); an
    all-reduce's tuple is its combined results."""
    if not start or not text.startswith("(") or op == "all-reduce":
        return text
    if text.startswith("(("):  # ((operands), results): what follows the first group
        depth = 0
        for i, ch in enumerate(text):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 1 and ch == ")":
                return text[i + 1:]
        return text
    shapes = _SHAPE.findall(text)
    data = [sh for sh in shapes if sh[1]]  # drop scalar contexts
    half = data[len(data) // 2:] if len(data) > 1 else data
    return " ".join(f"{dt}[{dims}]" for dt, dims in half)


def hlo_collectives(hlo_text: str, mesh) -> list[HloCollective]:
    """Collectives in compiled HLO text (``compiled.as_text()``), with the mesh axes they span
    and the times each runs per execution (inside a ``while`` body of known trip count, that
    many times per run of its caller)."""
    comps, entry = _computations(hlo_text)
    runs = _runs(comps, entry)
    out, current = [], None
    for line in hlo_text.splitlines():
        head = _COMPUTATION.match(line)
        if head:
            current = head.group(1)
            continue
        line = re.sub(r"/\*.*?\*/", "", line)  # XLA writes /*index=5*/ inside long tuple types
        m = _LINE.search(line)
        if not m or "-done" in line.split("=")[0]:
            continue
        nbytes = 0
        for dt, dims in _SHAPE.findall(_result_type(m.group("type"), m.group("op"),
                                                     bool(m.group("start")))):
            n = int(np.prod([int(x) for x in dims.split(",") if x])) if dims else 1
            nbytes += n * _BYTES.get(dt, 4)
        out.append(HloCollective(_KINDS[m.group("op")], nbytes,
                                 _axes_of(_groups(line), mesh,
                                          pairs=m.group("op") == "collective-permute"),
                                 times=max(1, int(runs.get(current, 1)))))
    return out


def expected_collectives(graph: Graph, plan: Plan) -> list[tuple[str, str, str]]:
    """``(kind, mesh axis, tensor)`` per layout change the plan implies in the forward pass.

    Per mesh axis, producer state -> consumer state: V->R all-reduce, V->D reduce-scatter,
    D->R all-gather, D(i)->D(j) all-to-all; R->D and R->V are local.
    """
    plans = {p.op: p for p in plan.ops}
    layout: dict[int, Layout] = {}
    for t in graph.inputs:
        spec = plan.variable_spec(t.name) if t.role is Role.VARIABLE else None
        layout[t.id] = Layout.from_pspec(spec, t.ndim) if spec else None
    out = []
    sole = sole_read_variables(graph)
    for op in graph.walk():
        ins, outs = plan_layouts(op, plans, sole)
        for t, want in zip(op.inputs, ins, strict=True):
            have = layout.get(t.id)
            if have is None or t.ndim == 0:
                continue
            for axis, _ in plan.mesh:
                a, b = have.axis_state(axis), want.axis_state(axis)
                kind = {("V", "R"): "all_reduce", ("V", "D"): "reduce_scatter",
                        ("D", "R"): "all_gather"}.get((a[0], b[0]))
                if a[0] == "D" and b[0] == "D" and a != b:
                    kind = "all_to_all"
                if kind and dict(plan.mesh)[axis] > 1:
                    out.append((kind, axis, str(t)))
        for t, lay in zip(op.outputs, outs, strict=True):
            layout[t.id] = lay
    return out


def summarize(items) -> Counter:
    """Count ``(kind, axes)`` of HloCollective values or ``(kind, axis, _)`` tuples."""
    c: Counter = Counter()
    for x in items:
        if isinstance(x, HloCollective):
            c[(x.kind, x.axes)] += 1
        else:
            c[(x[0], (x[1],))] += 1
    return c


# ---- memory traffic of large buffers ---------------------------------------------------------

_FREE = frozenset({"get-tuple-element", "tuple", "parameter", "bitcast", "constant",
                   "while", "call", "conditional", "async-start", "after-all", "opt-barrier"})


def _type_bytes(text: str) -> int:
    total = 0
    for dtype, dims in _SHAPE.findall(text):
        if dtype in _BYTES:
            total += _BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d]))
    return total


@dataclass(frozen=True)
class HloTraffic:
    """Bytes of large buffers a compiled module's kernels read and write, per execution.

    Attributes:
        bytes: every kernel's operands and results of at least ``min_bytes`` each (a buffer read
            by two kernels counts twice), times the times its computation runs (a ``while``
            body with a known trip count runs that many times per run of its caller).
        kernels: how many such kernel executions.
        by_kind: bytes per kernel kind (``fusion:kInput``, ``fusion:kCustom`` (a GEMM), ...).
    """

    bytes: float
    kernels: int
    by_kind: dict[str, float]


def _computations(hlo_text: str) -> tuple[dict[str, list[tuple[str, str, str, str]]],
                                           str | None]:
    """``({computation: [(name, type, opcode, rest)]}, entry)`` of compiled HLO text."""
    comps: dict[str, list[tuple[str, str, str, str]]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            current = m.group(1)
            comps[current] = []
            if line.startswith("ENTRY"):
                entry = current
            continue
        m = _INSTRUCTION.match(line)
        if m and current is not None:
            comps[current].append(m.groups())
    return comps, entry


def _runs(comps: dict[str, list[tuple[str, str, str, str]]], entry: str | None) -> Counter:
    """Times each computation the entry reaches through ``while`` (a body: its known trip
    count), ``call``, ``conditional`` and ``async-start`` runs per execution of the module
    (fusion bodies and reducers are inside their kernel: not listed)."""
    runs: Counter = Counter()

    def visit(comp: str, times: float) -> None:
        runs[comp] += times
        for _, _, opcode, rest in comps.get(comp, ()):
            if opcode == "while":
                body = re.search(r"body=%?([\w.\-]+)", rest)
                trip = _TRIP.search(rest)
                if body:
                    visit(body.group(1), times * (int(trip.group(1)) if trip else 1))
            elif opcode in ("call", "conditional", "async-start"):
                for callee in re.findall(r"(?:to_apply=|calls=|branch_computations=\{|, )%"
                                         r"([\w.\-]+)", rest.split("metadata=")[0]):
                    if callee in comps:
                        visit(callee, times)

    if entry is not None:
        visit(entry, 1.0)
    return runs


def hlo_traffic(hlo_text: str, min_bytes: int) -> HloTraffic:
    """The traffic of buffers of at least ``min_bytes`` through device memory in a compiled
    module (``compiled.as_text()``): a floor on the time its kernels take, whatever their
    FLOPs (``bytes / bandwidth``). Kernels are the instructions of the entry computation and of
    the computations it runs through ``while`` / ``call`` / ``conditional``; fusion bodies are
    inside their kernel (their intermediates stay on chip).

    >>> text = '''ENTRY %main (p: f32[1024]) -> f32[1024] {
    ...   %p = f32[1024]{0} parameter(0)
    ...   ROOT %e = f32[1024]{0} fusion(%p), kind=kLoop, calls=%fused_exp
    ... }'''
    >>> hlo_traffic(text, 4096).bytes  # read 4 KiB, write 4 KiB
    8192.0
    """
    comps, entry = _computations(hlo_text)
    sizes = {name: _type_bytes(typ.split("{")[0] if not typ.startswith("(") else typ)
             for body in comps.values() for name, typ, _, _ in body}
    runs = _runs(comps, entry)
    total, kernels, by_kind = 0.0, 0, Counter()
    for comp, times in runs.items():
        for name, _, opcode, rest in comps[comp]:
            if opcode in _FREE or opcode.endswith("-done"):
                continue
            operands = re.findall(r"%([\w.\-]+)", rest.split("), ")[0])
            big = [b for b in [sizes.get(o, 0) for o in operands] + [sizes[name]]
                   if b >= min_bytes]
            if big:
                kind = re.search(r"kind=(\w+)", rest)
                key = opcode + (f":{kind.group(1)}" if kind else "")
                total += sum(big) * times
                kernels += int(times)
                by_kind[key] += sum(big) * times
    return HloTraffic(float(total), kernels, dict(by_kind))
