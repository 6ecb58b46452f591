"""The Trainer's options gathered (``Options``): its ``stages``, ``schedule``, ``runner`` and ``observe`` as typed values.

The typed values (``Schedule``, ``InProcess``, ``Ray``, ``Observe``, ``PerStage``) are
``option_values``'s, also importable from here; ``options_of`` makes them from the
Trainer's arguments (a schedule's name, a runner's name).

May import ``option_values`` and ``ownership`` of this room, ``stages``, and the layers below ``pipeline``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ...artifact.artifact import Artifact
from ..schedules.catalog import schedule_of
from ..stages.directory import Stages
from .option_values import InProcess as InProcess
from .option_values import Observe, PerStage, Runner, Schedule, runner_of


@dataclass(frozen=True)
class Options:
    """The Trainer's ``stages``, ``schedule``, ``runner`` and ``observe`` as typed values."""

    stages: Stages | PerStage | Sequence[Artifact]
    schedule: Schedule | None  # None: not given (the Trainer's 1f1b; restore's recorded schedule)
    runner: Runner
    observe: Observe


def options_of(
    stages: Stages | PerStage | Sequence[Artifact],
    schedule: str | Schedule | None,
    runner: str | Runner,
    observe: Observe | None,
) -> Options:
    """The typed options from the Trainer's arguments: names made values, ``observe=None`` the default ``Observe``.

    ``schedule=None`` stays ``None`` (``restore`` reads the recorded schedule then).

    Raises:
        VjpsplitError: a schedule or runner that is neither a name nor its value (plans given bare: the message
            says ``Schedule(plans=plans)``); an unknown name.
    """
    new_schedule = None if schedule is None else schedule_of(schedule)
    return Options(stages, new_schedule, runner_of(runner), Observe() if observe is None else observe)
