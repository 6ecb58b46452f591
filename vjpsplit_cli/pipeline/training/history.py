"""What a Trainer keeps of its steps: one record per step (``StepRecord``), per checkpoint ``fit`` wrote
(``CheckpointTime``) and per lost worker it replaced (``RestartRecord``), a progress bar over steps, the loss curve.

The records are frozen dataclasses read by attribute (``row.loss``); ``as_dict()`` gives one as JSON.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import statistics
from typing import Hashable, Protocol, Sequence

from ...treetypes import JSONObject, PyTree
from ..runtime.result import PipelineResult
from ..schedules.plots import plot_loss
from ...artifact.artifact import Artifact


SLOWER = 1.15  # a worker's compute this far above its peers' ...
IN_A_ROW = 3  # ... for this many timed steps in a row is a straggler


def cost_signature(artifact: Artifact) -> tuple[tuple[str, tuple[int | str, ...]], ...]:
    """What makes two stages cost the same: their inputs' (parameters', activations') shapes and dtypes, not their
    names (a transformer's blocks share one signature)."""
    return tuple((leaf.dtype, tuple(leaf.shape)) for leaf in artifact.manifest.inputs)


class Stragglers:
    """Workers whose compute in a timed step is ``SLOWER`` times their peers' median for ``IN_A_ROW`` timed steps
    in a row. A worker's peers are those whose stages have the same cost signature (``cost_signature``); a
    worker without peers is never named (a heavier stage is not a slow worker)."""

    def __init__(self, groups: Sequence[Hashable]):
        self.groups = list(groups)
        self.streak = [0] * len(self.groups)

    def see(self, busy: Sequence[float]) -> tuple[list[int], list[int]]:
        """One timed step's busy seconds per worker: the stragglers now, and those newly named (to warn of)."""
        now, new = [], []
        for w, b in enumerate(busy):
            peers = [busy[v] for v, g in enumerate(self.groups) if v != w and g == self.groups[w]]
            self.streak[w] = self.streak[w] + 1 if peers and b >= SLOWER * statistics.median(peers) else 0
            if self.streak[w] >= IN_A_ROW:
                now.append(w)
                if self.streak[w] == IN_A_ROW:
                    new.append(w)
        return now, new


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One step of ``Trainer.history``.

    Attributes:
        step: The step count after this step (the first step is 1).
        loss: The step's loss, the mean over microbatches.
        grad_norm: The gradients' global norm before clipping.
        step_time: Seconds the step took, from the caller's side.
        bubble: The fraction of the workers' time idle in the step's measured timeline (0 to 1).
        modeled_bubble: The same fraction in the schedule's modeled timeline (0 to 1).
        schedule: Under ``schedule="auto"``, what ran (the measuring step's schedule, then ``"auto"``); else None.
        modeled_makespan: Under ``schedule="auto"``, the plans' makespan under the measured costs, seconds; else None.
        measuring: Under ``schedule="auto"``, True on the timed first steps that measure the costs.
        busy: A timed step's compute seconds per worker; None for an untimed step.
        stragglers: A timed step's workers 15% or more above their peers for 3 timed steps; None untimed.
        eval_loss: ``fit(eval_data=..., eval_every=...)``'s loss after this step (``Trainer.evaluate``); else None.
        trial: Under ``schedule="auto"``, on a trial step, the candidate it ran (``autoplan``); else None.
        aux: The step's aux as the Trainer's ``aux=`` says (``step_aux``), not in ``as_dict``; else None.
        eval_aux: The aux of ``eval_loss``'s evaluation, likewise; else None.
    """

    step: int
    loss: float
    grad_norm: float
    step_time: float
    bubble: float
    modeled_bubble: float
    schedule: str | None = None
    modeled_makespan: float | None = None
    measuring: bool = False
    busy: tuple[float, ...] | None = None
    stragglers: tuple[int, ...] | None = None
    eval_loss: float | None = None
    trial: str | None = None
    aux: PyTree = dataclasses.field(default=None, compare=False)  # arrays: no ==
    eval_aux: PyTree = dataclasses.field(default=None, compare=False)

    def as_dict(self) -> JSONObject:
        """The record as JSON, the dict a row was before it was typed.

        Returns:
            Every field by name, the optional ones only where set (``measuring`` only when True).
        """
        row: JSONObject = {
            "step": self.step,
            "loss": self.loss,
            "grad_norm": self.grad_norm,
            "step_time": self.step_time,
            "bubble": self.bubble,
            "modeled_bubble": self.modeled_bubble,
        }
        if self.schedule is not None:
            row["schedule"] = self.schedule
        if self.modeled_makespan is not None:
            row["modeled_makespan"] = self.modeled_makespan
        if self.measuring:
            row["measuring"] = True
        if self.busy is not None:
            row["busy"] = [b for b in self.busy]
        if self.stragglers is not None:
            row["stragglers"] = [w for w in self.stragglers]
        if self.eval_loss is not None:
            row["eval_loss"] = self.eval_loss
        if self.trial is not None:
            row["trial"] = self.trial
        return row


@dataclasses.dataclass(frozen=True)
class CheckpointTime:
    """One checkpoint of ``Trainer.checkpoint_times`` (``fit`` with ``checkpoint_dir``).

    Attributes:
        step: the step count the checkpoint holds the state after.
        wait: seconds the steps waited for it (the copy to host memory, and any write still running).
        write: seconds the files took to write, in the background; NaN while the write runs.
    """

    step: int
    wait: float
    write: float

    def as_dict(self) -> JSONObject:
        """The record as JSON, the dict an entry was before it was typed.

        Returns:
            ``step``, ``wait`` and ``write``.
        """
        return {"step": self.step, "wait": self.wait, "write": self.write}


@dataclasses.dataclass(frozen=True)
class RestartRecord:
    """One lost Ray worker ``fit`` replaced, in ``Trainer.restarts``.

    Attributes:
        step: the step count when the loss was found.
        workers: the workers replaced (indices into the layout's workers).
        returned_to: the step count of the checkpoint every worker went back to.
        found_at: when the loss was found, seconds on ``time.monotonic``'s clock.
        recovery_time: seconds from replacing the workers to holding the checkpoint again.
    """

    step: int
    workers: tuple[int, ...]
    returned_to: int
    found_at: float
    recovery_time: float

    def as_dict(self) -> JSONObject:
        """The record as JSON, the dict an entry was before it was typed.

        Returns:
            ``step``, ``workers`` (a list), ``returned_to``, ``found_at`` and ``recovery_time``.
        """
        return {
            "step": self.step,
            "workers": [w for w in self.workers],
            "returned_to": self.returned_to,
            "found_at": self.found_at,
            "recovery_time": self.recovery_time,
        }


class _Bar(Protocol):
    """What ``History`` calls of a tqdm bar."""

    def set_postfix(self, *, loss: str, refresh: bool) -> None: ...

    def update(self, n: int) -> object: ...

    def close(self) -> None: ...


class History:
    """Per step: the loss, the gradients' global norm (before clipping), the step time, the measured and
    modeled bubble; ``progress=True`` shows a tqdm bar over steps with the loss (where tqdm is installed)."""

    def __init__(self, progress: bool, first_step: int):
        self.rows: list[StepRecord] = []
        self.progress, self.first_step = progress, first_step
        self._bar: _Bar | None = None

    def record(
        self,
        step: int,
        result: PipelineResult,
        grad_norm: float,
        step_time: float,
        auto: tuple[str, float | None, bool, str | None] | None = None,
        busy: tuple[tuple[float, ...], tuple[int, ...]] | None = None,
        aux: PyTree = None,
    ) -> None:
        """Step ``step``'s row, and the bar moved on. ``auto``: an automatic schedule's ``(schedule,
        modeled_makespan, measuring, trial)``; ``busy``: a timed step's ``(busy, stragglers)``; ``aux``: the
        step's aux (None without)."""
        schedule, makespan, measuring, trial = (None, None, False, None) if auto is None else auto
        seconds, stragglers = (None, None) if busy is None else busy
        self.rows.append(
            StepRecord(
                step=step,
                loss=result.loss,
                grad_norm=grad_norm,
                step_time=step_time,
                bubble=result.bubble_ratio,
                modeled_bubble=result.modeled_bubble_ratio,
                schedule=schedule,
                modeled_makespan=makespan,
                measuring=measuring,
                busy=seconds,
                stragglers=stragglers,
                trial=trial,
                aux=aux,
            )
        )
        self._show(result.loss)

    def rewind(self, step: int) -> None:
        """Forget the rows after step ``step`` (the run returned to a checkpoint there)."""
        self.rows = [row for row in self.rows if row.step <= step]

    def _show(self, loss: float) -> None:
        if not self.progress:
            return
        if self._bar is None:
            try:
                from tqdm import tqdm
            except ImportError:
                self.progress = False
                return
            self._bar = tqdm(desc="train", unit="step", file=sys.stderr, initial=self.first_step + len(self.rows) - 1)
        self._bar.set_postfix(loss=f"{loss:.4g}", refresh=False)
        self._bar.update(1)

    def plot(self, path: str | os.PathLike[str], title: str) -> None:
        """A PNG of the loss per step (needs matplotlib)."""
        plot_loss([row.loss for row in self.rows], path, title)

    def close(self) -> None:
        """Close the progress bar."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
