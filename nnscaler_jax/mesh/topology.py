"""Alpha-beta communication costs per mesh axis, and the abstract mesh the planner prices against.

Every collective runs over the ``p`` devices of one mesh axis (a *group*; all groups of that
axis run at the same time, so the time of one group is the time of the step). Its time follows
Alpa's per-mesh-dimension model, with ``n`` the per-device *full* bytes the collective handles —
the size of the whole buffer the group works on, as seen by one device:

==============  =====================  ========================================================
collective      time                   ``n`` is
==============  =====================  ========================================================
all_gather      ``a + b (p-1)/p n``    bytes of the gathered result on each device (p x input)
all_reduce      ``a + 2 b (p-1)/p n``  bytes of the buffer each device reduces (input == output)
reduce_scatter  ``a + b (p-1)/p n``    bytes of each device's (unreduced) input (p x output)
all_to_all      ``a + b (p-1)/p^2 n``  bytes the group holds together (p x each device's buffer)
ppermute        ``a + b n``            bytes each device sends
==============  =====================  ========================================================

``a`` is the link's latency (``alpha_s``) and ``b`` its inverse bandwidth (``beta_s_per_byte``).
With ``p == 1`` no data moves and every time is exactly 0. ``(time - a) / b`` is the number of bytes
each device puts on the wire (:func:`wire_bytes`).

>>> link = LinkCost(alpha_s=1e-5, beta_s_per_byte=1e-9)
>>> round(all_reduce_time(link, 4, 1_000_000), 9)
0.00151
>>> all_gather_time(link, 1, 1_000_000)
0.0
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias

from nnscaler_jax.errors import PlanError

CollectiveKind: TypeAlias = Literal[
    "all_gather", "all_reduce", "reduce_scatter", "all_to_all", "ppermute", "slice", "value_chunk"
]
"""Kinds of layout transitions; ``slice`` and ``value_chunk`` are local (no communication)."""


@dataclass(frozen=True, slots=True)
class LinkCost:
    """Alpha-beta cost of one mesh axis' links.

    Attributes:
        alpha_s: latency of one collective step, in seconds.
        beta_s_per_byte: seconds per byte sent by one device (1 / bandwidth).
    """

    alpha_s: float
    beta_s_per_byte: float

    def __post_init__(self) -> None:
        # (an infinite one priced a zero-byte step inf * 0 = nan: the collective path search
        # then found "no sequence of collectives" between layouts)
        if not (0 <= self.alpha_s < math.inf and 0 <= self.beta_s_per_byte < math.inf):
            raise PlanError(
                f"LinkCost(alpha_s={self.alpha_s}, beta_s_per_byte={self.beta_s_per_byte}): "
                "both must be finite and >= 0 (seconds and seconds per byte); a mesh axis "
                "without a usable link is not a mesh axis: leave it out of the mesh"
            )

    @classmethod
    def from_bandwidth(cls, latency_s: float, bytes_per_s: float) -> LinkCost:
        """A link from its latency (s) and per-device one-direction bandwidth (bytes/s).

        >>> LinkCost.from_bandwidth(2e-6, 25e9).beta_s_per_byte
        4e-11
        """
        if not bytes_per_s > 0:
            raise PlanError(f"LinkCost.from_bandwidth: bytes_per_s must be > 0, got {bytes_per_s}")
        return cls(alpha_s=float(latency_s), beta_s_per_byte=1.0 / bytes_per_s)


DEFAULT_LINK = LinkCost(alpha_s=1e-5, beta_s_per_byte=1.0 / 100e9)
"""Used when a mesh axis has no link given: 10 us latency, 100 GB/s (NVLink-class)."""


def _check_group(p: int, n: float) -> None:
    if p < 1 or n < 0:
        raise PlanError(f"collective over p={p} devices with n={n} bytes: need p >= 1 and n >= 0")


def all_gather_time(link: LinkCost, p: int, n: float) -> float:
    """All-gather over ``p`` devices; ``n`` = bytes of the gathered result per device."""
    _check_group(p, n)
    return 0.0 if p == 1 else link.alpha_s + link.beta_s_per_byte * (p - 1) / p * n


def all_reduce_time(link: LinkCost, p: int, n: float) -> float:
    """All-reduce over ``p`` devices; ``n`` = bytes of the buffer each device reduces."""
    _check_group(p, n)
    return 0.0 if p == 1 else link.alpha_s + 2 * link.beta_s_per_byte * (p - 1) / p * n


def reduce_scatter_time(link: LinkCost, p: int, n: float) -> float:
    """Reduce-scatter over ``p`` devices; ``n`` = bytes of each device's input (p x its output)."""
    _check_group(p, n)
    return 0.0 if p == 1 else link.alpha_s + link.beta_s_per_byte * (p - 1) / p * n


def all_to_all_time(link: LinkCost, p: int, n: float) -> float:
    """All-to-all over ``p`` devices; ``n`` = bytes the group holds together (p x per device)."""
    _check_group(p, n)
    return 0.0 if p == 1 else link.alpha_s + link.beta_s_per_byte * (p - 1) / (p * p) * n


def ppermute_time(link: LinkCost, p: int, n: float) -> float:
    """Collective permute among ``p`` devices; ``n`` = bytes each device sends."""
    _check_group(p, n)
    return 0.0 if p == 1 else link.alpha_s + link.beta_s_per_byte * n


_WIRE_FACTOR = {
    "all_gather": lambda p: (p - 1) / p,
    "all_reduce": lambda p: 2 * (p - 1) / p,
    "reduce_scatter": lambda p: (p - 1) / p,
    "all_to_all": lambda p: (p - 1) / (p * p),
    "ppermute": lambda p: 1.0,
    "slice": lambda p: 0.0,
    "value_chunk": lambda p: 0.0,
}


def wire_bytes(kind: CollectiveKind, p: int, n: float) -> float:
    """Bytes each device sends for collective ``kind`` with the ``n`` convention above.

    >>> wire_bytes("all_gather", 4, 4096)
    3072.0
    """
    _check_group(p, n)
    if kind not in _WIRE_FACTOR:
        raise PlanError(f"unknown collective kind {kind!r}; expected one of {sorted(_WIRE_FACTOR)}")
    return 0.0 if p == 1 else float(_WIRE_FACTOR[kind](p) * n)


def collective_time(kind: CollectiveKind, link: LinkCost, p: int, n: float) -> float:
    """Time of collective ``kind`` (dispatch to the ``*_time`` functions; local kinds cost 0)."""
    if kind in ("slice", "value_chunk"):
        _check_group(p, n)
        return 0.0
    fns = {
        "all_gather": all_gather_time,
        "all_reduce": all_reduce_time,
        "reduce_scatter": reduce_scatter_time,
        "all_to_all": all_to_all_time,
        "ppermute": ppermute_time,
    }
    if kind not in fns:
        raise PlanError(f"unknown collective kind {kind!r}; expected one of {sorted(_WIRE_FACTOR)}")
    return fns[kind](link, p, n)


@dataclass(frozen=True, slots=True)
class MeshSpec:
    """An abstract device mesh: axis names, sizes and one link cost per axis. Hashable.

    Attributes:
        axis_names: mesh axis names, major to minor (as in ``jax.sharding.Mesh``).
        axis_sizes: number of devices along each axis.
        links: the :class:`LinkCost` of each axis.

    >>> m = MeshSpec(("data", "model"), (2, 4), (DEFAULT_LINK, DEFAULT_LINK))
    >>> m.size("model"), m.num_devices
    (4, 8)
    """

    axis_names: tuple[str, ...]
    axis_sizes: tuple[int, ...]
    links: tuple[LinkCost, ...]
    _hash: int = field(default=0, init=False, repr=False, compare=False)  # a cache key

    def __post_init__(self) -> None:
        object.__setattr__(self, "axis_names", tuple(self.axis_names))
        object.__setattr__(self, "axis_sizes", tuple(int(s) for s in self.axis_sizes))
        object.__setattr__(self, "links", tuple(self.links))
        object.__setattr__(self, "_hash", hash((self.axis_names, self.axis_sizes, self.links)))
        n = len(self.axis_names)
        if len(self.axis_sizes) != n or len(self.links) != n:
            raise PlanError(
                f"MeshSpec{self.axis_names}: need one size and one link per axis, got sizes "
                f"{self.axis_sizes} and {len(self.links)} links"
            )
        if len(set(self.axis_names)) != n:
            raise PlanError(f"MeshSpec: axis names must be unique, got {self.axis_names}")
        if any(s < 1 for s in self.axis_sizes):
            raise PlanError(f"MeshSpec{self.axis_names}: sizes must be >= 1, got {self.axis_sizes}")
        if not all(isinstance(link, LinkCost) for link in self.links):
            raise PlanError(f"MeshSpec{self.axis_names}: links must be LinkCost, got {self.links}")

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):  # rebuilt on unpickling: string hashes differ between processes
        return (MeshSpec, (self.axis_names, self.axis_sizes, self.links))

    @classmethod
    def from_mesh(
        cls,
        mesh: Any,
        links: LinkCost | Sequence[LinkCost] | Mapping[str, LinkCost] | None = None,
    ) -> MeshSpec:
        """The abstract spec of a ``jax.sharding.Mesh`` (or ``AbstractMesh``).

        Args:
            mesh: anything with ``axis_names`` and ``shape`` (a name -> size mapping).
            links: one link for all axes, one per axis, or a mapping axis name -> link (missing
                axes get :data:`DEFAULT_LINK`). ``None``: :data:`DEFAULT_LINK` everywhere.

        Returns:
            The :class:`MeshSpec`.
        """
        names = tuple(mesh.axis_names)
        sizes = tuple(int(mesh.shape[name]) for name in names)
        if links is None:
            per_axis = (DEFAULT_LINK,) * len(names)
        elif isinstance(links, LinkCost):
            per_axis = (links,) * len(names)
        elif isinstance(links, Mapping):
            unknown = set(links) - set(names)
            if unknown:
                raise PlanError(f"links for unknown mesh axes {sorted(unknown)}; mesh has {names}")
            per_axis = tuple(links.get(name, DEFAULT_LINK) for name in names)
        else:
            per_axis = tuple(links)
        return cls(names, sizes, per_axis)

    def index(self, axis: str) -> int:
        """Position of ``axis`` in :attr:`axis_names`; :class:`PlanError` if unknown."""
        try:
            return self.axis_names.index(axis)
        except ValueError:
            raise PlanError(
                f"unknown mesh axis {axis!r}; mesh axes are {self.axis_names}"
            ) from None

    def size(self, axis: str | tuple[str, ...]) -> int:
        """Number of devices along ``axis`` (a tuple of axes: the devices of their product)."""
        if isinstance(axis, tuple):
            return math.prod(self.size(a) for a in axis)
        return self.axis_sizes[self.index(axis)]

    def link(self, axis: str | tuple[str, ...]) -> LinkCost:
        """The link cost of ``axis``. A collective over a tuple of axes runs one ring through
        all their devices: it waits for the slowest of their links (largest latency, least
        bandwidth), as NCCL's flat ring across nodes is bound by the inter-node link."""
        if isinstance(axis, tuple):
            links = [self.link(a) for a in axis]
            return LinkCost(max(lk.alpha_s for lk in links),
                            max(lk.beta_s_per_byte for lk in links))
        return self.links[self.index(axis)]

    @property
    def num_devices(self) -> int:
        """Total number of devices."""
        out = 1
        for s in self.axis_sizes:
            out *= s
        return out
