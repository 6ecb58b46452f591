"""``Microbatches``: a step's microbatches given one by one, each of its own shape, with per-microbatch loss weights.

A ``Trainer`` step cuts one batch into equal microbatches. ``Microbatches([b0, b1, ...], weights=[w0, w1, ...])``
hands it the microbatches instead: each ``b_i`` a batch tuple as ``step`` takes one (the function's batch inputs),
their shapes free to differ within the stages' symbolic dims (a sequence-length bucket), and the step's loss the
weighted mean ``sum_i w_i * loss_i / sum_i w_i`` (``scales``: each microbatch's ``w_i / sum_i w_i``, the cotangent
its last stage's backward starts from). Checked here when made; each batch against the export when the step runs
(``Stages.stage_microbatches``).
"""

from __future__ import annotations

import math
import numbers
from typing import Sequence

from ...errors import VjpsplitError
from ...treetypes import PyTree


class Microbatches:
    """A step's microbatches one by one (shapes within the stages' symbolic dims), with per-microbatch loss weights.

    ``trainer.step(Microbatches([b0, b1], weights=[n0, n1]))``: the step's loss and gradients are the weighted mean
    ``sum_i w_i * loss_i / sum_i w_i``, as ``jax.value_and_grad`` of that sum gives them in one process. ``fit`` and
    ``evaluate`` take them too. ``scales`` is each weight over their sum.

    Args:
        batches: One batch tuple per microbatch, in the function's argument order (a 1-tuple for one input), as
            ``step`` takes a batch; their count is the step's microbatches (``Trainer(microbatches=)``).
        weights: One loss weight per microbatch (a token count, say), each a finite number > 0; None weighs them
            equally. Kept as floats.

    Raises:
        VjpsplitError: ``batches`` is not a non-empty list or tuple of batch tuples; ``weights`` is not one finite
            number > 0 per batch.
    """

    def __init__(self, batches: Sequence[tuple[PyTree, ...]], *, weights: Sequence[float] | None = None):
        if not isinstance(batches, (list, tuple)) or not batches:
            raise VjpsplitError(
                f"Microbatches(batches=...): give a non-empty list of batch tuples, one per microbatch; "
                f"got {type(batches).__name__}" + (" of none" if isinstance(batches, (list, tuple)) else "")
            )
        for i, b in enumerate(batches):
            if not isinstance(b, tuple):
                raise VjpsplitError(
                    f"Microbatches(batches=...): batch {i} is a {type(b).__name__}; give each microbatch as a tuple "
                    "of the function's batch inputs (a 1-tuple for one input), as step takes a batch"
                )
        self.batches = list(batches)
        self.weights = [1.0] * len(self.batches) if weights is None else _checked_weights(weights, len(self.batches))
        total = math.fsum(self.weights)
        self.scales = [w / total for w in self.weights]

    def __len__(self) -> int:
        return len(self.batches)

    def __repr__(self) -> str:
        return f"Microbatches({len(self.batches)} microbatches, weights={self.weights})"


def _checked_weights(weights: object, n: int) -> list[float]:
    """``weights`` as ``n`` floats, each finite and > 0; else one error naming the option."""
    if not isinstance(weights, (list, tuple)) and not hasattr(weights, "__len__"):
        raise VjpsplitError(
            f"Microbatches(weights=...): give one number per microbatch ({n}); got {type(weights).__name__}"
        )
    values = list(weights)  # type: ignore[call-overload]  # a list, tuple or 1-D array, checked one by one below
    if len(values) != n:
        raise VjpsplitError(f"Microbatches(weights=...): {len(values)} weights for {n} microbatches; give one each")
    out = []
    for i, w in enumerate(values):
        ok = (
            isinstance(w, numbers.Real)
            and not isinstance(w, bool)
            or hasattr(w, "dtype")
            and getattr(w, "ndim", 1) == 0
        )
        v = float(w) if ok else math.nan
        if not ok or not math.isfinite(v) or v <= 0:
            raise VjpsplitError(
                f"Microbatches(weights=...): weight {i} is {w!r}; each weight must be a finite number > 0 "
                "(a microbatch's token count, say)"
            )
        out.append(v)
    return out
