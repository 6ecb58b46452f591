"""Waiting on Ray for a step: the one step-timeout wait, and a dead actor named by the stages it held.

``wait_step`` waits for a step's object references until its deadline (updating a
progress bar, if given, as each completes) and names the worker of the first one
still pending when time is up; ``get`` fetches values, turning Ray's actor error
into one line naming the stages of every actor that is gone (a ``WorkerLost``,
which also says which workers they were, for the Trainer to replace them).
"""

from __future__ import annotations

import time
from types import ModuleType
from typing import TYPE_CHECKING, Callable, Sequence, TypeVar

from ....errors import VjpsplitError
from ...schedules.layout import Layout
from ..dispatch import ProgressBar
from ..hang_report import StepInterrupted
from .setup import ActorHandle

if TYPE_CHECKING:
    from ray import ObjectRef

T = TypeVar("T")


class WorkerLost(VjpsplitError):
    """A Ray actor died: ``workers`` are the indices of those gone, ``reason`` Ray's word for it."""

    def __init__(self, message: str, workers: Sequence[int], reason: str):
        super().__init__(message)
        self.workers, self.reason = list(workers), reason


def wait_step(
    ray: ModuleType,
    refs: Sequence[object],
    owners: Sequence[int],
    deadline: float,
    step_timeout: float,
    layout: Layout,
    *,
    hint: str = "",
    bar: ProgressBar | None = None,
    watch: Sequence[object] = (),
    on_stop: Callable[[], None] | None = None,
    describe: Callable[[], str] | None = None,
) -> None:
    """Wait until every ref in ``refs`` (worker ``owners[i]``'s) is done or ``deadline`` (``time.monotonic``) passes.

    Past the deadline: one error naming the first late worker's stages and ``step_timeout``, then ``hint``.
    ``watch``: refs that fail when their actor dies (each worker's list of the step), checked as they
    complete; one that failed ends the wait at once, so that ``get`` names the actor. Before either,
    ``on_stop()`` releases the other workers (which may be waiting for the one gone).
    ``fetch_local=False``: completion only, no values copied here. ``describe()``: what each worker is doing
    (asked before ``on_stop`` releases them), appended to the error past the deadline or on Ctrl-C (then a
    ``StepInterrupted``).
    """
    owner = {id(r): w for r, w in zip(refs, owners)}
    watched = {id(r) for r in watch}
    pending = [*refs, *(r for r in watch if id(r) not in owner)]
    for w, r in enumerate(watch):  # worker w's list
        owner.setdefault(id(r), w)
    while pending:
        want = 1 if bar is not None or watched else len(pending)
        left = max(deadline - time.monotonic(), 0.0)
        try:
            ready, pending = ray.wait(pending, num_returns=min(want, len(pending)), fetch_local=False, timeout=left)
        except KeyboardInterrupt as e:
            detail = describe() if describe is not None else ""
            if on_stop is not None:
                on_stop()
            raise StepInterrupted(f"the step was interrupted{detail}") from e
        if bar is not None:
            bar.update(len(ready))
        if any(id(r) in watched and _failed(ray, r) for r in ready):
            if on_stop is not None:
                on_stop()
            return
        if pending and not ready:
            detail = describe() if describe is not None else ""
            if on_stop is not None:
                on_stop()
            late = sorted({owner[id(r)] for r in pending})
            raise VjpsplitError(
                f"{layout.label(late[0])}: the step did not finish within step_timeout={step_timeout:g} s{detail}{hint}"
            )


def _failed(ray: ModuleType, ref: object) -> bool:
    """Whether a completed ``ref`` holds an error (its actor died) rather than a value."""
    try:
        ray.get(ref)
    except ray.exceptions.RayError:
        return True
    return False


def get(ray: ModuleType, refs: Sequence[ObjectRef[T]], actors: Sequence[ActorHandle], layout: Layout) -> list[T]:
    """``ray.get(refs)``, with a dead actor reported by the stages it held."""
    try:
        return list(ray.get(list(refs)))
    except ray.exceptions.RayActorError as e:
        pings = [a.clock.remote() for a in actors]  # all at once: a live actor still busy answers in turn
        deadline = time.monotonic() + 30
        dead = []
        for w, ping in enumerate(pings):
            try:
                ray.get(ping, timeout=max(deadline - time.monotonic(), 0.1))
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                dead.append(w)
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        names = ", ".join(layout.label(w) for w in dead) or "a stage"
        raise WorkerLost(
            f"{names}: its Ray actor died ({why}); build a new RayPipeline to run again", dead, why
        ) from None
