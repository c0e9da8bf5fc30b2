"""Calibration: time ops on the local backend and keep the times in a JSON profile database.

:func:`profile_ops` times every distinct ``(primitive, input shapes, output shapes, dtype)`` of a
graph on the local backend — each op jitted alone (``primitive.bind`` with its jaxpr params),
warmed up, the median of a few runs — and stores the forward seconds in a :class:`ProfileDB`
keyed also by the device kind (``jax.Device.device_kind``). A
:class:`~nnscaler_jax.cost.model.CostModel` built with ``profile=db`` prefers these times over
its roofline for devices of the same kind.

>>> db = ProfileDB()
>>> db.record("add", ((8, 16), (8, 16)), ((8, 16),), "float32", "cpu", 1e-6)
>>> db.lookup("add", ((8, 16), (8, 16)), ((8, 16),), "float32", "cpu")
1e-06
>>> ProfileDB.from_json(db.to_json()) == db
True
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from nnscaler_jax.errors import PlanError
from nnscaler_jax.ir.graph import Graph, Op

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_PATH", "ProfileDB", "profile_ops"]

FORMAT = "nnscaler_jax.profile/1"
DEFAULT_PATH = Path("~/.cache/nnscaler_jax/profile.json")
"""Where :func:`profile_ops` stores times unless given a path (``~`` expanded when used)."""

Shapes = tuple[tuple[int, ...], ...]


def _key(primitive: str, ins: Shapes, outs: Shapes, dtype: str, kind: str) -> str:
    def s(shapes: Shapes) -> str:
        return ",".join("x".join(map(str, sh)) or "()" for sh in shapes)

    return f"{primitive}|{s(ins)}|{s(outs)}|{dtype}|{kind}"


@dataclass
class ProfileDB:
    """Measured forward seconds of ops, keyed by primitive, shapes, dtype and device kind.

    Attributes:
        entries: key -> seconds (see :meth:`lookup` for the key's parts).
    """

    entries: dict[str, float] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.entries)

    def record(self, primitive: str, in_shapes: Shapes, out_shapes: Shapes, dtype: str,
               device_kind: str, seconds: float) -> None:
        """Store one measured time (replacing an older one)."""
        self.entries[_key(primitive, _shapes(in_shapes), _shapes(out_shapes), dtype,
                          device_kind)] = float(seconds)

    def lookup(self, primitive: str, in_shapes: Shapes, out_shapes: Shapes, dtype: str,
               device_kind: str) -> float | None:
        """The measured forward seconds, or None if never profiled."""
        return self.entries.get(_key(primitive, _shapes(in_shapes), _shapes(out_shapes), dtype,
                                     device_kind))

    def lookup_op(self, op: Op, device_kind: str, in_shapes: Shapes | None = None,
                  out_shapes: Shapes | None = None) -> float | None:
        """:meth:`lookup` for ``op`` (its own shapes unless local shapes are given)."""
        ins = in_shapes if in_shapes is not None else tuple(t.shape for t in op.inputs)
        outs = out_shapes if out_shapes is not None else tuple(t.shape for t in op.outputs)
        return self.lookup(op.primitive, ins, outs, _dtype(op), device_kind)

    def keys_of(self, graph: Graph, device_kind: str) -> set[str]:
        """Keys of ``graph``'s ops (as :func:`profile_ops` stores them) held in the database."""
        keys = {_key(op.primitive, _shapes([t.shape for t in op.inputs]),
                     _shapes([t.shape for t in op.outputs]), _dtype(op), device_kind)
                for op in graph.walk()}
        return keys & set(self.entries)

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "entries": dict(sorted(self.entries.items()))},
                          indent=1)

    @classmethod
    def from_json(cls, text: str) -> ProfileDB:
        """Parse :meth:`to_json` output; :class:`PlanError` if it is not a profile database."""
        try:
            d = json.loads(text)
            if not isinstance(d, dict) or d.get("format") != FORMAT:
                raise ValueError(f"format is {d.get('format') if isinstance(d, dict) else d!r}, "
                                 f"expected {FORMAT!r}")
            return cls({str(k): float(v) for k, v in d["entries"].items()})
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise PlanError(f"not a profile database ({type(e).__name__}: {e}); write one with "
                            "`nnscaler-jax profile` or ProfileDB.save()") from e

    def save(self, path: str | os.PathLike | None = None) -> Path:
        """Write the database as JSON (default :data:`DEFAULT_PATH`); returns the path."""
        p = Path(path or DEFAULT_PATH).expanduser()
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(p.suffix + ".tmp")
        tmp.write_text(self.to_json())
        tmp.replace(p)
        return p

    @classmethod
    def load(cls, path: str | os.PathLike | None = None, missing_ok: bool = False) -> ProfileDB:
        """Read a database (default :data:`DEFAULT_PATH`); empty if missing and ``missing_ok``."""
        p = Path(path or DEFAULT_PATH).expanduser()
        if not p.exists():
            if missing_ok:
                return cls()
            raise PlanError(f"no profile database at {p}; create one with `nnscaler-jax profile "
                            "--model NAME --out PATH`")
        return cls.from_json(p.read_text())


def _shapes(shapes: Sequence[Sequence[int]]) -> Shapes:
    return tuple(tuple(int(d) for d in s) for s in shapes)


def _dtype(op: Op) -> str:
    ts = op.inputs or op.outputs
    return ts[0].dtype if ts else ""


def _profilable(op: Op) -> bool:
    if op.regions or op.eqn is None:
        return False
    for t in op.inputs + op.outputs:
        try:
            np.dtype(t.dtype)
        except TypeError:  # rng keys and other extended dtypes
            return False
    return not any(hasattr(v, "jaxpr") or hasattr(v, "eqns") for v in op.params.values())


def _time_op(op: Op, runs: int, warmup: int) -> float:
    import jax

    eqn = op.eqn
    rng = np.random.default_rng(0)
    args = []
    for t in op.inputs:
        dt = np.dtype(t.dtype)
        if np.issubdtype(dt, np.inexact):
            args.append(jax.numpy.asarray(rng.standard_normal(t.shape), dtype=dt))
        else:  # integers (indices) and bools: zeros are always in range
            args.append(jax.numpy.zeros(t.shape, dt))
    fn = jax.jit(lambda *a: eqn.primitive.bind(*a, **eqn.params))
    for _ in range(max(warmup, 1)):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(max(runs, 1)):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def profile_ops(graph: Graph, db: ProfileDB | None = None, *,
                path: str | os.PathLike | None = None, save: bool = True, runs: int = 5,
                warmup: int = 2) -> ProfileDB:
    """Time every distinct op of ``graph`` on the local backend.

    Args:
        graph: the traced graph (region bodies are walked; region ops themselves and ops on rng
            keys are skipped).
        db: a database to add to (default: the one at ``path`` if it exists, else a new one).
        path: where to load from / save to (default :data:`DEFAULT_PATH`).
        save: write the database back to ``path``.
        runs / warmup: timed runs (the median is kept) and untimed runs before them.

    Returns:
        The database with one entry per distinct (primitive, shapes, dtype) of this device kind.
    """
    import jax

    kind = jax.devices()[0].device_kind
    if db is None:
        db = ProfileDB.load(path, missing_ok=True)
    seen: set[str] = set()
    for op in graph.walk():
        if not _profilable(op):
            continue
        ins = tuple(t.shape for t in op.inputs)
        outs = tuple(t.shape for t in op.outputs)
        key = _key(op.primitive, ins, outs, _dtype(op), kind)
        if key in seen:
            continue
        seen.add(key)
        try:
            secs = _time_op(op, runs, warmup)
        except Exception as e:  # noqa: BLE001 - one unprofilable op must not stop the rest
            log.warning("could not profile %s %s: %s", op.primitive, ins, e)
            continue
        db.record(op.primitive, ins, outs, _dtype(op), kind, secs)
    if save:
        db.save(path)
    return db
