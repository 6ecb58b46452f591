"""``stage_boundary``: the identity on a pytree, marking where one pipeline stage ends.

It is one primitive, ``stage_boundary``, whose every rule is the identity: its
jvp passes tangents straight through (so no backward ever meets it), its vmap
rule keeps the batch dims, and it lowers to nothing. ``jit``, ``grad``,
``vmap``, ``split`` and ``export`` of a function using it therefore compute
exactly what they compute without it; only ``export_stages`` reads the marks,
in the function's jaxpr.
"""

from __future__ import annotations

from typing import Sequence, TypeVar

import jax
from jax.extend import core as jcore
from jax.interpreters import ad, batching, mlir

NAME = "stage_boundary"
T = TypeVar("T")

boundary_p = jcore.Primitive(NAME)
boundary_p.multiple_results = True
boundary_p.def_impl(lambda *xs: list(xs))
boundary_p.def_abstract_eval(lambda *avals: list(avals))


def _jvp(primals: Sequence[jax.Array], tangents: Sequence[object]) -> tuple[list[jax.Array], list[object]]:
    # Tangents bypass the mark: linearised and transposed code never contains it. A tangent may be jax's
    # symbolic zero, not an array: it passes through as it came.
    return boundary_p.bind(*primals), list(tangents)


def _batch(args: Sequence[jax.Array], dims: Sequence[int | None]) -> tuple[list[jax.Array], list[int | None]]:
    return boundary_p.bind(*args), list(dims)


ad.primitive_jvps[boundary_p] = _jvp
batching.primitive_batchers[boundary_p] = _batch
mlir.register_lowering(boundary_p, lambda ctx, *xs: list(xs))


def stage_boundary(x: T) -> T:
    """Return ``x`` (any pytree) unchanged, marking the end of a pipeline stage for ``export_stages``.

    Args:
        x: The values that cross to the next stage, any pytree of arrays.

    Returns:
        ``x``, with the same structure and values.
    """
    leaves, tree = jax.tree_util.tree_flatten(x)
    if not leaves:
        return x
    return jax.tree_util.tree_unflatten(tree, boundary_p.bind(*leaves))


def is_boundary(eqn: jcore.JaxprEqn) -> bool:
    """Whether a jaxpr equation is a stage mark."""
    return eqn.primitive is boundary_p
