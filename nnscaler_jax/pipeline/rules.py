"""Recompute rules in a pipelined step: per layer, recomputed once more inside its chunk or not.

Every pipelined chunk runs its forward again in its backward, from its saved input. Inside that
backward a layer may also be recomputed on its own (``jax.checkpoint``: its activations are not
kept while the rest of the chunk's backward runs, at one more forward of the layer):
``PipelineSettings.recompute='layer'`` does so for every layer when the budget needs it.
``Rule(module=glob, recompute=True)`` asks it for the layers the glob selects whatever the
budget, ``recompute=False`` forbids it for them. The layers are the modules a chunk may start at
(cut programs) or the stack's layers; a rule selects whole layers (a glob matching a layer's path
or a module above it), and one that also selects ops outside them is a ``PlanError``.

>>> from nnscaler_jax.constraints import Rule
>>> layer_flags(["enc_0", "enc_1", "dec_0"], ["embed", "enc_0/mlp", "enc_1/mlp", "dec_0/attn"],
...             [Rule(module="enc_*", recompute=True), Rule(module="dec_0", recompute=False)])
{'enc_0': True, 'enc_1': True, 'dec_0': False}
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from nnscaler_jax.constraints import Rule
from nnscaler_jax.errors import PlanError
from nnscaler_jax.ir.remat import in_group

__all__ = ["layer_flags", "stack_modes"]


def layer_flags(layers: Sequence[str], paths: Iterable[str],
                rules: Sequence[Rule]) -> dict[str, bool]:
    """Per layer a recompute rule selects (``layers``: their module paths; ``paths``: every op's
    module path): True (recomputed on its own inside its chunk's backward), False (never).

    Raises:
        PlanError: a rule selecting part of a layer or ops outside the layers, or two rules
            disagreeing on a layer.
    """
    paths = list(dict.fromkeys(paths))
    flags: dict[str, bool] = {}
    for rule in rules:
        if rule.recompute is None:
            continue
        glob = rule.module or "*"
        if rule.recompute == "selective":
            raise PlanError(
                f"pipeline: {rule}: a pipelined step recomputes whole layers inside their "
                "chunks; selective recompute (matmul outputs kept) is planned for SPMD plans "
                "only. Use recompute=True, or plan without pipeline stages")
        hit = [name for name in layers if in_group(name, glob)]
        stray = next((p for p in paths if in_group(p, glob)
                      and not any(in_group(p, name) for name in hit)), None)
        if stray is not None:
            shown = ", ".join(list(layers)[:4]) + (", ..." if len(layers) > 4 else "")
            holder = next((name for name in layers if in_group(stray, name)), None)
            fix = (f"Rule(module='{holder}*', recompute={rule.recompute}) for the layer that "
                   "holds it" if holder is not None else "a glob selecting whole layers (or a "
                   "module above them)")
            raise PlanError(
                f"pipeline: {rule} selects '{stray}', which is not a whole layer: a pipelined "
                f"step recomputes whole layers inside their chunk (its layers: {shown}). Use "
                f"{fix}, or plan without pipeline stages to recompute part of a layer")
        for name in hit:
            if flags.setdefault(name, rule.recompute) != rule.recompute:
                raise PlanError(f"pipeline: recompute rules disagree on layer '{name}' ({rule} "
                                "and another); keep one")
    return flags


def stack_modes(layers: Sequence[str], paths: Iterable[str],
                rules: Sequence[Rule]) -> tuple[str, ...]:
    """The ``PipelineSettings.recompute`` modes a stack of identical layers may run under the
    recompute ``rules``: its stages run one program, so a rule selects every layer or none
    (``layers``: the layers' paths, or a scanned stack's one path).

    Raises:
        PlanError: a rule selecting some of the layers (or see :func:`layer_flags`).
    """
    flags = layer_flags(layers, paths, rules)
    if not flags:
        return ("chunk", "layer")
    if len(flags) < len(layers) or len(set(flags.values())) > 1:
        some = sorted(flags)[:4]
        raise PlanError(
            f"pipeline: recompute rules select the layers {some} but not all {len(layers)} "
            "alike: a stack of identical layers runs one program on every stage, so a rule "
            "recomputes every layer or none. Use a glob matching every layer (such as "
            f"'{_stem(layers)}*'), or pipeline_pivots to cut the model into chunks whose "
            "layers may differ")
    return ("layer",) if next(iter(flags.values())) else ("chunk",)


def _stem(layers: Sequence[str]) -> str:
    first = layers[0] if layers else ""
    return first.rstrip("0123456789[]")
