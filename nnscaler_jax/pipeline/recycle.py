"""The micro-batch program of a recycling pipeline (``nf1b``, AlphaFold2's recycling).

Recycling runs the model ``R`` times without gradient, each pass on the previous pass's
outputs, then once with gradient (:func:`reference_loss` is that program on one device)::

    x = batch
    for _ in range(R):
        x = stop_gradient(module.apply(variables, *x))
    loss = loss_fn(module.apply(variables, *x), *batch)

so the module's outputs must have the structure, shapes and dtypes of its inputs (Evoformer's
``(msa, pair) -> (msa, pair)``). :func:`recycling_program` traces
``(params, x, batch) -> (loss, *outputs)`` once: the pipeline's no-grad passes read the outputs
of its last chunk, its gradient pass the loss.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from nnscaler_jax.capture.module_call import ModuleCall
from nnscaler_jax.errors import PlanError

__all__ = ["recycling_program", "reference_loss", "traced_program"]


def reference_loss(module: Any, loss_fn: Callable, recycles: int) -> Callable:
    """``loss(params, *batch)``: the recycling program on one device (what ``nf1b`` computes)."""

    def loss(params: Any, *batch: Any) -> Any:
        x = batch
        for _ in range(recycles):
            x = jax.lax.stop_gradient(module.apply({"params": params}, *x))
            x = tuple(x) if isinstance(x, (tuple, list)) else (x,)
        return loss_fn(module.apply({"params": params}, *x), *batch)

    return loss


def recycling_program(prog: Any, params: Any, batch: tuple,
                      call: ModuleCall) -> tuple[Any, list, tuple]:
    """``(closed jaxpr (params..., x..., batch..., keys...) -> (loss, *outputs), parameter
    avals, the x input variables)`` for ``prog`` (a :class:`~nnscaler_jax.pipeline.cut_program.
    CutProgram` with ``mb_size`` set): ``x`` are the module's arguments (``call``'s ``inputs``
    leading batch arrays); sets what
    :meth:`~nnscaler_jax.pipeline.program.PipelineRuntime.trace_micro` sets.

    Raises:
        PlanError: the module's outputs do not match its inputs.
    """
    abstract, mb = prog.micro_setup(params, batch, call)
    args = call.options.args(mb)
    args_tree = jax.tree.structure(args)
    n, nx, nb = len(abstract), len(jax.tree.leaves(args)), len(jax.tree.leaves(mb))
    out_tree: list[Any] = []

    def program(*leaves):
        p = jax.tree.unflatten(prog.params_tree, leaves[:n])
        x = jax.tree.unflatten(args_tree, leaves[n:n + nx])
        b = jax.tree.unflatten(prog.batch_tree, leaves[n + nx:n + nx + nb])
        out, _ = call(p, x, leaves[n + nx + nb:])
        out_tree.append(jax.tree.structure(out))
        return (prog.loss_fn(out, *b), *jax.tree.leaves(out))

    key = jax.eval_shape(lambda: jax.random.key(0))
    closed = jax.make_jaxpr(program)(*abstract, *jax.tree.leaves(args), *jax.tree.leaves(mb),
                                     *[key] * len(call.slots))
    got = [(tuple(v.aval.shape), np.dtype(v.aval.dtype).name) for v in closed.jaxpr.outvars[1:]]
    want = [(tuple(x.shape), np.dtype(x.dtype).name) for x in jax.tree.leaves(args)]
    same = out_tree[0] == args_tree or (nx == 1 and out_tree[0].num_leaves == 1)
    if got != want or not same:
        name = type(prog.module).__name__
        raise PlanError(f"nf1b recycling feeds the module's outputs back as its inputs: {name} "
                        f"returns {got} for inputs {want} (per micro-batch: shape, dtype); "
                        "return the recycled state with the inputs' structure, or use "
                        "schedule='1f1b'")
    return closed, abstract, tuple(closed.jaxpr.invars[n:n + nx])


def traced_program(prog: Any, params: Any, batch: tuple, call: ModuleCall) -> tuple[Any, list]:
    """``(closed jaxpr, parameter avals)`` of the micro-batch program ``prog``'s schedule runs
    (a program cut into chunks, ``mb_size`` set): the recycling program for a schedule with
    recycling passes (``nf1b``), its ``x`` variables ``prog.x_vars``; else
    :meth:`~nnscaler_jax.pipeline.program.PipelineRuntime.trace_micro`'s (``prog.x_vars`` empty)."""
    if prog.schedule.recycles:  # nf1b: the module's outputs are its next pass's inputs
        closed, abstract, prog.x_vars = recycling_program(prog, params, batch, call)
    else:
        closed, abstract = prog.trace_micro(params, batch, call)
        prog.x_vars = ()
    return closed, abstract
