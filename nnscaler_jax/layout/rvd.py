"""RVD layouts: how one tensor lies over a named device mesh, and their PartitionSpec round trip.

For every mesh axis a tensor is in exactly one state:

- ``R`` Replicated: every device along the axis holds the same data;
- ``V`` Value-split: the true value is the *sum* over the axis of the devices' (partial) values;
- ``D(i)`` Dim-split along tensor dimension ``i``: each device holds one contiguous block.

A :class:`Layout` stores the ``D`` axes per tensor dim (major to minor, exactly like one
``PartitionSpec`` entry) and the ``V`` axes; every other mesh axis is ``R``.

>>> lay = Layout.of(3, {0: "data", 2: "model"})
>>> str(lay), lay.to_pspec() == PartitionSpec("data", None, "model")
('D(0:data,2:model)', True)
>>> lay.axis_state("model"), lay.axis_state("other")
(('D', 2), ('R',))
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from jax.sharding import PartitionSpec

from nnscaler_jax.errors import PlanError
from nnscaler_jax.mesh.topology import MeshSpec

AxisState = tuple[str] | tuple[str, int]
"""``('R',)``, ``('V',)`` or ``('D', dim)``."""


def _axes_tuple(entry: Any, where: str) -> tuple[str, ...]:
    """A PartitionSpec-like entry (None, a name, or a sequence of names) as a tuple of names."""
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    if isinstance(entry, Sequence) and all(isinstance(a, str) for a in entry):
        return tuple(entry)
    raise PlanError(f"{where}: expected None, a mesh axis name or a tuple of names, got {entry!r}")


def _divisibility_error(
    layout: Layout, shape: tuple[int, ...], dim: int, mesh: MeshSpec
) -> PlanError:
    axes = layout.dims[dim]
    sizes = " x ".join(f"{a}={mesh.size(a)}" for a in axes)
    ways = 1
    for a in axes:
        ways *= mesh.size(a)
    return PlanError(
        f"layout {layout} on tensor shape {shape}: dim {dim} has size {shape[dim]}, which is not "
        f"divisible by the {ways} shards of mesh axes {axes} ({sizes}). Split this dim over fewer "
        f"axes, or split another dim (mesh axes {mesh.axis_names}, sizes {mesh.axis_sizes})."
    )


@dataclass(frozen=True, slots=True)
class Layout:
    """The RVD layout of one tensor over a mesh. Immutable and hashable.

    Attributes:
        dims: one entry per tensor dim: the mesh axes splitting that dim, major to minor (the
            device at mesh coordinates ``c`` holds block ``sum_k c[a_k] * prod_{l>k} size(a_l)``).
        partial: mesh axes over which the value is a partial sum, sorted by name (canonical).

    Raises:
        PlanError: a mesh axis is used twice (in two dims, twice in one dim, or split and partial).
    """

    dims: tuple[tuple[str, ...], ...]
    partial: tuple[str, ...] = ()
    # derived once (layouts are dict keys and queried in the search's inner loops)
    _split: tuple[str, ...] = field(default=(), init=False, repr=False, compare=False)
    _hash: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        dims = tuple(_axes_tuple(d, f"Layout dim {i}") for i, d in enumerate(self.dims))
        partial = tuple(sorted(_axes_tuple(tuple(self.partial), "Layout partial")))
        object.__setattr__(self, "dims", dims)
        object.__setattr__(self, "partial", partial)
        object.__setattr__(self, "_split", tuple(a for d in dims for a in d))
        object.__setattr__(self, "_hash", hash((dims, partial)))
        used = [a for d in dims for a in d] + list(partial)
        twice = sorted({a for a in used if used.count(a) > 1})
        if twice:
            raise PlanError(
                f"layout {self}: mesh axes {twice} are used more than once; each mesh axis either "
                "splits one tensor dim, or holds partial sums, or replicates (e.g. "
                "Layout.of(2, {0: 'data'}, partial=('model',)), not Layout.of(2, {0: 'data', "
                "1: 'data'}))"
            )

    # ---- constructors -------------------------------------------------------------------------

    @classmethod
    def replicated(cls, ndim: int) -> Layout:
        """Fully replicated layout of an ``ndim``-dimensional tensor."""
        return cls(dims=((),) * ndim)

    @classmethod
    def of(
        cls,
        ndim: int,
        split: Mapping[int, str | Sequence[str]] | None = None,
        partial: Sequence[str] = (),
    ) -> Layout:
        """Layout from ``{dim: axis or axes}`` and the partial axes.

        >>> str(Layout.of(2, {1: ("data", "model")}, partial=()))
        'D(1:(data,model))'
        """
        split = dict(split or {})
        bad = [d for d in split if not (isinstance(d, int) and -ndim <= d < ndim)]
        if bad:
            raise PlanError(f"Layout.of: dims {bad} out of range for a {ndim}-d tensor")
        split = {d % ndim: v for d, v in split.items()}
        return cls(
            dims=tuple(_axes_tuple(split.get(i), f"dim {i}") for i in range(ndim)),
            partial=tuple(partial),
        )

    @classmethod
    def from_pspec(
        cls, pspec: PartitionSpec | Sequence[Any], ndim: int, partial: Sequence[str] = ()
    ) -> Layout:
        """Layout of a ``PartitionSpec`` on an ``ndim``-d tensor (missing trailing entries: None).

        ``pspec.unreduced`` axes (jax >= 0.7 partial sums), if any, are added to ``partial``.

        >>> str(Layout.from_pspec(PartitionSpec(None, "model"), 3, partial=("data",)))
        'V(data)D(1:model)'
        """
        entries = tuple(pspec)
        if len(entries) > ndim:
            raise PlanError(
                f"PartitionSpec {pspec} has {len(entries)} entries for a {ndim}-d tensor"
            )
        if any(e is PartitionSpec.UNCONSTRAINED for e in entries):
            raise PlanError(f"PartitionSpec {pspec}: UNCONSTRAINED entries have no RVD layout")
        unreduced = tuple(getattr(pspec, "unreduced", ()) or ())
        dims = tuple(_axes_tuple(e, f"PartitionSpec {pspec}") for e in entries)
        return cls(
            dims=dims + ((),) * (ndim - len(entries)),
            partial=tuple(partial) + tuple(a for a in unreduced if a not in partial),
        )

    # ---- queries ------------------------------------------------------------------------------

    @property
    def ndim(self) -> int:
        """Number of tensor dims."""
        return len(self.dims)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, Layout):
            return NotImplemented
        return (self._hash == other._hash and self.dims == other.dims
                and self.partial == other.partial)

    def __reduce__(self):  # rebuilt on unpickling: string hashes differ between processes
        return (Layout, (self.dims, self.partial))

    @property
    def split_axes(self) -> tuple[str, ...]:
        """All mesh axes that split some dim, dim by dim, major to minor."""
        return self._split

    def axis_state(self, axis: str) -> AxisState:
        """``('R',)``, ``('V',)`` or ``('D', dim)`` for mesh ``axis`` (unknown axes are ``R``)."""
        if axis in self.partial:
            return ("V",)
        for i, d in enumerate(self.dims):
            if axis in d:
                return ("D", i)
        return ("R",)

    def replicated_axes(self, mesh: MeshSpec) -> tuple[str, ...]:
        """Mesh axes (in mesh order) over which the tensor is replicated."""
        used = set(self.split_axes) | set(self.partial)
        return tuple(a for a in mesh.axis_names if a not in used)

    def check(self, shape: Sequence[int], mesh: MeshSpec) -> None:
        """Validate against a tensor shape and a mesh.

        Raises:
            PlanError: rank mismatch, an axis not in ``mesh``, or a dim size not divisible by the
                product of its axes' sizes.
        """
        shape = tuple(shape)
        if len(shape) != self.ndim:
            raise PlanError(
                f"layout {self} has {self.ndim} dims but the tensor has shape {shape} "
                f"({len(shape)} dims)"
            )
        unknown = [a for a in self.split_axes + self.partial if a not in mesh.axis_names]
        if unknown:
            raise PlanError(
                f"layout {self} on tensor shape {shape} uses mesh axes {unknown} which are not in "
                f"the mesh (axes {mesh.axis_names}, sizes {mesh.axis_sizes})"
            )
        for i, axes in enumerate(self.dims):
            ways = 1
            for a in axes:
                ways *= mesh.size(a)
            if shape[i] % ways:
                raise _divisibility_error(self, shape, i, mesh)

    def local_shape(self, shape: Sequence[int], mesh: MeshSpec) -> tuple[int, ...]:
        """Shape of each device's block (partial sums keep the block's full shape).

        >>> m = MeshSpec.from_mesh(type("M", (), {"axis_names": ("d", "m"),
        ...                                       "shape": {"d": 2, "m": 4}})())
        >>> Layout.of(2, {0: "d", 1: "m"}).local_shape((8, 8), m)
        (4, 2)
        """
        self.check(shape, mesh)
        out = []
        for n, axes in zip(shape, self.dims, strict=True):
            for a in axes:
                n //= mesh.size(a)
            out.append(n)
        return tuple(out)

    def local_bytes(self, shape: Sequence[int], itemsize: int, mesh: MeshSpec) -> int:
        """Bytes of each device's block."""
        n = itemsize
        for s in self.local_shape(shape, mesh):
            n *= s
        return n

    # ---- conversions --------------------------------------------------------------------------

    def to_pspec(self, allow_partial: bool = False) -> PartitionSpec:
        """The ``PartitionSpec`` of the D part.

        Args:
            allow_partial: partial sums cannot be expressed as a sharding. ``False`` (default):
                raise if the layout has partial axes. ``True``: ignore them, i.e. return the spec
                of the layout after all partial sums were reduced (V axes read as R).

        Raises:
            PlanError: the layout has partial axes and ``allow_partial`` is False.
        """
        if self.partial and not allow_partial:
            raise PlanError(
                f"layout {self} holds partial sums over mesh axes {self.partial}, which a "
                "PartitionSpec cannot express; reduce them first (all_reduce / reduce_scatter) "
                "or call to_pspec(allow_partial=True) to get the spec of the reduced value"
            )
        entries = [None if not d else d[0] if len(d) == 1 else d for d in self.dims]
        while entries and entries[-1] is None:
            entries.pop()
        return PartitionSpec(*entries)

    def replace_axis(self, axis: str, state: AxisState) -> Layout:
        """A copy with ``axis`` moved to ``state``; a new ``D`` axis becomes the minor-most one."""
        dims = tuple(tuple(a for a in d if a != axis) for d in self.dims)
        partial = tuple(a for a in self.partial if a != axis)
        if state[0] == "V":
            partial += (axis,)
        elif state[0] == "D":
            i = state[1]
            if not 0 <= i < self.ndim:
                raise PlanError(f"layout {self}: dim {i} out of range for axis {axis!r}")
            dims = dims[:i] + (dims[i] + (axis,),) + dims[i + 1 :]
        return Layout(dims=dims, partial=partial)

    def __str__(self) -> str:
        """``V(<partial axes>)D(<dim>:<axes>,...)``, empty groups left out; ``R`` if replicated."""
        out = f"V({','.join(self.partial)})" if self.partial else ""
        splits = [
            f"{i}:{d[0] if len(d) == 1 else '(' + ','.join(d) + ')'}"
            for i, d in enumerate(self.dims)
            if d
        ]
        out += f"D({','.join(splits)})" if splits else ""
        return out or "R"

    def describe(self, mesh: MeshSpec) -> str:
        """nnScaler-like ``R(<axes>)V(<axes>)D(<dim>:<axes>,...)`` with every group shown.

        >>> m = MeshSpec.from_mesh(type("M", (), {"axis_names": ("data", "model"),
        ...                                       "shape": {"data": 2, "model": 4}})())
        >>> Layout.of(2, {0: "data"}).describe(m)
        'R(model)V()D(0:data)'
        """
        d = str(Layout(dims=self.dims)) if self.split_axes else "D()"
        return f"R({','.join(self.replicated_axes(mesh))})V({','.join(self.partial)}){d}"


_INTERNED: dict[Layout, Layout] = {}


def interned(layout: Layout) -> Layout:
    """One shared object per layout value: dict lookups keyed on layouts (the search's memos,
    cached collective paths) then hit by identity instead of comparing dims."""
    return _INTERNED.setdefault(layout, layout)
