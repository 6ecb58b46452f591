"""The Trainer's options gathered (``Options``), and the keywords they replace.

The typed values (``Schedule``, ``InProcess``, ``Ray``, ``Observe``, ``PerStage``) are
``option_values``'s, also importable from here. The keywords they replace
(``schedule_name=``, ``memory_limit=``, ``devices=``, ``address=``, ``progress=``,
``tied=``, ...) still work this release: ``LEGACY`` says where each one's value now
goes, and ``from_legacy`` builds the new values from them, with one
``DeprecationWarning`` per group naming the form to write. Giving a group's old
keyword and its new value together is one error.

May import ``option_values`` and ``ownership`` of this room, ``stages``, and the layers below ``pipeline``.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any, Mapping, Sequence, TypedDict

import jax

from ...artifact.artifact import Artifact
from ...errors import VjpsplitError
from ..runtime.runners import check_runner
from ..stages.directory import Stages
from .option_values import Distributed as Distributed
from .option_values import InProcess as InProcess
from .option_values import MemoryLimit, MemoryLimitBytes, Observe, PathLike, PerStage, Plans, Ray, Runner, Schedule
from .option_values import runner_of, schedule_of
from .ownership import Tied


class Deprecated(TypedDict, total=False):
    """The Trainer's keywords before its option values; each still works this release, with a ``DeprecationWarning``.

    ``LEGACY`` says where each one's value goes now.
    """

    schedule_name: str
    memory_limit: MemoryLimit | None
    memory_limit_bytes: MemoryLimitBytes | None
    devices: Sequence[Sequence[jax.Device]] | None
    data_parallel: int
    address: str | None
    runtime_env: Mapping[str, object] | None
    actor_options: Sequence[Mapping[str, object]] | None
    schedule_timeout: float
    progress: bool
    timeline: bool
    trace_dir: PathLike | None
    trace_every: int | None
    step_timeout: float
    hang_report: PathLike | None
    tied: Tied | None


# Every old keyword: the Trainer argument its value goes in now, and that value's field. One row per keyword;
# a keyword another release adds to a value is one more row here (and a field there, and a key of Deprecated).
LEGACY: dict[str, tuple[str, str]] = {
    "schedule_name": ("schedule", "name"),
    "memory_limit": ("schedule", "memory_limit"),
    "memory_limit_bytes": ("schedule", "memory_limit_bytes"),
    "devices": ("runner", "devices"),
    "data_parallel": ("runner", "data_parallel"),
    "address": ("runner", "address"),
    "runtime_env": ("runner", "runtime_env"),
    "actor_options": ("runner", "actor_options"),
    "schedule_timeout": ("runner", "schedule_timeout"),
    "progress": ("observe", "progress"),
    "timeline": ("observe", "timeline"),
    "trace_dir": ("observe", "trace_dir"),
    "trace_every": ("observe", "trace_every"),
    "step_timeout": ("observe", "step_timeout"),
    "hang_report": ("observe", "hang_report"),
    "tied": ("stages", "tied"),
}


@dataclass(frozen=True)
class Options:
    """The Trainer's ``stages``, ``schedule``, ``runner`` and ``observe`` as typed values."""

    stages: Stages | PerStage | Sequence[Artifact]
    schedule: Schedule | None  # None: not given (the Trainer's 1f1b; restore's recorded schedule)
    runner: Runner
    observe: Observe


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else "..."


def _form(kind: str, fields: Mapping[str, object]) -> str:
    """How to write ``fields`` in the new form, e.g. ``Schedule(name='auto', memory_limit=8)``."""
    inner = ", ".join(f"{k}={_shown(v)}" for k, v in fields.items())
    if kind == "PerStage":
        return f"PerStage(artifacts, {inner or 'tied=...'})"
    return f"{kind}({inner})"


def _fields_of(built: object, fields: Mapping[str, object]) -> dict[str, object]:
    """The given ``fields`` that ``built`` (the new value) has: what the new form spells out."""
    if not dataclasses.is_dataclass(built):
        return {}
    names = {f.name for f in dataclasses.fields(built)}
    return {k: v for k, v in fields.items() if k in names}


def from_legacy(
    caller: str,
    stages: Stages | PerStage | Sequence[Artifact],
    schedule: str | Plans | Schedule | None,
    runner: str | Runner,
    observe: Observe | None,
    old: Mapping[str, object],
) -> Options:
    """The typed options from the new arguments and any old keywords (``old``), warning once per group of them.

    ``caller`` names the call in the messages (``Trainer`` or ``Trainer.restore``). The warning names the
    value to write instead; ``schedule=None`` stays ``None`` where no old keyword sets it (``restore`` reads
    the recorded schedule then).

    Raises:
        TypeError: a keyword that is neither a parameter nor an old one (as Python says for any call).
        VjpsplitError: an old keyword and the new value it goes into given together (e.g. ``schedule_name=``
            with ``schedule=``, ``devices=`` with ``runner=InProcess(...)``); a keyword of one runner given for
            the other (``devices=`` with ``runner="ray"``).
    """
    unknown = sorted(set(old) - set(LEGACY))
    if unknown:
        raise TypeError(f"{caller}() got an unexpected keyword argument {unknown[0]!r}")
    groups: dict[str, dict[str, Any]] = {}
    for key, value in old.items():
        target, field = LEGACY[key]
        groups.setdefault(target, {})[field] = value
    new_schedule: Schedule | None = None if schedule is None else schedule_of(schedule)
    new_runner = runner
    new_observe = Observe() if observe is None else observe
    given = {"schedule": schedule is not None, "observe": observe is not None}
    given["runner"] = isinstance(runner, (InProcess, Ray, Distributed))
    given["stages"] = isinstance(stages, PerStage)
    for target, fields in groups.items():
        names = ", ".join(f"{k}=" for k in old if LEGACY[k][0] == target)
        if given[target]:
            raise VjpsplitError(
                f"{caller}({names}) and {target}= say the same thing: give it once, as {target}= "
                f"(the old keywords are deprecated)"
            )
        kind, built = _built(target, fields, runner, stages)
        if isinstance(built, Schedule):
            new_schedule = built
        elif isinstance(built, (InProcess, Ray, Distributed)):
            new_runner = built
        elif isinstance(built, Observe):
            new_observe = built
        else:
            stages = built
        warnings.warn(
            f"{caller}({names}) is deprecated and goes in a later release: write "
            f"{target}={_form(kind, _fields_of(built, fields))} "
            f"(vjpsplit_cli.pipeline.{kind})",
            DeprecationWarning,
            stacklevel=3,
        )
    return Options(stages, new_schedule, runner_of(new_runner), new_observe)


def _built(
    target: str, fields: dict[str, Any], runner: str | Runner, stages: Stages | PerStage | Sequence[Artifact]
) -> tuple[str, Schedule | Observe | Runner | Stages | PerStage | Sequence[Artifact]]:
    """The new value an old group's ``fields`` make: its class's name and the value."""
    if target == "schedule":
        return "Schedule", Schedule(**fields)
    if target == "observe":
        return "Observe", Observe(**fields)
    if target == "stages":
        tied = fields["tied"]
        if not tied:
            return "PerStage", stages
        if not isinstance(stages, Sequence):
            raise VjpsplitError(
                "tied= names the tied leaves of the per-stage form (a list of artifacts); a Stages knows its own"
            )
        return "PerStage", PerStage(stages, tied)
    check_runner(str(runner))  # a name here: from_legacy refused old runner keywords beside an InProcess or Ray
    local = {k: v for k, v in fields.items() if k in ("devices", "data_parallel")}
    ray = {k: v for k, v in fields.items() if k != "devices"}  # data_parallel is both runners'
    if runner == Ray.name:
        if local.get("devices") is not None:
            raise VjpsplitError(
                "devices= places the stages of this process; a Ray worker runs on the devices its actor sees "
                "(give each worker num_gpus or resources in actor_options)"
            )
        return "Ray", Ray(**ray)
    ray = {k: v for k, v in ray.items() if k not in local}
    if ray:
        raise VjpsplitError(
            f"{', '.join(f'{k}=' for k in ray)} configure Ray's actors, but the runner is {runner!r}: "
            f"write runner={_form('Ray', ray)} to run on Ray, or leave them out"
        )
    return "InProcess", InProcess(**local)
