"""Errors a user can cause and act on."""


class PlanError(ValueError):
    """Every planning failure a user can cause.

    Messages name what was passed (op, module path, shapes, mesh axes), which rule it broke and
    how to fix it.
    """
