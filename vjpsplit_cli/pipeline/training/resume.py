"""From a checkpoint to a run: the parameters and optax state it holds, for any cut of the model or for one process.

A checkpoint of layout 2 (``checkpoint``) is keyed by the model: its parameters
by key, optax's whole-model state by its own keys. ``load_checkpoint`` gives
them to a one-process optax loop; ``restored_model`` gives ``Trainer.restore``
the parameters (in the structure the Trainer takes for the given stages) and the
state; ``stage_snapshots`` gives a running Trainer's stages their share
(``fit`` resuming from its ``checkpoint_dir``, and after a lost worker). A checkpoint of layout 1
(per stage) loads only into the cut that wrote it; any other use names it.
``restored_run`` gives ``Trainer.restore`` all it starts from: those, and the
settings the checkpoint records where the caller gives none (``RestoredRun``).
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Mapping, Sequence

import jax
import numpy as np

from ...artifact.artifact import Artifact
from ...errors import VjpsplitError
from ...files.trees import decode_structure, structure_keys
from ...treetypes import Leaf, PyTree
from ..schedules.csvformat import parse_schedule
from ..stages.directory import Stages
from .checkpoint import read_checkpoint
from .checkpoint_layout import MetaJSON, Saved
from .option_values import PerStage, Schedule
from .options import Options
from .ownership import Ownership, Snapshot, Tied, saved_params, stage_keys
from .stage_trainer import param_node
from .optax_state import StateMap, opt_state_from_file

if TYPE_CHECKING:  # annotations only: optax is an optional extra, imported by the caller that has an optimizer
    import optax


def _per_stage(saved: Saved) -> VjpsplitError:
    return VjpsplitError(
        f"{saved.directory}: an older vjpsplit wrote this checkpoint per stage ({len(saved.stages)} stages, layout 1); "
        "it loads only into the stages that wrote it: restore it there with Trainer.restore and save it again"
    )


def _check_keys(saved: Saved, held: Sequence[Sequence[str]]) -> None:
    need = {k for names in held for k in names}
    missing, extra = sorted(need - set(saved.params)), sorted(set(saved.params) - need)
    if missing or extra:
        what = f"has no parameter '{missing[0]}'" if missing else f"holds a parameter '{extra[0]}' the stages lack"
        raise VjpsplitError(f"{saved.directory}: {what}; pass stages of the function it was saved from")


Spec = tuple[str, tuple[int | str, ...]]  # a leaf's dtype name and shape (a symbolic dim as its text)


def stages_specs(stages: Stages | Sequence[Artifact], tied: Tied | None) -> dict[str, Spec]:
    """Each parameter's dtype and shape by global key, as the stages were exported for them."""
    if isinstance(stages, Stages):
        return {leaf.key: (leaf.dtype, tuple(leaf.shape)) for leaf in stages.index.params}
    specs: dict[str, Spec] = {}
    for a, names in zip(stages, stage_keys(stages, tied)):
        m = a.manifest
        inputs = {leaf.key: leaf for leaf in m.inputs}
        for name, key in zip(names, structure_keys(m.arg_names[0], param_node(a))):
            if key in inputs:
                specs.setdefault(name, (inputs[key].dtype, tuple(inputs[key].shape)))
    return specs


def ownership_specs(ownership: Ownership) -> dict[str, Spec]:
    """Each parameter's dtype and shape by global key, as the running Trainer holds them."""
    specs: dict[str, Spec] = {}
    for names, p in zip(ownership.names, ownership.stage_params):
        for k, v in zip(names, jax.tree_util.tree_leaves(p)):
            specs.setdefault(k, (str(np.asarray(v).dtype if not hasattr(v, "dtype") else v.dtype), tuple(np.shape(v))))
    return specs


def check_specs(directory: str, params: Mapping[str, Leaf], want: Mapping[str, Spec]) -> None:
    """Refuse a saved parameter whose dtype or shape is not the stages' (before any stage holds it)."""
    for k, (dtype, shape) in want.items():
        if k not in params:
            continue  # a missing key is _check_keys' to name
        v = params[k]
        got_dtype, got_shape = str(v.dtype), tuple(np.shape(v))
        fits = len(got_shape) == len(shape) and all(isinstance(d, str) or d == g for d, g in zip(shape, got_shape))
        if got_dtype != dtype or not fits:
            raise VjpsplitError(
                f"{directory}: parameter '{k}' is {got_dtype}{list(got_shape)}, the stages take {dtype}{list(shape)}; "
                "pass stages of the function and parameters it was saved from"
            )


def saved_whole_params(saved: Saved) -> PyTree:
    """The parameters as the saving Trainer took them (user classes come back as dicts, as in artifacts)."""
    if saved.layout == 1:
        raise _per_stage(saved)
    return decode_structure(saved.structure, iter([saved.params[k] for k in saved.leaves]))


def load_checkpoint(
    directory: str | os.PathLike[str], *, optimizer: optax.GradientTransformation
) -> tuple[PyTree, optax.OptState, int]:
    """``(params, opt_state, step)`` of a Trainer's checkpoint, for a one-process optax loop.

    Arrays are host (NumPy) arrays, typed PRNG keys typed::

        params, opt_state, step = P.load_checkpoint("ck", optimizer=tx)
        updates, opt_state = tx.update(grads, opt_state, params)

    Args:
        directory: The checkpoint directory (``Trainer.save``'s).
        optimizer: The optax optimizer the run was saved with, whose ``init`` gives the optimizer state's structure.

    Returns:
        The triple ``(params, opt_state, step)``: the parameters in the Trainer's structure, optax's optimizer state
        for them, and the count of steps taken.

    Raises:
        VjpsplitError: If the directory is not a readable checkpoint (missing, damaged or malformed files), was
            written per stage by an older vjpsplit (restore it into those stages and save it again), or its optimizer
            state does not fit ``optimizer``'s (naming the entry).
    """
    saved = read_checkpoint(directory)
    params = saved_whole_params(saved)
    return params, opt_state_from_file(optimizer, params, saved.opt_state, saved.directory), saved.step


def restored_model(
    saved: Saved, stages: Stages | Sequence[Artifact], optimizer: optax.GradientTransformation, tied: Tied | None
) -> tuple[PyTree, optax.OptState | None, list[dict[str, Leaf]] | None]:
    """``(params, opt_state, per-stage states)`` for ``Trainer.restore`` on ``stages``: layout 2 gives the whole
    model's opt_state (any cut of the same function), layout 1 the saving cut's own per-stage states."""
    if saved.layout == 1:
        params = saved_params(saved.directory, stages, saved.stages, saved.meta.structure, tied)
        names = stage_keys(stages, tied)
        specs = stages_specs(stages, tied)
        for n, (p, _) in zip(names, saved.stages):
            check_specs(saved.directory, {k: p[k] for k in n}, {k: specs[k] for k in n if k in specs})
        return params, None, [st for _, st in saved.stages]
    held = stage_keys(stages, tied)
    _check_keys(saved, held)
    check_specs(saved.directory, saved.params, stages_specs(stages, tied))
    if isinstance(stages, Stages):
        params = saved_whole_params(saved)
    else:
        params = [decode_structure(param_node(a), iter([saved.params[k] for k in n])) for a, n in zip(stages, held)]
    return params, opt_state_from_file(optimizer, params, saved.opt_state, saved.directory), None


def stage_snapshots(
    directory: str | os.PathLike[str], ownership: Ownership, smap: StateMap, optimizer: optax.GradientTransformation
) -> tuple[list[Snapshot], int]:
    """Each stage's ``(params, optimizer state)`` of the checkpoint in ``directory``, and its step count."""
    saved = read_checkpoint(directory)
    names = ownership.names
    if saved.layout == 1:
        if [sorted(p) for p, _ in saved.stages] != [sorted(n) for n in names]:
            raise _per_stage(saved)
        specs = ownership_specs(ownership)
        for p, _ in saved.stages:
            check_specs(saved.directory, p, specs)
        return list(saved.stages), saved.step
    _check_keys(saved, names)
    check_specs(saved.directory, saved.params, ownership_specs(ownership))
    params = ownership.gather([{k: saved.params[k] for k in n} for n in names])
    states = smap.scatter(opt_state_from_file(optimizer, params, saved.opt_state, saved.directory))
    return [({k: saved.params[k] for k in n}, st) for n, st in zip(names, states)], saved.step


@dataclasses.dataclass(frozen=True)
class RestoredRun:
    """What ``Trainer.restore`` starts a Trainer from: the options (the schedule chosen), the parameters, the
    settings and the state, each the caller's where given, else the checkpoint's (``states``: an older
    per-stage checkpoint's own optimizer states, None where ``opt_state`` is the one to start from)."""

    options: Options
    params: PyTree
    microbatches: int
    clip_global_norm: float | None
    opt_state: PyTree
    step_count: int
    states: list[dict[str, Leaf]] | None


def restored_run(
    directory: str | os.PathLike[str],
    options: Options,
    optimizer: optax.GradientTransformation,
    *,
    microbatches: int | None,
    clip_global_norm: float | None,
    clip_recorded: bool,
    opt_state: PyTree,
    step_count: int | None,
) -> RestoredRun:
    """The checkpoint in ``directory`` read, its parameters and state for ``options.stages``, and every setting
    not given (``microbatches``, the schedule, ``clip_global_norm`` where ``clip_recorded``) taken from it.

    Raises:
        VjpsplitError: no checkpoint there, or it lacks a setting it must record (naming it); a saved leaf
            that does not match the stages.
    """
    saved = read_checkpoint(directory)
    meta = saved.meta.as_dict()
    given = options.stages
    arts, tied = (given.artifacts, given.tied) if isinstance(given, PerStage) else (given, None)
    params, saved_state, states = restored_model(saved, arts, optimizer, tied)
    if opt_state is None:
        opt_state = saved_state
    else:  # the caller's state, as Trainer(opt_state=) takes it; an older per-stage checkpoint's is not used
        states = None
    step = saved.step if step_count is None else step_count
    microbatches = _restored_microbatches(directory, meta) if microbatches is None else microbatches
    chosen = _restored_schedule(directory, meta, options.schedule)
    if clip_recorded:
        clip_global_norm = meta.get("clip_global_norm")
    chosen = _auto_limits(meta, chosen)
    return RestoredRun(
        dataclasses.replace(options, schedule=chosen),
        params,
        microbatches,
        clip_global_norm,
        opt_state,
        step,
        states,
    )


def _restored_microbatches(directory: str | os.PathLike[str], meta: MetaJSON) -> int:
    """The microbatches the checkpoint records (one an older vjpsplit wrote lacks them: one error saying so)."""
    if "microbatches" not in meta:
        raise VjpsplitError(
            f"{os.fspath(directory)}: this checkpoint does not record its microbatches (an older "
            "vjpsplit wrote it); pass microbatches= to Trainer.restore"
        )
    return int(meta["microbatches"])


def _restored_schedule(directory: str | os.PathLike[str], meta: MetaJSON, chosen: Schedule | None) -> Schedule:
    """The schedule given, else the checkpoint's: its plans where they were the caller's, else its name."""
    if chosen is not None:
        return chosen
    if "plans" in meta:
        try:
            return Schedule(plans=parse_schedule(str(meta["plans"])))
        except VjpsplitError as e:
            raise VjpsplitError(f"{os.fspath(directory)}: its recorded plans: {e}") from e
    return Schedule(str(meta.get("schedule", "1f1b")))


def _auto_limits(meta: MetaJSON, chosen: Schedule) -> Schedule:
    """An ``"auto"`` schedule given without a memory limit (or trial rounds) takes the checkpoint's, as given
    (None: not recorded); restore measures again, on its own hosts."""
    if chosen.auto and chosen.memory_limit is None and chosen.memory_limit_bytes is None:
        limit, limit_bytes = meta.get("memory_limit"), meta.get("memory_limit_bytes")
        chosen = dataclasses.replace(chosen, memory_limit=limit, memory_limit_bytes=limit_bytes)
    if chosen.auto and chosen.trial_rounds is None and meta.get("trial_rounds") is not None:
        chosen = dataclasses.replace(chosen, trial_rounds=meta["trial_rounds"])
    return chosen
