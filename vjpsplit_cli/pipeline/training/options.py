"""The Trainer's options gathered (``Options``): its ``stages``, ``schedule``, ``runner`` and ``observe`` as typed values.

The typed values (``Schedule``, ``InProcess``, ``Ray``, ``Observe``, ``PerStage``) are
``option_values``'s, also importable from here; ``options_of`` makes them from the
Trainer's arguments (a schedule's name, a runner's name), and from the keywords the
user-facing contract writes for them (``ContractKeywords``: ``schedule_name=``,
``memory_limit=``, ``memory_limit_bytes=``, ``devices=``, ``address=``), each the same
as a field of ``schedule=`` or ``runner=``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence, TypedDict

import jax

from ...artifact.artifact import Artifact
from ...errors import VjpsplitError
from ..schedules.catalog import MemoryLimit, MemoryLimitBytes, Plans, schedule_of
from ..stages.directory import Stages
from .option_values import Distributed as Distributed
from .option_values import InProcess as InProcess
from .option_values import Observe, PerStage, Ray, Runner, Schedule, runner_of


class ContractKeywords(TypedDict, total=False):
    """The Trainer's keywords as the user-facing contract writes them (docs/contract.md), each a field of a value.

    ``schedule_name``, ``memory_limit`` and ``memory_limit_bytes`` are ``Schedule``'s ``name``,
    ``memory_limit`` and ``memory_limit_bytes``; ``devices`` is ``InProcess``'s (with ``runner="inprocess"``),
    ``address`` ``Ray``'s (with ``runner="ray"``). ``None`` is the same as not giving one.
    """

    schedule_name: str | None
    memory_limit: MemoryLimit | None
    memory_limit_bytes: MemoryLimitBytes | None
    devices: Sequence[Sequence[jax.Device]] | None
    address: str | None


_SCHEDULE_KEYWORDS = {
    "schedule_name": "name",
    "memory_limit": "memory_limit",
    "memory_limit_bytes": "memory_limit_bytes",
}


@dataclass(frozen=True)
class Options:
    """The Trainer's ``stages``, ``schedule``, ``runner`` and ``observe`` as typed values."""

    stages: Stages | PerStage | Sequence[Artifact]
    schedule: Schedule | None  # None: not given (the Trainer's 1f1b; restore's recorded schedule)
    runner: Runner
    observe: Observe


def options_of(
    stages: Stages | PerStage | Sequence[Artifact],
    schedule: str | Schedule | Plans | None,
    runner: str | Runner,
    observe: Observe | None,
    keywords: Mapping[str, object] | None = None,
    caller: str = "Trainer",
) -> Options:
    """The typed options from the Trainer's arguments: names and plans made values, ``observe=None`` the default.

    ``schedule=None`` stays ``None`` (``restore`` reads the recorded schedule then).

    Args:
        stages: The Trainer's ``stages``.
        schedule: A name, plans, a ``Schedule`` or ``None``.
        runner: A runner's name or value.
        observe: An ``Observe`` or ``None``.
        keywords: The contract's keywords given (``ContractKeywords``).
        caller: The call the messages name.

    Returns:
        The ``Options``.

    Raises:
        TypeError: a keyword that is none of ``ContractKeywords`` (as Python says for any call).
        VjpsplitError: a schedule or runner that is neither a name nor its value; an unknown name; a keyword
            and the value it is a field of given together (``schedule_name=`` with ``schedule=``); ``devices=``
            for a runner other than ``"inprocess"``, ``address=`` for one other than ``"ray"``.
    """
    given = {k: v for k, v in (keywords or {}).items() if v is not None}
    unknown = sorted(set(keywords or {}) - set(ContractKeywords.__annotations__))
    if unknown:
        raise TypeError(f"{caller}() got an unexpected keyword argument {unknown[0]!r}")
    fields = {_SCHEDULE_KEYWORDS[k]: v for k, v in given.items() if k in _SCHEDULE_KEYWORDS}
    if fields:
        if schedule is not None:
            names = ", ".join(f"{k}=" for k in given if k in _SCHEDULE_KEYWORDS)
            raise VjpsplitError(f"{caller}({names}) and schedule= say the same thing: give one of them")
        schedule = Schedule(**fields)  # type: ignore[arg-type]  # the fields' types are ContractKeywords'
    for key, cls in (("devices", InProcess), ("address", Ray)):
        if key not in given:
            continue
        if runner != cls.name:
            raise VjpsplitError(
                f"{caller}({key}=) is {cls.__name__}'s: give runner={cls.__name__}({key}=...) (or "
                f"runner={cls.name!r} with {key}=), not runner={runner!r}"
            )
        runner = cls(**{key: given[key]})  # type: ignore[arg-type]  # devices or address, as typed above
    new_schedule = None if schedule is None else schedule_of(schedule)
    return Options(stages, new_schedule, runner_of(runner), Observe() if observe is None else observe)
