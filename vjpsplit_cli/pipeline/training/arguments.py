"""The Trainer's numeric arguments as plain Python numbers: NumPy scalars taken, strings refused by name.

A NumPy scalar (``np.float32(0.5)``, ``np.int64(4)``, what a config read with
NumPy gives) is a number to the user; the checks downstream (``isinstance(v,
int)``) and the checkpoint's JSON index are not, so each numeric argument is
made a Python ``int`` or ``float`` once, where the Trainer takes it (``files.sizes.plain``). ``Optimizer``
says what the Trainer takes as its optimizer (an optax ``GradientTransformation``'s two functions).
"""

from __future__ import annotations

import math
import numbers
from typing import Protocol

from ...errors import VjpsplitError
from ...files.sizes import plain
from ...treetypes import PyTree


class Optimizer(Protocol):
    """An optax ``GradientTransformation`` as the Trainer uses it (``optimizer_name`` checks it is one)."""

    def init(self, params: PyTree) -> PyTree:
        """The optimizer state for ``params``."""
        ...

    def update(self, updates: PyTree, state: PyTree, params: PyTree = None) -> tuple[PyTree, PyTree]:
        """The updates and the next state."""
        ...


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
