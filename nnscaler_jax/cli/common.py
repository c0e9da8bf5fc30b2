"""Shared pieces of the command line: usage errors, device requests, model specs, meshes,
printing."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

from nnscaler_jax.mesh.cpu import COUNT_FLAG, cpu_xla_flags

DEFAULT_DEVICES = 8
DEFAULT_AXES = {1: ("data",), 2: ("data", "model"), 3: ("data", "fsdp", "model")}
DEFAULT_PLANNERS = "dp,zero3,megatron,auto,alpa"


class UsageError(Exception):
    """A bad value on the command line: one line, exit 2."""


# ---- environment ---------------------------------------------------------------------------------


def backends_started() -> bool:
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):
        return True


def request_devices(n: int | None) -> None:
    """Ask XLA for ``n`` virtual CPU devices (default 8 if the flags name no count), unless JAX's
    backends are already running (XLA_FLAGS is read when they start, not at ``import jax``)."""
    if backends_started():
        return
    flags = os.environ.get("XLA_FLAGS", "")
    if n is None and COUNT_FLAG not in flags:
        n = DEFAULT_DEVICES
    os.environ["XLA_FLAGS"] = cpu_xla_flags(flags, n)


# ---- small helpers -------------------------------------------------------------------------------


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Plain aligned text: first column left, others right."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), sep] + [line(r) for r in cells[1:]])


def mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def device_peak(mesh: Any) -> int | None:
    """The most bytes the runtime's allocator held at once on any of this process's devices of
    ``mesh`` (``memory_stats()['peak_bytes_in_use']``: GPUs and TPUs; None where the backend
    keeps no statistics, as on CPU)."""
    import jax

    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in mesh.devices.flat
             if d.process_index == jax.process_index()]
    peaks = [int(p) for p in peaks if p is not None]
    return max(peaks) if peaks else None


def emit(args: argparse.Namespace, text: str, obj: dict[str, Any]) -> None:
    if text:
        print(text)
    if args.json:
        print(json.dumps(obj, sort_keys=False, default=str))


def available_models() -> list[str]:
    import models

    out = []
    for name in models.names():
        try:
            models.presets(name)
        except ImportError:
            continue  # registered, not written yet
        out.append(name)
    return out


def model_spec(name: str, preset: str, precision: str | None = None, **overrides: Any) -> Any:
    """``models.get`` with the user's mistakes turned into one-line ``UsageError``s; with a
    ``precision`` (a name such as ``'bfloat16'``) the zoo config's ``dtype``, where it has one,
    is set to it, so the layers compute at that precision instead of their float32 default."""
    import models

    if name not in models.names():
        raise UsageError(f"unknown model {name!r}; choose one of: "
                         f"{', '.join(available_models())}")
    try:
        presets = models.presets(name)
    except ImportError as e:
        raise UsageError(f"model {name!r} is not implemented yet ({e}); choose one of: "
                         f"{', '.join(available_models())}") from e
    if preset not in presets:
        raise UsageError(f"model {name!r} has no preset {preset!r}; choose one of: "
                         f"{', '.join(presets)}")
    if precision is not None and getattr(models.preset_info(name, preset).config, "dtype",
                                         None) is not None:
        import jax.numpy as jnp

        overrides = {"dtype": jnp.dtype(precision), **overrides}
    return models.get(name, preset, **overrides)


def parse_mesh(text: str, axes: str | None, devices: int | None = None) -> Any:
    """``'2x4'`` (+ optional ``'data,model'``) -> a ``jax.sharding.Mesh`` on the first devices."""
    import jax

    if not re.fullmatch(r"\d+(x\d+)*", text or ""):
        raise UsageError(f"bad mesh {text!r}: write axis sizes joined by 'x', e.g. 8, 2x4, 2x2x2")
    shape = tuple(int(s) for s in text.split("x"))
    if any(s < 1 for s in shape):
        raise UsageError(f"bad mesh {text!r}: every axis size must be at least 1")
    if axes:
        names = tuple(a.strip() for a in axes.split(","))
        if len(names) != len(shape) or len(set(names)) != len(names) or not all(names):
            raise UsageError(f"--axes {axes!r} must name the {len(shape)} axes of mesh {text!r} "
                             "once each, e.g. --axes data,model")
    elif len(shape) in DEFAULT_AXES:
        names = DEFAULT_AXES[len(shape)]
    else:
        raise UsageError(f"mesh {text!r} has {len(shape)} axes: name them with --axes "
                         "(default names exist for 1 to 3 axes)")
    have = len(jax.devices())
    need = math.prod(shape)
    if need > have:
        raise UsageError(f"mesh {text!r} needs {need} devices, but {have} are available; use a "
                         f"smaller mesh or --devices {need} (virtual CPU devices)")
    return jax.make_mesh(shape, names, devices=jax.devices()[:need])


def policy_names() -> list[str]:
    """The policies ``--policy`` takes: those ``auto_parallel(mesh, policy=...)`` takes by name
    (the searches ``auto`` and ``alpa`` included)."""
    from nnscaler_jax.search.entry import POLICIES

    return sorted(POLICIES)


def check_policy(name: str) -> str:
    if name not in policy_names():
        raise UsageError(f"unknown policy {name!r}; choose one of: {', '.join(policy_names())}")
    return name


def spec_rng_names(spec: Any) -> dict[str, Any] | None:
    from nnscaler_jax.capture.trace import spec_rngs

    return spec_rngs(spec)


def spec_mutable(spec: Any) -> Any:
    return list(spec.mutable) if spec.mutable else False


def abstract_inputs(spec: Any) -> tuple[tuple[Any, ...], Any]:
    from nnscaler_jax.capture.trace import spec_inputs

    return spec_inputs(spec)


def capture_model(spec: Any, **kw: Any) -> Any:
    from nnscaler_jax.capture.trace import capture_spec

    return capture_spec(spec, **kw)


def make_plan(spec: Any, mesh: Any, policy: str) -> Any:
    """``AutoParallel.make_plan`` on abstract args."""
    from nnscaler_jax.api import auto_parallel

    args, variables = abstract_inputs(spec)
    pm = auto_parallel(mesh, policy=policy)(spec.module)
    if spec.kind == "nnx":
        return pm.make_plan(*args)
    return pm.make_plan(*args, variables=variables, rngs=spec_rng_names(spec),
                        mutable=spec_mutable(spec))


def cost_dict(plan: Any) -> dict[str, Any] | None:
    import dataclasses

    return dataclasses.asdict(plan.cost) if plan.cost is not None else None


# ---- verification (shared by verify and demo) --------------------------------------------------
