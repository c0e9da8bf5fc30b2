"""Stage detection: which stage holds which layer of the model's layer stack
(:mod:`nnscaler_jax.ir.layers` finds the stack, for the pipeline and the search alike).

Everything the pipeline does per layer starts from that stack: the stage DP's units
(:func:`nnscaler_jax.pipeline.units.layer_units` via ``graph_layers``), the program split
the runtime executes (:func:`nnscaler_jax.pipeline.split.split_program` via
``numbered_layers``), and which stage holds which layer (:func:`stage_of`, recorded on a
pipelined plan).

>>> from nnscaler_jax.ir.layers import variable_stack
>>> stack = variable_stack([("params/h_0/w", (4, 4)), ("params/h_1/w", (4, 4)),
...                         ("params/wte/embedding", (8, 4))])
>>> stage_of(stack, 2)
(('h_0', 0), ('h_1', 1))
"""

from __future__ import annotations

from collections.abc import Sequence

from nnscaler_jax.errors import PlanError
from nnscaler_jax.ir.layers import LayerStack, variable_stack

__all__ = ["stage_layers", "stage_of"]


def stage_of(stack: LayerStack, stages: int, virtual: int = 1) -> tuple[tuple[str, int], ...]:
    """Which stage holds which layer: ``((layer, stage), ...)``, contiguous chunks of layers.

    Chunk ``c`` holds layers ``[c L/C, (c+1) L/C)`` (``C = stages x virtual``) and runs on
    stage ``c mod stages``.

    Raises:
        PlanError: the layers do not divide into ``stages x virtual`` chunks.
    """
    names, chunks = stack.names, stages * virtual
    if len(names) % chunks:
        raise PlanError(f"pipeline_stages={stages}" + (f" x virtual {virtual}" if virtual > 1
                        else "") + f": {len(names)} layers ({names[0]}..{names[-1]}) do not "
                        f"split evenly; use a stage count dividing {len(names)}")
    per = len(names) // chunks
    return tuple((n, (i // per) % stages) for i, n in enumerate(names))


def stage_layers(variables: Sequence[tuple[str, tuple[int, ...]]], stages: int,
                 virtual: int = 1) -> tuple[tuple[str, int], ...]:
    """:func:`stage_of` the :func:`variable_stack` of ``variables``.

    Raises:
        PlanError: no layer stack, or its length does not divide into ``stages x virtual``.
    """
    try:
        stack = variable_stack(variables)
    except PlanError as e:
        raise PlanError(f"pipeline_stages={stages}: {e}. Fix: pipeline_stages=None") from None
    return stage_of(stack, stages, virtual)
