"""The names signatures use for values the package holds but does not shape: pytrees, array leaves, JSON.

A pytree's structure is the user's (nested tuples, dicts, flax or equinox modules), so no
static type describes it; ``PyTree`` says which arguments are one, as optax's ``Params``
and flax's ``PyTree`` do. Everything else here is a real type mypy checks.
"""

from __future__ import annotations

from typing import Any, TypeAlias

import jax
import numpy as np

PyTree: TypeAlias = Any
"""A pytree whose structure the user chose: only ``jax.tree_util`` looks inside it."""

Leaf: TypeAlias = jax.Array | np.ndarray
"""One array leaf, on a device (``jax.Array``) or on the host (``np.ndarray``)."""

JSON: TypeAlias = dict[str, "JSON"] | list["JSON"] | str | int | float | bool | None
"""A value ``json`` reads or writes."""

JSONObject: TypeAlias = dict[str, JSON]
"""A JSON object (an index file's top level, a record's ``as_dict()``)."""

__all__ = ["JSON", "JSONObject", "Leaf", "PyTree"]
