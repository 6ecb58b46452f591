"""``Trainer.fit``: the steps of a run from ``data``, checkpoints written beside the next steps, restarts after a
lost Ray worker.

* ``data(step)`` (or ``data[step]``) gives step ``step``'s batch, steps counted
  from 0 of the run; ``steps`` is the run's total, so a Trainer at step k runs
  k ... steps-1, and ``fit`` returns the losses of the steps it ran.
* With ``checkpoint_dir``, a checkpoint already there is where ``fit`` begins
  (any cut of the same function; logged at INFO on this module's
  ``logging`` logger, with the step), and one is saved after every
  ``checkpoint_every``-th step and after the last. The step only waits for the
  copy of the state to host memory (``Trainer.host_checkpoint``); a thread
  writes the files while the next steps run (``CheckpointWriter``: one write at a
  time; an error comes back at the next step, or when ``fit`` ends; the last
  checkpoint is complete when ``fit`` returns). On a ``jax.distributed`` job every process copies the
  state and process 0 writes it; a failed write is every process's error at the next checkpoint or
  at the end (``CheckpointWriter``).
* On Ray, a worker whose actor dies (``WorkerLost``: Ray reports it, so nothing
  waits for ``step_timeout``) is replaced with the same actor options, every
  worker returns to the last checkpoint, and the steps since run again from
  ``data``: the losses and parameters are those of a run that never failed.
  More failures than ``max_restarts``, or no checkpoint to return to, is one
  error naming the worker and the step.
* A run with nothing left to train (the Trainer, or the checkpoint it resumed from, already at or past
  ``steps``) is a ``UserWarning`` naming the step and the fix; ``fit`` returns ``[]``.
* ``checkpoint_dir`` is checked before the first step (``checkpoint.check_directory``),
  after taking back a checkpoint a cut-short save left aside (``checkpoint.tidy``); one
  that overlaps the Trainer's offload directory or ``trace_dir`` is refused then too
  (``safeio.outputs.check_apart``: a save replaces the whole directory).
* A loss or gradient norm that is not finite stops the run (``stop_on_nonfinite``)
  before its checkpoint is submitted, so the last checkpoint stays the last finite step.
* ``callback(step, loss, rerun=...)`` where the callback takes ``rerun``: True for a
  step this call already ran (it returned to a checkpoint after a lost worker).
* With ``eval_data`` and ``eval_every``, ``Trainer.evaluate`` runs after every
  ``eval_every``-th step and after the last (``evaluations``), its loss in the
  step's history row as ``eval_loss`` (``StepRecord.eval_loss``, and its aux as ``eval_aux`` for stages with aux:
  the row is replaced, records are frozen).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import os
import threading
import time
import warnings
from typing import Callable, Mapping, Protocol, Sequence

from ...errors import VjpsplitError, one_line
from ...safeio.outputs import check_apart
from ..runtime.ray.waiting import WorkerLost
from .checkpoint import save_checkpoint
from .checkpoint_directory import check_directory, has_checkpoint, tidy
from .checkpoint_layout import HostCheckpoint
from ...treetypes import PyTree
from ..schedules.stepplans import Resolved
from ..stages.microbatches import Microbatches
from .backend import Backend
from .distributed_backend import DistributedBackend
from .history import CheckpointTime, RestartRecord, StepRecord

LOG = logging.getLogger(__name__)
Batch = tuple[PyTree, ...] | Microbatches  # a step's batch: the function's batch tuple, or its microbatches one by one


class Fitted(Protocol):
    """What ``fit`` uses of the ``Trainer`` it runs (a protocol, not the class: ``trainer`` imports this module)."""

    @property
    def step_count(self) -> int:
        """The optimizer steps taken so far."""
        ...

    @property
    def plan(self) -> Resolved:
        """The schedule the steps run (its layout names the workers in errors)."""
        ...

    @property
    def backend(self) -> Backend:
        """Where the stages run (``replace`` after a lost worker)."""
        ...

    @property
    def history(self) -> list[StepRecord]:
        """One record per step; ``fit`` replaces the last one to add its ``eval_loss``."""
        ...

    @property
    def checkpoint_times(self) -> list[CheckpointTime]:
        """Per checkpoint ``fit`` wrote: the step's wait and the write."""
        ...

    @property
    def restarts(self) -> list[RestartRecord]:
        """Per lost worker ``fit`` replaced: the step, where it returned, how long."""
        ...

    def step(self, batch: Batch) -> float | tuple[float, PyTree]:
        """One optimizer step on ``batch``; its loss (``(loss, aux)`` for stages with aux)."""
        ...

    def evaluate(self, batch: Batch) -> float | tuple[float, PyTree]:
        """The loss on ``batch`` from the stages' forwards only (``(loss, aux)`` for stages with aux)."""
        ...

    def host_checkpoint(self) -> HostCheckpoint:
        """The state ``save`` writes, copied to host memory."""
        ...

    def _load(self, directory: str | os.PathLike[str]) -> None:
        """Every stage, and the step count, set to the checkpoint in ``directory``."""
        ...


class CheckpointWriter:
    """Writes checkpoints to ``directory`` in a thread of its own, one at a time, from host copies.

    ``times`` (a list it appends to) keeps, per checkpoint, the step it follows,
    how long the step waited (the host copy, and any write still running) and how
    long the files took to write.

    On a ``jax.distributed`` job (``job``), every process copies the state (gathered) and process 0 writes it; the
    others write nothing (their ``write`` time is 0). A failed write is every process's error at the same point,
    the next ``submit`` or the end of ``fit`` (``wait``), where the processes agree on it (``DistributedBackend.agree``).
    """

    def __init__(
        self, directory: str | os.PathLike[str], times: list[CheckpointTime], job: DistributedBackend | None = None
    ):
        self.directory = directory
        self.thread: threading.Thread | None = None
        self.done = threading.Event()
        self.done.set()
        self.error: tuple[int, BaseException] | None = None
        self.times = times
        self.last_step: int | None = None  # the step of the last checkpoint submitted
        self.job = job
        self.failed: tuple[int, BaseException] | None = None  # on a job: this process's failed write, not yet agreed

    def submit(self, host_copy: Callable[[], HostCheckpoint]) -> None:
        """Wait for the write before (raising its error), copy the state to host memory, write it in a thread."""
        t0 = time.monotonic()
        self.wait()
        ck = host_copy()
        row = CheckpointTime(step=ck.step, wait=time.monotonic() - t0, write=float("nan"))
        self.last_step = ck.step
        at = len(self.times)
        self.times.append(row)

        if self.job is not None and not self.job.writes_checkpoints:
            self.times[at] = dataclasses.replace(row, write=0.0)
            return
        done = self.done = threading.Event()

        def write() -> None:
            t1 = time.monotonic()
            try:
                save_checkpoint(self.directory, ck)
            except BaseException as e:  # noqa: BLE001 - handed to the thread that runs the steps
                if self.job is None:
                    self.error = (ck.step, e)
                else:
                    self.failed = (ck.step, e)
            finally:
                self.times[at] = dataclasses.replace(row, write=time.monotonic() - t1)
                done.set()

        self.thread = threading.Thread(target=write, name="vjpsplit-checkpoint")
        self.thread.start()

    def check(self) -> None:
        """Raise the error of a write that failed (once)."""
        if self.error is not None:
            (step, e), self.error = self.error, None
            raise VjpsplitError(
                f"{os.fspath(self.directory)}: the checkpoint after step {step} was not written ({one_line(e)})"
            ) from e

    def wait(self, *, check: bool = True) -> None:
        """Until the write in flight is done; then its error, if any (``check``).

        Waits on an event the write sets last, not on ``Thread.join``: Python 3.11's join, interrupted
        (Ctrl-C), marks a thread still running as stopped, and a second join then returns at once.
        """
        self.done.wait()
        self.thread = None
        if self.job is not None:
            self._agree()
        if check:
            self.check()

    def _agree(self) -> None:
        """On a job: every process learns whether the last write failed (in process 0), at the same point."""
        assert self.job is not None
        failed, self.failed = self.failed, None
        said = self.job.agree(None if failed is None else one_line(failed[1]))
        if said is not None:
            step = self.last_step if failed is None else failed[0]
            self.error = (-1 if step is None else step, VjpsplitError(said))

    def finish(self) -> None:
        """While an error leaves ``fit``: until the write in flight is done, through further Ctrl-Cs (a write
        takes seconds; cut short, its temp directory would stay until the next save sweeps it)."""
        while not self.done.is_set():
            try:
                self.done.wait()
            except KeyboardInterrupt:
                continue
        self.thread = None


def _batch_source(data: Callable[[int], Batch] | Sequence[Batch], steps: int) -> Callable[[int], Batch]:
    if callable(data):
        return data
    if isinstance(data, Sequence) and not isinstance(data, (str, bytes)):
        if len(data) < steps:
            raise VjpsplitError(
                f"data holds {len(data)} batches and steps={steps}; give one batch per step, or a function of the step"
            )
        return data.__getitem__
    raise VjpsplitError(
        f"data is a {type(data).__name__}; pass a function of the step number (data(step) -> batch) or a sequence of batches"
    )


def _reported(callback: Callable[..., object] | None) -> Callable[[int, float, bool], object] | None:
    """``callback`` as ``fit`` calls it, ``(step, loss, rerun)``: ``rerun=`` by keyword to a callback that takes
    it (a parameter ``rerun``, or ``**kwargs``), else ``callback(step, loss)`` as before."""
    if callback is None:
        return None
    if not callable(callback):
        raise VjpsplitError(f"callback is a {type(callback).__name__}; pass a function callback(step, loss)")
    try:
        params = inspect.signature(callback).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: the old two arguments
        params = ()  # type: ignore[assignment]
    if any(
        p.kind is p.VAR_KEYWORD or (p.name == "rerun" and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD))
        for p in params
    ):
        return lambda k, loss, rerun: callback(k, loss, rerun=rerun)
    return lambda k, loss, rerun: callback(k, loss)


def _nonfinite(trainer: Fitted, k: int, loss: float, writer: CheckpointWriter | None) -> VjpsplitError | None:
    """The error that stops ``fit`` at step ``k`` if its loss or gradient norm is not finite."""
    norm = trainer.history[-1].grad_norm if trainer.history else 0.0
    if math.isfinite(loss) and math.isfinite(norm):
        return None
    where = ""
    if writer is not None:
        last = writer.last_step
        where = (
            f"; the checkpoint in {os.fspath(writer.directory)} keeps the state after {last} steps (fit with this "
            "checkpoint_dir goes back to it)"
            if last is not None
            else "; no checkpoint was written in this run"
        )
    return VjpsplitError(
        f"step {k}: the loss is {loss} and the gradients' global norm {norm}: training stopped, this Trainer "
        f"holds the parameters that step gave{where}; lower the learning rate, clip (clip_global_norm=), or pass "
        "stop_on_nonfinite=False to train on"
    )


def _check_options(
    steps: int, checkpoint_dir: str | os.PathLike[str] | None, checkpoint_every: int | None, max_restarts: int
) -> None:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise VjpsplitError(f"steps={steps!r}; pass the run's total number of steps, an int >= 0")
    if checkpoint_every is not None:
        if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int) or checkpoint_every < 1:
            raise VjpsplitError(f"checkpoint_every={checkpoint_every!r}; pass a number of steps >= 1, or None")
        if checkpoint_dir is None:
            raise VjpsplitError("checkpoint_every is given without checkpoint_dir; say where the checkpoints go")
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise VjpsplitError(f"max_restarts={max_restarts!r}; pass an int >= 0")


def _warn_if_done(step_count: int, steps: int, checkpoint_dir: str | os.PathLike[str] | None) -> None:
    """A ``UserWarning`` when ``fit`` has no step to run: the Trainer (or the checkpoint in ``checkpoint_dir`` it
    resumed from) is already at or past ``steps``."""
    if step_count < steps:
        return
    where = (
        f"the Trainer is at step {step_count}"
        if checkpoint_dir is None
        else f"the checkpoint in {os.fspath(checkpoint_dir)} is at step {step_count}"
    )
    fix = "" if checkpoint_dir is None else ", or another checkpoint_dir to start over"
    warnings.warn(
        f"fit trains nothing: {where} and steps={steps} is the run's total; pass steps > {step_count} to go on{fix}",
        stacklevel=4,  # Trainer.fit's caller
    )


def evaluations(
    eval_data: Batch | Callable[[int], Batch] | None, eval_every: int | None
) -> Callable[[int], Batch] | None:
    """``eval_data`` as ``batch(step)`` for the steps to evaluate after; None without it. Refuses one without the
    other and an ``eval_every`` that is not a number of steps >= 1."""
    if eval_data is None and eval_every is None:
        return None
    if eval_data is None or eval_every is None:
        raise VjpsplitError("fit evaluates with both eval_data (a batch, or eval_data(step)) and eval_every (steps)")
    if isinstance(eval_every, bool) or not isinstance(eval_every, int) or eval_every < 1:
        raise VjpsplitError(f"eval_every={eval_every!r}; pass a number of steps >= 1")
    return eval_data if callable(eval_data) else (lambda step: eval_data)


def fit(
    trainer: Fitted,
    data: Callable[[int], Batch] | Sequence[Batch],
    steps: int,
    *,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    checkpoint_every: int | None = None,
    max_restarts: int = 0,
    callback: Callable[..., object] | None = None,
    stop_on_nonfinite: bool = True,
    eval_data: Batch | Callable[[int], Batch] | None = None,
    eval_every: int | None = None,
    apart: Mapping[str, str | os.PathLike[str] | None] | None = None,
) -> list[float]:
    """``trainer.fit``'s work (see ``Trainer.fit`` and the module docstring); returns the losses of the steps run.
    ``apart``: the Trainer's other directories by option (offload, traces), which ``checkpoint_dir`` must not
    overlap."""
    _check_options(steps, checkpoint_dir, checkpoint_every, max_restarts)
    if max_restarts and isinstance(trainer.backend, DistributedBackend):
        raise VjpsplitError(
            f"fit(max_restarts={max_restarts}): a jax.distributed job cannot replace a lost process from inside; "
            "give max_restarts=0 and a checkpoint_dir, and restart the job (its launcher) to resume there"
        )
    if checkpoint_dir is not None:
        check_apart({"fit(checkpoint_dir=...)": checkpoint_dir, **(apart or {})})
    eval_batch = evaluations(eval_data, eval_every)
    batch = _batch_source(data, steps)
    report = _reported(callback)
    job = trainer.backend if isinstance(trainer.backend, DistributedBackend) else None
    writer = None if checkpoint_dir is None else CheckpointWriter(checkpoint_dir, trainer.checkpoint_times, job)
    resumed = None if checkpoint_dir is None or writer is None else _resume(trainer, checkpoint_dir, steps, writer)
    _warn_if_done(trainer.step_count, steps, resumed)
    start, failures = trainer.step_count, 0
    reached = start  # steps below this one ran already in this call (a restart runs them again)
    losses: list[float] = []
    lost: set[int] = set()  # workers to replace before the next step
    found = 0.0  # when the first of them was found lost (time.monotonic)
    try:
        while trainer.step_count < steps or lost:  # a worker lost after the last step: its checkpoint too
            k = trainer.step_count
            try:
                if lost:
                    _replace_lost_workers(trainer, sorted(lost), k, writer, found)
                    lost = set()
                    start = min(start, trainer.step_count)
                    del losses[trainer.step_count - start :]
                    continue
                if writer is not None:
                    writer.check()
                got = trainer.step(batch(k))
                loss = got[0] if isinstance(got, tuple) else got  # the aux is in the step's history row
                losses.append(loss)
                if report is not None:
                    report(k, loss, k < reached)
                reached = max(reached, k + 1)
                if stop_on_nonfinite:
                    bad = _nonfinite(trainer, k, loss, writer)
                    if bad is not None:
                        raise bad
                done = k + 1
                if eval_batch is not None and (done == steps or done % (eval_every or 1) == 0):
                    last, evaluated = trainer.history[-1], trainer.evaluate(eval_batch(done))
                    eval_loss, eval_aux = evaluated if isinstance(evaluated, tuple) else (evaluated, None)
                    trainer.history[-1] = dataclasses.replace(last, eval_loss=eval_loss, eval_aux=eval_aux)
                if writer is not None and (
                    done == steps or (checkpoint_every is not None and done % checkpoint_every == 0)
                ):
                    writer.submit(trainer.host_checkpoint)  # the copy to host: on Ray, from every actor
            except WorkerLost as e:
                found = found if lost else time.monotonic()
                failures += 1
                _refuse_unless_recoverable(trainer, e, trainer.step_count, failures, max_restarts, writer)
                lost |= set(e.workers)
    except BaseException:
        if writer is not None:
            writer.finish()  # the error on its way out is the one to see; the write still finishes
        raise
    if writer is not None:
        writer.wait()
    return losses


def _resume(
    trainer: Fitted, checkpoint_dir: str | os.PathLike[str], steps: int, writer: CheckpointWriter
) -> str | os.PathLike[str] | None:
    """Before the first step: ``checkpoint_dir`` tidied and checked, and the trainer at its checkpoint if it holds
    one (logged); returns the directory resumed from, or None."""
    if os.path.isdir(os.path.dirname(os.path.abspath(os.fspath(checkpoint_dir)))):
        tidy(checkpoint_dir)  # a checkpoint a cut-short save left aside comes back first
    check_directory(checkpoint_dir)  # before the first step, not at the first save
    if not has_checkpoint(checkpoint_dir):
        return None
    trainer._load(checkpoint_dir)
    LOG.info(
        "fit resumes from the checkpoint in %s, after step %d of steps=%d",
        os.fspath(checkpoint_dir),
        trainer.step_count,
        steps,
    )
    writer.last_step = trainer.step_count
    return checkpoint_dir


def _refuse_unless_recoverable(
    trainer: Fitted, e: WorkerLost, step: int, failures: int, max_restarts: int, writer: CheckpointWriter | None
) -> None:
    """The one error when a lost worker is not to be replaced: too many failures, or no checkpoint."""
    names = ", ".join(trainer.plan.layout.label(w) for w in e.workers) or "a stage"
    what = f"{names}: its Ray actor was lost at step {step} ({e.reason})"
    if failures > max_restarts:
        allowed = "allows no restart" if max_restarts == 0 else f"allows {max_restarts}, and this is failure {failures}"
        raise VjpsplitError(f"{what}; max_restarts={max_restarts} {allowed}") from None
    if writer is None:
        raise VjpsplitError(f"{what}; there is no checkpoint to return to: pass fit checkpoint_dir=") from None
    writer.wait()
    if not has_checkpoint(writer.directory):
        raise VjpsplitError(
            f"{what}; there is no checkpoint in {os.fspath(writer.directory)} to return to yet "
            "(a smaller checkpoint_every writes one sooner)"
        ) from None
    if not e.workers:
        raise VjpsplitError(f"{what}; Ray does not say which worker it was, so none can be replaced") from None


def _replace_lost_workers(
    trainer: Fitted, workers: Sequence[int], step: int, writer: CheckpointWriter | None, found: float
) -> None:
    """Replace the lost workers and take every worker back to the last checkpoint (``found``: when the loss was
    seen, on ``time.monotonic``'s clock)."""
    if writer is None:
        raise VjpsplitError("a lost worker with no checkpoint_dir: nothing to return to")  # refused before
    t0 = time.monotonic()
    trainer.backend.replace(workers)
    trainer._load(writer.directory)
    trainer.restarts.append(
        RestartRecord(
            step=step,
            workers=tuple(workers),
            returned_to=trainer.step_count,
            found_at=found,
            recovery_time=time.monotonic() - t0,
        )
    )
