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

from nnscaler_jax.errors import fmt_bytes
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


def planned_model(spec: Any, mesh: Any, policy: str | None = None, constraints: Any = None,
                  plan: Any = None) -> Any:
    """The wrapper ``auto_parallel(mesh, constraints, policy=, plan=)(spec.module)`` after
    planning on abstract args: ``.plan`` and ``.graph`` are set. ``train`` builds its wrapper
    and step with the same arguments, so a plan this makes is the one ``train`` runs: a linen
    model's training step (the module and its loss as one graph,
    ``SpmdStep.abstract_init``); a pipelined or an nnx model's module call."""
    import jax
    import optax

    from nnscaler_jax.api import auto_parallel

    args, variables = abstract_inputs(spec)
    pm = auto_parallel(mesh, constraints, policy=policy, plan=plan)(spec.module)
    if spec.kind == "nnx":
        pm.make_plan(*args)
    elif pm.pipelined:  # planned as the pipelined step plans (typed keys: its graph)
        from nnscaler_jax.capture.module_call import microbatch_rngs

        rngs = (microbatch_rngs(jax.random.key(0), 0, spec.rng_streams)
                if spec.rng_streams else None)
        pm.make_plan(*args, variables=variables, rngs=rngs, mutable=spec_mutable(spec))
    else:
        step = pm.train_step(spec.loss_fn, optax.adamw(1e-3),
                             rng_streams=spec.rng_streams or ("dropout",))
        step.abstract_init(variables, *args,
                           rng=jax.random.key(0) if spec.rng_streams else None)
    return pm


def make_plan(spec: Any, mesh: Any, policy: str) -> Any:
    """``AutoParallel.make_plan`` on abstract args."""
    return planned_model(spec, mesh, policy).plan


# ---- plan settings (plan, train, verify, compare) ------------------------------------------------


def parse_budget(text: str | None) -> int | None:
    """``--budget``: bytes or a size string (``32GiB``, ``80GB``, ``512MiB``); None without."""
    from nnscaler_jax.constraints import parse_bytes
    from nnscaler_jax.errors import PlanError

    if text is None:
        return None
    try:
        return parse_bytes(text)
    except PlanError:
        raise UsageError(f"bad --budget {text!r}: give bytes or a size such as 32GiB, 80GB, "
                         "512MiB") from None


def load_plan(path: str) -> Any:
    """``--plan FILE``: the plan ``plan --out FILE`` wrote. A file that cannot be read is a
    usage error; one that is not a plan raises the ``PlanFormatError`` saying why (exit 2)."""
    from nnscaler_jax.plan.plan import Plan

    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise UsageError(f"cannot read --plan {path}: {e.strerror or e}; write one with "
                         "nnscaler-jax plan ... --out FILE") from None
    return Plan.from_json(text)


PLAN_HELP = ("run the plan saved by 'plan --out FILE' instead of planning; one for another "
             "model, mesh or batch is refused (exit 2) saying why")

# the flags that shape a plan, as ``--flag`` -> the attribute (``plan`` and ``train`` share them)
PLAN_FLAGS = {"--policy": "policy", "--zero": "zero", "--microbatches": "microbatches",
              "--precision": "precision", "--pipeline": "pipeline", "--schedule": "schedule",
              "--attention": "attention", "--budget": "budget", "--executor": "executor",
              "--overlap": "overlap"}


def add_plan_settings(p: argparse.ArgumentParser) -> None:
    """The options that shape a plan, the same on ``plan`` and ``train`` (so ``plan`` makes the
    plan ``train`` runs, and refuses what it refuses). Defaults are None: ``train --resume``
    tells a flag given from one left to the checkpoint."""
    p.add_argument("--policy", default=None,
                   help="dp, zero3, megatron, alpa or auto (default auto: the search)")
    p.add_argument("--budget", default=None,
                   help="memory per device the plan must fit, in bytes or e.g. 32GiB (default: "
                        "the device's, less a reserve; none on CPU)")
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3),
                   help="ZeRO stage over the data axes: optimizer state 1, grads 2, params 3")
    p.add_argument("--microbatches", type=int, default=None,
                   help="micro-batches (gradient accumulation, or the pipeline's; default: "
                        "the planner's choice)")
    p.add_argument("--precision", help="compute precision: bfloat16, float16 or float32 "
                   "(float32 master weights; default: the model's dtypes)")
    p.add_argument("--pipeline", type=int, default=None, metavar="S", help="S pipeline stages "
                   "along the mesh's 'stage' axis (e.g. --mesh 2x4 --axes stage,data)")
    p.add_argument("--schedule", default=None,
                   choices=("1f1b", "eager-1f1b", "gpipe", "interleaved", "interlaced", "nf1b",
                            "zb-h1"),
                   help="pipeline schedule (default: the cheapest the runtime executes)")
    p.add_argument("--executor", default=None, choices=("in-graph", "per-stage"),
                   help="how a pipelined plan runs: in-graph (one program over the stage "
                        "axis, in lock step) or per-stage (one program per stage, each as its "
                        "inputs arrive; tensor-parallel stages of a cut model always); default "
                        "in-graph where it runs")
    p.add_argument("--overlap", default=None, choices=("on", "off"),
                   help="in-graph pipelines: send each time step's results during the next "
                        "step, beside its compute (on), or after it (off); default: the "
                        "planner prices both")
    p.add_argument("--batch-size", type=int, help="global batch size (default: the preset's)")
    add_attention_flag(p)


def add_attention_flag(p: argparse.ArgumentParser) -> None:
    """``--attention fused|ring|zigzag``: ``Constraints(attention=...)``."""
    p.add_argument("--attention", default=None, choices=("fused", "ring", "zigzag"),
                   help="fused: every attention block as one flash kernel on GPUs; where the "
                        "sequence is split, the search moves it to the heads (all-to-all) or "
                        "runs ring attention on it; ring / zigzag: fused, a split sequence "
                        "always runs that ring layout; default: attention as the model writes it")


def plan_constraints(args: argparse.Namespace) -> Any:
    """The ``Constraints`` of the plan settings (:func:`add_plan_settings`)."""
    from nnscaler_jax.constraints import Constraints
    from nnscaler_jax.errors import PlanError

    budget = parse_budget(getattr(args, "budget", None))
    try:
        return Constraints(zero=args.zero, microbatches=args.microbatches,
                           precision=args.precision, pipeline_stages=args.pipeline or None,
                           schedule=getattr(args, "schedule", None),
                           attention=getattr(args, "attention", None),
                           pipeline_executor=getattr(args, "executor", None),
                           pipeline_overlap={"on": True, "off": False}.get(
                               getattr(args, "overlap", None)),
                           max_memory_per_device=budget)
    except PlanError as e:
        raise UsageError(cli_terms(str(e).splitlines()[0], args)) from None


def settings_spec(args: argparse.Namespace, precision: str | None) -> Any:
    """The zoo model of ``--model`` / ``--preset`` at ``--batch-size`` (where given) and
    ``precision``."""
    batch = getattr(args, "batch_size", None)
    if batch is not None and batch < 1:
        raise UsageError(f"--batch-size {batch} must be at least 1")
    return model_spec(args.model, args.preset, precision,
                      **({} if batch is None else {"batch_size": batch}))


def check_saved_plan_alone(args: argparse.Namespace) -> None:
    """``--plan FILE`` runs the saved plan as it was made: the flags that would shape another
    plan (all of :data:`PLAN_FLAGS` but ``--budget``, which the saved plan is checked against)
    are refused."""
    given = [f"{flag} {getattr(args, name)}" for flag, name in PLAN_FLAGS.items()
             if name != "budget" and getattr(args, name, None) is not None]
    if getattr(args, "plan", None) and given:
        raise UsageError(f"--plan {args.plan} runs the saved plan as it was made (its policy, "
                         f"ZeRO stage, micro-batches, pipeline and precision): drop "
                         f"{', '.join(given)}, or re-plan with nnscaler-jax plan ... "
                         f"{' '.join(given)} --out FILE")


# ---- messages in the command line's terms --------------------------------------------------------


def _mesh_hint(m: re.Match, args: argparse.Namespace | None) -> str:
    """``jax.make_mesh((S, k), ('stage', 'data'))`` -> ``--mesh SxK --axes stage,data``, the
    last axis grown to use this run's devices where it can."""
    sizes = [int(x) for x in re.findall(r"\d+", m.group(1))]
    names = re.findall(r"'([^']*)'", m.group(2))
    mesh = getattr(args, "mesh", None) or ""
    if re.fullmatch(r"\d+(x\d+)*", mesh) and len(sizes) == 2:
        total = math.prod(int(s) for s in mesh.split("x"))
        if total % sizes[0] == 0:
            sizes[1] = total // sizes[0]
    return f"--mesh {'x'.join(map(str, sizes))} --axes {','.join(names)}"


def _size_hint(m: re.Match, args: argparse.Namespace | None) -> str:
    """``30383.58 MiB`` in a library message -> ``29.67 GiB`` (:func:`fmt_bytes`); figures under
    a GiB stay as written (their two decimals of MiB are all there is of them)."""
    mib = float(m.group(1).replace(",", ""))
    return fmt_bytes(mib * 2**20) if mib >= 1024 else m.group(0)


# Python-API advice in library messages -> the flags that do the same, and sizes in MiB -> the
# unit that fits (one table for every error and warning the command line passes on).
_CLI_TERMS: tuple[tuple[str, Any], ...] = (
    (r"jax\.make_mesh\(\(([\d, ]+)\), \(([^)]*)\)\)", _mesh_hint),
    (r"Constraints\(pipeline_stages=(\d+)\)", r"--pipeline \1"),
    (r"pipeline_stages=None", "no --pipeline"),
    (r"Constraints\(zero=(\d)\)", r"--zero \1"),
    (r"Constraints\(microbatches=(\d+)\)", r"--microbatches \1"),
    (r"Constraints\(precision='?(\w+)'?\)", r"--precision \1"),
    (r"Constraints\(schedule='?(\w+)'?\)", r"--schedule \1"),
    (r"Constraints\(pipeline_executor='?([\w-]+)'?\)", r"--executor \1"),
    (r"Constraints\(pipeline_executor=\.\.\.\)", "--executor"),
    (r"Constraints\(pipeline_overlap=True\)", "--overlap on"),
    (r"Drop pipeline_overlap", "Drop --overlap"),
    (r"Constraints\(max_memory_per_device=(\d+)\)", r"--budget \1"),
    (r"policy='(\w+)'", r"--policy \1"),
    (r"re-plan for these inputs \(policy=\.\.\. or make_plan\(\) without plan=\)",
     "re-plan for these inputs (nnscaler-jax plan ... --out FILE, or drop --plan)"),
    (r"re-plan with policy=\.\.\. or make_plan\(\)",
     "re-plan with nnscaler-jax plan ... --out FILE (or drop --plan)"),
    (r"(?m)re-plan for this mesh$",
     "re-plan for this mesh (nnscaler-jax plan --mesh ... --out FILE)"),
    (r"write it with Plan\.to_json\(\)", "write it with nnscaler-jax plan ... --out FILE"),
    (r"(?m)(the batch into micro-batches x \d+)$", r"\1 (the batch: --batch-size)"),
    (r"str\(plan\) lists them", "nnscaler-jax plan --ops lists them"),
    (r"\b([0-9][0-9,]*(?:\.[0-9]+)?) MiB\b", _size_hint),
)


def cli_terms(text: str, args: argparse.Namespace | None = None) -> str:
    """A library message with its Python-API advice said as this command line's flags, and its
    sizes in the unit that fits.

    >>> cli_terms("needs a mesh axis 'stage'. E.g. jax.make_mesh((2, 2), ('stage', 'data'))",
    ...           argparse.Namespace(mesh="2x4"))
    "needs a mesh axis 'stage'. E.g. --mesh 2x4 --axes stage,data"
    >>> cli_terms("Use policy='auto' (it searches within the budget), Constraints(zero=3)")
    'Use --policy auto (it searches within the budget), --zero 3'
    >>> cli_terms("the plan needs an estimated 30383.58 MiB per device")
    'the plan needs an estimated 29.67 GiB per device'
    """
    for pattern, repl in _CLI_TERMS:
        if callable(repl):
            text = re.sub(pattern, lambda m, r=repl: r(m, args), text)
        else:
            text = re.sub(pattern, repl, text)
    return text


def cost_dict(plan: Any) -> dict[str, Any] | None:
    import dataclasses

    return dataclasses.asdict(plan.cost) if plan.cost is not None else None


# ---- verification (shared by verify and demo) --------------------------------------------------
