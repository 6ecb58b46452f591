"""What a Trainer keeps of its steps: one row per step, a progress bar over steps, the loss curve."""

from __future__ import annotations

import os
import sys
import statistics
from typing import Any, Hashable, Mapping, Sequence

from ..runtime.result import PipelineResult
from ..schedules.plots import plot_loss


SLOWER = 1.15  # a worker's compute this far above its peers' ...
IN_A_ROW = 3  # ... for this many timed steps in a row is a straggler


def cost_signature(artifact: Any) -> tuple[Any, ...]:
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


class History:
    """Per step: the loss, the gradients' global norm (before clipping), the step time, the measured and
    modeled bubble; ``progress=True`` shows a tqdm bar over steps with the loss (where tqdm is installed)."""

    def __init__(self, progress: bool, first_step: int):
        self.rows: list[dict[str, Any]] = []
        self.progress, self.first_step = progress, first_step
        self._bar: Any = None

    def record(
        self,
        step: int,
        result: PipelineResult,
        grad_norm: float,
        step_time: float,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        """Step ``step``'s row (with ``extra``'s entries: an automatic schedule's), and the bar moved on."""
        self.rows.append(
            {
                "step": step,
                "loss": result.loss,
                "grad_norm": grad_norm,
                "step_time": step_time,
                "bubble": result.bubble_ratio,
                "modeled_bubble": result.modeled_bubble_ratio,
                **(extra or {}),
            }
        )
        self._show(result.loss)

    def rewind(self, step: int) -> None:
        """Forget the rows after step ``step`` (the run returned to a checkpoint there)."""
        self.rows = [row for row in self.rows if row["step"] <= step]

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
        plot_loss([row["loss"] for row in self.rows], path, title)

    def close(self) -> None:
        """Close the progress bar."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
