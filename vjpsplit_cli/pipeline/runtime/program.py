"""A step on one serial device as one compiled program: the plans' actions traced in their order into one call.

Where every stage runs on one and the same device that runs one program at a time (``dispatch.whole_backwards``:
an accelerator's), each operation's call costs the host its dispatch, and the device runs the calls one after
the other either way. On one TPU v5e chip the GPT's stages at width 512 cost the host 370-470 µs a call against
a device time of the same size, so a step of 24 calls was bound by its host
(``benchmarks/results/2026-12-07-tpu-step-program.md``). A step there, timed or not, runs ``StepProgram``: the
workers' operations in the plans' execution order (``dispatch.order_of``), traced once into one jitted
function: each F the stage's ``fwd``, each B (and each I: its W runs nothing, the backward runs whole as
``dispatch.whole_backwards`` asks) its ``bwd`` with the gradient sum, the activations and cotangents handed on
inside. One dispatch a step, the same actions in the same order; XLA sees the whole step.
"""

from __future__ import annotations

import math
import threading
import time
import weakref
from typing import TYPE_CHECKING, Callable, NamedTuple, Protocol, Sequence

import jax

from ...errors import VjpsplitError, raised_line
from ..schedules.ops import Kind, Op
from ..schedules.timeline import Event
from ..stages.exporting import module_flops
from .stagecalls import Forward, signature_of
from .model import Microbatch, side_for
from ...treetypes import PyTree

if TYPE_CHECKING:
    from ...artifact.artifact import Artifact
    from .stagecalls import StageCalls
    from .stageops import RunsOps
    from .dispatch import Order
    from .worker import StageWorker


WARMUP = Forward.WARMUP  # the calls of a signature before it is warm (a timed step's, as ``StageWorker._run``'s)


class Notes(Protocol):
    """What notes a step's operations as they are handed out (``untimed.Dispatched``)."""

    @property
    def now(self) -> object: ...  # the operation being handed out, None between operations

    def begin(self, w: int, op: Op) -> None: ...

    def end(self, w: int, op: Op, out: object, stage: RunsOps) -> None: ...

    def program_step(self) -> None: ...  # the step runs as one compiled program


class StepProgram:
    """One step of a plan's actions on stages that share one serial device, as one jitted call.

    Traced at its first call per input signature; the trace walks ``order``'s computations (``serial_work``: each
    F, and each B or I as the whole backward; a W computes nothing), so the program holds each microbatch's
    residuals from its F to its B as the plan does. Plans of the same computations in the same order (1F1B and
    ZB-H1 on one device) share it. ``peaks`` is, per stage, the most bytes of stored residuals the plan holds at
    an operation's boundary (what ``StageWorker`` reports as ``peak_residual_bytes`` when it runs operation by
    operation; inside one program XLA places the buffers).

    Args:
        workers: The stages' workers, all on one device (``dispatch.whole_backwards``), none offloading.
        order: The operations in execution order (``dispatch.order_of``).
        microbatches: The step's microbatch count.
    """

    def __init__(self, workers: Sequence[StageWorker], order: Order, microbatches: int):
        # What the trace reads of each stage, not the workers (a program outlives them: ``program_for``).
        self.stages = [_Stage(st.art, st.calls, st.is_last, _fused(st, microbatches)) for st in workers]
        self.steps, self.microbatches = serial_work(order), microbatches
        self.peaks = [0] * len(workers)
        self._call = jax.jit(self._trace)
        self._runs: dict[tuple[object, ...], int] = {}  # timed steps: how often the call ran per input signature

    def _trace(
        self, params: list[PyTree], xs: list[PyTree], sides: list[list[list[PyTree]]], cts: list[PyTree]
    ) -> tuple[list[PyTree], list[list[jax.Array]], list[PyTree]]:
        """The step's losses (by microbatch), aux leaves (by microbatch; empty without aux) and per-stage gradient
        sums, from each stage's parameters, the first stage's inputs, the side inputs (by microbatch, by stage)
        and the last stage's starting cotangents (by microbatch)."""
        stages, M = self.stages, self.microbatches
        S = len(stages)
        grads: list[PyTree] = [None] * S
        losses: list[PyTree] = [None] * M
        aux: list[list[jax.Array]] = [[] for _ in range(M)]
        acts: dict[tuple[int, int], PyTree] = {}  # by (stage, microbatch): an F's activation, for the next stage
        # By (stage, microbatch): a backward's input cotangent, for the stage before.
        cots: dict[tuple[int, int], PyTree] = {}
        res: dict[tuple[int, int], PyTree] = {}
        held, peaks = [0] * S, [0] * S
        for s, forward, mb in self.steps:
            st = stages[s]
            if forward:
                x = xs[mb] if s == 0 else acts.pop((s - 1, mb))
                out, r = st.calls.forward._fwd(params[s], x, *sides[mb][s])
                res[(s, mb)] = r
                if mb not in st.fused:  # else its residuals are held past no boundary (as in its call)
                    held[s] += r.stored_nbytes
                    peaks[s] = max(peaks[s], held[s])
                if st.is_last:
                    if st.art.manifest.has_aux:
                        out, a = out
                        aux[mb] = jax.tree_util.tree_leaves(a)
                    losses[mb] = out
                else:
                    acts[(s, mb)] = out
            else:
                ct = cts[mb] if st.is_last else st.art.place_cotangent(cots.pop((s + 1, mb)))
                r = res.pop((s, mb))
                if mb not in st.fused:
                    held[s] -= r.stored_nbytes
                gw, gx = st.calls.backward(r, ct)
                grads[s] = gw if grads[s] is None else jax.tree_util.tree_map(lambda a, b: a + b, grads[s], gw)
                if s > 0:
                    cots[(s, mb)] = gx
        self.peaks = peaks
        return losses, aux, grads

    def run(
        self,
        workers: Sequence[StageWorker],
        order: Order,
        mbs: Sequence[Microbatch],
        scaled: Sequence[PyTree],
        record: Notes | None = None,
        timed: bool = False,
        tick: Callable[[], object] | None = None,
    ) -> None:
        """Run the step and leave its results in the workers as their operations would: each stage's ``grads``, the
        last stage's ``losses`` and ``aux``, ``peak_residual_bytes``, and each operation in its worker's ring.

        Untimed, nothing waits: every operation's ring entry has the program's dispatch time. Timed, the program's
        time is cut among the operations by their FLOPs (``flops_weights``), in the plans' order, each an
        ``Event``; a W (whose I ran the whole backward) an event of no time, as a call that ran in the one before
        it (``measured.step_samples`` then cuts that I's time by FLOPs). A warm call in an in-process timed step
        is dispatched as untimed and its lane's watcher times it (``watcher.Lane.watch_program``); a cold one,
        or one without a lane, is waited for here (run again until warm, as ``StageWorker._run`` does).

        Args:
            workers: The stages' workers (those the program was made for, or others of the same artifacts and
                device).
            order: The step's operations in execution order, of this program's ``serial_work``.
            mbs: The step's microbatches, placed on the device (``dispatch.placed_microbatches``).
            scaled: Per microbatch, the last stage's starting cotangent (placed).
            record: Notes the step's operations (``untimed.Dispatched``): the first as being dispatched while the
                program is, then every one as dispatched.
            timed: Whether to time the step (above).
            tick: Called once per operation once the program ran (a progress bar's).
        """
        S = len(workers)
        args = (
            [st.params for st in workers],
            [x for x, _ in mbs],
            [[list(side_for(side, s, S)) for s in range(S)] for _, side in mbs],
            list(scaled),
        )
        if record is not None and order:
            record.program_step()
            w, op, _ = order[0]
            record.begin(w, op)
        key = signature_of(args) if timed else ()
        cold = timed and self._runs.get(key, 0) < WARMUP
        lane = workers[0].lane if timed and not cold else None  # an in-process timed step's: its watcher times it
        waited = timed and lane is None
        weights = _weights(self.stages, order) if timed else []  # the FLOPs, found before the clock starts
        if waited:
            jax.block_until_ready(args)  # its inputs exist (the batch moved, the last update done): not its time
        t0 = time.monotonic()
        out = self._dispatch(args, f"{len(order)} operations of {S} stages on one device")
        t1 = time.monotonic()
        if timed:
            self._runs[key] = self._runs.get(key, 0) + 1
        if waited:
            t1 = self._waited(args, out, key, cold, t0)
        _leave(workers, out, self.peaks)
        events = [st.events for st in workers]  # this step's lists (the next step's reset makes new ones)

        def record_events(start: float, end: float) -> None:
            for (w, op, _), (a, b) in zip(order, _spans(weights, start, end)):
                events[op.stage].append(Event(w, op.kind, op.mb, a, b, op.stage, b - a))

        if lane is not None:
            lane.watch_program(t0, args, out, record_events)
        elif waited:
            record_events(t0, t1)
        spans = _spans(weights, t0, t1) if waited else [(t0, t1)] * len(order)
        first_loss = out[0][0]  # what says the program finished: its outputs are all ready at once
        for (w, op, _), (a, b) in zip(order, spans):
            st = workers[op.stage]
            st.ring.append((op.kind, op.mb, a, b, waited))
            if record is not None:
                if record.now is None:
                    record.begin(w, op)
                record.end(w, op, first_loss, st)
            if tick is not None:
                tick()

    def _dispatch(
        self, args: tuple[object, ...], what: str
    ) -> tuple[list[PyTree], list[list[jax.Array]], list[PyTree]]:
        """The compiled call on ``args`` (dispatched, not waited for); an error it raises is one ``VjpsplitError``
        naming the program (``what`` it runs: it names no one operation), chained."""
        try:
            return self._call(*args)
        except VjpsplitError:
            raise
        except Exception as e:  # a stage's own error (a host callback in the loss)
            raise VjpsplitError(f"the step's program ({what}) failed: {raised_line(e)}") from e

    def _waited(self, args: tuple[object, ...], out: object, key: tuple[object, ...], cold: bool, t0: float) -> float:
        """When a timed call dispatched at ``t0`` ended, waited for; a ``cold`` one (traced and compiled) is run
        again (the same results) until warm, and a warm run's time counts from ``t0``."""
        jax.block_until_ready(out)
        t1 = time.monotonic()
        if cold:
            while self._runs[key] < WARMUP:
                jax.block_until_ready(self._call(*args))
                self._runs[key] += 1
            a = time.monotonic()
            jax.block_until_ready(self._call(*args))
            t1 = t0 + time.monotonic() - a
        return t1


def _leave(
    workers: Sequence[StageWorker], out: tuple[list[PyTree], list[list[jax.Array]], list[PyTree]], peaks: Sequence[int]
) -> None:
    """The program's results ``(losses, aux, grads)`` where the workers' operations leave theirs: each stage's
    ``grads`` and ``peak_residual_bytes``, the last stage's ``losses`` and ``aux``."""
    losses, aux, grads = out
    for st, g, peak in zip(workers, grads, peaks):
        st.grads, st.peak_residual_bytes = g, peak
    last = workers[-1]
    last.losses = dict(enumerate(losses))
    last.aux = dict(enumerate(aux)) if last.art.manifest.has_aux else {}


class _Stage(NamedTuple):
    """What a ``StepProgram``'s trace reads of one stage."""

    art: Artifact
    calls: StageCalls
    is_last: bool
    fused: frozenset[int]  # the microbatches whose backward directly follows their F (``backward_in_forward``)


def serial_work(order: Order) -> tuple[tuple[int, bool, int], ...]:
    """What a step of ``order`` computes on one serial device, in order: per F and per B or I (the whole backward
    there) its stage, whether it is the forward, and its microbatch (a W: nothing, its I ran it).

    Args:
        order: The operations in execution order (``dispatch.order_of``).

    Returns:
        ``(stage, forward, microbatch)`` per computation.
    """
    return tuple((op.stage, op.kind == Kind.F, op.mb) for _, op, _ in order if op.kind != Kind.W)


def _weights(stages: Sequence[_Stage], order: Order) -> list[float]:
    """Each operation's FLOPs in ``order`` (``flops_weights``; a W: none, its I ran the whole backward)."""
    return [0.0 if op.kind == Kind.W else flops_weights(stages[op.stage].art)[op.kind == Kind.F] for _, op, _ in order]


def _spans(weights: Sequence[float], t0: float, t1: float) -> list[tuple[float, float]]:
    """Each operation's share of ``[t0, t1]`` by its ``weights``, one after the other; one of no weight starts
    where the one before ended and the next a hair later, so that the spans sort by start in their order."""
    total = sum(weights) or 1.0
    spans, t = [], t0
    for wt in weights:
        d = (t1 - t0) * wt / total
        spans.append((t, t + d))
        t = t + d if d > 0 else math.nextafter(t, math.inf)
    return spans


def _fused(st: StageWorker, microbatches: int) -> frozenset[int]:
    return frozenset(m for m in range(microbatches) if st.backward_in_forward(m))


_WEIGHTS: "weakref.WeakKeyDictionary[Artifact, tuple[float, float]]" = weakref.WeakKeyDictionary()


def flops_weights(art: Artifact) -> tuple[float, float]:
    """A stage's whole backward's and forward's FLOPs (``stages.exporting.module_flops``; 1.0 each where XLA gives
    no count), found once per artifact: how a timed ``StepProgram`` cuts its time among the operations.

    Args:
        art: The stage's artifact.

    Returns:
        ``(backward, forward)``.
    """
    got = _WEIGHTS.get(art)
    if got is None:
        f, b = module_flops(art, "fwd"), module_flops(art, "bwd")
        got = _WEIGHTS[art] = (1.0, 1.0) if f is None or b is None or f + b <= 0 else (b, f)
    return got


# The programs of a pipeline's artifacts, kept as long as its first stage's (with its compiled calls, ``stagecalls``):
# every Trainer and step of those stages on one device reuses the compiled call.
_PROGRAMS: "weakref.WeakKeyDictionary[Artifact, dict[tuple[object, ...], StepProgram]]" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def program_for(workers: Sequence[StageWorker], order: Order, microbatches: int) -> StepProgram:
    """The ``StepProgram`` of ``workers``' artifacts computing ``order``, made once and kept (with its compiled
    call): plans of the same ``serial_work`` share it.

    Args:
        workers: The stages' workers (see ``StepProgram``).
        order: The operations in execution order.
        microbatches: The step's microbatch count.

    Returns:
        The program.
    """
    key = (
        tuple(id(w.art) for w in workers),
        tuple(_fused(w, microbatches) for w in workers),
        serial_work(order),
        microbatches,
    )
    with _LOCK:
        per = _PROGRAMS.setdefault(workers[0].art, {})
        prog = per.get(key)
        if prog is None:
            prog = per[key] = StepProgram(workers, order, microbatches)
        return prog
