"""The Trainer's training state read back and written: ``params()``, ``state()``, ``save``, and ``_load`` (``fit``'s).

``TrainerState`` is the part of ``trainer.Trainer`` that gathers the stages'
parameters and optimizer states from the workers into the model's structure and
optax's (``ownership``, ``optax_state``), writes them as a checkpoint keyed by the
model (``checkpoint``) and sets every stage from one (``resume``). ``Trainer``
sets the attributes it declares.

May import ``checkpoint``, ``checkpoint_layout``, ``resume``, ``optax_state``, ``ownership``, ``backend``,
``history``, ``autoplan``, ``option_values`` and ``arguments`` of this room, ``schedules``, and the layers
below ``pipeline``.
"""

from __future__ import annotations

import os

from ...files.trees import encode_structure
from ...treetypes import PyTree
from ..schedules.csvformat import format_schedule
from ..schedules.stepplans import Resolved
from .arguments import Optimizer
from .autoplan import AutoPlan
from .backend import Backend, write_checkpoint
from .checkpoint_layout import HostCheckpoint
from .history import History
from .optax_state import StateMap, state_map
from .option_values import Schedule
from .ownership import Ownership
from .resume import stage_snapshots


class TrainerState:
    """``Trainer``'s parameters, optax state and checkpoints (the module docstring); its attributes are the
    Trainer's."""

    backend: Backend
    ownership: Ownership
    optimizer: Optimizer
    optimizer_name: str
    _state_map: StateMap | None
    _history: History
    step_count: int
    microbatches: int
    clip_global_norm: float | None
    schedule: Schedule
    plan: Resolved
    auto: AutoPlan | None

    def params(self) -> PyTree:
        """The parameters now.

        Returns:
            The parameters in the structure the Trainer was given (host arrays; one pytree per stage in the
            per-stage form).
        """
        return self.ownership.gather([p for p, _ in self.backend.snapshots()])

    def state(self) -> tuple[PyTree, PyTree]:
        """The training state now, in the form a one-process optax loop (or orbax) keeps it.

        Returns:
            ``(params, opt_state)``: ``params`` as ``params()`` gives them, ``opt_state`` optax's own state for
            the whole model, as ``optimizer.init(params)`` and the same updates give it in one process (its
            structure, its values; a value tied to no parameter, such as a step count, once). Host arrays.

        Raises:
            VjpsplitError: a tied leaf's state differs between the stages that hold it.
        """
        snaps = self.backend.snapshots()
        return self.ownership.gather([p for p, _ in snaps]), self._states().gather([st for _, st in snaps])

    def _states(self) -> StateMap:
        if self._state_map is None:
            self._state_map = state_map(self.optimizer, self.ownership)
        return self._state_map

    def host_checkpoint(self) -> HostCheckpoint:
        """What ``save`` writes, copied to host memory (the copy ``fit`` waits for before writing in the background).

        Returns:
            A ``HostCheckpoint``: the parameters by key, ``state()``'s ``opt_state``, the step count and the
            settings ``restore`` uses.
        """
        snaps = self.backend.snapshots()
        flat = self.ownership.flat([p for p, _ in snaps])
        params = self.ownership.gather([p for p, _ in snaps])
        smap = self._states()
        opt_state = smap.gather([st for _, st in snaps])
        return HostCheckpoint(flat, smap.leaf_keys, encode_structure(params), opt_state, self.step_count, self._meta())

    def _meta(self) -> dict[str, object]:
        meta: dict[str, object] = {
            "schedule": self.plan.name,
            "optimizer": self.optimizer_name,
            "structure": self.ownership.structure,
            "microbatches": self.microbatches,
            "clip_global_norm": self.clip_global_norm,
        }
        if self.schedule.plans is not None:
            meta["plans"] = format_schedule(self.plan.plans)
        if self.auto is not None:
            meta.update(self.auto.record())  # restore measures again, on its own hosts
        return meta

    def save(self, directory: str | os.PathLike[str]) -> None:
        """Write the parameters, optax's whole-model optimizer state and the step count to ``directory`` (all or
        nothing), keyed by the model's parameter paths, not by stage: any ``Stages`` of the same function
        restores it (``restore``), and so does a one-process loop (``load_checkpoint``).

        The checkpoint also records what ``restore`` needs to go on: the schedule (its plans,
        when they were the caller's), the microbatches and ``clip_global_norm``. A save replaces the whole
        directory, so a ``directory`` holding files no save wrote is refused (naming one), never emptied.

        Args:
            directory: the checkpoint directory (created, or replaced whole).

        Raises:
            VjpsplitError: ``directory`` is a file, cannot be written, or holds files no save wrote.
        """
        write_checkpoint(self.backend, directory, self.host_checkpoint())

    def _load(self, directory: str | os.PathLike[str]) -> None:
        """Set every stage, and the step count, to the checkpoint in ``directory`` (saved by any cut of the same
        function; one an older vjpsplit wrote per stage only by this cut). This Trainer's settings stay. ``fit``
        resumes with it (``checkpoint_dir=``, and after a lost worker); users restore with ``Trainer.restore``.

        Every saved parameter is checked against the dtype and shape this Trainer holds first: a mismatch is
        one error naming the leaf, and the Trainer keeps its parameters.

        Args:
            directory: a checkpoint ``save`` (or ``fit``) wrote.

        Raises:
            VjpsplitError: a missing or damaged checkpoint (naming the file or field), a leaf of another dtype
                or shape, a leaf missing or unexpected, an optimizer state of another structure.
        """
        snapshots, step = stage_snapshots(directory, self.ownership, self._states(), self.optimizer)
        self.backend.load(snapshots)
        self.step_count = step
        self._history.rewind(step)
