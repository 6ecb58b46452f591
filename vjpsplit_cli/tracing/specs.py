"""Pytrees of ``jax.ShapeDtypeStruct``: the symbolic dims they name, and the same specs at concrete sizes."""

from __future__ import annotations

from typing import Any, Mapping

import jax
import numpy as np

from ..errors import VjpsplitError
from ..files.dimtext import names, parse
from ..files.shapes import eval_dim, is_symbolic_shape


def symbolic_dim_names(specs: Any) -> list[str]:
    """The symbolic dim names in ``specs`` (pytrees of ShapeDtypeStructs), in first-seen order."""
    out: list[str] = []
    for s in jax.tree_util.tree_leaves(specs):
        for d in getattr(s, "shape", ()):
            if not isinstance(d, (int, np.integer)):
                out += [n for n in names(parse(str(d))) if n not in out]
    return out


def concrete_specs(specs: tuple[Any, ...], at: Mapping[str, int]) -> tuple[Any, ...]:
    """``specs`` with every symbolic dim replaced by its size from ``at``."""
    missing: list[str] = []

    def fix(s: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        if not is_symbolic_shape(s.shape):
            return s
        dims: list[int] = []
        for d in s.shape:
            v = eval_dim(d if isinstance(d, int) else str(d), at)
            if v is None:
                missing.append(str(d))
                v = 1
            dims.append(v)
        return jax.ShapeDtypeStruct(tuple(dims), s.dtype)

    out = tuple(jax.tree_util.tree_map(fix, s) for s in specs)
    if missing:
        raise VjpsplitError(
            f"sizes needed for symbolic dim{'s' if len(set(missing)) > 1 else ''} {', '.join(sorted(set(missing)))}; "
            f"pass --at {','.join(f'{n}=SIZE' for n in sorted(set(missing)))} (the at= argument in Python)"
        )
    return out
