"""A training checkpoint's layout: its file names and versions, the records it holds, its index's field checks.

``DIR/checkpoint.json`` (``INDEX``) is the index; ``params.npz`` (``PARAMS``) and
``opt_state.npz`` (``OPT_STATE``) hold the arrays of layout 2, ``stage-<s>.npz``
those of layout 1 (``checkpoint`` says what each holds and how it is written and
read). The records: ``CheckpointMeta`` (the Trainer's settings, ``meta``),
``HostCheckpoint`` (what a save writes, on the host) and ``Saved`` (what a read
gives, of either layout). ``damaged`` and the ``field_*`` checks narrow an index's
fields, each a bad value one error naming the field.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence, TypedDict, cast

import numpy as np

from ...errors import VjpsplitError
from ...treetypes import JSON, JSONObject, Leaf, PyTree

KIND = "vjpsplit-trainer-checkpoint"
# 1 (2026-12-01): per stage, ``stage-<s>.npz`` of its ``params/<key>`` and ``state/<key>`` (its own optax state).
#   Its free-form ``meta`` holds the schedule, the optimizer's name and ``params``' structure; from 2026-12-02
#   also ``microbatches``, ``clip_global_norm`` and, for the caller's plans, ``plans`` (their CSV text), which
#   ``Trainer.restore`` uses where they are not given. Older checkpoints lack those and still load.
# 2 (2026-12-01, issue 36): keyed by the model: ``params.npz`` by parameter key, ``opt_state.npz`` by the keys of
#   optax's whole-model state; the index records the parameters' structure and each leaf's key (``params``), the
#   state's keys and PRNG impls (``opt_state``). ``meta`` as in 1. From 2026-12-02 (issue 43) also ``id``, one
#   per save, which every array file's metadata repeats (``checkpoint``); read without it as before.
FORMAT = 2
READS = (1, 2)
INDEX = "checkpoint.json"
PARAMS, OPT_STATE = "params.npz", "opt_state.npz"


class MetaJSON(TypedDict, total=False):
    """``meta`` as ``checkpoint.json`` holds it: a key is there only where it is recorded (``CheckpointMeta``)."""

    schedule: str
    optimizer: str
    structure: JSON
    microbatches: int
    clip_global_norm: float | None
    plans: str
    memory_limit: int | list[int] | None
    memory_limit_bytes: int | str | list[int | str] | None
    trial_rounds: int | None


@dataclasses.dataclass(frozen=True)
class CheckpointMeta:
    """The Trainer's settings a checkpoint records (``checkpoint.json``'s ``meta``), for ``Trainer.restore``.

    None: not recorded (a checkpoint of an older vjpsplit lacks ``microbatches``, ``clip_global_norm`` and
    ``plans``), except in ``structure`` and ``clip_global_norm``, which are always written: None is per-stage
    parameters (artifacts, no one structure) and no clipping. ``schedule``: the schedule's name; ``optimizer``:
    the optimizer's, for messages; ``structure``: the parameters' encoded structure
    (``files.trees.encode_structure``; layout 1 reads it); ``plans``: the caller's plans as CSV text.

    ``auto``: an auto schedule's run, whose ``memory_limit`` and ``memory_limit_bytes`` are both recorded (as
    given, either None), so that ``restore`` measures again on its own hosts; ``trial_rounds`` as given, where
    it was (checkpoints before it was recorded lack it).
    """

    schedule: str | None = None
    optimizer: str | None = None
    structure: JSON = None
    microbatches: int | None = None
    clip_global_norm: float | None = None
    plans: str | None = None
    auto: bool = False
    memory_limit: int | list[int] | None = None
    memory_limit_bytes: int | str | list[int | str] | None = None
    trial_rounds: int | None = None

    def as_dict(self) -> MetaJSON:
        """The record as ``checkpoint.json`` holds it, its keys in the order the Trainer has always written them."""
        out = MetaJSON()
        if self.schedule is not None:
            out["schedule"] = self.schedule
        if self.optimizer is not None:
            out["optimizer"] = self.optimizer
        out["structure"] = self.structure
        if self.microbatches is not None:
            out["microbatches"] = self.microbatches
        out["clip_global_norm"] = self.clip_global_norm
        if self.plans is not None:
            out["plans"] = self.plans
        if self.auto:
            out["memory_limit"] = self.memory_limit
            out["memory_limit_bytes"] = self.memory_limit_bytes
            if self.trial_rounds is not None:
                out["trial_rounds"] = self.trial_rounds
        return out

    @classmethod
    def from_dict(cls, directory: str, value: JSON) -> CheckpointMeta:
        """``meta`` as read from ``directory``'s index, each setting ``restore`` takes checked for its type
        (missing ones are left to the caller; keys it does not know are not read).

        Raises:
            VjpsplitError: ``value`` is not an object, or a setting is not of its type (naming it).
        """
        d = directory
        meta = field_object(d, "meta", value)
        m = meta.get("microbatches")
        if "microbatches" in meta and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise damaged(d, "meta.microbatches", m, "an int >= 1")
        c = meta.get("clip_global_norm")
        if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float)) or not c > 0):
            raise damaged(d, "meta.clip_global_norm", c, "a positive number or null")
        for key in ("schedule", "plans"):
            if key in meta and not isinstance(meta[key], str):
                raise damaged(d, f"meta.{key}", meta[key], "a string")
        for key, kinds in (("memory_limit", (int,)), ("memory_limit_bytes", (int, str))):
            v = meta.get(key)
            if v is None:
                continue
            if not all(isinstance(x, kinds) and not isinstance(x, bool) for x in (v if isinstance(v, list) else [v])):
                raise damaged(d, f"meta.{key}", v, "a limit or one per worker")
        t = meta.get("trial_rounds")
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or t < 0):
            raise damaged(d, "meta.trial_rounds", t, "an int >= 0 or null")
        schedule, optimizer, plans = meta.get("schedule"), meta.get("optimizer"), meta.get("plans")
        return cls(
            schedule=schedule if isinstance(schedule, str) else None,
            optimizer=optimizer if isinstance(optimizer, str) else None,  # for messages only: never refused
            structure=meta.get("structure"),
            microbatches=m if isinstance(m, int) else None,
            clip_global_norm=c if isinstance(c, (int, float)) else None,
            plans=plans if isinstance(plans, str) else None,
            auto="memory_limit" in meta or "memory_limit_bytes" in meta,
            # Checked just above, element by element.
            memory_limit=cast("int | list[int] | None", meta.get("memory_limit")),
            memory_limit_bytes=cast("int | str | list[int | str] | None", meta.get("memory_limit_bytes")),
            trial_rounds=t if isinstance(t, int) else None,
        )


@dataclasses.dataclass(frozen=True)
class HostCheckpoint:
    """What a checkpoint holds, on the host: ``params`` by key, the structure (``encode_structure``'s JSON) and
    key of each of ``params``' leaves, optax's whole-model ``opt_state``, the ``step`` count and ``meta`` (the
    Trainer's settings: a ``CheckpointMeta``, or a mapping of ``meta``'s keys, written as given)."""

    params: Mapping[str, Leaf]
    leaves: Sequence[str]
    structure: JSON
    opt_state: PyTree
    step: int
    meta: CheckpointMeta | Mapping[str, object]


# Layout 1: one stage's ``(params, optimizer state)`` flat by key (typed PRNG keys as such).
StageArrays = tuple[dict[str, np.ndarray], dict[str, Leaf]]


@dataclasses.dataclass(frozen=True)
class Saved:
    """A checkpoint as read, of one of two layouts, each made by its constructor: ``by_model`` (layout 2) fills
    ``params``, ``leaves``, ``structure`` and ``opt_state`` (flat by file key, PRNG keys typed); ``by_stage``
    (layout 1) fills ``stages`` (per stage, ``(params, state)`` flat by key). The other layout's fields are empty."""

    directory: str
    layout: int
    step: int
    meta: CheckpointMeta
    params: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    leaves: list[str] = dataclasses.field(default_factory=list)
    structure: JSON = None
    opt_state: dict[str, Leaf] = dataclasses.field(default_factory=dict)
    stages: list[StageArrays] = dataclasses.field(default_factory=list)

    @classmethod
    def by_model(
        cls,
        directory: str,
        step: int,
        meta: CheckpointMeta,
        params: dict[str, np.ndarray],
        leaves: list[str],
        structure: JSON,
        opt_state: dict[str, Leaf],
    ) -> Saved:
        """A layout 2 checkpoint: keyed by the model."""
        return cls(directory, 2, step, meta, params, leaves, structure, opt_state)

    @classmethod
    def by_stage(cls, directory: str, step: int, meta: CheckpointMeta, stages: list[StageArrays]) -> Saved:
        """A layout 1 checkpoint: one ``(params, state)`` per stage of the cut that wrote it."""
        return cls(directory, 1, step, meta, stages=stages)


def damaged(d: str, field: str, value: object, want: str) -> VjpsplitError:
    """The one-line error for checkpoint ``d`` whose index field ``field`` holds ``value`` instead of ``want``."""
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return VjpsplitError(f"{d}: {INDEX}'s {field} is {shown}, not {want}; the checkpoint is damaged")


def field_count(d: str, field: str, value: object) -> int:
    """``value``, an index field of checkpoint ``d``, checked to be an int >= 0."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise damaged(d, field, value, "an int >= 0")
    return value


def field_strings(d: str, field: str, value: object) -> list[str]:
    """``value``, an index field of checkpoint ``d``, checked to be a list of strings."""
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise damaged(d, field, value, "a list of strings")
    return value


def field_object(d: str, field: str, value: object) -> JSONObject:
    """``value``, an index field of checkpoint ``d``, checked to be a JSON object."""
    if not isinstance(value, dict):
        raise damaged(d, field, value, "an object")
    return value


def field_objects(d: str, field: str, value: object) -> list[JSONObject]:
    """``value``, an index field of checkpoint ``d``, checked to be a list of JSON objects."""
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise damaged(d, field, value, "a list of objects")
    return value
