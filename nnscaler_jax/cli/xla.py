"""``--xla``: each plan's training step compiled by XLA's GPU compiler for the cluster's GPU
(compile-only devices, :mod:`nnscaler_jax.train.xla_gpu`), its figures beside the estimate.

The step is the one ``train`` runs: ``pm.train_step(spec.loss_fn, optax.adamw(...))`` (forward,
backward, Adam's update, the state donated) on the plan, at the plan's precision, compiled over a
mesh of compile-only GPUs of the cluster shaped as the plan's mesh. The JSON entry::

    {"peak_bytes", "fits", "xla_remat", "involuntary_remat",
     "collectives": {kind: {count, bytes, plan_bytes, priced_bytes}}, "compile_s", "device",
     "device_memory_bytes", "argument_bytes", "output_bytes", "temp_bytes", "alias_bytes",
     "notes", "over_estimate"}

``over_estimate``: XLA's peak / the plan's ``memory_bytes_per_device``. Per kind of
collective, ``plan_bytes`` is XLA's in the convention of the plan's ``comm_bytes`` (all-reduce /
all-gather result bytes, reduce-scatter / all-to-all group x result bytes) and
``priced_bytes`` what the plan priced of that kind (``PlanCost.comm_kinds``; None where the
plan's cost has no breakdown). A plan that the estimate says fits and XLA's peak does not (or
that XLA had to rematerialize) says so in ``notes`` and in the command's table. A pipelined
plan whose stages run one program each (``executor`` ``'per-stage'``: tensor-parallel cut
stages, or others the stage DP runs so) is compiled per stage
(:func:`~nnscaler_jax.train.xla_gpu.check_stages`: ``stages``, each with its programs;
``peak_bytes`` the largest stage's); one whose stages run as one program says so (``error``).
"""

from __future__ import annotations

from typing import Any

from nnscaler_jax.cli.common import UsageError, abstract_inputs, fmt_bytes

__all__ = ["XLA_HELP", "add_priced", "check_cluster", "xla_entry", "xla_text"]

XLA_HELP = ("compile each plan's training step (forward, backward, Adam, donated state) with "
            "XLA's GPU compiler for the --cluster GPU on compile-only devices (no GPU needed; "
            "the xla-gpu extra) and report XLA's peak memory, its own rematerialization, "
            "involuntary full rematerializations and collectives beside the estimate")


def check_cluster(args: Any) -> None:
    """``--xla`` needs a GPU ``--cluster``."""
    if getattr(args, "xla", False) and not getattr(args, "cluster", None):
        raise UsageError("--xla compiles for a GPU: name it with --cluster (e.g. v100-32g-8x, "
                         "a100-80g-8x, h100-80g-8x, h200-8x)")


def xla_entry(spec: Any, plan: Any, cluster: Any, axes: dict[str, int],
              traffic_min_bytes: int | None = None) -> dict[str, Any]:
    """The ``xla`` JSON entry of ``plan`` (made for ``spec``'s model on a mesh ``axes``)
    compiled for ``cluster``'s GPU; ``{"error": ...}`` when it cannot be compiled here.
    ``traffic_min_bytes``: with ``traffic``, the bytes of buffers of at least that size its
    kernels move (:func:`~nnscaler_jax.lower.hlo.hlo_traffic`)."""
    import jax
    import optax

    from nnscaler_jax.api import auto_parallel
    from nnscaler_jax.cost.devices import compile_only_mesh
    from nnscaler_jax.errors import PlanError
    from nnscaler_jax.train.xla_gpu import check_stages, check_step

    if spec.kind != "linen":
        return {"error": "--xla compiles linen models' steps (an nnx module holds its arrays)"}
    try:
        mesh = compile_only_mesh(cluster, tuple(axes.values()), tuple(axes))
        pm = auto_parallel(mesh, plan=plan)(spec.module)
        step = pm.train_step(spec.loss_fn, optax.adamw(1e-4),
                             rng_streams=spec.rng_streams or ("dropout",))
        args, variables = abstract_inputs(spec)
        rng = jax.random.key(0) if spec.rng_streams else None
        if plan.pipeline is not None:  # one program per stage (executor 'per-stage')
            return _stages_entry(check_stages(step, variables, args, rng=rng), plan)
        check = check_step(step, variables, args, rng=rng, traffic_min_bytes=traffic_min_bytes)
    except PlanError as e:
        return {"error": str(e).splitlines()[0]}
    except jax.errors.JaxRuntimeError as e:  # the compiler's own failure, said in one line
        return {"error": f"XLA:GPU could not compile the step: {str(e).splitlines()[0][:300]}"}
    out = check.to_json()
    add_priced(out["collectives"], plan)
    est = plan.cost.memory_bytes_per_device if plan.cost is not None else None
    out["over_estimate"] = (check.peak_bytes / est) if est else None
    if not check.fits:
        out["notes"].append(f"does not fit by XLA:GPU: peak {fmt_bytes(check.peak_bytes)} "
                            f"over the device's {fmt_bytes(check.device_memory_bytes)}")
    return out


def add_priced(collectives: dict[str, dict[str, int]], plan: Any) -> None:
    """``priced_bytes`` in ``collectives`` (XLA's, by kind): what the plan's cost prices of
    each kind, in the same convention as ``plan_bytes`` (a kind only one side has gets a zero
    on the other)."""
    priced = dict(plan.cost.comm_kinds) if plan.cost is not None and plan.cost.comm_kinds \
        else None
    for kind in priced or ():
        collectives.setdefault(kind, {"count": 0, "bytes": 0, "plan_bytes": 0})
    for kind, e in collectives.items():
        e["priced_bytes"] = None if priced is None else priced.get(kind, 0)


def _stages_entry(got: dict[str, Any], plan: Any) -> dict[str, Any]:
    """The ``xla`` entry of a pipelined plan from :func:`~nnscaler_jax.train.xla_gpu.
    check_stages`: its figures with ``over_estimate`` and ``notes``."""
    est = plan.cost.memory_bytes_per_device if plan.cost is not None else None
    notes = [f"stage {s['stage']} does not fit by XLA:GPU: {fmt_bytes(s['peak_bytes'])} over "
             f"the device's {fmt_bytes(got['device_memory_bytes'])}"
             for s in got["stages"] if not s["fits"]]
    return {**got, "over_estimate": got["peak_bytes"] / est if est else None,
            "notes": [*notes, ("per stage: its programs compiled apart (check_stages), "
                               "with the chunk inputs held for the backwards")]}


def xla_text(entry: dict[str, Any] | None) -> tuple[str, str]:
    """``(peak, ratio)`` cells of the table (``'-'`` without; ``'NO FIT'`` / ``'remat'`` marks)."""
    if not entry:
        return "-", "-"
    if "error" in entry:
        return "n/a", "-"
    peak = fmt_bytes(entry["peak_bytes"])
    if not entry["fits"]:
        peak += " NO FIT"
    elif entry["xla_remat"]:
        peak += " remat"
    if entry["involuntary_remat"]:
        peak += f" invol {entry['involuntary_remat']}"
    ratio = "-" if entry.get("over_estimate") is None else f"{entry['over_estimate']:.2f}"
    return peak, ratio
