"""Walking jaxprs, sub-jaxprs (jit, remat, custom_vjp bodies) included."""

from __future__ import annotations

from typing import Iterator


def sub_jaxprs(eqn) -> list:
    """The jaxprs an equation carries in its params (empty for a plain primitive)."""
    return [
        item
        for v in eqn.params.values()
        for item in (v if isinstance(v, (tuple, list)) else (v,))
        if hasattr(item, "eqns") or hasattr(getattr(item, "jaxpr", None), "eqns")
    ]


def iter_eqns(jaxpr) -> Iterator:
    """Every equation of ``jaxpr`` (Jaxpr or ClosedJaxpr) and of every jaxpr nested in it."""
    stack = [jaxpr]
    while stack:
        j = stack.pop()
        for eqn in getattr(getattr(j, "jaxpr", j), "eqns", ()):
            yield eqn
            stack.extend(sub_jaxprs(eqn))
