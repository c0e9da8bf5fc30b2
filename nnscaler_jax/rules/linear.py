"""Primitives linear in their partial-sum inputs: which of an op's inputs may be value-split.

``all``: every non-constant input is partial on the same axes (sums commute with the op);
``one``: exactly one input is partial (``mul``, ``dot_general``: bilinear); ``first``: only the
first (``div`` by a replicated divisor). Value-split chains (``op_trans(op, "+")`` and
``keep_partial``) may only run through these ops.

>>> VALUE_SPLIT_LINEAR["dot_general"]
'one'
"""

from __future__ import annotations

__all__ = ["VALUE_SPLIT_LINEAR"]

VALUE_SPLIT_LINEAR = {
    "add": "all", "sub": "all", "add_any": "all", "neg": "all", "convert_element_type": "all",
    "reshape": "all", "transpose": "all", "broadcast_in_dim": "all", "reduce_sum": "all",
    "copy": "all", "copy_p": "all", "squeeze": "all", "expand_dims": "all",
    "mul": "one", "dot_general": "one", "div": "first",
}
