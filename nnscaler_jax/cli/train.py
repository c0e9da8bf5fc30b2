"""``nnscaler-jax train``: train a zoo model on its synthetic data under an automatic plan.

``pm = auto_parallel(mesh, Constraints(zero=, microbatches=, precision=, pipeline_stages=),
policy=)(module)``, ``step = pm.train_step(loss_fn, optax.adamw(lr))``, then steps up to
``--steps``. Step ``i``'s batch (0-based, counted from the first run) is ``make_args(rng=
fold_in(data_key, i))``, ``data_key`` drawn from ``--seed``: a resumed run sees the batches of
an uninterrupted one. ``--checkpoint-dir D`` saves the state (params, optimizer state, step,
dropout key), the plan JSON and ``meta`` (model, preset, seed, every loss so far) every
``--every`` steps in the background and after the last; ``--resume`` reads the newest onto this
run's mesh and plan (any ``--mesh``) and goes on from its step. ``--processes K``: K local
processes of ``mesh size / K`` CPU devices (``launch_local``); only process 0 prints.

``--json`` prints one object on the last line: ``losses`` (one per step this run made, in order),
``start_step`` (0, or the restored step), ``steps`` (the step it ended at), ``step_time_s`` (median
of the steps after the first; null with fewer than two), ``first_step_s`` (with compilation),
``predicted_step_s`` (the plan's ``cost.step_time_s``), ``unit``, ``units_per_step``,
``units_per_s`` and ``tokens_per_s`` or ``samples_per_s``, ``flops_per_step``
(``models.flops_per_token`` x units), ``mfu`` (null where no peak FLOP/s of the device is known, as
on CPU; ``mfu_basis``: which peak), ``memory`` (``{"measured", "predicted"}`` per-device bytes of
params / grads / optimizer, predicted ``peak``; ``device_peak``: the allocator's peak, null on
CPU), ``plan`` (policy, zero, microbatches, precision, stages, recompute, cosharded) and
``checkpoint`` (``{"dir", "last_saved_step", "resumed_from"}`` or null). User errors (unknown
model, bad mesh, ``--resume`` without a checkpoint, another model's checkpoint): one line, exit 2.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import re
import statistics
import sys
import time
from typing import Any

from nnscaler_jax.cli.common import (
    UsageError,
    check_policy,
    device_peak,
    emit,
    mib,
    model_spec,
    parse_mesh,
)
from nnscaler_jax.cli.compare import plan_features
from nnscaler_jax.mesh.axes import data_axes, mesh_axes

__all__ = ["add_train_parser", "child_argv", "cmd_train"]


def add_train_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    """The ``train`` subparser (``parents``: the common, model and mesh options)."""
    t = sub.add_parser("train", parents=parents, help="train a zoo model on synthetic data "
                       "under a plan (checkpoints, resume, several processes)")
    t.add_argument("--steps", type=int, default=10, help="train up to this step (default 10)")
    t.add_argument("--policy", default="auto", help="dp, zero3, megatron, alpa or auto (default)")
    t.add_argument("--batch-size", type=int, help="global batch size (default: the preset's)")
    t.add_argument("--lr", type=float, default=1e-3, help="adamw learning rate (default 1e-3)")
    t.add_argument("--seed", type=int, default=0, help="seed of the init and of every batch")
    t.add_argument("--zero", type=int, choices=(0, 1, 2, 3),
                   help="ZeRO stage over the data axes: optimizer state 1, grads 2, params 3")
    t.add_argument("--microbatches", type=int, help="gradient accumulation: micro-batches")
    t.add_argument("--precision", help="compute precision: bfloat16, float16 or float32 "
                   "(float32 master weights; default: the model's dtypes)")
    t.add_argument("--pipeline", type=int, default=0, metavar="S", help="S pipeline stages "
                   "along the mesh's 'stage' axis (e.g. --mesh 2x4 --axes stage,data)")
    t.add_argument("--checkpoint-dir", metavar="D",
                   help="save the training state here (orbax, in the background)")
    t.add_argument("--every", type=int, default=1, help="save every K steps (default 1)")
    t.add_argument("--keep", type=int, default=3, help="checkpoints to keep (default 3)")
    t.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint in --checkpoint-dir (any mesh)")
    t.add_argument("--processes", type=int, default=1, metavar="K",
                   help="run as K local processes of (mesh size / K) CPU devices each")
    t.set_defaults(fn=cmd_train)


_NOT_PASSED = ("command", "fn", "processes", "devices")


def child_argv(args: argparse.Namespace) -> list[str]:
    """The ``train`` arguments of ``args`` without ``--processes`` and ``--devices`` (each child
    gets its device count from the launcher's ``XLA_FLAGS``).

    >>> child_argv(argparse.Namespace(command="train", model="gpt", steps=6, lr=0.01, seed=None,
    ...                               resume=True, json=False, processes=2, devices=None))
    ['train', '--model', 'gpt', '--steps', '6', '--lr', '0.01', '--resume']
    """
    out = ["train"]
    for name, value in vars(args).items():
        flag = "--" + name.replace("_", "-")
        if name in _NOT_PASSED or value is None or value is False:
            continue
        out += [flag] if value is True else [flag, repr(value) if isinstance(value, float)
                                             else str(value)]
    return out


def _mesh_size(text: str) -> int:
    if not re.fullmatch(r"\d+(x\d+)*", text or ""):
        raise UsageError(f"bad mesh {text!r}: write axis sizes joined by 'x', e.g. 8, 2x4, 2x2x2")
    return math.prod(int(s) for s in text.split("x"))


def _check(args: argparse.Namespace) -> None:
    for name, low in (("steps", 0), ("every", 1), ("processes", 1), ("keep", 1),
                      ("batch_size", 1)):
        if getattr(args, name) is not None and getattr(args, name) < low:
            raise UsageError(f"--{name.replace('_', '-')} {getattr(args, name)} must be at "
                             f"least {low}")
    if args.resume and not args.checkpoint_dir:
        raise UsageError("--resume needs --checkpoint-dir D (the directory that holds the "
                         "checkpoints)")
    size, k = _mesh_size(args.mesh), args.processes
    if k > 1 and (size % k or args.devices not in (None, size)):
        raise UsageError(f"--processes {k} runs the mesh {args.mesh}'s {size} devices as {k} "
                         "processes of size / K devices each: K must divide the size (and "
                         "--devices, if given, equal it)")


def _launch(args: argparse.Namespace) -> int:
    """``--processes K``: this command without it as K local processes; process 0 prints."""
    from nnscaler_jax.train.distributed import launch_local

    model_spec(args.model, args.preset)  # a usage error here, not K times in the children
    check_policy(args.policy)
    per = _mesh_size(args.mesh) // args.processes
    argv = [sys.executable, "-m", "nnscaler_jax", *child_argv(args)]
    return launch_local(argv, args.processes, devices_per_process=per)


def cmd_train(args: argparse.Namespace) -> int:
    """Run ``train`` (the launcher with ``--processes K > 1``, else one process of a job)."""
    from nnscaler_jax.errors import CheckpointError

    _check(args)
    if args.processes > 1:
        return _launch(args)
    from nnscaler_jax.train.distributed import initialize

    try:
        initialize()  # before anything touches the devices; a no-op for one process
    except ValueError as e:
        raise UsageError(str(e)) from None
    try:
        return _run(args)
    except CheckpointError as e:
        raise UsageError(str(e)) from None


@dataclasses.dataclass
class _Job:
    """What one run needs: the spec, the mesh, the wrapper, its step and the data key."""

    args: argparse.Namespace
    spec: Any
    mesh: Any
    pm: Any
    step: Any
    policy: str
    data_key: Any
    init_key: Any
    lead: bool  # process 0: the one that prints


def _constraints(args: argparse.Namespace) -> Any:
    from nnscaler_jax.constraints import Constraints
    from nnscaler_jax.errors import PlanError

    try:
        return Constraints(zero=args.zero, microbatches=args.microbatches,
                           precision=args.precision, pipeline_stages=args.pipeline or None)
    except PlanError as e:
        raise UsageError(str(e).splitlines()[0]) from None


def _job(args: argparse.Namespace) -> _Job:
    import jax
    import optax

    from nnscaler_jax.api import auto_parallel

    over = {} if args.batch_size is None else {"batch_size": args.batch_size}
    constraints = _constraints(args)
    spec = model_spec(args.model, args.preset, constraints.precision, **over)
    mesh = parse_mesh(args.mesh, args.axes)
    policy = check_policy(args.policy)
    pm = auto_parallel(mesh, constraints, policy=policy)(spec.module)
    step = pm.train_step(spec.loss_fn, optax.adamw(args.lr),
                         rng_streams=spec.rng_streams or ("dropout",))
    init_key, data_key = jax.random.split(jax.random.key(args.seed))
    return _Job(args, spec, mesh, pm, step, policy, data_key, init_key,
                jax.process_index() == 0)


def _host_batch(job: _Job, i: int) -> tuple[Any, ...]:
    """Step ``i``'s batch as numpy arrays, the same on every process."""
    import jax
    import numpy as np

    args = job.spec.make_args(abstract=False, rng=jax.random.fold_in(job.data_key, i))
    return tuple(np.asarray(x) for x in args)


def _batch(job: _Job, i: int) -> tuple[Any, ...]:
    """Step ``i``'s batch as global arrays over the mesh (the same numbers on every process),
    the batch dim split over the mesh's data axes where they divide it."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    # the mesh the step runs on (set by its init): a pipelined step takes no batch of another
    program = getattr(job.step, "program", None)
    mesh = getattr(program, "mesh", None) or getattr(job.step, "mesh", None) or job.mesh
    sizes = mesh_axes(mesh)
    dp = tuple(data_axes(sizes))
    ways = math.prod(sizes[a] for a in dp)
    out = []
    for value in _host_batch(job, i):
        split = program is None and bool(dp) and value.ndim and value.shape[0] % ways == 0
        spec = P(dp if len(dp) > 1 else dp[0]) if split else P()
        out.append(jax.make_array_from_callback(value.shape, NamedSharding(mesh, spec),
                                                lambda index, v=value: v[index]))
    return tuple(out)


def _init_state(job: _Job, batch: tuple[Any, ...]) -> Any:
    """The freshly initialised training state (laid out by the plan)."""
    import jax

    streams = job.spec.rng_streams
    keys = jax.random.split(job.init_key, 2 + len(streams))
    rngs = {"params": keys[0], **{s: keys[2 + j] for j, s in enumerate(streams)}}
    if job.spec.kind == "nnx":  # the module holds its own state (the zoo's nnx.Rngs)
        return job.step.init(None, *(_host_batch(job, 0) if job.args.pipeline else batch))
    if job.args.pipeline:
        host = _host_batch(job, 0)
        return job.step.init(job.spec.init(keys[0], *host), *host,
                             rng=keys[1] if streams else None)
    variables = job.pm.init(rngs, *batch)
    return job.step.init(variables, *batch, rng=keys[1] if streams else None)


def _resume(job: _Job, ckpt: Any, state: Any) -> tuple[Any, int, list[float]]:
    """``state`` replaced by the newest checkpoint, read onto ``state``'s shardings:
    (state, its step, the losses it recorded)."""
    import jax

    restored, info = ckpt.restore(target=jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state))
    meta, a = info.meta, job.args
    for key, mine in (("model", a.model), ("preset", a.preset), ("seed", a.seed)):
        if job.lead and meta.get(key, mine) != mine:  # the arrays fit: a warning, not an error
            print(f"nnscaler-jax train: warning: the checkpoint's run had --{key} "
                  f"{meta[key]}, this one {mine}", file=sys.stderr)
    return restored, info.step, [float(v) for v in meta.get("losses", [])]


@dataclasses.dataclass
class _Rates:
    """How a step's seconds read: units per step (tokens or samples), FLOPs, peak, prediction."""

    unit: str
    units_per_step: int
    flops_per_step: float
    peak: float | None  # per device, FLOP/s; None where unknown (CPU)
    basis: str
    devices: int
    predicted_s: float | None

    def per_s(self, seconds: float | None) -> float | None:
        return None if not seconds else self.units_per_step / seconds

    def mfu(self, seconds: float | None) -> float | None:
        ok = seconds and self.peak
        return self.flops_per_step / (seconds * self.devices * self.peak) if ok else None

    def words(self, seconds: float) -> str:
        """``loss``-free part of a step's line: time vs prediction, throughput, MFU."""
        pred = "?" if self.predicted_s is None else f"{self.predicted_s * 1e3:.3g} ms"
        mfu = self.mfu(seconds)
        return (f"{seconds * 1e3:8.1f} ms (predicted {pred})  "
                f"{self.per_s(seconds):,.0f} {self.unit}s/s  "
                f"MFU {'n/a' if mfu is None else f'{mfu:.1%}'}")


def _rates(job: _Job, batch: tuple[Any, ...]) -> _Rates:
    import jax
    import numpy as np

    import models
    from nnscaler_jax.cost.devices import device_for_kind

    unit = models.flops_unit(job.args.model)
    shape = batch[0].shape  # tokens: batch x sequence; else the batch's samples
    units = int(shape[0] * shape[1]) if unit == "token" and len(shape) >= 2 else int(shape[0])
    flops = models.flops_per_token(job.args.model, job.args.preset) * units
    kind = jax.devices()[0].device_kind
    device = device_for_kind(kind)
    plan = _plan(job)
    model_dtype = np.dtype(getattr(job.spec.config, "dtype", "float32")).name
    dtype = getattr(plan, "precision", None) or model_dtype
    if device is None:
        peak, basis = None, f"no peak FLOP/s known for device kind {kind!r}"
    else:
        peak = device.peak(dtype, matmul=True)
        basis = f"{device.name} peak {peak / 1e12:.1f} TFLOP/s per device ({dtype} matmul)"
    cost = getattr(plan, "cost", None)  # the plan of the whole batch: the whole step
    predicted = None if cost is None else cost.step_time_s
    return _Rates(unit, units, flops, peak, basis, job.mesh.devices.size, predicted)


def _plan(job: _Job) -> Any:
    from nnscaler_jax.errors import PlanError

    try:  # the step's plan; a pipelined step's is the wrapper's
        return job.step.plan if hasattr(type(job.step), "plan") else job.pm.plan
    except PlanError:
        return None


class _Progress:
    """A rich bar when a person watches (a tty, no ``--json``), and one line per step in the
    human mode; silent with ``--json`` and on every process but the first."""

    def __init__(self, job: _Job, rates: _Rates, start: int) -> None:
        self.rates, self.total = rates, job.args.steps
        self.quiet = job.args.json or not job.lead
        self.bar = None
        if not self.quiet and sys.stdout.isatty() and start < self.total:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            self.bar = Progress(TextColumn("[bold]train"), BarColumn(bar_width=24),
                                MofNCompleteColumn(),
                                TextColumn("{task.fields[info]}"))
            self.task = self.bar.add_task("train", total=self.total, completed=start, info="")

    def step(self, i: int, loss: float, seconds: float, *, first: bool, saved: bool) -> None:
        if self.quiet:
            return
        line = (f"step {i:{len(str(self.total))}d}/{self.total}  loss {loss:.4f}  "
                f"{self.rates.words(seconds)}{'  (compiling)' if first else ''}"
                f"{'  [checkpoint]' if saved else ''}")
        if self.bar is None:
            print(line, flush=True)
            return
        mfu = self.rates.mfu(seconds)
        self.bar.update(self.task, completed=i, refresh=True, info=f"loss {loss:.4f} "
                        f"{self.rates.per_s(seconds):,.0f} {self.rates.unit}s/s"
                        + ("" if mfu is None else f" MFU {mfu:.1%}"))
        self.bar.console.print(line, highlight=False, soft_wrap=True)  # above the bar


def _meta(job: _Job, losses: list[float]) -> dict[str, Any]:
    a = job.args
    return {"model": a.model, "preset": a.preset, "seed": a.seed, "mesh": a.mesh,
            "policy": job.policy, "batch_size": a.batch_size, "lr": a.lr, "losses": losses}


def _loop(job: _Job, state: Any, start: int, ckpt: Any, prior: list[float],
          progress: _Progress) -> tuple[Any, list[float], list[float]]:
    """Steps ``start + 1 .. --steps``: (state, their losses, their seconds)."""
    plan = _plan(job)
    plan_json = plan.to_json() if plan is not None else None
    losses, times = [], []
    saved = None
    for i in range(start, job.args.steps):
        batch = _batch(job, i)
        t0 = time.perf_counter()
        state, metrics = job.step(state, *batch)
        loss = float(metrics["loss"])  # waits for the step
        times.append(time.perf_counter() - t0)
        losses.append(loss)
        did = ckpt is not None and ckpt.maybe_save(i + 1, state, plan_json=plan_json,
                                                   meta=_meta(job, prior + losses))
        saved = i + 1 if did else saved
        progress.step(i + 1, loss, times[-1], first=i == start, saved=did)
    if ckpt is not None and losses and saved != job.args.steps:  # the last step, always
        ckpt.save(job.args.steps, state, plan_json=plan_json, meta=_meta(job, prior + losses))
    return state, losses, times


def _checkpointer(args: argparse.Namespace) -> Any:
    """The ``--checkpoint-dir`` (None without), checked before anything compiles: one with
    steps in it needs ``--resume``, ``--resume`` needs a step in it."""
    from nnscaler_jax.train.checkpoint import Checkpointer

    if not args.checkpoint_dir:
        return None
    ckpt = Checkpointer(args.checkpoint_dir, every=args.every, keep=args.keep)
    steps = ckpt.steps()
    try:
        if args.resume:
            ckpt.info()  # raises the CheckpointError that says why there is nothing to restore
        elif steps:
            raise UsageError(f"--checkpoint-dir {args.checkpoint_dir} already holds checkpoints "
                             f"(steps {steps}); pass --resume to continue from step "
                             f"{steps[-1]}, or give a new directory")
    except Exception:
        ckpt.close()
        raise
    return ckpt


def _run(args: argparse.Namespace) -> int:
    ckpt = _checkpointer(args)
    try:
        job = _job(args)
        batch = _batch(job, 0)
        state = _init_state(job, batch)
        rates = _rates(job, batch)
        start, prior = 0, []
        if ckpt is not None and args.resume:
            state, start, prior = _resume(job, ckpt, state)
        if job.lead and not args.json:
            print(_header(job, rates, start), flush=True)
        progress = _Progress(job, rates, start)
        with progress.bar or contextlib.nullcontext():  # the rich bar shows while it runs
            state, losses, times = _loop(job, state, start, ckpt, prior, progress)
        if ckpt is not None:
            ckpt.wait()
        last = ckpt.latest_step() if ckpt is not None else None
    finally:
        if ckpt is not None:
            ckpt.close()
    obj = _summary(job, rates, state, start, losses, times, last)
    if job.lead:
        emit(args, "" if args.json else _summary_text(obj, rates), obj)
    return 0


def _header(job: _Job, rates: _Rates, start: int) -> str:
    a = job.args
    axes = mesh_axes(job.mesh)
    plan = _plan(job)
    first = f"resuming at step {start}" if start else "from step 0"
    estimate = str(plan).splitlines()[-1] if plan is not None else "estimate: none"
    return (f"train {a.model} [{a.preset}] on mesh {axes} ({job.mesh.devices.size} "
            f"{job.mesh.devices.flat[0].platform.upper()} devices), policy {job.policy}, "
            f"{first} to {a.steps}\nplan {estimate}\n"
            f"{rates.units_per_step:,} {rates.unit}s per step, "
            f"{rates.flops_per_step:.3g} FLOPs per step; MFU basis: {rates.basis}")


def _summary(job: _Job, rates: _Rates, state: Any, start: int, losses: list[float],
             times: list[float], last: int | None) -> dict[str, Any]:
    import jax

    a = job.args
    plan = _plan(job)
    step_s = statistics.median(times[1:]) if len(times) > 1 else None
    per_s = rates.per_s(step_s)
    features = dict(plan_features(plan)) if plan is not None else {}
    memory = None  # per-device bytes: from the state's arrays, and the plan's estimate
    if hasattr(job.step, "predicted_memory"):  # the pipelined step has neither yet
        memory = {"measured": {k: int(v) for k, v in job.step.memory(state).items()},
                  "predicted": {k: int(v) for k, v in job.step.predicted_memory().items()},
                  "device_peak": device_peak(job.mesh)}
    features.update(policy=job.policy, zero=getattr(plan, "zero", None),
                    precision=getattr(plan, "precision", None))
    return {
        "ok": True, "model": a.model, "preset": a.preset, "mesh": a.mesh,
        "processes": jax.process_count(), "devices": job.mesh.devices.size,
        "start_step": start, "steps": a.steps, "losses": losses,
        "step_time_s": step_s, "first_step_s": times[0] if times else None,
        "predicted_step_s": rates.predicted_s, "unit": rates.unit,
        "units_per_step": rates.units_per_step, "units_per_s": per_s,
        "tokens_per_s" if rates.unit == "token" else "samples_per_s": per_s,
        "flops_per_step": rates.flops_per_step, "mfu": rates.mfu(step_s),
        "peak_flops_per_device": rates.peak, "mfu_basis": rates.basis,
        "memory": memory, "plan": features,
        "checkpoint": None if not a.checkpoint_dir else {
            "dir": a.checkpoint_dir, "last_saved_step": last,
            "resumed_from": start if a.resume else None},
    }


def _summary_text(obj: dict[str, Any], rates: _Rates) -> str:
    losses, step_s, p, mem, ck = (obj[k] for k in ("losses", "step_time_s", "plan", "memory",
                                                    "checkpoint"))
    lines = [f"trained steps {obj['start_step'] + 1}..{obj['steps']}: loss {losses[0]:.4f} -> "
             f"{losses[-1]:.4f}" if losses else
             f"nothing to train: the run is at step {obj['start_step']} of {obj['steps']}"]
    if step_s is not None:
        lines.append(f"median step {rates.words(step_s).strip()} ({rates.basis})")
    if mem is not None:
        lines.append("memory per device, measured / predicted: " + ", ".join(
            f"{k} {mib(v)} / {mib(mem['predicted'].get(k, 0))}"
            for k, v in mem["measured"].items()))
        if (peak := mem.get("device_peak")) is not None:
            lines.append(f"allocator peak {mib(peak)} / predicted {mib(mem['predicted']['peak'])}")
    lines.append(f"plan: policy {p['policy']}, zero {p['zero']}, {p.get('microbatches', 1)} "
                 f"micro-batch(es), precision {p['precision'] or 'of the model'}, "
                 f"{p.get('stages', 1)} stage(s)")
    if ck is not None:
        lines.append(f"checkpoint: {ck['dir']} (last saved step {ck['last_saved_step']})")
    return "\n".join(lines)
