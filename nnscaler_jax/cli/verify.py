"""``nnscaler-jax verify`` and ``demo``: parallel vs single-device checks, and the quickstart job.

Split from :mod:`nnscaler_jax.cli` (argparse, shared helpers, the other subcommands).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from nnscaler_jax.cli.common import (
    UsageError,
    check_policy,
    emit,
    load_plan,
    model_spec,
    parse_mesh,
    spec_mutable,
    table,
)

__all__ = ["cmd_demo", "cmd_verify"]


def _tolerance(tree: Any) -> float:
    import jax
    import numpy as np

    from nnscaler_jax.lower.verify import RTOL

    tols = [RTOL.get(np.dtype(x.dtype).name, 1e-4) for x in jax.tree_util.tree_leaves(tree)
            if hasattr(x, "dtype") and np.issubdtype(np.dtype(x.dtype), np.floating)]
    return max(tols or [1e-4])


def _verify(spec: Any, mesh: Any, policy: str, plan: Any = None) -> dict[str, Any]:
    """Forward and gradients of the loss, parallel vs single device (both jitted), under
    ``policy`` or the saved ``plan``. A linen model is checked as ``train`` runs it: the
    training step's loss (the module and its loss planned as one graph; the "forward" figure)
    and the parameters' gradients (``SpmdStep.loss_and_grads``); an nnx model's outputs and
    gradients through the wrapper; a pipelined plan, linen or nnx, the pipeline runtime's
    loss and gradients (``PipelineStep.loss_and_grads``)."""
    import jax
    import optax

    from nnscaler_jax.api import auto_parallel
    from nnscaler_jax.capture.module_call import microbatch_rngs

    args = spec.make_args(abstract=False)
    mutable = spec_mutable(spec)
    if spec.kind == "nnx":
        from flax import nnx

        module = spec.module
        pm = auto_parallel(mesh, policy=policy if plan is None else None, plan=plan)(module)
        if pm._core.pipelined:
            return _verify_nnx_pipelined(spec, pm, args)

        def loss(m):
            return spec.loss_fn(m(*args), *args)

        ref_out = module(*args)
        ref_grad = jax.tree_util.tree_leaves(nnx.grad(loss)(module))
        out = pm(*args)
        grad = jax.tree_util.tree_leaves(nnx.grad(loss)(pm))
    else:
        variables = spec.init(jax.random.PRNGKey(0), *args)
        pm = auto_parallel(mesh, policy=policy if plan is None else None, plan=plan)(spec.module)
        step = pm.train_step(spec.loss_fn, optax.sgd(0.0),
                             rng_streams=spec.rng_streams or ("dropout",))
        key = jax.random.key(1) if spec.rng_streams else None
        out, grad = step.loss_and_grads(variables, *args, rng=key)
        piped = pm.pipelined  # (its stages' runtime, as train runs it)
        m = (step.program.schedule.microbatches * step.program.dp if piped
             else step.plan.microbatches)
        rows = lambda i: (slice(i * (len(args[0]) // m), (i + 1) * (len(args[0]) // m))
                          if piped else slice(i, None, m))

        def ref_loss(params):  # the step's micro-batches and their rng keys: SPMD rows i::m;
            total = 0.0  # pipelined, micro-batch j of data shard d the block i = j D + d
            for i in range(m):
                mb = tuple(x[rows(i)] for x in args)
                r = microbatch_rngs(key, i, spec.rng_streams) if key is not None else None
                res = spec.module.apply({**variables, "params": params}, *mb, rngs=r,
                                        mutable=mutable)
                total = total + spec.loss_fn(res[0] if mutable else res, *mb)
            return total / m

        ref_out, ref_grad = jax.jit(jax.value_and_grad(ref_loss))(variables["params"])
        return dict(_compare(out, ref_out, grad, ref_grad), plan=step.plan, forward="loss",
                    **({"runtime": type(step.program).__name__} if piped else {}))
    return dict(_compare(out, ref_out, grad, ref_grad), plan=pm.plan)


def _verify_nnx_pipelined(spec: Any, pm: Any, args: tuple) -> dict[str, Any]:
    """An nnx model's pipelined plan: the loss and gradients of the pipeline runtime
    ``train`` runs against the module's own, micro-batch ``j`` of data shard ``d`` the block
    ``i = j D + d`` of rows, its streams keyed as the step keys them (``nnx.reseed`` with
    ``microbatch_rngs(the module's first stream's key, i)``)."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from nnscaler_jax.capture.module_call import microbatch_rngs

    graphdef, params, rest = jax.tree.map(jnp.copy, nnx.split(spec.module, nnx.Param, ...))
    step = pm.train_step(spec.loss_fn, optax.sgd(0.0))
    out, grad = step.loss_and_grads(None, *args)
    prog, call = step.program, step.call
    m = prog.schedule.microbatches * prog.dp
    b = len(args[0]) // m
    key = call.default_rng if call.slots else None

    def ref_loss(p):
        total = 0.0
        for i in range(m):
            mm = nnx.merge(graphdef, p, rest, copy=True)
            if key is not None:
                rngs = microbatch_rngs(key, i, call.streams)
                tags = {s.key.tag for _, s in nnx.iter_graph(mm) if isinstance(s, nnx.RngStream)}
                nnx.reseed(mm, **{t: rngs[t] for t in tags if t in rngs})
            blk = tuple(x[i * b:(i + 1) * b] for x in args)
            total = total + spec.loss_fn(mm(*blk), *blk)
        return total / m

    ref_out, ref_grad = jax.value_and_grad(ref_loss)(params)
    return dict(_compare(out, ref_out, jax.tree_util.tree_leaves(grad),
                         jax.tree_util.tree_leaves(ref_grad)),
                plan=step.plan, forward="loss", runtime=type(prog).__name__)


def _compare(out: Any, ref_out: Any, grad: Any, ref_grad: Any) -> dict[str, Any]:
    """Relative differences of the forward outputs and the gradients, and the verdict."""
    import numpy as np

    from nnscaler_jax.lower.verify import max_rel_diff

    fwd, fwd_at = max_rel_diff(out, ref_out)
    grd, grd_at = max_rel_diff(grad, ref_grad)
    tol = _tolerance((ref_out, ref_grad))
    worst = max(fwd, grd)
    return {"ok": bool(np.isfinite(worst) and worst <= tol), "max_rel_diff": worst,
            "forward_rel_diff": fwd, "grad_rel_diff": grd, "tolerance": tol,
            "forward_worst_at": fwd_at, "grad_worst_at": grd_at}


def _verify_table(res: dict[str, Any]) -> str:
    what = "forward (loss)" if res.get("forward") == "loss" else "forward"
    rows = [[what, f"{res['forward_rel_diff']:.3e}", res["forward_worst_at"] or "-"],
            ["grad of loss", f"{res['grad_rel_diff']:.3e}", res["grad_worst_at"] or "-"]]
    verdict = "OK" if res["ok"] else "MISMATCH"
    return (table(["check", "max rel diff", "worst leaf"], rows)
            + f"\n{verdict}: max relative difference {res['max_rel_diff']:.3e} "
              f"(tolerance {res['tolerance']:g})")


# ---- subcommands ---------------------------------------------------------------------------------


def cmd_verify(args: argparse.Namespace) -> int:
    if args.plan and args.policy:
        raise UsageError(f"--plan {args.plan} runs the saved plan as it was made: drop "
                         f"--policy {args.policy}")
    saved = load_plan(args.plan) if args.plan else None
    spec = model_spec(args.model, args.preset, saved.precision if saved is not None else None)
    mesh = parse_mesh(args.mesh, args.axes)
    policy = saved.policy if saved is not None else check_policy(args.policy or "auto")
    res = _verify(spec, mesh, policy, saved)
    obj = {"ok": res["ok"], "max_rel_diff": res["max_rel_diff"],
           "forward_rel_diff": res["forward_rel_diff"], "grad_rel_diff": res["grad_rel_diff"],
           "tolerance": res["tolerance"], "mesh": args.mesh, "policy": policy,
           "plan": args.plan, "model": args.model, "preset": args.preset}
    if "runtime" in res:  # a pipelined plan: the pipeline runtime train runs, checked
        obj["runtime"] = res["runtime"]
    text = ""
    if not args.json:
        from nnscaler_jax.mesh.axes import mesh_axes
        source = f"plan {args.plan} (policy {policy})" if saved is not None else \
            f"policy {policy}"
        runs = f", pipelined ({res['runtime']})" if "runtime" in res else ""
        text = (f"{args.model} [{args.preset}] on mesh {args.mesh} {mesh_axes(mesh)}, "
                f"{source}{runs}\n" + _verify_table(res))
    emit(args, text, obj)
    return 0 if res["ok"] else 1


def cmd_demo(args: argparse.Namespace) -> int:
    import jax
    import optax
    from jax.sharding import NamedSharding, PartitionSpec

    from nnscaler_jax.api import auto_parallel
    from nnscaler_jax.mesh.axes import mesh_axes

    spec = model_spec("gpt", "tiny")
    mesh = parse_mesh(args.mesh, args.axes)
    policy = check_policy(args.policy)
    say = (lambda *a: None) if args.json else print
    say(f"GPT [tiny] on {mesh.devices.size} {jax.devices()[0].platform.upper()} devices, "
        f"mesh {mesh_axes(mesh)}, policy {policy}")

    tokens = spec.make_args(abstract=False)
    pm = auto_parallel(mesh, policy=policy)(spec.module)
    variables = pm.init({"params": jax.random.PRNGKey(0)}, *tokens)  # plans, lays out
    say("\n" + str(pm.plan) + "\n")
    opt = optax.adamw(args.lr)
    params = variables["params"]
    # Keep the plan's layouts across steps (one compilation); optimizer scalars replicated on
    # the mesh the plan laid the parameters out on.
    replicated = NamedSharding(jax.tree.leaves(params)[0].sharding.mesh, PartitionSpec())
    opt_state = opt.init(params)
    shardings = jax.tree.map(
        lambda x: x.sharding if isinstance(x.sharding, NamedSharding) else replicated,
        (params, opt_state))
    opt_state = jax.device_put(opt_state, shardings[1])

    def loss_with(apply, variables):
        return lambda p, *batch: spec.loss_fn(apply({**variables, "params": p}, *batch), *batch)

    parallel_loss = loss_with(pm.apply, variables)

    def step(params, opt_state, *batch):
        value, grads = jax.value_and_grad(parallel_loss)(params, *batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value, grads

    step = jax.jit(step, out_shardings=(*shardings, replicated, shardings[0]))

    # The single-device program on the same values: forward, and the gradient that the first
    # training step must reproduce.
    host = jax.device_get(variables)
    ref_out = spec.module.apply(host, *tokens)
    ref_grad = jax.jit(jax.grad(loss_with(spec.module.apply, host)))(host["params"], *tokens)
    out = pm.apply(variables, *tokens)

    losses = []
    res: dict[str, Any] = {}
    for i in range(args.steps):
        t0 = time.perf_counter()
        new_params, opt_state, value, grads = step(params, opt_state, *tokens)
        if i == 0:
            res = _compare(out, ref_out, grads, ref_grad)
            say(_verify_table(res) + "\n")
        params = new_params
        losses.append(float(value))
        say(f"step {i + 1:3d}  loss {losses[-1]:.4f}  ({time.perf_counter() - t0:.2f} s)")
    if not res:
        res = _compare(out, ref_out, ref_grad, ref_grad)
    fell = len(losses) >= 2 and losses[-1] < losses[0]
    ok = bool(res["ok"] and fell)
    if not res["ok"]:
        say("FAIL: the parallel program differs from the single-device program")
    elif not fell:
        say(f"FAIL: the loss did not fall over {args.steps} steps")
    else:
        say(f"OK: verified (max rel diff {res['max_rel_diff']:.2e}) and trained, loss "
            f"{losses[0]:.4f} -> {losses[-1]:.4f}")
    emit(args, "", {"ok": ok, "max_rel_diff": res["max_rel_diff"], "losses": losses,
                     "mesh": args.mesh, "policy": policy})
    return 0 if ok else 1


