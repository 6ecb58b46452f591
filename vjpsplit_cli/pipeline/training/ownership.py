"""Parameter ownership: which stage holds which parameter leaf, under which global key, and ``params`` back.

Leaves are named by their file keys in ``params`` (``params/embed``); a leaf
several stages read is one key held by each (a tied leaf), its gradient summed
over its holders and counted once in the global norm (by its first holder). The
per-stage form (a list of artifacts and one parameter pytree per stage, with
``tied=`` naming ``(stage, key)`` groups) keys leaves ``"s/k"``.

Which *worker* runs which stage is the layout (``schedules.layout``), another matter.
"""

from __future__ import annotations

import os
from typing import Mapping, Sequence, TypeVar

import jax
import numpy as np

from ...artifact.artifact import Artifact
from ...errors import VjpsplitError
from ...treetypes import JSON, Leaf, PyTree
from ...files.trees import decode_structure, encode_structure, flatten_with_keys, structure_keys
from ..runtime.model import Model, StagesModel
from ..stages.directory import Stages
from .clipping import norm_owners
from .stage_trainer import param_node

T = TypeVar("T")
Tied = Sequence[Sequence[tuple[int, str]]]
# A stage's (params, optimizer state), flat by global key, on the host (a typed PRNG key in the state stays a jax.Array).
Snapshot = tuple[Mapping[str, np.ndarray], Mapping[str, Leaf]]


def global_keys(local: Sequence[Sequence[str]], tied: Tied | None) -> list[list[str]]:
    """Per-stage form: per stage, each leaf's global key (``"s/k"``, or its tied group's first member's)."""
    names = [{k: f"{s}/{k}" for k in keys} for s, keys in enumerate(local)]
    for group in tied or ():
        pairs = [(int(s), str(k)) for s, k in group]
        for s, k in pairs:
            if not 0 <= s < len(local) or k not in names[s]:
                raise VjpsplitError(f"tied leaf ({s}, {k!r}) is not a parameter of stage {s}; name (stage, key) pairs")
        first = names[pairs[0][0]][pairs[0][1]]
        for s, k in pairs:
            names[s][k] = first
    return [[n[k] for k in keys] for n, keys in zip(names, local)]


def stage_keys(stages: Stages | Sequence[Artifact], tied: Tied | None = None) -> list[list[str]]:
    """Per stage, the global keys of the parameter leaves it holds, from the stages alone (no parameters)."""
    if isinstance(stages, Stages):
        return stages.index.stage_param_keys()
    return global_keys([structure_keys("", param_node(a)) for a in stages], tied)


class Ownership:
    """Which parameter leaves each stage holds (``names``), which are tied (``holders``), which each
    counts in the global norm (``counted``), and how to rebuild the caller's ``params``."""

    def __init__(self, model: Model, tied: Tied | None = None):
        self.artifacts = model.artifacts
        self.stage_params = model.stage_params
        self.stages = model.stages if isinstance(model, StagesModel) else None
        self.structure: JSON = None
        if isinstance(model, StagesModel):
            self.names = stage_keys(model.stages)
            self.keys = model.stages.index.param_keys
            self.tree = jax.tree_util.tree_structure(model.params)
            self.structure = encode_structure(model.params)
        else:
            self.names = global_keys([[k for k, _ in flatten_with_keys("", p)] for p in model.stage_params], tied)
            flat = [dict(zip(n, jax.tree_util.tree_leaves(p))) for n, p in zip(self.names, model.stage_params)]
            _check_tied_equal(flat)
        held: dict[str, list[int]] = {}
        for s, names in enumerate(self.names):
            for k in names:
                held.setdefault(k, []).append(s)
        self.holders = [{k: held[k] for k in names if len(held[k]) > 1} for names in self.names]
        self.counted = [sorted(c) for c in norm_owners(self.names)]
        self.tied = any(self.holders)

    @staticmethod
    def flat(snapshots: Sequence[Mapping[str, T]]) -> dict[str, T]:
        """Every parameter by key from each stage's flat ``{key: array}`` (a tied leaf: its first holder's; any
        value per key, e.g. a spec or a name, passes through alike)."""
        flat: dict[str, T] = {}
        for snap in snapshots:
            for k, v in snap.items():
                flat.setdefault(k, v)
        return flat

    def gather(self, snapshots: Sequence[Mapping[str, object]]) -> PyTree:
        """The parameters in the user's structure from each stage's flat ``{key: array}`` (or any value per key,
        e.g. a spec or a name: the tree holds what the snapshots hold)."""
        if self.stages is not None:
            flat = self.flat(snapshots)
            return jax.tree_util.tree_unflatten(self.tree, [flat[k] for k in self.keys])
        return [
            decode_structure(param_node(a), iter([snap[n] for n in names]))
            for a, names, snap in zip(self.artifacts, self.names, snapshots)
        ]


def saved_params(
    directory: str | os.PathLike[str],
    stages: Stages | Sequence[Artifact],
    saved: Sequence[Snapshot],
    structure: JSON,
    tied: Tied | None,
) -> PyTree:
    """The parameters a checkpoint holds, in the structure ``Trainer`` takes for ``stages``; one error naming
    what does not fit (another number of stages, a missing leaf)."""
    names = stage_keys(stages, tied)
    if len(saved) != len(names):
        raise VjpsplitError(
            f"{os.fspath(directory)}: holds {len(saved)} stages, not {len(names)}; pass the stages it was saved from"
        )
    for s, (n, (p, _)) in enumerate(zip(names, saved)):
        missing = [k for k in n if k not in p]
        if missing:
            raise VjpsplitError(
                f"{os.fspath(directory)}: stage {s} lacks parameter '{missing[0]}'; pass the stages it was saved from"
            )
    if isinstance(stages, Stages):
        flat = {k: v for p, _ in saved for k, v in p.items()}
        return decode_structure(structure, iter([flat[k] for k in stages.index.param_keys]))
    return [decode_structure(param_node(a), iter([p[k] for k in n])) for a, n, (p, _) in zip(stages, names, saved)]


def _check_tied_equal(flat: Sequence[Mapping[str, Leaf]]) -> None:
    first: dict[str, tuple[int, Leaf]] = {}
    for s, f in enumerate(flat):
        for k, v in f.items():
            if k in first:
                s0, v0 = first[k]
                if not np.array_equal(np.asarray(v0), np.asarray(v)):
                    raise VjpsplitError(
                        f"tied leaf '{k}' differs between stages {s0} and {s}; give every holder the same value"
                    )
            else:
                first[k] = (s, v)
