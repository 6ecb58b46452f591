"""The Trainer's numeric arguments as plain Python numbers: NumPy scalars taken, strings refused by name.

A NumPy scalar (``np.float32(0.5)``, ``np.int64(4)``, what a config read with
NumPy gives) is a number to the user; the checks downstream (``isinstance(v,
int)``) and the checkpoint's JSON index are not, so each numeric argument is
made a Python ``int`` or ``float`` once, where the Trainer takes it. ``Optimizer``
says what the Trainer takes as its optimizer (an optax ``GradientTransformation``'s two functions).
"""

from __future__ import annotations

import math
import numbers
from typing import Protocol, TypeVar, cast

import numpy as np

from ...errors import VjpsplitError
from ...treetypes import PyTree

T = TypeVar("T")


class Optimizer(Protocol):
    """An optax ``GradientTransformation`` as the Trainer uses it (``optimizer_name`` checks it is one)."""

    def init(self, params: PyTree) -> PyTree:
        """The optimizer state for ``params``."""
        ...

    def update(self, updates: PyTree, state: PyTree, params: PyTree = None) -> tuple[PyTree, PyTree]:
        """The updates and the next state."""
        ...


def plain(value: T) -> T:
    """``value`` with NumPy integer and floating scalars (also in a list or tuple) as Python ints and floats.

    Typed as the value's own type: the caller's annotation says the number it means, and a NumPy scalar
    becomes that Python number here."""
    if isinstance(value, (list, tuple)):
        return cast(T, type(value)(plain(v) for v in value))
    if isinstance(value, np.bool_):
        return value  # not a number: left for the check that refuses it
    if isinstance(value, np.integer):
        return cast(T, int(value))
    if isinstance(value, np.floating):
        return cast(T, float(value))
    if isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind in "iuf":
        return cast(T, plain(value[()]))
    return value


def checked_microbatches(value: object) -> int:
    """``microbatches`` (the Trainer's, or ``evaluate``'s) as a Python int >= 1.

    Raises:
        VjpsplitError: not an int (a string, a float, a bool), or below 1.
    """
    value = plain(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise VjpsplitError(f"microbatches={value!r}: give how many microbatches to cut the batch into, an int >= 1")
    return value


def checked_clip(value: object) -> float | None:
    """``clip_global_norm`` as a positive float (or None for no clipping).

    Raises:
        VjpsplitError: not a real number (a string, a bool), or not > 0.
    """
    if value is None:
        return None
    value = plain(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise VjpsplitError(
            f"clip_global_norm={value!r} is a {type(value).__name__}; give a positive number (or None for no clipping)"
        )
    if not float(value) > 0 or math.isnan(value):
        raise VjpsplitError(f"clip_global_norm={value!r}: give a positive number (or None for no clipping)")
    return float(value)
