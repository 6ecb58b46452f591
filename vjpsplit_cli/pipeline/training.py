"""Training over pipeline stages (prototype): the optimizer step where each stage's parameters live.

``Trainer`` drives the runner form ``run_inprocess`` takes today (one artifact and
one parameter pytree per stage). Each stage has a ``StageState``: its parameters
and optimizer state, flat ``{leaf key: array}``, and its optimizer program
(``optimizer.export_optimizer``, loaded back from bytes as a worker would, so the
update needs no optax). A step runs the schedule, sums tied leaves' gradients
over their holders, computes the global norm from per-stage sums of squares (and
the clip scale), and has every stage apply its update; only the loss and
scalars reach the driver's bookkeeping.

Leaf keys: stage ``s``'s leaf ``k`` (its file key inside the stage's parameter
pytree) is ``"s/k"``, unless ``tied`` names it in a group of ``(stage, key)``
pairs that hold one parameter: all of a group take its first member's key.
"""

from __future__ import annotations

import time
from typing import Any, Mapping, Sequence

import jax
import numpy as np

from ..errors import VjpsplitError
from ..files.trees import decode_structure, flatten_with_keys, structure_keys
from .checkpoint import load_checkpoint, save_checkpoint
from .clipping import clip_scale, norm_owners, shared_keys, sum_of_squares, sum_tied
from .inprocess import run_inprocess
from .optimizer import OptimizerProgram, export_optimizer, load_optimizer
from .stage import stage_devices


class StageState:
    """One stage's training state where it lives: parameters, optimizer state and the optimizer program."""

    def __init__(self, program: OptimizerProgram, params: Mapping[str, Any], state: Mapping[str, Any] | None = None):
        self.program = program
        self.params = dict(params)
        self.state = program.init(self.params) if state is None else dict(state)

    def sum_of_squares(self, grads: Mapping[str, Any], counted) -> float:
        """This stage's share of the squared global norm (see ``clipping.norm_owners``)."""
        return sum_of_squares(grads, counted)

    def apply(self, grads: Mapping[str, Any], scale: float = 1.0) -> None:
        """One optimizer step on ``grads * scale``, in place."""
        self.params, self.state = self.program.update(self.params, self.state, grads, scale)


def _global_keys(local: Sequence[Sequence[str]], tied) -> list[dict[str, str]]:
    """Per stage, local leaf key -> global key (``"s/k"``, or a tied group's first member's)."""
    names = [{k: f"{s}/{k}" for k in keys} for s, keys in enumerate(local)]
    for group in tied or ():
        group = [(int(s), str(k)) for s, k in group]
        for s, k in group:
            if not 0 <= s < len(local) or k not in names[s]:
                raise VjpsplitError(f"tied leaf ({s}, {k!r}) is not a parameter of stage {s}; name (stage, key) pairs")
        first = names[group[0][0]][group[0][1]]
        for s, k in group:
            names[s][k] = first
    return names


class Trainer:
    """Pipelined training in this process: ``step(batch)`` runs the schedule and each stage's optimizer update.

    ``artifacts`` and ``params`` are what ``run_inprocess`` takes (per stage).
    ``optimizer`` is an optax ``GradientTransformation``, exported per stage.
    ``clip_global_norm=c`` clips by the norm over all stages' gradients (tied
    leaves counted once). ``tied``: groups of ``(stage, key)`` pairs holding one
    parameter (their values must be equal). ``history`` keeps per step the loss,
    the gradients' global norm, the step time and the measured and modeled bubble.
    """

    def __init__(
        self,
        artifacts: Sequence,
        params: Sequence,
        *,
        optimizer,
        microbatches: int,
        schedule_name: str = "1f1b",
        clip_global_norm: float | None = None,
        tied: Sequence[Sequence[tuple[int, str]]] | None = None,
        devices: Sequence[Sequence] | None = None,
        _restored: tuple[list, int] | None = None,
    ):
        if len(params) != len(artifacts):
            raise VjpsplitError(f"{len(artifacts)} stages but {len(params)} parameter sets")
        self.artifacts = stage_devices(artifacts, devices)
        self.microbatches, self.schedule_name = microbatches, schedule_name
        self.clip_global_norm, self.tied = clip_global_norm, tied
        clip_scale([], clip_global_norm)  # a bad value is refused now, not after the first step
        self.trees = [jax.tree_util.tree_structure(p) for p in params]
        self.local = [[k for k, _ in flatten_with_keys("", p)] for p in params]
        self.names = _global_keys(self.local, tied)
        flat = [{self.names[s][k]: v for k, v in flatten_with_keys("", p)} for s, p in enumerate(params)]
        _check_tied_equal(flat)
        holdings = [list(f) for f in flat]
        self.owners, self.shared = norm_owners(holdings), shared_keys(holdings)
        self.stages = []
        for s, (art, f) in enumerate(zip(self.artifacts, flat)):
            placed = dict(
                zip(
                    f,
                    jax.tree_util.tree_leaves(art.place_arg(0, _tree(self.trees[s], self.local[s], self.names[s], f))),
                )
            )
            specs = {
                k: jax.ShapeDtypeStruct(
                    np.shape(v), v.dtype, sharding=getattr(v, "sharding", None) if art.manifest.sharded else None
                )
                for k, v in placed.items()
            }
            program = export_optimizer(optimizer, specs, platforms=art.manifest.platforms)
            # The bytes a worker gets: it loads them without optax.
            program = load_optimizer(program.to_bytes(), source=f"stage {s}'s optimizer", devices=art.devices or None)
            state = None if _restored is None else _restored[0][s][1]
            self.stages.append(StageState(program, placed, state))
        self.step_count = 0 if _restored is None else _restored[1]
        self.history: list[dict] = []

    def _stage_params(self) -> list:
        return [_tree(self.trees[s], self.local[s], self.names[s], st.params) for s, st in enumerate(self.stages)]

    def step(self, batch: Sequence) -> float:
        """One optimizer step on ``batch`` (``(x, *side inputs)``); returns the step's loss."""
        x, side = batch[0], list(batch[1:])
        t0 = time.monotonic()
        r = run_inprocess(
            self.artifacts,
            self._stage_params(),
            x,
            side,
            microbatches=self.microbatches,
            schedule_name=self.schedule_name,
        )
        grads = [{self.names[s][k]: v for k, v in flatten_with_keys("", g)} for s, g in enumerate(r.grads)]
        grads = sum_tied(grads, self.shared)
        sums = [st.sum_of_squares(g, own) for st, g, own in zip(self.stages, grads, self.owners)]
        scale, norm = clip_scale(sums, self.clip_global_norm)
        for st, g in zip(self.stages, grads):
            st.apply(g, scale)
        self.step_count += 1
        self.history.append(
            {
                "step": self.step_count,
                "loss": r.loss,
                "grad_norm": norm,
                "step_time": time.monotonic() - t0,
                "bubble": r.bubble_ratio,
                "modeled_bubble": r.modeled_bubble_ratio,
            }
        )
        return r.loss

    def params(self) -> list:
        """Every stage's parameters in its own pytree structure (host arrays)."""
        return [jax.tree_util.tree_map(np.asarray, p) for p in self._stage_params()]

    def save(self, directory) -> None:
        """Write every stage's parameters, optimizer state and the step count to ``directory`` (all or nothing)."""
        meta = {"schedule": self.schedule_name, "optimizers": [st.program.name for st in self.stages]}
        save_checkpoint(directory, [(st.params, st.state) for st in self.stages], self.step_count, meta)

    @classmethod
    def restore(cls, directory, artifacts: Sequence, **kwargs) -> "Trainer":
        """A Trainer continuing the run saved in ``directory``; takes ``Trainer``'s keyword arguments."""
        saved, step, _ = load_checkpoint(directory)
        if len(saved) != len(artifacts):
            raise VjpsplitError(
                f"{directory}: holds {len(saved)} stages, not {len(artifacts)}; pass the stages it was saved from"
            )
        nodes = [art.manifest.structure["args"][art.manifest.arg_names[0]] for art in artifacts]
        local = [structure_keys("", node) for node in nodes]
        names = _global_keys(local, kwargs.get("tied"))
        params = []
        for s, (node, (p, _)) in enumerate(zip(nodes, saved)):
            missing = [names[s][k] for k in local[s] if names[s][k] not in p]
            if missing:
                raise VjpsplitError(
                    f"{directory}: stage {s} lacks parameter '{missing[0]}'; pass the stages it was saved from"
                )
            params.append(decode_structure(node, iter([p[names[s][k]] for k in local[s]])))
        return cls(artifacts, params, _restored=(saved, step), **kwargs)


def _tree(treedef, local: Sequence[str], names: Mapping[str, str], flat: Mapping[str, Any]):
    return jax.tree_util.tree_unflatten(treedef, [flat[names[k]] for k in local])


def _check_tied_equal(flat: Sequence[Mapping[str, Any]]) -> None:
    first: dict[str, tuple[int, np.ndarray]] = {}
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
