"""Measured costs: every stage's F, B and W seconds and the send time, from the timelines of timed steps.

``CostSamples`` keeps, for the last ``COST_STEPS`` timed steps (steps whose
events are the operations' compute times), each operation's seconds by stage
and kind, and the send gaps; ``costs`` gives them in the form
``auto_schedule`` takes (``MeasuredCosts``): medians over those steps' microbatches. A Trainer's
first step counts only until another step is timed: it is the first run of
every call (on 2 shared cores the mid GPT's first step timed its operations at
up to 1.9 times what later steps did, compiling left out; docs/howto/schedules.md).

* **F, B, W.** A split backward's I and W are timed as they ran: the costs'
  ``B`` (the input part's time) and ``W``. A whole backward (B) timed on a stage
  that has the split backward is cut into those two by the stage's own FLOPs:
  XLA's count of its ``bwd_input`` and ``bwd_weight`` modules (half each where
  the backend counts none). A stage without the split has only whole backwards:
  ``B`` is all of it and ``W`` is 0, which is what ``auto_schedule`` charges such
  a stage (B + W).
* **Each operation's own time.** An operation's time starts once its inputs
  exist on its device (the activation or cotangent moved there, the batch's
  transfer and the previous step's update done) and ends when its results do.
  An operation whose call was cold (the first runs of a signature: ``fwd``'s
  checked call, then the jitted one compiling; a jitted backward's compile) is
  run again by its worker until warm, and one warm run timed (``Event.own``):
  that is what it counts, in any step and on any runner (Ray's actors time
  their own). An operation that ran warm while this process traced, lowered or
  compiled (``jax.monitoring``'s compile events), slowed by it on a shared host,
  is left out; where that leaves none of a stage and kind, its last one counts.
* **Sends.** ``gap`` is the median gap from the end of an operation to the start
  of the one on the next worker that reads its result (F to the next stage's F,
  a B or I to the previous stage's B or I), counted only where that worker was idle
  (its previous operation had ended): the time from a result existing to the
  next worker computing on it. It costs nothing beyond the timeline the step
  keeps anyway, but it holds more than the send: the receiving worker's wake-up
  and, on a shared host, its wait for a core (on Ray also the clock offsets
  measured at start; a negative gap counts as 0). ``Trainer.costs()``'s ``comm``,
  what ``auto`` plans with, is the send measured apart (``measure_copy_seconds``
  in-process, ``RayPipeline.probe_delivery`` on Ray); the gap stands in only where
  that cannot be measured.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections import deque
from time import perf_counter  # the transfer probe's clock, apart from the step clock tests replace
from typing import Callable, Collection, NotRequired, Sequence, TypedDict

import jax
import numpy as np

from ...artifact.artifact import Artifact
from ...errors import VjpsplitError
from ..runtime.offload import to_host_and_back
from ..runtime.result import PipelineResult
from ..schedules.ops import BACKWARDS, Kind
from ..schedules.timeline import Event, one_per_op
from ..stages.exporting import module_flops

COST_STEPS = 16  # the timed steps whose operation times ``costs`` takes medians over
COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)
_compiles: deque[tuple[float, float]] = deque(maxlen=4096)  # this process's latest compile phases, monotonic seconds

# One timed step: per (stage, kind) the operations' seconds (kind B: a whole backward, I: its input part); the send gaps.
Step = tuple[dict[tuple[int, str], list[float]], list[float]]


@functools.cache
def listen_for_compiles() -> None:
    """From now on, note when this process traces, lowers or compiles (once per process)."""
    jax.monitoring.register_event_duration_secs_listener(_noted)


def _noted(event: str, duration_secs: float, **kwargs: str | int) -> None:
    if event in COMPILE_EVENTS:
        end = time.monotonic()
        _compiles.append((end - duration_secs, end))


def counted(events: Sequence[Event]) -> dict[tuple[int, str], list[Event]]:
    """The operations whose times count, by stage and kind (``Kind``'s letters); see the module docstring."""
    t0, t1 = min((e.start for e in events), default=0.0), max((e.end for e in events), default=0.0)
    spans = [(a, b) for a, b in list(_compiles) if b > t0 and a < t1]
    groups: dict[tuple[int, str], list[Event]] = {}
    for e in sorted(events, key=lambda e: e.start):
        groups.setdefault((e.stage, str(e.kind)), []).append(e)
    out = {}
    for key, group in groups.items():
        # A cold call's own warm run was timed apart from its compile: it counts, though its span overlaps one.
        keep = [e for e in group if e.own is not None or not any(a < e.end and e.start < b for a, b in spans)]
        out[key] = keep or group[-1:]
    return out


def seconds(e: Event) -> float:
    """An operation's own seconds: its warm run's where its call was cold, else its span."""
    return e.own if e.own is not None else e.end - e.start


FUSED = {"B": "F", "I": "F", "W": "I"}  # an operation that can run in the call of the one before it: that one


def step_samples(result: PipelineResult, share: Callable[[int, str, str], float] | None = None) -> Step:
    """One timed step's counted operation seconds by stage and kind, and its send gaps (on a stage with replicas,
    each on its own device, its first replica's copy of each operation counts).

    An operation that ran in the call of the one before it (``StageWorker.reset``: the last stage's B or I in its
    F's, the first stage's W in its I's; its event has ``own`` 0.0 and no span) counts as its own kind with its
    share of that call's time: ``share(stage, first, then)`` is ``first``'s share (by the stage's FLOPs; 0.5
    without it). An F whose call ran I and W too (a whole backward on one device) is cut in three: F's share of
    F and B, then I's of I and W."""
    events = one_per_op(result.events)
    ran_before = {
        (e.stage, e.mb, FUSED[str(e.kind)]): str(e.kind)
        for e in events
        if str(e.kind) in FUSED and e.own == 0.0 and e.end == e.start
    }
    ops = counted(events)
    keys = {(e.kind, e.mb, e.stage) for group in ops.values() for e in group}
    times: dict[tuple[int, str], list[float]] = {}
    for (stage, kind), group in ops.items():
        for e in group:
            then = ran_before.get((stage, e.mb, kind))
            if (stage, e.mb, FUSED.get(kind)) in ran_before and ran_before[(stage, e.mb, FUSED[kind])] == kind:
                continue  # ran in the call before it: counted there
            if then is None:
                times.setdefault((stage, kind), []).append(seconds(e))
                continue
            after = ran_before.get((stage, e.mb, then)) if then == "I" else None  # F, I and W in one call
            if after is not None:
                f = 0.5 if share is None else share(stage, kind, "B")
                i = 0.5 if share is None else share(stage, then, after)
                times.setdefault((stage, kind), []).append(seconds(e) * f)
                times.setdefault((stage, then), []).append(seconds(e) * (1.0 - f) * i)
                times.setdefault((stage, after), []).append(seconds(e) * (1.0 - f) * (1.0 - i))
                continue
            cut = 0.5 if share is None else share(stage, kind, then)
            times.setdefault((stage, kind), []).append(seconds(e) * cut)
            times.setdefault((stage, then), []).append(seconds(e) * (1.0 - cut))
    return times, send_gaps(events, result.num_stages, keys)


def send_gaps(
    events: Sequence[Event], num_stages: int, counted: Collection[tuple[str, int, int]] | None = None
) -> list[float]:
    """Seconds from a result's end to the next worker starting on it, where that worker was idle (and, given
    ``counted``, its operation's ``(kind, mb, stage)`` is among them)."""
    by_op = {(e.kind, e.mb, e.stage): e for e in events}
    backward = {(e.mb, e.stage): e for e in events if e.kind in BACKWARDS}  # what hands on each cotangent
    before: dict[tuple[str, int, int], float] = {}  # each op's worker's previous op's end (-inf: none)
    last: dict[int, float] = {}
    for e in sorted(events, key=lambda e: e.start):
        before[(e.kind, e.mb, e.stage)] = last.get(e.worker, float("-inf"))
        last[e.worker] = e.end
    gaps = []
    for (kind, mb, s), e in by_op.items():
        if kind == Kind.F and s > 0:
            src = by_op.get((Kind.F, mb, s - 1))
        elif kind in BACKWARDS and s < num_stages - 1:
            src = backward.get((mb, s + 1))
        else:
            continue
        if counted is not None and (kind, mb, s) not in counted:
            continue
        if src is not None and src.worker != e.worker and before[(kind, mb, s)] <= src.end:
            gaps.append(max(0.0, e.start - src.end))
    return gaps


class TimelineCosts(TypedDict):
    """What timed steps' timelines give: every stage's operation seconds (``F``, ``B``: its input part, ``W``:
    its weight part, one entry per stage) and ``gap``, the median idle gap from a result to the next worker
    starting on it, seconds (the module docstring)."""

    F: list[float]
    B: list[float]
    W: list[float]
    gap: float


class MeasuredCosts(TypedDict):
    """``Trainer.costs()``: the ``TimelineCosts`` and ``comm``, one send between stages measured apart, seconds;
    ``transfer``: bytes per second of a residual copy off a device (``out``) and back (``back``)."""

    F: list[float]
    B: list[float]
    W: list[float]
    comm: float
    gap: NotRequired[float]
    transfer: NotRequired[dict[str, float]]


class CostSamples:
    """The operation times of the last ``COST_STEPS`` timed steps; ``costs`` gives their medians per stage."""

    def __init__(self, artifacts: Sequence[Artifact]):
        self.artifacts = list(artifacts)
        self.steps: deque[Step] = deque(maxlen=COST_STEPS)
        self.first: Step | None = None  # the Trainer's first step, while it is the only one timed
        listen_for_compiles()
        self._shares: dict[int, float] = {}
        self._forward_shares: dict[int, float] = {}

    def add(self, result: PipelineResult, first: bool) -> None:
        """Keep a timed step's samples (``first``: the Trainer's first step)."""
        if first:
            self.first = step_samples(result, self.share)
        else:
            self.steps.append(step_samples(result, self.share))

    def share(self, stage: int, first: str, then: str) -> float:
        """``first``'s share of one call that ran ``first`` and ``then`` on stage ``stage`` (``step_samples``):
        F of F and B, F of F and I, I of I and W (the whole backward), by the stage's FLOPs."""
        if first == "I":
            return self.input_share(stage)
        f = self.forward_share(stage)
        if then == "B":
            return f
        i = self.input_share(stage)
        return f / (f + (1.0 - f) * i) if f + (1.0 - f) * i > 0 else 0.5

    def forward_share(self, stage: int) -> float:
        """The share of stage ``stage``'s forward and whole backward FLOPs in its forward, by XLA; 0.5 if unknown."""
        if stage not in self._forward_shares:
            art = self.artifacts[stage]
            f, b = module_flops(art, "fwd"), module_flops(art, "bwd")
            self._forward_shares[stage] = f / (f + b) if f is not None and b is not None and f + b > 0 else 0.5
        return self._forward_shares[stage]

    def input_share(self, stage: int) -> float:
        """The share of stage ``stage``'s backward FLOPs in its input part (``bwd_input``), by XLA; 0.5 if unknown."""
        if stage not in self._shares:
            art = self.artifacts[stage]
            b, w = module_flops(art, "bwd_input"), module_flops(art, "bwd_weight")
            self._shares[stage] = b / (b + w) if b is not None and w is not None and b + w > 0 else 0.5
        return self._shares[stage]

    def kept(self) -> list[Step]:
        """The timed steps' samples ``costs`` takes medians over: the last ``COST_STEPS`` timed steps, else the
        Trainer's first step.

        Raises:
            VjpsplitError: No timed step has run yet.
        """
        kept = list(self.steps) or ([self.first] if self.first is not None else [])
        if not kept:
            raise VjpsplitError(
                "no timed step has run yet: run trainer.step(batch, timed=True) first "
                "(schedule='auto' times its first step itself)"
            )
        return kept

    def costs(self, kept: Sequence[Step] | None = None) -> TimelineCosts:
        """``{"F": [...], "B": [...], "W": [...], "gap": g}`` in seconds: medians over the kept steps (``kept``:
        other samples, such as every process's of a ``jax.distributed`` job, merged)."""
        kept = self.kept() if kept is None else kept
        merged: dict[tuple[int, str], list[float]] = {}
        gaps: list[float] = []
        for ops, g in kept:
            for k, v in ops.items():
                merged.setdefault(k, []).extend(v)
            gaps.extend(g)

        def median(stage: int, kind: str) -> float | None:
            v = merged.get((stage, kind))
            return statistics.median(v) if v else None

        F, B, W = [], [], []
        for s, art in enumerate(self.artifacts):
            F.append(median(s, "F") or 0.0)
            b, w, whole = median(s, "I"), median(s, "W"), median(s, "B")
            if b is None or w is None:  # no split backward timed: the whole one, cut where the stage can split
                whole = whole if whole is not None else b or 0.0
                share = self.input_share(s) if art.manifest.splits_backward else 1.0
                b, w = whole * share, whole * (1.0 - share)
            B.append(b)
            W.append(w)
        return {"F": F, "B": B, "W": W, "gap": statistics.median(gaps) if gaps else 0.0}


PROBE_BYTES = 4 << 20  # what one transfer probe copies each way (a few MiB: past the fixed cost of a copy)


def measure_transfer_rates(device: object, nbytes: int = PROBE_BYTES, repeats: int = 3) -> dict[str, float]:
    """Bytes per second of a copy off ``device`` and back, as offload makes them: to an accelerator's
    ``pinned_host`` memory where it has one, else (CPU devices too) to host NumPy (``runtime.offload``); the
    medians of ``repeats`` timed copies of ``nbytes``. What ``costs()["transfer"]`` holds and ``auto_schedule`` plans offload with."""
    if isinstance(device, str):  # a Ray actor's device, by name: this process's own stands in for it
        device = jax.local_devices()[0]
    x = jax.device_put(np.zeros(max(1, nbytes // 4), np.float32), device)
    x.block_until_ready()
    outs, backs = [], []
    for _ in range(repeats + 1):  # the first warms the copies up
        t0 = perf_counter()
        away = to_host_and_back(x, None)
        t1 = perf_counter()
        again = to_host_and_back(x, away)
        t2 = perf_counter()
        del again
        outs.append(t1 - t0)
        backs.append(t2 - t1)
    size = float(x.size * 4)
    return {
        "out": size / max(statistics.median(outs[1:]), 1e-9),
        "back": size / max(statistics.median(backs[1:]), 1e-9),
    }


SEND_PROBES = 50  # the deliveries a send-time probe times per stage boundary (their median counts)


def measure_copy_seconds(value: object, source: object, target: object, repeats: int = SEND_PROBES) -> float:
    """The median seconds of ``jax.device_put`` of ``value`` (a pytree of arrays) from device ``source`` to
    ``target``, waited for: how an in-process step hands one stage's result to the next stage's device."""
    x = jax.block_until_ready(jax.device_put(value, source))
    times = []
    for _ in range(repeats + 1):  # the first warms the copy up
        t0 = perf_counter()
        jax.block_until_ready(jax.device_put(x, target))
        times.append(perf_counter() - t0)
    return statistics.median(times[1:])
