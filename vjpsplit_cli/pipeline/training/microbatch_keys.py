"""The Trainer's ``rng=``: one PRNG key per microbatch for a loss that takes a key.

A function exported with a batch argument that is one scalar typed key
(``jax.ShapeDtypeStruct((), jax.random.key(0).dtype)``; ``StagesIndex.key_position``)
is handed, for microbatch ``i`` of step ``t``, the key ``fold_in(fold_in(rng, t), i)``
on every stage that reads it, so a dropout mask drawn from it is the same wherever
it is drawn. ``t`` is the Trainer's ``step_count`` when the step starts (a resumed
run goes on with the same keys); ``evaluate`` takes the keys the next step would.
``checked_rng`` checks ``rng=`` when the Trainer is made; ``microbatch_keys`` derives
a step's keys.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence, cast

import jax
import numpy as np

from ...artifact.artifact import Artifact
from ...errors import VjpsplitError
from ...files.prng import is_key
from ..stages.directory import Stages

DERIVATION = "microbatch i of step t gets jax.random.fold_in(jax.random.fold_in(rng, t), i)"


def checked_rng(rng: object, stages: Stages | Sequence[Artifact], data_parallel: int) -> jax.Array | None:
    """``rng=`` as a scalar typed PRNG key, checked against the key argument the stages' function takes.

    Args:
        rng: ``Trainer``'s ``rng=``: a typed key (``jax.random.key(seed)``), a raw ``uint32[2]`` key
            (``jax.random.PRNGKey(seed)``, wrapped with JAX's default impl), or None.
        stages: the Trainer's stages (a ``Stages``, or the per-stage form, which reads no key).
        data_parallel: the Trainer's replicas of every stage.

    Returns:
        The typed key, or None where none is given (and none is read).

    Raises:
        VjpsplitError: the stages' function takes a key and no ``rng=`` is given, or takes none and one is;
            ``rng`` is not one PRNG key, or a key of another impl than the export's; ``data_parallel > 1``.
    """
    pos = stages.index.key_position if isinstance(stages, Stages) else None
    if rng is None:
        if pos is not None and isinstance(stages, Stages):
            raise VjpsplitError(
                f"the stages' function takes a PRNG key ('{stages.index.batch[pos].key}'): give "
                f"Trainer(..., rng=jax.random.key(seed)) ({DERIVATION})"
            )
        return None
    if pos is None or not isinstance(stages, Stages):
        raise VjpsplitError(
            "rng=: the stages' function takes no PRNG key argument, so no stage reads one; give no rng=, or export "
            "a loss that takes a key (its spec jax.ShapeDtypeStruct((), jax.random.key(0).dtype))"
        )
    key = _as_key(rng)
    want = stages.index.batch[pos].dtype
    if str(key.dtype) != want:
        raise VjpsplitError(
            f"rng= is a {key.dtype} key, the stages were exported for {want}: give a key of that impl "
            "(jax.random.key(seed, impl=...))"
        )
    if data_parallel > 1:
        raise VjpsplitError(
            f"rng= with data_parallel={data_parallel}: replicas do not yet share a microbatch's key; "
            "train the stages with data_parallel=1"
        )
    return key


def _as_key(rng: object) -> jax.Array:
    """``rng`` as one scalar typed key: a typed key as it is, a raw ``uint32[2]`` key wrapped."""
    if not is_key(rng):
        if not (isinstance(rng, (np.ndarray, jax.Array)) and rng.shape == (2,) and rng.dtype == np.uint32):
            raise VjpsplitError(
                f"rng={rng!r:.60}: give one PRNG key, jax.random.key(seed) (or jax.random.PRNGKey(seed))"
            )
        rng = jax.random.wrap_key_data(jax.numpy.asarray(rng))
    key = cast(jax.Array, rng)  # is_key, or wrapped: a typed key array
    if key.shape != ():
        shape = key.shape[0] if key.ndim == 1 else key.shape
        raise VjpsplitError(f"rng= is {shape} keys; give one, jax.random.key(seed)")
    return key


def microbatch_keys(rng: jax.Array, step: int, microbatches: int) -> list[jax.Array]:
    """Step ``step``'s keys: ``fold_in(fold_in(rng, step), i)`` for microbatch ``i`` (one jitted call).

    Args:
        rng: the Trainer's typed key.
        step: the step count (``Trainer.step_count`` when the step starts).
        microbatches: how many microbatches the step has.

    Returns:
        One typed scalar key per microbatch.
    """
    return list(_derive(microbatches)(rng, np.uint32(step)))


@functools.lru_cache(maxsize=None)
def _derive(microbatches: int) -> Callable[[jax.Array, np.uint32], list[jax.Array]]:
    """The jitted derivation of one step's ``microbatches`` keys (compiled once per count)."""

    def keys(rng: jax.Array, step: np.uint32) -> list[jax.Array]:
        at_step = jax.random.fold_in(rng, step)
        return [jax.random.fold_in(at_step, i) for i in range(microbatches)]

    return jax.jit(keys)
