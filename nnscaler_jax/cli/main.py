"""``nnscaler-jax``: the command line (also ``python -m nnscaler_jax``). Thin: argparse + printing.

Subcommands: ``graph``, ``plan``, ``verify``, ``compare``, ``demo``, ``profile``, ``train``.
Each prints tables for a person, or with ``--json`` only one JSON object on stdout (its last
line; ``"ok"`` true or false), the tables left out (``graph --print-ir --json``: the IR, then
the JSON line). Warnings, notes and errors go to stderr.
Errors a user can cause (unknown model / preset / policy, a bad mesh, a plan that cannot be
made, a ``--plan`` file for another model or mesh) print ``nnscaler-jax CMD: error: ...`` and
exit 2 (with ``--json``: ``{"ok": false, "command", "error"}``), their advice in the command
line's flags (:func:`~nnscaler_jax.cli.common.cli_terms`); each warning prints once per run.

``plan`` and ``train`` share the options that shape a plan (``--policy``, ``--budget``,
``--zero``, ``--microbatches``, ``--precision``, ``--pipeline``, ``--schedule``,
``--attention``, ``--batch-size``): ``plan`` makes the plan ``train`` runs, and refuses what ``train`` refuses.
``plan --out FILE`` writes it; ``train``, ``verify`` and ``compare`` take it as ``--plan FILE``.

Before JAX starts its backends, :func:`main` sets ``XLA_FLAGS`` to ask for ``--devices`` virtual
CPU devices (default 8 when the flags name no device count).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from nnscaler_jax.cli.commands import cmd_graph, cmd_plan, cmd_profile
from nnscaler_jax.cli.common import (
    DEFAULT_DEVICES,
    DEFAULT_PLANNERS,
    PLAN_HELP,
    UsageError,
    add_attention_flag,
    add_plan_settings,
    backends_started,
    cli_terms,
    request_devices,
)
from nnscaler_jax.cli.compare import cmd_compare
from nnscaler_jax.cli.train import add_train_parser
from nnscaler_jax.cli.xla import XLA_HELP
from nnscaler_jax.mesh.gpu import use_cpu_platform

__all__ = ["main"]

def _lazy(name: str) -> Any:
    """A handler defined in :mod:`nnscaler_jax.cli.verify` (imported when it runs)."""
    def run(args: argparse.Namespace) -> int:
        from nnscaler_jax.cli import verify

        return getattr(verify, name)(args)
    return run


def _parents() -> tuple[argparse.ArgumentParser, ...]:
    """The options every command / model commands / mesh commands / plan makers (``plan``,
    ``train``) share."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true",
                        help="print one JSON object on the last line")
    common.add_argument("--devices", type=int, default=None,
                        help=f"virtual CPU devices to request (default {DEFAULT_DEVICES}; "
                             "only before JAX starts)")
    model = argparse.ArgumentParser(add_help=False)
    model.add_argument("--model", required=True, help="model zoo name (e.g. gpt, mlp)")
    model.add_argument("--preset", default="tiny", help="model preset (default tiny)")
    mesh = argparse.ArgumentParser(add_help=False)
    mesh.add_argument("--mesh", default="2x4", help="mesh shape, e.g. 8, 2x4 (default 2x4)")
    mesh.add_argument("--axes", default=None,
                      help="mesh axis names, comma separated (default: data | data,model | "
                           "data,fsdp,model)")
    settings = argparse.ArgumentParser(add_help=False)
    add_plan_settings(settings)
    return common, model, mesh, settings


def _parser() -> argparse.ArgumentParser:
    common, model, mesh, settings = _parents()
    p = argparse.ArgumentParser(prog="nnscaler-jax",
                                description="Automatic parallelization of JAX/Flax models.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    g = sub.add_parser("graph", parents=[common, model],
                       help="trace a model and summarise its graph")
    g.add_argument("--print-ir", action="store_true", help="print the annotated graph")
    g.add_argument("--depth", type=int, default=2, help="module path components per summary row")
    g.set_defaults(fn=cmd_graph)

    pl = sub.add_parser("plan", parents=[common, model, mesh, settings],
                        help="make and print a plan (the one train runs with the same options)")
    pl.add_argument("--out", default=None, help="write the plan JSON to this file (for --plan)")
    pl.add_argument("--ops", action="store_true",
                    help="print every op's layout (default: one row per module, repeated "
                         "layers collapsed)")
    pl.add_argument("--gantt", default=None, metavar="PNG",
                    help="write a Gantt chart PNG of the pipeline's schedule (with --pipeline)")
    pl.add_argument("--plot", default=None, metavar="PNG",
                    help="write the plan's layout map (modules x mesh axes: the dim split) PNG")
    pl.add_argument("--cluster", default=None,
                    help="plan for a cluster preset (e.g. v100-32g-8x): priced with its devices "
                         "and links, its device memory less a 10%% reserve the budget")
    pl.add_argument("--xla", action="store_true", help=XLA_HELP)
    pl.set_defaults(fn=cmd_plan)

    v = sub.add_parser("verify", parents=[common, model, mesh],
                       help="compare forward and gradients with the single-device program")
    v.add_argument("--policy", default=None, help="dp, zero3, megatron, alpa or auto (default)")
    v.add_argument("--plan", default=None, metavar="FILE", help=PLAN_HELP)
    v.set_defaults(fn=_lazy('cmd_verify'))

    c = sub.add_parser("compare", parents=[common, model, mesh],
                       help="plan with several planners and compare their cost estimates")
    c.add_argument("--planners", default=DEFAULT_PLANNERS,
                   help=f"comma separated (default {DEFAULT_PLANNERS})")
    c.add_argument("--plan", default=None, metavar="FILE",
                   help="also price a plan saved by plan --out FILE: one more row, named "
                        "'plan:FILE', under the same cluster and budget")
    c.add_argument("--cluster", default=None,
                   help="price on a cluster preset (e.g. v100-32g-8x, h100-80g-8x) instead of the "
                        "local CPU; its device memory less a 10%% reserve is the default budget")
    c.add_argument("--budget", default=None,
                   help="memory per device every planner must fit, in bytes or e.g. 32GiB "
                        "(default: the --cluster device's; none on CPU)")
    c.add_argument("--precision", default=None,
                   help="compute precision of every planner's plan: bfloat16, float16 or float32 "
                        "(params and inputs cast on entry; float32 master weights and optimizer "
                        "state); default: the model's own dtypes")
    add_attention_flag(c)
    c.add_argument("--batch-size", type=int, help="global batch size (default: the preset's; "
                   "on a mixed --cluster what groups share or micro-batches split)")
    c.add_argument("--pipelines", action="store_true",
                   help="let the searches (auto, alpa) also use the mesh's devices as pipeline "
                        "stages x data x model (the stage DP picks schedule, micro-batches and "
                        "cuts under the same budget); each entry gains 'mesh' and 'candidates'")
    c.add_argument("--xla", action="store_true", help=XLA_HELP)
    c.add_argument("--plot", default=None, metavar="PNG",
                   help="write a PNG of per-planner bars: step time, memory per device (the "
                        "budget as a line), communication")
    c.set_defaults(fn=cmd_compare)

    d = sub.add_parser("demo", parents=[common, mesh],
                       help="plan, verify and train a tiny GPT (the quickstart)")
    d.add_argument("--policy", default="megatron", help="default megatron")
    d.add_argument("--steps", type=int, default=5, help="training steps (default 5)")
    d.add_argument("--lr", type=float, default=1e-2, help="adamw learning rate (default 1e-2)")
    d.set_defaults(fn=_lazy('cmd_demo'))

    pr = sub.add_parser("profile", parents=[common, model],
                        help="time a model's ops on the local backend into a profile database")
    pr.add_argument("--out", default=None,
                    help="profile database JSON (default ~/.cache/nnscaler_jax/profile.json)")
    pr.add_argument("--runs", type=int, default=5, help="timed runs per op (median kept)")
    pr.set_defaults(fn=cmd_profile)

    add_train_parser(sub, [common, model, mesh, settings])
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (0 ok, 1 check failed, 2 usage error)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if getattr(args, "fn", None) is None:
        parser.print_help()
        return 2
    request_devices(args.devices)
    if not backends_started():
        # with no GPU driver, jax's CUDA plugin (the xla-gpu extra) would fail to start: CPU
        # devices run, and its compile-only GPUs stay available to --xla
        use_cpu_platform()

    from nnscaler_jax.errors import PlanError

    try:
        with _warnings_once(args):
            return args.fn(args)
    except (UsageError, PlanError) as e:
        kind = "error" if isinstance(e, UsageError) else "plan error"
        text = cli_terms(str(e), args)
        print(f"nnscaler-jax {args.command}: {kind}: {text}", file=sys.stderr)
        if args.json:
            print(json.dumps({"ok": False, "command": args.command, "error": text}))
        return 2


_PACKAGE = str(Path(__file__).resolve().parents[1]) + os.sep


def _from_package(frame: Any) -> bool:
    """Whether the warning being shown was raised by this package (``frame``: the caller of
    ``showwarning``; the pure-Python ``warnings`` module's own frames skipped)."""
    while frame is not None and frame.f_code.co_filename.endswith("warnings.py"):
        frame = frame.f_back
    return frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE)


@contextlib.contextmanager
def _warnings_once(args: argparse.Namespace) -> Iterator[None]:
    """Each warning once per run. The package's own (a plan's dims left replicated, ...) print
    as ``nnscaler-jax CMD: warning: ...`` in the command line's terms: the user's call is this
    command, not the frame Python would name (``<frozen runpy>``, or jax's internals when the
    plan is made while the training step is traced); others keep Python's format."""
    seen: set[tuple[type, str]] = set()
    show = warnings.showwarning

    def once(message: Any, category: type[Warning], filename: str, lineno: int,
             file: Any = None, line: str | None = None) -> None:
        key = (category, str(message))
        if key in seen:
            return
        seen.add(key)
        if _from_package(sys._getframe(1)):
            print(f"nnscaler-jax {args.command}: warning: {cli_terms(str(message), args)}",
                  file=sys.stderr)
        else:
            show(message, category, filename, lineno, file, line)

    with warnings.catch_warnings():
        warnings.showwarning = once
        yield
