"""Walking jaxprs, sub-jaxprs (jit, remat, custom_vjp bodies) included."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Union

if TYPE_CHECKING:  # no jax import at run time: callers hand in jaxprs they already made
    from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn

# An open or closed jaxpr: equations carry both kinds in their params.
AnyJaxpr = Union["Jaxpr", "ClosedJaxpr"]


def sub_jaxprs(eqn: JaxprEqn) -> list[AnyJaxpr]:
    """The jaxprs an equation carries in its params (empty for a plain primitive)."""
    return [
        item
        for v in eqn.params.values()
        for item in (v if isinstance(v, (tuple, list)) else (v,))
        if hasattr(item, "eqns") or hasattr(getattr(item, "jaxpr", None), "eqns")
    ]


def iter_eqns(jaxpr: AnyJaxpr) -> Iterator[JaxprEqn]:
    """Every equation of ``jaxpr`` (Jaxpr or ClosedJaxpr) and of every jaxpr nested in it."""
    stack: list[AnyJaxpr] = [jaxpr]
    while stack:
        j = stack.pop()
        for eqn in getattr(getattr(j, "jaxpr", j), "eqns", ()):
            yield eqn
            stack.extend(sub_jaxprs(eqn))
