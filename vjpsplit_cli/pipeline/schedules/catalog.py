"""The built-in schedules by name: their labels, which split the backward, and what each needs of the stages.

``check_schedule`` refuses an unknown name, or stage and microbatch counts the
named schedule cannot run, before any list is built. ``Schedule`` is what every
runner's ``schedule=`` takes beside a name: a name, plans, or ``"auto"`` with its limits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ...errors import VjpsplitError
from ...files.sizes import plain
from .ops import Op

SCHEDULES = ("gpipe", "1f1b", "zbh1", "zbv", "interleaved1f1b", "dualpipev")
SPLIT_BACKWARD = ("zbh1", "zbv", "dualpipev")  # schedules that split (some) backwards into I and W
LABELS = {
    "gpipe": "GPipe",
    "1f1b": "1F1B",
    "zbh1": "ZB-H1",
    "zbv": "ZB-V",
    "interleaved1f1b": "Interleaved 1F1B",
    "dualpipev": "DualPipeV",
    "custom": "Custom schedule",
}
V_SHAPED = ("zbv", "dualpipev")  # worker w holds stages w and 2p-1-w
CHUNKS = 2  # interleaved 1F1B's stages per worker when only a name is given (Megatron-LM's usual choice)
AUTO = "auto"  # the Trainer's schedule planned from the measured costs (``training.autoplan``)

Plans = Sequence[Sequence[Op]]
MemoryLimit = int | Sequence[int]
MemoryLimitBytes = int | str | Sequence[int | str]


def describe(name: str) -> str:
    """A schedule's label for titles and messages."""
    return LABELS.get(name, name)


def check_schedule(name: str, num_stages: int, microbatches: int | None = None, chunks: int = CHUNKS) -> None:
    """Refuse an unknown schedule, an empty pipeline, or stages and microbatches the schedule cannot run.

    ``microbatches=None`` checks only what the stages decide.
    """
    S = num_stages
    if name not in SCHEDULES:
        raise VjpsplitError(f"unknown schedule {name!r}; use one of {', '.join(SCHEDULES)}")
    if S < 1 or (microbatches is not None and microbatches < 1):
        raise VjpsplitError("a pipeline needs at least one stage and one microbatch")
    if name in V_SHAPED and S % 2:
        raise VjpsplitError(
            f"{LABELS[name]} runs two stages per worker in a V: it needs an even number of stages, not {S}"
        )
    if name == "interleaved1f1b":
        if chunks < 1 or S % chunks:
            raise VjpsplitError(
                f"interleaved 1F1B with {chunks} stages per worker needs a multiple of {chunks} stages, not "
                f"{S}; for another count pass schedule=Schedule(plans=schedule('interleaved1f1b', S, m, chunks=v))"
            )
        p = S // chunks
        if microbatches is not None and microbatches % p:
            raise VjpsplitError(
                f"interleaved 1F1B on {p} workers needs a multiple of {p} microbatches, not {microbatches}"
            )
    if name == "dualpipev" and microbatches is not None and microbatches < S:
        raise VjpsplitError(
            f"DualPipeV on {S // 2} workers needs at least {S} microbatches (2 per worker), not {microbatches}"
        )


@dataclass(frozen=True)
class Schedule:
    """What each worker runs in a step: a built-in schedule, plans, or ``"auto"`` within a memory limit.

    Every runner's ``schedule=`` takes a name (``"zbh1"``, the same as ``Schedule("zbh1")``) or a ``Schedule``.
    ``"auto"`` (the Trainer's only) times the first step and runs ``auto_schedule``'s plans for the measured costs.

    Args:
        name: ``gpipe``, ``1f1b``, ``zbh1``, ``zbv``, ``interleaved1f1b``, ``dualpipev`` or ``"auto"`` (default:
            ``1f1b``, or the plans').
        plans: One list of operations per worker, as ``read_schedule`` returns them (checked by ``check_plans``;
            the schedule's name is then ``"custom"``).
        memory_limit: ``"auto"`` only: the most microbatches a worker holds at once, an int or one per worker.
        memory_limit_bytes: ``"auto"`` only: bytes per worker (an int or a size such as ``"2GiB"``, or one per worker).
        trial_rounds: ``"auto"`` only: the steps each plan the model rates close runs at least before the fastest is
            kept (default 3; 0 keeps the model's choice without trial steps).

    Raises:
        VjpsplitError: Both ``name`` and ``plans``; both memory limits, or one (or ``trial_rounds``) for a schedule
            other than ``"auto"``; a name that is no schedule's (the message lists them); ``trial_rounds`` < 0.
    """

    name: str | None = None
    plans: Plans | None = None
    memory_limit: MemoryLimit | None = None
    memory_limit_bytes: MemoryLimitBytes | None = None
    trial_rounds: int | None = None

    def __post_init__(self) -> None:
        if self.name is not None and not isinstance(self.name, str):
            raise VjpsplitError(f"Schedule(name={self.name!r}): give a schedule's name as a string, or plans as plans=")
        if self.name is not None and self.name not in (*SCHEDULES, AUTO):
            raise VjpsplitError(
                f"unknown schedule {self.name!r}; use one of {', '.join(SCHEDULES)}, or {AUTO!r} (plans for the "
                "measured costs)"
            )
        if self.name is not None and self.plans is not None:
            raise VjpsplitError(
                f"Schedule(name={self.name!r}, plans=...): give a schedule's name or its plans, not both"
            )
        object.__setattr__(self, "memory_limit", plain(self.memory_limit))
        object.__setattr__(self, "memory_limit_bytes", plain(self.memory_limit_bytes))
        if self.memory_limit is not None and self.memory_limit_bytes is not None:
            raise VjpsplitError("give memory_limit (microbatches) or memory_limit_bytes, not both")
        limited = self.memory_limit is not None or self.memory_limit_bytes is not None
        if limited and self.name != AUTO:
            raise VjpsplitError(
                f"memory_limit and memory_limit_bytes apply to Schedule('auto'), not to {self.label!r}: "
                f"write Schedule('auto', memory_limit=...), or leave the limit out"
            )
        object.__setattr__(self, "trial_rounds", plain(self.trial_rounds))
        rounds = self.trial_rounds
        if rounds is not None:
            if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
                raise VjpsplitError(
                    f"Schedule(trial_rounds={rounds!r}): give the steps each close candidate runs, an int >= 0"
                )
            if self.name != AUTO:
                raise VjpsplitError(
                    f"trial_rounds applies to Schedule('auto'), not to {self.label!r}: leave it out, or write "
                    "Schedule('auto', trial_rounds=...)"
                )

    @property
    def label(self) -> str:
        """The schedule's name: ``name``, or ``"custom"`` for plans, ``"1f1b"`` when neither is given."""
        if self.plans is not None:
            return "custom"
        return self.name if self.name is not None else "1f1b"

    @property
    def auto(self) -> bool:
        """Whether this is ``"auto"``: plans chosen from the measured costs."""
        return self.name == AUTO


def schedule_of(schedule: str | Schedule | Plans | None) -> Schedule:
    """A runner's ``schedule=`` as a ``Schedule``: a name, plans (``read_schedule``'s form, as the contract
    writes them: ``Schedule(plans=plans)``), or one already (``None``: ``1f1b``).

    Raises:
        VjpsplitError: anything but a name, plans or a ``Schedule``.
    """
    if schedule is None:
        return Schedule()
    if isinstance(schedule, Schedule):
        return schedule
    if isinstance(schedule, str):
        return Schedule(schedule)
    if isinstance(schedule, (list, tuple)):
        return Schedule(plans=schedule)
    raise VjpsplitError(f"schedule={schedule!r}: give a schedule's name, plans or a Schedule")
