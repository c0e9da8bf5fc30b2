"""``nnscaler-jax train``: train a zoo model on its synthetic data under an automatic plan.

``pm = auto_parallel(mesh, Constraints(zero=, microbatches=, precision=, pipeline_stages=,
schedule=, max_memory_per_device=), policy=)(module)`` (the plan ``nnscaler-jax plan`` makes with
the same options), or ``auto_parallel(mesh, plan=)`` of ``--plan FILE`` (a plan saved by ``plan
--out FILE``, run as it was made: ``--policy``, ``--zero``, ... are refused beside it), ``step =
pm.train_step(loss_fn, optax.adamw(lr))``, then steps up to
``--steps``. Step ``i``'s batch (0-based, counted from the first run) is ``make_args(rng=
fold_in(data_key, i))``, ``data_key`` drawn from ``--seed``: a resumed run sees the batches of
an uninterrupted one. ``--checkpoint-dir D`` saves the state (params, optimizer state, step,
dropout key), the plan JSON and ``meta`` (model, preset, seed, mesh, the run's settings, every
loss so far) every ``--every`` steps in the background and after the last; ``--resume`` reads
the newest onto this run's mesh and plan (any ``--mesh``) and goes on from its step, with the
checkpoint's run's plan settings, ``--plan``, ``--batch-size`` and ``--lr`` where this command
line gives none; it says on stderr which it kept and which this run changes
(:func:`resume_settings`). ``--processes K``: K local
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
``checkpoint`` (``{"dir", "last_saved_step", "resumed_from", "settings"}`` or null; ``settings``
after ``--resume``: ``{"kept": {name: value}, "changed": {name: {"checkpoint", "now"}}}``).
User errors (unknown model, bad mesh, ``--resume`` without a checkpoint, another model's
checkpoint, a ``--plan`` for another model or mesh): one line, exit 2.
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
import warnings
from typing import Any

from nnscaler_jax.cli.common import (
    PLAN_FLAGS,
    PLAN_HELP,
    UsageError,
    check_policy,
    check_saved_plan_alone,
    device_peak,
    emit,
    fmt_bytes,
    load_plan,
    model_spec,
    parse_mesh,
    plan_constraints,
    settings_spec,
)
from nnscaler_jax.cli.compare import plan_features
from nnscaler_jax.mesh.axes import data_axes, mesh_axes

__all__ = ["add_train_parser", "child_argv", "cmd_train", "resume_settings"]

DEFAULT_LR = 1e-3


def add_train_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    """The ``train`` subparser (``parents``: the common, model, mesh and plan-settings
    options)."""
    t = sub.add_parser("train", parents=parents, help="train a zoo model on synthetic data "
                       "under a plan (checkpoints, resume, several processes)")
    t.add_argument("--plan", default=None, metavar="FILE", help=PLAN_HELP)
    t.add_argument("--steps", type=int, default=10, help="train up to this step (default 10)")
    t.add_argument("--lr", type=float, default=None,
                   help=f"adamw learning rate (default {DEFAULT_LR:g})")
    t.add_argument("--seed", type=int, default=0, help="seed of the init and of every batch")
    t.add_argument("--checkpoint-dir", metavar="D",
                   help="save the training state here (orbax, in the background)")
    t.add_argument("--every", type=int, default=1, help="save every K steps (default 1)")
    t.add_argument("--keep", type=int, default=3, help="checkpoints to keep (default 3)")
    t.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint in --checkpoint-dir (any mesh), "
                        "with its run's plan settings and learning rate unless given again")
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
    check_saved_plan_alone(args)
    size, k = _mesh_size(args.mesh), args.processes
    if k > 1 and (size % k or args.devices not in (None, size)):
        raise UsageError(f"--processes {k} runs the mesh {args.mesh}'s {size} devices as {k} "
                         "processes of size / K devices each: K must divide the size (and "
                         "--devices, if given, equal it)")


def _launch(args: argparse.Namespace) -> int:
    """``--processes K``: this command without it as K local processes; process 0 prints."""
    from nnscaler_jax.train.distributed import launch_local

    model_spec(args.model, args.preset)  # a usage error here, not K times in the children
    check_policy(args.policy or "auto")
    check_saved_plan_alone(args)
    if args.plan:
        load_plan(args.plan)
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
    pipelined: bool = False  # --pipeline, or a --plan with pipeline stages
    settings: dict[str, Any] | None = None  # --resume: the settings kept and changed


def _job(args: argparse.Namespace) -> _Job:
    """The wrapper as ``plan`` makes it (the same constraints, or the ``--plan`` file), its
    training step, the mesh and the keys."""
    import jax
    import optax

    from nnscaler_jax.api import auto_parallel

    constraints = plan_constraints(args)
    saved = load_plan(args.plan) if args.plan else None
    precision = saved.precision if saved is not None else constraints.precision
    spec = settings_spec(args, precision)
    mesh = parse_mesh(args.mesh, args.axes)
    policy = saved.policy if saved is not None else check_policy(args.policy or "auto")
    if saved is not None:
        pm = auto_parallel(mesh, constraints, plan=saved)(spec.module)
    else:
        pm = auto_parallel(mesh, constraints, policy=policy)(spec.module)
    lr = DEFAULT_LR if args.lr is None else args.lr
    step = pm.train_step(spec.loss_fn, optax.adamw(lr),
                         rng_streams=spec.rng_streams or ("dropout",))
    init_key, data_key = jax.random.split(jax.random.key(args.seed))
    pipelined = saved.pipeline is not None if saved is not None else bool(args.pipeline)
    return _Job(args, spec, mesh, pm, step, policy, data_key, init_key,
                jax.process_index() == 0, pipelined)


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
    if job.spec.kind == "nnx":  # the module holds its own state (the zoo's nnx.Rngs); the
        # step's key keys its streams per micro-batch under either step: one checkpoint form
        return job.step.init(None, *(_host_batch(job, 0) if job.pipelined else batch),
                             rng=keys[1])
    if job.pipelined:
        host = _host_batch(job, 0)
        return job.step.init(job.spec.init(keys[0], *host), *host,
                             rng=keys[1] if streams else None)
    with warnings.catch_warnings():  # the step's plan (the module and its loss) runs: it
        warnings.filterwarnings("ignore", "policy .* left .* op dims replicated")  # says so
        variables = job.pm.init(rngs, *batch)
    return job.step.init(variables, *batch, rng=keys[1] if streams else None)


def _resume(job: _Job, ckpt: Any, state: Any) -> tuple[Any, int, list[float]]:
    """``state`` replaced by the newest checkpoint, read onto ``state``'s shardings:
    (state, its step, the losses it recorded)."""
    import jax

    restored, info = ckpt.restore(target=jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
        job.step.checkpoint_state(state)))
    restored = job.step.restore_state(restored)
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
    lr = DEFAULT_LR if a.lr is None else a.lr
    # "settings": what --resume keeps (the policy and lr as run; None: left to the planner)
    settings = {**_given(a), "policy": None if a.plan else job.policy, "lr": lr}
    return {"model": a.model, "preset": a.preset, "seed": a.seed, "mesh": a.mesh,
            "axes": a.axes, "policy": job.policy, "batch_size": a.batch_size, "lr": lr,
            "settings": settings, "losses": losses}


# what --resume keeps from the checkpoint's run unless given again: the plan settings, the saved
# plan file, the batch size and the learning rate
_KEPT = (*PLAN_FLAGS.values(), "plan", "batch_size", "lr")
_SHAPING = tuple(n for n in PLAN_FLAGS.values() if n != "budget")  # what --plan fixes


def _given(args: argparse.Namespace) -> dict[str, Any]:
    """The kept settings as given on this command line (None: not given)."""
    return {name: getattr(args, name, None) for name in _KEPT}


def _flag(name: str, value: Any) -> str:
    return f"--{name.replace('_', '-')} {'(not given)' if value is None else value}"


def resume_settings(args: argparse.Namespace,
                    meta: dict[str, Any]) -> tuple[argparse.Namespace, dict[str, Any]]:
    """``--resume``: ``args`` with the checkpoint's run's settings where this command line
    gives none, and what happened: ``{"kept": {flag: value}, "changed": {flag: {"checkpoint",
    "now"}}}``. A ``--plan`` given now drops the checkpoint's policy, ZeRO, ... (and any of them
    given now drops its ``--plan``): the plan is then this run's own. ``--mesh`` / ``--axes``
    are this run's (a resume may change the mesh), reported when they differ.

    >>> a = argparse.Namespace(policy=None, zero=None, microbatches=None, precision=None,
    ...     pipeline=None, schedule=None, budget=None, plan=None, batch_size=None, lr=0.01,
    ...     mesh="4x2", axes=None)
    >>> a, report = resume_settings(a, {"mesh": "2x4", "settings": {"policy": "megatron",
    ...                                                             "lr": 0.001}})
    >>> a.policy, a.lr, report["kept"], report["changed"]["lr"]
    ('megatron', 0.01, {'policy': 'megatron'}, {'checkpoint': 0.001, 'now': 0.01})
    """
    theirs = meta.get("settings")
    if not isinstance(theirs, dict):  # written before the settings were kept
        theirs = {k: meta.get(k) for k in ("policy", "batch_size", "lr")}
    mine = _given(args)
    own_plan = bool(mine["plan"])
    own_settings = any(mine[n] is not None for n in _SHAPING)
    out, kept, changed = dict(vars(args)), {}, {}
    for name in _KEPT:
        t, m = theirs.get(name), mine[name]
        if m is None and t is not None:
            if (own_plan and name in _SHAPING) or (own_settings and name == "plan"):
                changed[name] = {"checkpoint": t, "now": None}
            else:
                out[name] = kept[name] = t
        elif m is not None and m != t:
            changed[name] = {"checkpoint": t, "now": m}
    for name in ("mesh", "axes"):
        if meta.get(name, mine.get(name)) != getattr(args, name):
            changed[name] = {"checkpoint": meta.get(name), "now": getattr(args, name)}
    return argparse.Namespace(**out), {"kept": kept, "changed": changed}


def _settings_notes(report: dict[str, Any]) -> list[str]:
    """The lines that say which of the checkpoint's settings a resumed run kept and changed."""
    lines = []
    if report["kept"]:
        lines.append("resuming with the checkpoint's settings: " + ", ".join(
            _flag(k, v) for k, v in report["kept"].items()))
    if report["changed"]:
        lines.append("this run changes the checkpoint's settings: " + ", ".join(
            f"{_flag(k, c['checkpoint'])} -> {'(not given)' if c['now'] is None else c['now']}"
            for k, c in report["changed"].items()))
    return lines


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
        # (saved as the module's trees: restorable under another plan, pipelined or not)
        did = ckpt is not None and (i + 1) % ckpt.every == 0 and ckpt.save(
            i + 1, job.step.checkpoint_state(state), plan_json=plan_json,
            meta=_meta(job, prior + losses))
        saved = i + 1 if did else saved
        progress.step(i + 1, loss, times[-1], first=i == start, saved=did)
    if ckpt is not None and losses and saved != job.args.steps:  # the last step, always
        ckpt.save(job.args.steps, job.step.checkpoint_state(state), plan_json=plan_json,
                  meta=_meta(job, prior + losses))
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
        report = None
        if ckpt is not None and args.resume:
            args, report = resume_settings(args, ckpt.info().meta)
            check_saved_plan_alone(args)
        job = _job(args)
        job.settings = report
        if job.lead and report is not None:
            for line in _settings_notes(report):
                print(f"nnscaler-jax train: {line}", file=sys.stderr, flush=True)
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
    c = getattr(plan, "cost", None)
    estimate = "estimate: none" if c is None else (
        f"estimate: step {c.step_time_s * 1e3:.3f} ms, memory/device "
        f"{fmt_bytes(c.memory_bytes_per_device)}, comm {fmt_bytes(c.comm_bytes)}")
    source = f"plan {a.plan} (policy {job.policy})" if a.plan else f"policy {job.policy}"
    return (f"train {a.model} [{a.preset}] on mesh {axes} ({job.mesh.devices.size} "
            f"{job.mesh.devices.flat[0].platform.upper()} devices), {source}, "
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
    # per-device bytes: from the state's arrays, and the plan's estimate
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
            "resumed_from": start if a.resume else None,
            "settings": job.settings},
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
            f"{k} {fmt_bytes(v)} / {fmt_bytes(mem['predicted'].get(k, 0))}"
            for k, v in mem["measured"].items()))
        if (peak := mem.get("device_peak")) is not None:
            lines.append(f"allocator peak {fmt_bytes(peak)} / predicted "
                         f"{fmt_bytes(mem['predicted']['peak'])}")
    lines.append(f"plan: policy {p['policy']}, zero {p['zero']}, {p.get('microbatches', 1)} "
                 f"micro-batch(es), precision {p['precision'] or 'of the model'}, "
                 f"{p.get('stages', 1)} stage(s)")
    if ck is not None:
        lines.append(f"checkpoint: {ck['dir']} (last saved step {ck['last_saved_step']})")
    return "\n".join(lines)
