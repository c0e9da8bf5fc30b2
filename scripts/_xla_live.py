"""XLA's own account of a compiled step's memory peak, for the benchmarks (CPU).

``dump_flags(dir)`` makes XLA write each ``jit_loss`` module's buffer live ranges
(``*live-range.txt``) under ``dir``; :func:`peak_kinds` reads the last one: the bytes live at the
instruction where the live set is largest, by buffer kind (the HLO instruction name without its
number: ``param``, ``transpose_copy_fusion``...). Their sum is the step's live peak, which
``compiled.memory_analysis()`` does not give: its ``temp`` is the size of one preallocated buffer
the heap simulator packs the temporaries into, which can be larger than what is ever live at once
(recomputed blocks' many short-lived buffers pack badly on XLA:CPU).
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

__all__ = ["dump_flags", "peak_kinds"]


def dump_flags(dump_dir: str) -> str:
    """XLA flags that dump the live ranges of the ``jit_loss`` modules under ``dump_dir``."""
    return f" --xla_dump_to={dump_dir} --xla_dump_hlo_module_re=jit_loss"


def peak_kinds(dump_dir: str) -> dict[str, int]:
    """Bytes live at the memory peak of the last compiled ``jit_loss`` module, by buffer kind,
    largest first (constants left out: ``memory_analysis`` does not count them either); empty
    when XLA wrote none. Clears ``dump_dir`` so that the next compile's dump starts clean."""
    files = sorted(Path(dump_dir).glob("*jit_loss*live-range.txt"),
                   key=lambda f: f.stat().st_mtime)
    kinds: Counter = Counter()
    if files:
        text = files[-1].read_text()
        at = text.find("(peak):")
        end = text.find("Stack trace breakdown", at)
        for m in re.finditer(r"^\s+([\w.\-]+)\{[^}]*\}: (\d+) bytes", text[at:end], re.MULTILINE):
            kind = re.sub(r"\.\d+$", "", m.group(1))
            if not kind.startswith("constant"):
                kinds[kind] += int(m.group(2))
    for f in Path(dump_dir).iterdir():
        if f.is_file():
            f.unlink()
    return dict(kinds.most_common())
