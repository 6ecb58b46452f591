"""Timelines: executed operations as events, a schedule played on paper, bubbles and plots.

Events carry seconds on one clock, the driver's ``time.monotonic``: the Ray
runner moves each actor's events onto it by the offset it measured at start.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ...errors import VjpsplitError
from .builtins import LABELS, SPLIT_BACKWARD, Op, dependencies, placement, schedule


@dataclass(frozen=True)
class Event:
    """One executed operation: worker, kind, microbatch, start and end (seconds, one clock), stage."""

    worker: int
    kind: str
    mb: int
    start: float
    end: float
    chunk: int = -1

    @property
    def stage(self) -> int:
        """The stage (artifact) this operation ran; the worker's own index when it holds one stage."""
        return self.worker if self.chunk < 0 else self.chunk

    def shifted(self, offset: float) -> "Event":
        """The same operation on a clock that reads ``offset`` seconds less than the one it was recorded on."""
        return Event(self.worker, self.kind, self.mb, self.start - offset, self.end - offset, self.chunk)


def simulate(
    plans: Sequence[Sequence[Op]], stages: int, duration: Callable[[Op], float], split: bool | None = None
) -> list[Event]:
    """Play per-worker lists on one device per worker: each op starts when its worker is free and its inputs exist.

    ``duration(op)`` gives each op's time. Raises if the lists deadlock.
    """
    if split is None:
        split = any(o.kind == "W" for ops in plans for o in ops)
    done: dict[tuple, float] = {}
    free = [0.0] * len(plans)
    idx = [0] * len(plans)
    out = []
    progress = True
    while progress:
        progress = False
        for w, ops in enumerate(plans):
            while idx[w] < len(ops):
                op = ops[idx[w]]
                deps = dependencies(op, stages, split)
                if any(d not in done for d in deps):
                    break
                start = max([free[w]] + [done[d] for d in deps])
                end = start + duration(op)
                done[(op.kind, op.mb, op.chunk)] = end
                free[w] = end
                out.append(Event(w, op.kind, op.mb, start, end, op.chunk))
                idx[w] += 1
                progress = True
    if any(idx[w] < len(ops) for w, ops in enumerate(plans)):
        raise VjpsplitError("the schedule deadlocks: some operation waits for one that runs after it")
    return out


@dataclass
class PipelineResult:
    """Loss, accumulated per-stage parameter gradients, and the recorded timeline."""

    schedule: str
    loss: float
    grads: list[Any]
    events: list[Event]
    stages: int
    microbatches: int
    runner: str
    step_time: float = 0.0
    extra: dict = field(default_factory=dict)
    plans: list | None = None  # the per-worker lists that ran (a named schedule's, or the caller's)

    @property
    def workers(self) -> int:
        """How many workers (threads or actors) ran the stages."""
        return len(self.plans) if self.plans is not None else len(placement(self.schedule, self.stages))

    @property
    def bubble_ratio(self) -> float:
        """Idle share of the workers' time between the first start and the last end."""
        return bubble_ratio(self.events, self.workers)

    @property
    def modeled_bubble_ratio(self) -> float:
        """The bubble ratio if every worker had a device of its own: measured op times, replayed."""
        return bubble_ratio(
            replay(self.events, self.schedule, self.stages, self.microbatches, self.plans), self.workers
        )

    def per_worker(self) -> list[dict]:
        """Busy seconds per worker and kind, and idle seconds."""
        t0 = min(e.start for e in self.events)
        t1 = max(e.end for e in self.events)
        rows = []
        for w in range(self.workers):
            row = {"worker": w, "F": 0.0, "B": 0.0, "W": 0.0}
            for e in self.events:
                if e.worker == w:
                    row[e.kind] += e.end - e.start
            row["idle"] = (t1 - t0) - row["F"] - row["B"] - row["W"]
            rows.append(row)
        return rows

    per_stage = per_worker  # the name from before workers could hold two stages

    def plot(self, path, title: str | None = None) -> None:
        """Write a PNG timeline (workers as rows; F, B, W coloured; idle left blank)."""
        plot_timeline(
            self.events,
            self.workers,
            path,
            title
            or f"{LABELS.get(self.schedule, self.schedule)}: {self.stages} stages on {self.workers} workers, "
            f"{self.microbatches} microbatches, bubble {self.bubble_ratio:.0%} ({self.runner})",
        )


def bubble_ratio(events: Sequence[Event], workers: int) -> float:
    """1 - busy time / (workers x makespan)."""
    if not events:
        return 0.0
    span = max(e.end for e in events) - min(e.start for e in events)
    busy = sum(e.end - e.start for e in events)
    return max(0.0, 1.0 - busy / (workers * span)) if span > 0 else 0.0


def replay(
    events: Sequence[Event], name: str, stages: int, microbatches: int, plans: Sequence[Sequence[Op]] | None = None
) -> list[Event]:
    """The timeline the schedule (or ``plans``) would have with one device per worker, given each op's measured time."""
    dur = {(e.stage, e.kind, e.mb): e.end - e.start for e in events}
    return simulate(
        schedule(name, stages, microbatches) if plans is None else plans,
        stages,
        lambda op: dur.get((op.chunk, op.kind, op.mb), 0.0),
        split=None if plans is not None else name in SPLIT_BACKWARD,
    )


def plot_timeline(events: Sequence[Event], workers: int, path, title: str) -> None:
    """A Gantt chart of ``events`` as a PNG (needs matplotlib: ``pip install vjpsplit[pipeline]``).

    Where a worker holds two stages (ZB-V), the second one's operations are hatched.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise VjpsplitError("plotting needs matplotlib; pip install 'vjpsplit[pipeline]'") from e
    colors = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868"}
    first: dict[int, int] = {}
    for ev in events:
        first[ev.worker] = min(first.get(ev.worker, ev.stage), ev.stage)
    t0 = min(ev.start for ev in events)
    fig, ax = plt.subplots(figsize=(10, 0.6 * workers + 1.2), dpi=110)
    for ev in events:
        second = ev.stage != first[ev.worker]
        ax.barh(
            ev.worker,
            (ev.end - ev.start) * 1e3,
            left=(ev.start - t0) * 1e3,
            color=colors[ev.kind],
            edgecolor="white",
            linewidth=0.5,
            hatch="///" if second else None,
        )
        if (ev.end - ev.start) * 1e3 > 0:
            ax.text(
                (ev.start - t0 + (ev.end - ev.start) / 2) * 1e3,
                ev.worker,
                f"{ev.kind}{ev.mb}",
                ha="center",
                va="center",
                fontsize=6,
                color="white",
            )
    ax.set_yticks(range(workers), [f"worker {w}" for w in range(workers)])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(title, fontsize=9)
    from matplotlib.patches import Patch

    handles = [Patch(color=c, label=k) for k, c in colors.items()]
    if any(ev.stage != first[ev.worker] for ev in events):
        handles.append(Patch(facecolor="white", edgecolor="grey", hatch="///", label="2nd stage"))
    ax.legend(handles=handles, loc="upper right", fontsize=7)
    fig.tight_layout()
    tmp = f"{path}.tmp.png"
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)


def plot_loss(curves, path, title: str) -> None:
    """A loss-per-step PNG (needs matplotlib): ``curves`` is one list of losses, or ``{label: losses}``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise VjpsplitError("plotting needs matplotlib; pip install 'vjpsplit[pipeline]'") from e
    curves = curves if isinstance(curves, dict) else {"loss": list(curves)}
    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=110)
    for i, (label, ys) in enumerate(curves.items()):
        ax.plot(range(1, len(ys) + 1), ys, label=label, linewidth=1.2, linestyle="-" if i == 0 else "--")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title, fontsize=9)
    if len(curves) > 1:
        ax.legend(fontsize=7)
    fig.tight_layout()
    tmp = f"{path}.tmp.png"
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)
