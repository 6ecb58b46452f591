"""The Trainer's ``aux=``: what a step reports of the aux the last stage returns (``export_stages(has_aux=True)``).

A function exported with ``has_aux=True`` returns ``(loss, aux)``; its last stage's
artifact gives the aux of each microbatch, fetched to the host with the losses at
the step's end (``StageWorker.fetch_outputs``). ``step``, ``evaluate`` and the
history report it as ``aux=`` says: ``"mean"`` (the default), the mean over the
microbatches of each leaf, as ``jax.tree.map(lambda *a: jnp.mean(jnp.stack(a), 0),
*auxes)`` over a one-process loop's; or ``"per_microbatch"``, the list of each
microbatch's aux. ``checked_aux`` checks ``aux=`` when the Trainer is made;
``reduced`` gives a step's aux.
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from ...artifact.artifact import Artifact
from ...errors import VjpsplitError
from ...treetypes import PyTree

MODES = ("mean", "per_microbatch")


def checked_aux(aux: object, artifacts: Sequence[Artifact]) -> str | None:
    """``Trainer(aux=)`` checked against the stages: how a step reports the last stage's aux.

    Args:
        aux: ``"mean"``, ``"per_microbatch"``, or None (``"mean"`` where the last stage returns aux).
        artifacts: the stages' artifacts.

    Returns:
        The mode, or None where the last stage returns no aux (and none was asked for).

    Raises:
        VjpsplitError: ``aux`` is none of the modes; it is given for stages whose function returns no aux; a stage
            other than the last was exported with aux (its output would be sent on as an activation).
    """
    early = [k for k, a in enumerate(artifacts[:-1]) if a.manifest.has_aux]
    if early:
        raise VjpsplitError(
            f"stage {early[0]}'s artifact was exported with has_aux; only the last stage's may return (loss, aux): "
            "export it without has_aux, or export the whole function with export_stages(..., has_aux=True)"
        )
    if aux is not None and (not isinstance(aux, str) or aux not in MODES):
        raise VjpsplitError(f"aux={aux!r}: give 'mean' (the default) or 'per_microbatch'")
    if not artifacts[-1].manifest.has_aux:
        if aux is not None:
            raise VjpsplitError(
                f"aux={aux!r}: the stages' function returns no aux; export it with export_stages(..., has_aux=True) "
                "returning (loss, aux), or give no aux="
            )
        return None
    return "mean" if aux is None else aux


def reduced(per_microbatch: Sequence[PyTree], mode: str) -> PyTree:
    """A step's aux as ``mode`` says, from each microbatch's (host arrays in the function's aux structure).

    Args:
        per_microbatch: each microbatch's aux, in order.
        mode: ``"mean"``: each leaf's mean over the microbatches (an integer leaf's as a float);
            ``"per_microbatch"``: the list as it is.

    Returns:
        The step's aux.
    """
    if mode == "per_microbatch":
        return list(per_microbatch)
    return jax.tree_util.tree_map(lambda *leaves: np.mean(np.stack(leaves), axis=0), *per_microbatch)
