"""Markdown summary of the zoo: parameters and training FLOPs per preset (for docs/models.md)."""

from __future__ import annotations

import models


def _human(x: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"


def markdown() -> str:
    """One markdown table over every model and preset (traces init abstractly; no allocation)."""
    lines = ["| model | preset | params | exact params | train FLOPs / unit | unit | note |",
             "|---|---|---|---|---|---|---|"]
    for name in models.names():
        for preset in models.presets(name):
            n = models.param_count(name, preset)
            f = models.flops_per_token(name, preset)
            note = models.preset_info(name, preset).note
            lines.append(f"| {name} | {preset} | {_human(n)} | {n:,} | {f:.3e} | "
                         f"{models.flops_unit(name)} | {note} |")
    return "\n".join(lines)
