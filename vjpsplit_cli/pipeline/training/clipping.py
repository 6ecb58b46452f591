"""Gradients across stages: the global norm (a tied leaf counted once), the clip scale, and tied-leaf sums.

Each stage holds a flat ``{leaf key: array}`` of parameters; a key held by
several stages is a tied leaf (one parameter, a copy on each). Clipping by the
global norm over all stages is three small steps, so that only scalars cross
between workers and the driver:

1. every stage reports ``sum_of_squares(grads, counted)`` over the leaves
   ``norm_owners`` gives it (a tied leaf is counted by its first holder only);
2. the driver turns the reports into one ``clip_scale`` (``min(1, c / norm)``);
3. every stage's optimizer program scales its gradients by it (``update(...,
   scale)``).

That equals ``optax.chain(optax.clip_by_global_norm(c), optimizer)`` on one
device. A ``clip_by_global_norm`` inside the optimizer is a reduction over
leaves that ``separable`` joins across stages the same way.

Tied leaves: ``sum_tied`` adds a tied leaf's gradients over its holders (in
stage order, on the host) and hands every holder the very same array, so each
applies the same update to the same copy and the copies stay bitwise equal (a
Trainer's stages add them on each holder's device, in the same order). ``Squares``
is a stage's squared sum dispatched and fetched later, with the step's losses.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Callable, Iterable, Mapping, Sequence

import numpy as np

from ...errors import VjpsplitError

if TYPE_CHECKING:  # annotations only: this module imports jax where it computes, not when imported
    import jax

    from ...treetypes import Leaf


def norm_owners(holdings: Sequence[Iterable[str]]) -> list[set[str]]:
    """Per stage, the keys whose gradients it counts in the global norm: every key by its first holder."""
    seen: set[str] = set()
    out = []
    for keys in holdings:
        mine = {k for k in keys if k not in seen}
        seen |= mine
        out.append(mine)
    return out


def shared_keys(holdings: Sequence[Iterable[str]]) -> list[set[str]]:
    """Per stage, its keys that another stage holds too (tied leaves)."""
    sets = [set(k) for k in holdings]
    return [
        {k for k in mine if any(k in other for j, other in enumerate(sets) if j != i)} for i, mine in enumerate(sets)
    ]


def sum_of_squares(grads: Mapping[str, Leaf], counted: Iterable[str]) -> float:
    """The sum of squares of the ``counted`` leaves of one stage's gradients, as a Python float.

    Each leaf's sum is taken in its own dtype (float32 as optax does), on the
    device where it lives, in one jitted call; only the scalars come to the host, in one transfer.
    """
    return Squares.of(grads, counted).value()


class Squares:
    """The sum of squares of some leaves of one stage's gradients, not yet fetched: parts whose elements, in order,
    are the leaves' sums in leaf order (one array of them all where they share a dtype, else one scalar per leaf;
    a replica group's reduction gives its leaves' as one array).

    ``of`` dispatches the sums (one jitted call) and waits for nothing; ``value()`` fetches them in one
    transfer and adds them on the host in leaf order, as a Python float (the same float whenever it is asked).
    ``fetch`` turns many at once into floats with one transfer for all.
    """

    def __init__(self, parts: list[jax.Array]):
        self.parts = parts
        self._value: float | None = None

    @classmethod
    def of(cls, grads: Mapping[str, Leaf], counted: Iterable[str]) -> Squares:
        """The squares of the ``counted`` leaves of ``grads``, dispatched.

        Raises:
            VjpsplitError: a counted leaf is missing from ``grads``.
        """
        leaves = []
        for k in sorted(counted):
            if k not in grads:
                raise VjpsplitError(
                    f"gradient of '{k}' is missing from the stage's gradients; pass every leaf it holds"
                )
            leaves.append(grads[k])
        return cls(_squares(leaves))

    def __float__(self) -> float:
        return self.value()

    def value(self) -> float:
        """The sum, fetched (once) and added on the host."""
        if self._value is None:
            (self._value,) = Squares.fetch([self])
        return self._value

    @staticmethod
    def fetch(many: Sequence[Squares | float]) -> list[float]:
        """Each of ``many`` as a float (floats as they are), every unfetched one in one transfer."""
        import jax

        todo = [m for m in many if isinstance(m, Squares) and m._value is None]
        got = jax.device_get([m.parts for m in todo])  # one call and one transfer, not one per leaf or stage
        for m, parts in zip(todo, got):
            total = 0.0
            for v in parts:  # a part: one leaf's sum, or a replica group's per leaf (``zero1``), in leaf order
                for x in np.ravel(v):
                    total += float(x)
            m._value = total
        return [m.value() if isinstance(m, Squares) else float(m) for m in many]


def _leaf_squares(leaves: list[Leaf]) -> list[jax.Array]:
    """Each leaf's sum of squares in its own dtype; stacked into one array where they share a dtype (the same
    values): each array fetched costs the host its own copy, 76 µs on a TPU v5e host
    (benchmarks/results/2026-12-07-tpu-timed-profile.md)."""
    import jax.numpy as jnp

    sums = [jnp.sum(jnp.square(jnp.abs(g) if jnp.iscomplexobj(g) else g)) for g in leaves]
    return [jnp.stack(sums)] if len({v.dtype for v in sums}) == 1 else sums


@functools.lru_cache(maxsize=1)
def _squares_call() -> Callable[[list[Leaf]], list[jax.Array]]:
    import jax

    return jax.jit(_leaf_squares)


def _squares(leaves: list[Leaf]) -> list[jax.Array]:
    """Each leaf's sum of squares, in one jitted call (compiled once per signature)."""
    return list(_squares_call()(leaves)) if leaves else []


def clip_scale(sums: Sequence[float], max_norm: float | None) -> tuple[float, float]:
    """``(scale, norm)``: the global norm of gradients whose per-stage squared sums are ``sums``, and
    ``min(1, max_norm / norm)`` (1 when ``max_norm`` is None)."""
    norm = math.sqrt(math.fsum(sums))
    if max_norm is None:
        return 1.0, norm
    if not max_norm > 0:
        raise VjpsplitError(f"clip_global_norm={max_norm!r}: give a positive number (or None for no clipping)")
    return (1.0 if not norm > max_norm else float(max_norm) / norm), norm


def sum_tied(grads: Sequence[Mapping[str, Leaf]], shared: Sequence[Iterable[str]]) -> list[dict[str, Leaf]]:
    """Every stage's gradients with each tied leaf replaced by its sum over the holders (one host array)."""
    totals: dict[str, np.ndarray] = {}
    for g, keys in zip(grads, shared):
        for k in sorted(keys):
            v = np.asarray(g[k])
            totals[k] = v.copy() if k not in totals else totals[k] + v
    out = []
    for g, keys in zip(grads, shared):
        mine = dict(g)
        for k in keys:
            mine[k] = totals[k]
        out.append(mine)
    return out
