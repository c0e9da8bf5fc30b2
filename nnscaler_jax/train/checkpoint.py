"""Checkpoints of a training state with orbax: async saves, restore onto any mesh and plan.

A training state is any pytree of arrays (params, optax state, a step counter, PRNG keys). A
:class:`Checkpointer` saves it every ``every`` steps in the background (orbax's
``CheckpointManager``), keeps the last ``keep`` steps, and restores it onto the shardings of a
*target* tree: the mesh shape and plan may differ from the ones that saved it, since every
array is resharded as it is read. Next to the arrays each step stores a small JSON record
(:class:`CheckpointInfo`): the plan JSON, the caller's ``meta`` dict and the tree's leaf
specs (path, shape, dtype), which a restore checks first so that a checkpoint of another model
is a :class:`~nnscaler_jax.errors.CheckpointError` naming the first leaf that differs.

>>> import tempfile, jax, jax.numpy as jnp
>>> state = {"w": jnp.arange(4.0), "step": jnp.int32(7)}
>>> with Checkpointer(tempfile.mkdtemp()) as ckpt:
...     ckpt.save(7, state, meta={"model": "toy"})
...     ckpt.wait()
...     restored, info = ckpt.restore(target=state)
True
>>> info.step, info.meta, restored["step"].item()
(7, {'model': 'toy'}, 7)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from pathlib import Path
from typing import Any, Self

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec

from nnscaler_jax.errors import CheckpointError

__all__ = ["CheckpointInfo", "Checkpointer", "LeafSpec", "leaf_specs", "tree_fingerprint"]

log = logging.getLogger(__name__)

_STATE, _INFO = "state", "nnscaler"  # the orbax item names of one step
_FORMAT = 1
_FIX_FOREIGN = "restore with the model that wrote it, or save to a new checkpoint directory"


@dataclasses.dataclass(frozen=True, slots=True)
class LeafSpec:
    """One leaf of a checkpointed tree: its path (``'params/fc1/kernel'``), shape and dtype."""

    path: str
    shape: tuple[int, ...]
    dtype: str

    def describe(self) -> str:
        return f"{self.dtype}{list(self.shape)}"


@dataclasses.dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """What a step stored next to its arrays.

    Attributes:
        step: the training step.
        plan_json: the plan JSON passed to ``save`` (None when none was).
        meta: the caller's JSON dict (model name, preset, losses so far, ...).
        fingerprint: a hash of the leaf specs (equal for trees of the same paths/shapes/dtypes).
        leaves: the saved tree's leaf specs, in flattening order.
    """

    step: int
    plan_json: str | None
    meta: dict[str, Any]
    fingerprint: str
    leaves: tuple[LeafSpec, ...]


def _path_names(path: tuple[Any, ...]) -> tuple[str, ...]:
    if not path:
        return ("_",)  # the tree is one leaf
    names = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                names.append(str(getattr(k, attr)))
                break
        else:
            names.append(str(k))
    return tuple(names)


def _is_key(leaf: Any) -> bool:
    return jax.dtypes.issubdtype(getattr(leaf, "dtype", None), jax.dtypes.prng_key)


def _leaf_spec(names: tuple[str, ...], leaf: Any) -> LeafSpec:
    if _is_key(leaf) or isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)):
        shape, dtype = tuple(leaf.shape), str(leaf.dtype)
    else:
        arr = _as_numpy(leaf)
        shape, dtype = arr.shape, str(arr.dtype)
    return LeafSpec("/".join(names), tuple(int(d) for d in shape), dtype)


def leaf_specs(tree: Any) -> tuple[LeafSpec, ...]:
    """The (path, shape, dtype) of every leaf of ``tree``, in flattening order.

    >>> import jax.numpy as jnp
    >>> leaf_specs({"w": jnp.zeros((2, 3)), "n": 1})
    (LeafSpec(path='n', shape=(), dtype='int32'), LeafSpec(path='w', shape=(2, 3), dtype='float32'))
    """
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return tuple(_leaf_spec(_path_names(p), leaf) for p, leaf in flat)


def tree_fingerprint(specs: tuple[LeafSpec, ...]) -> str:
    """A short hash of leaf specs: equal for trees with the same paths, shapes and dtypes."""
    text = json.dumps([[s.path, list(s.shape), s.dtype] for s in specs])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _as_numpy(leaf: Any) -> np.ndarray:
    """A non-jax leaf (numpy array, Python scalar) as the numpy array it is saved as."""
    if isinstance(leaf, (np.ndarray, np.generic)):
        return np.asarray(leaf)
    return np.asarray(leaf, dtype=jax.dtypes.canonicalize_dtype(np.result_type(leaf)))


def _jsonable(x: Any) -> Any:
    if isinstance(x, (np.ndarray, np.generic, jax.Array)):
        return np.asarray(jax.random.key_data(x) if _is_key(x) else x).tolist()
    raise TypeError(f"{type(x).__name__} is not JSON serializable")


def _nest(names: list[tuple[str, ...]], leaves: list[Any]) -> dict[str, Any]:
    """Leaves as a nested dict keyed by their path names (how orbax stores them)."""
    root: dict[str, Any] = {}
    for path, leaf in zip(names, leaves, strict=True):
        node = root
        for name in path[:-1]:
            node = node.setdefault(name, {})
            if not isinstance(node, dict):
                raise CheckpointError(f"leaf path {'/'.join(path)!r} clashes with another leaf; "
                                      "give the state's pytree distinct key names")
        if path[-1] in node:
            raise CheckpointError(f"two leaves share the path {'/'.join(path)!r}; give the "
                                  "state's pytree distinct key names")
        node[path[-1]] = leaf
    return root


def _unnest(tree: dict[str, Any], names: list[tuple[str, ...]]) -> list[Any]:
    out = []
    for path in names:
        node = tree
        for name in path:
            node = node[name]
        out.append(node)
    return out


def _flatten(tree: Any) -> tuple[list[tuple[str, ...]], list[Any], Any]:
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    names = [_path_names(p) for p, _ in flat]
    return names, [leaf for _, leaf in flat], treedef


def _saveable(leaf: Any) -> Any:
    if _is_key(leaf):
        return jax.random.key_data(leaf)
    return leaf if isinstance(leaf, jax.Array) else _as_numpy(leaf)


def _replicated() -> NamedSharding:
    return NamedSharding(jax.sharding.Mesh(np.array(jax.devices()), ("_all",)), PartitionSpec())


def _key_data_sharding(sharding: Any, extra: int) -> Any:
    """The sharding of a key array's data (``extra`` trailing dims, never split)."""
    if sharding is None:
        return _replicated()
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec, *([None] * extra)))
    return sharding if sharding.is_fully_replicated else _replicated()


def _target_leaf(leaf: Any, spec: LeafSpec, key_impl: str | None) -> Any:
    """What orbax restores one leaf onto: a ShapeDtypeStruct with a sharding, or numpy."""
    if key_impl is not None:
        data = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0, impl=key_impl)))
        sharding = _key_data_sharding(getattr(leaf, "sharding", None), len(data.shape))
        return jax.ShapeDtypeStruct(spec.shape + data.shape, data.dtype, sharding=sharding)
    if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)):
        sharding = getattr(leaf, "sharding", None) or _replicated()
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
    return _as_numpy(leaf)


def _mismatch_error(saved: tuple[LeafSpec, ...], expected: tuple[LeafSpec, ...],
                    directory: str, step: int) -> CheckpointError:
    saved_by, expected_by = {s.path: s for s in saved}, {s.path: s for s in expected}
    where = f"checkpoint step {step} in {directory}"
    for s, e in zip(saved, expected, strict=False):
        if s != e:
            break
    else:
        s, e = (saved[len(expected)], None) if len(saved) > len(expected) else (
            None, expected[len(saved)])
    if e is not None and e.path not in saved_by:
        what = f"it has no leaf {e.path!r} (expected {e.describe()})"
    elif s is not None and s.path not in expected_by:
        what = f"it has a leaf {s.path!r} ({s.describe()}) that the model has not"
    else:
        path = (e or s).path
        what = (f"its leaf {path!r} was saved as {saved_by[path].describe()}, expected "
                f"{expected_by[path].describe()}")
    return CheckpointError(
        f"{where} was written by another model: {what} ({len(saved)} leaves saved, "
        f"{len(expected)} expected). Fix: {_FIX_FOREIGN}.", directory=directory, step=step)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def _parse_info(raw: Any, step: int, directory: str) -> CheckpointInfo:
    try:
        if raw.get("format") != _FORMAT:
            raise ValueError(f"unknown format {raw.get('format')!r}")
        leaves = tuple(LeafSpec(str(p), tuple(int(d) for d in shape), str(dtype))
                       for p, shape, dtype in raw["leaves"])
        meta = raw.get("meta") or {}
        if not isinstance(meta, dict):
            raise TypeError("meta is not a dict")
        return CheckpointInfo(step=step, plan_json=raw.get("plan_json"), meta=meta,
                              fingerprint=str(raw["fingerprint"]), leaves=leaves)
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise CheckpointError(
            f"checkpoint step {step} in {directory} has corrupted metadata ({_first_line(e)}). "
            "Fix: restore another step, or save to a new checkpoint directory.",
            directory=directory, step=step) from None


def _step_number(step: Any) -> int:
    """``step`` as the training step's number (a CheckpointError for anything else, e.g. the
    train-step object that ``step = pm.train_step(...)`` names)."""
    integral = isinstance(step, (int, np.integer)) or (
        isinstance(step, (np.ndarray, jax.Array)) and step.shape == ()
        and np.issubdtype(step.dtype, np.integer))
    if isinstance(step, bool) or not integral:
        raise CheckpointError(
            f"step={type(step).__name__} must be the training step's number (an int): "
            "Checkpointer.save(step, state) names the subfolder by it. Fix: pass the "
            "loop's counter, e.g. `for i in range(n): state, m = train_step(state, *batch); "
            "ckpt.maybe_save(i + 1, state)`; name the train-step object something other "
            "than `step`.")
    return int(step)


class Checkpointer:
    """Saves and restores a training state under ``directory`` (one subfolder per step).

    Args:
        directory: where the steps go; created on the first save.
        every: ``maybe_save`` saves the steps divisible by ``every``.
        keep: how many of the latest steps to keep (None keeps all).
        async_save: save in the background (``wait`` / ``close`` wait for it).

    Saves are collective in a multi-process run: every process calls them with its shards.

    >>> import tempfile, jax.numpy as jnp
    >>> ckpt = Checkpointer(tempfile.mkdtemp(), every=2, keep=1)
    >>> [ckpt.maybe_save(s, {"w": jnp.ones(2) * s}) for s in (1, 2, 3, 4)]
    [False, True, False, True]
    >>> ckpt.wait(); ckpt.steps(), ckpt.latest_step()
    ([4], 4)
    >>> ckpt.close()
    """

    def __init__(self, directory: str | Path, *, every: int = 1, keep: int | None = 3,
                 async_save: bool = True) -> None:
        if int(every) < 1:
            raise CheckpointError(f"every={every} must be >= 1 (save every N steps)")
        if keep is not None and int(keep) < 1:
            raise CheckpointError(f"keep={keep} must be >= 1, or None to keep every step")
        self.directory = Path(directory).expanduser().absolute()
        self.every, self.keep, self.async_save = int(every), keep, async_save
        self._manager: ocp.CheckpointManager | None = None
        if self.directory.exists() and not self.directory.is_dir():
            raise CheckpointError(f"checkpoint directory {self.directory} is a file. Fix: pass "
                                  "a directory's path (or a new one to create).",
                                  directory=str(self.directory))

    def _open(self, create: bool) -> ocp.CheckpointManager | None:
        if self._manager is None:
            if not create and not self.directory.is_dir():
                return None
            options = ocp.CheckpointManagerOptions(
                max_to_keep=self.keep, create=True,
                enable_async_checkpointing=self.async_save)
            self._manager = ocp.CheckpointManager(self.directory, options=options)
        return self._manager

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def maybe_save(self, step: int, state: Any, *, plan_json: str | None = None,
                   meta: dict[str, Any] | None = None) -> bool:
        """Saves ``state`` as ``step`` when ``step % every == 0``; True when it did.

        The save runs in the background once the arrays are copied off the devices.
        """
        if _step_number(step) % self.every:
            return False
        return self.save(step, state, plan_json=plan_json, meta=meta)

    def save(self, step: int, state: Any, *, plan_json: str | None = None,
             meta: dict[str, Any] | None = None) -> bool:
        """Saves ``state`` as ``step`` (in the background); False if that step already exists.

        Args:
            step: the training step (the subfolder's name).
            state: a pytree of arrays (jax arrays of any sharding, numpy, PRNG keys).
            plan_json: the plan's JSON (``plan.to_json()``) kept for the restore.
            meta: a JSON-able dict (numpy / jax values become lists) kept for the restore.
        """
        step = _step_number(step)
        manager = self._open(create=True)
        if step in manager.all_steps():
            log.info("checkpoint step %d already in %s: not saved again", step, self.directory)
            return False
        names, leaves, _ = _flatten(state)
        specs = leaf_specs(state)
        keys = {s.path: str(jax.random.key_impl(x)) for s, x in zip(specs, leaves, strict=True)
                if _is_key(x)}
        if hasattr(plan_json, "to_json"):
            plan_json = plan_json.to_json()
        try:
            meta = json.loads(json.dumps(dict(meta or {}), default=_jsonable))
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"meta for checkpoint step {step} is not JSON-able: {e}. "
                                  "Fix: pass numbers, strings, lists and dicts.") from None
        info = {"format": _FORMAT, "step": step, "plan_json": plan_json, "meta": meta,
                "fingerprint": tree_fingerprint(specs), "key_impls": keys,
                "leaves": [[s.path, list(s.shape), s.dtype] for s in specs]}
        arrays = _nest(names, [_saveable(x) for x in leaves])
        args = ocp.args.Composite(**{_STATE: ocp.args.StandardSave(arrays),
                                     _INFO: ocp.args.JsonSave(info)})
        saved = manager.save(step, args=args, force=True)
        log.info("checkpoint step %d -> %s%s", step, self.directory,
                 " (in the background)" if self.async_save else "")
        return bool(saved)

    def wait(self) -> None:
        """Waits until the background saves are on disk."""
        if self._manager is not None:
            self._manager.wait_until_finished()

    def steps(self) -> list[int]:
        """The saved steps, oldest first (a save still in progress included)."""
        manager = self._open(create=False)
        return sorted(manager.all_steps()) if manager is not None else []

    def latest_step(self) -> int | None:
        """The newest saved step, or None when there is none."""
        steps = self.steps()
        return steps[-1] if steps else None

    def info(self, step: int | None = None) -> CheckpointInfo:
        """The :class:`CheckpointInfo` of ``step`` (default: the latest) without its arrays."""
        return self._read_info(step)[0]

    def _read_info(self, step: int | None) -> tuple[CheckpointInfo, dict[str, str]]:
        step = self._pick_step(step)
        try:
            raw = self._manager.restore(step, args=ocp.args.Composite(
                **{_INFO: ocp.args.JsonRestore()}))[_INFO]
        except Exception as e:  # noqa: BLE001 - orbax raises many kinds; re-raised with context
            raise CheckpointError(
                f"checkpoint step {step} in {self.directory} has unreadable metadata "
                f"({_first_line(e)}). Fix: restore another step, or save to a new "
                "checkpoint directory.", directory=str(self.directory), step=step) from None
        info = _parse_info(raw, step, str(self.directory))
        return info, dict(raw.get("key_impls") or {})

    def _pick_step(self, step: int | None) -> int:
        where = str(self.directory)
        if not self.directory.is_dir():
            raise CheckpointError(
                f"no checkpoint to restore: {where} does not exist. Fix: pass the "
                "directory that holds the checkpoints, or start without restoring.",
                directory=where)
        self.wait()
        steps = self.steps()
        if not steps:
            raise CheckpointError(
                f"no checkpoint to restore in {where}: it holds no saved step. Fix: pass the "
                "directory that holds the checkpoints, or start without restoring.",
                directory=where)
        if step is None:
            return steps[-1]
        if int(step) not in steps:
            raise CheckpointError(f"no checkpoint step {step} in {where}; saved steps: {steps}",
                                  directory=where, step=int(step))
        return int(step)

    def restore(self, step: int | None = None, *, target: Any) -> tuple[Any, CheckpointInfo]:
        """Reads ``step`` (default: the latest) onto the layout of ``target``.

        Args:
            step: the step to restore; None for the latest.
            target: a pytree like the saved state whose leaves are ``jax.ShapeDtypeStruct``
                (with ``.sharding``) or arrays: each array is read straight into that sharding,
                on any mesh shape or plan. Leaves without a sharding are restored replicated
                over all devices; numpy leaves as numpy.

        Returns:
            ``(state, info)``: the state in ``target``'s tree structure, and the step's
            :class:`CheckpointInfo`.

        Raises:
            CheckpointError: no directory, no (such) step, corrupted metadata, or a
                checkpoint of another model (the first differing leaf is named).
        """
        info, raw_keys = self._read_info(step)
        names, leaves, treedef = _flatten(target)
        expected = leaf_specs(target)
        if expected != info.leaves:
            raise _mismatch_error(info.leaves, expected, str(self.directory), info.step)
        targets = [_target_leaf(x, s, raw_keys.get(s.path) if _is_key(x) else None)
                   for x, s in zip(leaves, expected, strict=True)]
        try:
            arrays = self._manager.restore(info.step, args=ocp.args.Composite(
                **{_STATE: ocp.args.StandardRestore(_nest(names, targets))}))[_STATE]
            values = _unnest(arrays, names)
        except Exception as e:  # noqa: BLE001 - orbax raises many kinds; re-raised with context
            raise CheckpointError(
                f"checkpoint step {info.step} in {self.directory} could not be read "
                f"({_first_line(e)}). Fix: restore another step, or save to a new "
                "checkpoint directory.", directory=str(self.directory), step=info.step) from None
        values = [jax.random.wrap_key_data(v, impl=raw_keys[s.path]) if _is_key(x) else v
                  for v, x, s in zip(values, leaves, expected, strict=True)]
        return jax.tree_util.tree_unflatten(treedef, values), info

    def close(self) -> None:
        """Waits for the background saves and releases orbax's resources."""
        if self._manager is not None:
            self._manager.wait_until_finished()
            self._manager.close()
            self._manager = None
