"""Plots: a step's timeline as a Gantt chart, and a loss curve (matplotlib, ``pip install 'vjpsplit[pipeline]'``)."""

from __future__ import annotations

import os
from types import ModuleType
from typing import TYPE_CHECKING, Mapping, Sequence

from ...errors import VjpsplitError
from ...safeio.outputs import atomic_write
from .timeline import Event
from .tracefile import read_trace

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def _pyplot() -> ModuleType:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise VjpsplitError("plotting needs matplotlib; pip install 'vjpsplit[pipeline]'") from e
    return plt


def _save(fig: Figure, path: str | os.PathLike[str]) -> None:
    try:
        atomic_write(path, lambda f: fig.savefig(f, format="png"))
    finally:
        _pyplot().close(fig)


def plot_timeline(
    events: Sequence[Event] | str | os.PathLike[str],
    num_workers: int | None,
    path: str | os.PathLike[str],
    title: str,
) -> list[tuple[float, float, float, float, str]]:
    """A Gantt chart of a step's operations as a PNG (needs matplotlib: ``pip install vjpsplit[pipeline]``).

    Where a worker holds two stages (ZB-V), the second one's operations are hatched.

    Args:
        events: the step's ``Event``s, or the path of its trace file (``PipelineResult.write_trace``).
        num_workers: the rows to draw; None: as many as the trace file (or the events) have.
        path: the PNG to write.
        title: the chart's title.

    Returns:
        The rectangles drawn, as ``(left ms, worker, width ms, height, label)``, in drawing order.

    Raises:
        VjpsplitError: matplotlib is missing, the trace file cannot be read, there
            are no events to draw, or the PNG cannot be written.
    """
    if isinstance(events, (str, os.PathLike)):
        trace = read_trace(events)
        events, num_workers = trace.events, num_workers if num_workers is not None else trace.num_workers
    if num_workers is None:
        num_workers = 1 + max((ev.worker for ev in events), default=0)
    if not events:
        raise VjpsplitError("no operations to draw: the step's timeline is empty")
    plt = _pyplot()
    colors = {"F": "#4C72B0", "B": "#DD8452", "I": "#C44E52", "W": "#55A868"}
    first: dict[int, int] = {}
    for ev in events:
        first[ev.worker] = min(first.get(ev.worker, ev.stage), ev.stage)
    t0 = min(ev.start for ev in events)
    fig, ax = plt.subplots(figsize=(10, 0.6 * num_workers + 1.2), dpi=110)
    drawn = []
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
        drawn.append(f"{ev.kind}{ev.mb}" + (" 2nd" if second else ""))
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
    ax.set_yticks(range(num_workers), [f"worker {w}" for w in range(num_workers)])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(title, fontsize=9)
    from matplotlib.patches import Patch

    shown = {ev.kind for ev in events}  # the legend names the kinds drawn (a whole-backward schedule has no I, W)
    handles = [Patch(color=c, label=k) for k, c in colors.items() if k in shown]
    if any(ev.stage != first[ev.worker] for ev in events):
        handles.append(Patch(facecolor="white", edgecolor="grey", hatch="///", label="2nd stage"))
    ax.legend(handles=handles, loc="upper right", fontsize=7)
    bars = [(r.get_x(), r.get_y() + r.get_height() / 2, r.get_width(), r.get_height()) for r in ax.patches]
    fig.tight_layout()
    _save(fig, path)
    return [(*bar, label) for bar, label in zip(bars, drawn)]


def plot_loss(
    curves: Sequence[float] | Mapping[str, Sequence[float]], path: str | os.PathLike[str], title: str
) -> None:
    """A loss-per-step PNG (needs matplotlib): ``curves`` is one list of losses, or ``{label: losses}``.

    Args:
        curves: One list of losses (one per step), or several by label (the first drawn solid, the others dashed).
        path: The PNG to write (atomically).
        title: The chart's title.

    Raises:
        VjpsplitError: If matplotlib is missing, or the PNG cannot be written.
    """
    plt = _pyplot()
    named = dict(curves) if isinstance(curves, Mapping) else {"loss": list(curves)}
    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=110)
    for i, (label, ys) in enumerate(named.items()):
        ax.plot(range(1, len(ys) + 1), ys, label=label, linewidth=1.2, linestyle="-" if i == 0 else "--")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title, fontsize=9)
    if len(named) > 1:
        ax.legend(fontsize=7)
    fig.tight_layout()
    _save(fig, path)
