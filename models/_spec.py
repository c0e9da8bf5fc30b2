"""Shared pieces of the model zoo: presets, the ModelSpec value, example args and losses.

Every model file (``models/gpt.py``, ...) defines a frozen ``Config`` dataclass, a ``PRESETS``
dict of :class:`Preset` and a ``spec(config, batch_size, abstract)`` function returning a
:class:`ModelSpec`. :mod:`models` (``__init__``) looks them up by name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax

Kind = Literal["linen", "nnx"]


@dataclasses.dataclass(frozen=True, slots=True)
class Preset:
    """A named configuration.

    Attributes:
        config: the model's frozen config dataclass.
        batch_size: default batch size of the example args.
        paper: True for paper-scale presets; their example args and variables default to
            abstract (``jax.ShapeDtypeStruct``) so nothing of that size is ever allocated.
        note: where the numbers come from.
    """

    config: Any
    batch_size: int = 2
    paper: bool = True
    note: str = ""


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A model ready for a parallelizer: a module, example args and a scalar loss.

    The calling convention is ``loss_fn(module.apply(variables, *args), *args)`` for linen and
    ``loss_fn(module(*args), *args)`` for nnx (``variables`` is then an ``nnx.State`` of ``module``). ``apply``/``loss`` below do exactly that and also
    handle the mutable collections (``batch_stats``) and rng streams (``dropout``) some models need.

    Attributes:
        module: a ``flax.linen.Module`` (``kind == "linen"``) or an ``nnx.Module`` instance; for
            abstract nnx specs its variables are ``jax.ShapeDtypeStruct`` (built by ``nnx.eval_shape``).
        make_args: ``make_args(batch_size=None, *, abstract=None, rng=None) -> tuple`` of example
            args (arrays, or ``jax.ShapeDtypeStruct`` when abstract; ``None`` means the spec's default).
        loss_fn: ``loss_fn(module_output, *args) -> scalar``.
        name, preset, config: what was built.
        kind: ``"linen"`` or ``"nnx"``.
        abstract: the default of ``make_args``.
        mutable: collections to pass as ``mutable=`` to ``apply`` in training (e.g. ``batch_stats``).
        rng_streams: rng streams ``apply`` needs (e.g. ``("dropout",)`` when dropout is active).
    """

    module: Any
    make_args: Callable[..., tuple]
    loss_fn: Callable[..., jax.Array]
    name: str = ""
    preset: str = ""
    config: Any = None
    kind: Kind = "linen"
    abstract: bool = False
    mutable: tuple[str, ...] = ()
    rng_streams: tuple[str, ...] = ()

    def __iter__(self):
        """Unpacks as ``module, make_args, loss_fn``."""
        return iter((self.module, self.make_args, self.loss_fn))

    def init(self, rng: jax.Array, *args) -> Any:
        """Linen variables for ``args`` (default: ``make_args()``). Abstract args give no shapes."""
        if self.kind != "linen":
            raise TypeError(f"{self.name}:{self.preset} is an nnx module; it holds its own state")
        args = args or self.make_args(abstract=False)
        init = jax.jit(lambda r, *a: self.module.init(_rngs(r, ("params", *self.rng_streams)), *a))
        return init(rng, *args)

    def init_abstract(self) -> Any:
        """Variables as ``jax.ShapeDtypeStruct`` via ``jax.eval_shape`` (no allocation)."""
        if self.kind == "nnx":
            from flax import nnx

            return nnx.state(self.module)
        args = self.make_args(abstract=True)
        rng = jax.ShapeDtypeStruct((2,), jnp.uint32)
        return jax.eval_shape(
            lambda r, *a: self.module.init(_rngs(r, ("params", *self.rng_streams)), *a), rng, *args
        )

    def apply(self, variables: Any, *args, rng: jax.Array | None = None) -> tuple[Any, Any]:
        """Training-mode forward: returns ``(output, updated_mutable_collections)``."""
        if self.kind == "nnx":  # variables: an nnx.State of self.module (concrete or abstract)
            from flax import nnx

            return nnx.merge(nnx.graphdef(self.module), variables)(*args), {}
        rngs = _rngs(rng, self.rng_streams) if self.rng_streams else None
        if self.mutable:
            return self.module.apply(variables, *args, rngs=rngs, mutable=list(self.mutable))
        return self.module.apply(variables, *args, rngs=rngs), {}

    def loss(self, variables: Any, *args, rng: jax.Array | None = None) -> jax.Array:
        """Scalar training loss ``loss_fn(apply(variables, *args)[0], *args)``."""
        out, _ = self.apply(variables, *args, rng=rng)
        return self.loss_fn(out, *args)


def _rngs(rng: jax.Array | None, streams: tuple[str, ...]) -> dict[str, jax.Array]:
    rng = jax.random.PRNGKey(0) if rng is None else rng
    if len(streams) == 1:
        return {streams[0]: rng}
    return dict(zip(streams, jax.random.split(rng, len(streams)), strict=True))


def array(shape: tuple[int, ...], dtype: Any, abstract: bool, fill: Callable[[], Any]) -> Any:
    """A ``jax.ShapeDtypeStruct`` when ``abstract`` else ``fill()`` as an array of that dtype."""
    if abstract:
        return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))
    return jnp.asarray(fill(), dtype=dtype).reshape(shape)


def tokens(shape: tuple[int, ...], vocab: int, abstract: bool, rng: jax.Array | None) -> Any:
    """Random int32 token ids in ``[0, vocab)``."""
    rng = jax.random.PRNGKey(0) if rng is None else rng
    return array(shape, jnp.int32, abstract, lambda: jax.random.randint(rng, shape, 0, vocab))


def normal(shape: tuple[int, ...], abstract: bool, rng: jax.Array | None, dtype=jnp.float32) -> Any:
    """Standard-normal floats."""
    rng = jax.random.PRNGKey(0) if rng is None else rng
    return array(shape, dtype, abstract, lambda: jax.random.normal(rng, shape, dtype))


def next_token_loss(logits: jax.Array, tokens: jax.Array, *_: Any) -> jax.Array:
    """Mean cross-entropy of predicting ``tokens[:, t+1]`` from ``logits[:, t]``.

    Written over the whole sequence (the labels rolled by one, the last position weighted 0),
    not on ``logits[:, :-1]``: a sequence of ``S - 1`` positions is odd, and no mesh axis
    could split the loss's softmax over it (a plan of the step would compute it whole)."""
    seq = tokens.shape[1]
    labels = jnp.roll(tokens, -1, axis=1)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
    weight = (jnp.arange(seq) < seq - 1).astype(jnp.float32)
    return jnp.sum(ce * weight) / (tokens.shape[0] * (seq - 1))


def classification_loss(logits: jax.Array, images: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy against integer ``labels``."""
    del images
    logits = logits.astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def count(tree: Any) -> int:
    """Number of scalars in a pytree of arrays / ShapeDtypeStructs."""
    return int(sum(np.prod(x.shape, dtype=np.int64) for x in jax.tree.leaves(tree)))


def args_factory(
    build: Callable[[int, bool, jax.Array | None], tuple], default_batch: int, default_abstract: bool
) -> Callable[..., tuple]:
    """Wraps ``build(batch, abstract, rng)`` into the public ``make_args`` signature."""

    def make_args(batch_size: int | None = None, *, abstract: bool | None = None,
                  rng: jax.Array | None = None) -> tuple:
        """Example args; ``None`` takes the spec's default batch size / abstractness."""
        b = default_batch if batch_size is None else batch_size
        return build(b, default_abstract if abstract is None else abstract, rng)

    return make_args
