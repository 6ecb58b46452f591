"""The Trainer's Ray actor: a pipeline worker that also trains its stages and ends each step with the others.

``TrainActor`` extends the pipeline's ``StageActor`` with the step's last three
phases (``stage_trainer``): its stages' tied gradients, their sums and squared
norms, the update. They run inside the step's one call per actor
(``train_step``), right after the worker's list: the parts one actor needs of
another (tied gradients, squared norms when clipping, the loss, the optimizer's
reductions over leaves) go actor to actor through the inboxes that carry the
activations, and every actor joins them as the driver once did, in stage order
(``EndOfStep``: what each needs to). The optimizer arrives as exported bytes: an
actor imports neither optax nor the user's code. It also evaluates: its stages' evaluation programs, sent once
(``load_eval``), and one stage's forward (``eval_op``). ``ray_backend`` drives these actors.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Mapping, Sequence, TypeVar

import numpy as np

from ...files.dtypes import dtype_from_name
from ...treetypes import Leaf, PyTree
from ..runtime.evaluation import eval_stage, host
from ..runtime.hang_report import DONE, FINISH
from ..runtime.ray import reports
from ..runtime.ray.actor import StageActor
from ..runtime.replicas import ReplicaGroup
from ..runtime.result import step_loss
from ..schedules.timeline import Phase
from ..stages.evalprograms import EvalProgram
from .clipping import clip_scale
from .device_memory import DeviceMemory, memory_records
from .leaf_labels import combine
from .ownership import Snapshot
from .stage_trainer import StageTrainer
from .zero1 import ReplicaTrainer


@dataclasses.dataclass(frozen=True)
class EndOfStep:
    """What every actor needs to finish a step with the others and no driver: every stage's tied keys and
    their holders, the optimizer's reductions over leaves ``(op, dtype, round)`` and whether its update takes
    the step's loss (``separable``)."""

    holders: tuple[dict[str, list[int]], ...]
    reductions: tuple[tuple[str, str, int], ...] = ()
    uses_value: bool = False

    @property
    def rounds(self) -> int:
        """The optimizer's rounds of reductions over leaves."""
        return 1 + max((r for _, _, r in self.reductions), default=-1)

    def sources(self, stage: int) -> list[int]:
        """The other stages whose gradients of ``stage``'s tied leaves it adds (ascending)."""
        return sorted({h for hs in self.holders[stage].values() for h in hs if h != stage})


T = TypeVar("T")

StageEntry = tuple[int, list[str], bytes, dict[str, list[int]], list[str], "Mapping[str, Leaf] | None"]
"""What ``TrainActor.setup`` takes per stage: ``(stage, names, optimizer bytes, holders, counted, state or None)``."""


class TrainActor(StageActor):
    """A pipeline worker's actor that also trains (one ``StageTrainer`` per stage it holds) and evaluates.

    ``train_step`` runs the worker's list and then the end of the step with the other actors through their
    inboxes (``inbox.Inbox``), not through the driver: tied gradients to the other holders, every stage's
    squared norm (for the clip scale), the loss (for an update that takes it) and each round's shares of
    the optimizer's reductions to every actor, each of which joins them as the driver did (in stage order),
    so every actor computes the same scale and reductions; then the update. A failed actor sends None in
    place of each part, so no actor waits for it; where no part goes from every worker to every other (no
    clipping, no reductions over leaves), the workers exchange whether their step went well before the
    update, so none updates when one failed.
    """

    def setup(self, entries: Sequence[StageEntry], end: EndOfStep) -> None:
        """``(stage, names, optimizer bytes, holders, counted, state or None)`` per stage this actor holds;
        ``end``: what the end of each step exchanges with the other actors."""
        held = self.stage_workers
        # A stage on replicas (data_parallel) keeps its optimizer state sharded across them (training.zero1).
        self.trainers: dict[int, StageTrainer | ReplicaTrainer] = {
            s: (ReplicaTrainer if isinstance(held[s], ReplicaGroup) else StageTrainer)(
                held[s], names, program, holders, counted, state
            )
            for s, names, program, holders, counted, state in entries
        }
        self.end = end

    def optimizer_bytes(self) -> dict[int, tuple[int, int]]:
        """Per stage held on replicas: ``(most bytes of optimizer state on one device, bytes of the whole state)``,
        from its arrays' shards (``ReplicaTrainer.optimizer_bytes``)."""
        return {s: t.optimizer_bytes() for s, t in self.trainers.items() if isinstance(t, ReplicaTrainer)}

    def memory(self) -> list[DeviceMemory]:
        """Per device of this actor that holds a stage, its bytes (``device_memory``; devices by name)."""
        return memory_records(self.trainers.values(), self.worker, named=True)

    def train_step(
        self,
        step: int,
        ops: Sequence[tuple[str, int, int]],
        batch: dict[tuple[int, int], tuple[PyTree, list[Leaf]]],
        microbatches: int,
        timed: bool,
        clip: float | None,
        scales: Sequence[float] | None = None,
    ) -> dict[str, object] | str:
        """Step ``step``: this worker's list (``run_step``), then the end of the step (see the class); its
        ``report`` and ``"sums"``, each held stage's squared norm (None where the step failed). An untimed step's
        report of numbers only goes to the driver's socket as a frame, and the call returns ``reports.SENT``.
        ``scales``: per microbatch, its loss weight over the step's (``Backend.step``); None: the mean."""
        self.run_step(step, ops, batch, microbatches, timed, scales)
        self.now = (FINISH, None, None, time.monotonic())
        sums = self._finish(step, microbatches, clip, scales)
        self.now = (DONE, None, None, time.monotonic())
        report = {**self.report(), "sums": sums}
        items = None if timed or self.to_driver is None else reports.as_frame(self.worker, report)
        if items is not None:
            try:
                self.to_driver.send(0, step, items)  # type: ignore[union-attr]  # checked above
                return reports.SENT
            except OSError:
                pass  # the driver's socket gone: the report goes back through Ray
        return report

    def _exchange(self, step: int, tag: str, parts: Mapping[int, Any], peers: Sequence[int]) -> dict[int, Any]:
        """Send ``parts[w]`` (None: this step failed here) to each worker ``w`` of ``parts`` and take what each of
        ``peers`` sent this one under ``tag``: worker -> its part (None where it failed or the step was aborted)."""
        assert self.sender is not None  # connected before any step
        for w, part in parts.items():
            self.sender.send(step, w, (tag, 0, self.worker), part)
        return {w: self.inbox.take(step, (tag, 0, w)) for w in peers}

    def _finish(
        self, step: int, microbatches: int, clip: float | None, scales: Sequence[float] | None = None
    ) -> dict[int, float | None]:
        """The step's tied sums, norms, clip scale, reductions and update for this worker's stages (see the class).

        Every actor sends and takes the same parts in the same order whether or not its step failed, so that
        none waits for a part that never comes; ``ok`` turns False at the first failure here or a None
        received, and from then on this actor sends None and computes nothing. Its phases: ``reduce tied``
        and ``reduce norms`` (each with its wait for the other workers), ``reduce optimizer`` (the rounds of
        reductions over leaves) and ``update``, as in-process.
        """
        f = _Finishing(self, step)
        contributions = self._tied_contributions(f)
        sums = {s: f.run(lambda s=s: float(self.trainers[s].prepare(contributions[s]))) for s in f.mine}
        f.ok = f.ok and None not in sums.values()
        if any(self.end.holders):
            f.mark("reduce tied")
        scale = self._clip_scale(f, sums, clip)
        f.mark("reduce norms")
        value = self._loss_value(f, microbatches, scales)
        reduced = self._reductions(f, scale, value)
        if self.end.rounds:
            f.mark("reduce optimizer")
        if clip is None and not self.end.rounds and f.others:
            # No exchange above went from every worker to every other (tied sums go between holders, the loss
            # from the last worker): without this one, a worker would update while another's step failed.
            said = self._exchange(step, "ok", {w: True if f.ok else None for w in f.others}, f.others)
            f.ok = f.ok and None not in said.values()
            f.mark("agree")
        for s in f.mine:
            f.run(lambda s=s: self.trainers[s].apply(scale, value, reduced))
        f.mark("update")
        return sums

    def _tied_contributions(self, f: _Finishing) -> dict[int, dict[int, Any]]:
        """Per stage held, the gradients of its tied leaves it adds: its own and the other holders', these
        exchanged with the workers holding them (none where no leaf is tied)."""
        end, me, S, worker_of = self.end, self.worker, self.num_stages, self.worker_of
        contributions: dict[int, dict[int, Any]] = {s: {} for s in f.mine}
        if not any(end.holders):
            return contributions
        needs = {s: end.sources(s) for s in range(S)}
        own = {s: f.run(self.trainers[s].tied_grads) for s in f.mine if end.holders[s]}
        out = {}  # to each other worker: the tied gradients of this worker's stages that its stages add
        for w in f.others:
            wanted = sorted({h for t in range(S) if worker_of[t] == w for h in needs[t] if worker_of[h] == me})
            if wanted:
                # Host arrays on the wire (a stage's own stay on its device for its own sum).
                ok = f.ok and None not in own.values()
                out[w] = {h: _host_arrays(own[h]) for h in wanted} if ok else None
        senders = sorted({worker_of[h] for t in f.mine for h in needs[t]} - {me})
        have = f.joined(self._exchange(f.step, "tied", out, senders), own)
        f.ok = have is not None
        if have is not None:
            contributions = {s: {h: have[h] for h in [*needs[s], *([s] if s in own else [])]} for s in f.mine}
        return contributions

    def _clip_scale(self, f: _Finishing, sums: Mapping[int, float | None], clip: float | None) -> float:
        """The clip scale from every stage's squared norm, exchanged with every other worker (1.0: no clipping,
        and a placeholder once the step failed: ``f.ok`` is False, nothing after it computes)."""
        if clip is None:
            return 1.0
        S = self.num_stages
        every = f.joined(self._exchange(f.step, "norms", {w: sums if f.ok else None for w in f.others}, f.others), sums)
        f.ok = every is not None
        scale = f.run(lambda: clip_scale([float(every[t]) for t in range(S)], clip)[0])  # type: ignore[index, arg-type]
        f.ok = f.ok and scale is not None
        return 1.0 if scale is None else scale

    def _loss_value(self, f: _Finishing, microbatches: int, scales: Sequence[float] | None) -> float:
        """The step's loss for an update that takes it, from the last stage's worker (0.0: not taken, and a
        placeholder once the step failed: ``f.ok`` is False, nothing after it computes)."""
        if not self.end.uses_value:
            return 0.0
        S = self.num_stages
        last = self.worker_of[S - 1]
        value: object
        if last == self.worker:
            value = f.run(lambda: self._loss(S - 1, microbatches, scales))
            self._exchange(f.step, "loss", {w: value for w in f.others}, [])
        else:
            value = self._exchange(f.step, "loss", {}, [last])[last]
        if value is None or not f.ok:
            f.ok = False
            return 0.0
        return float(value)  # type: ignore[arg-type]  # the last worker's float, sent as it is

    def _reductions(self, f: _Finishing, scale: float, value: float) -> list[np.ndarray]:
        """The optimizer's reductions over leaves, round by round: this worker's stages' shares exchanged with
        every other worker and joined in stage order (``combine``), as every actor joins them."""
        end, S = self.end, self.num_stages
        reduced = [np.zeros((), dtype_from_name(dt)) for _, dt, _ in end.reductions]
        for r in range(end.rounds):
            parts = {s: f.run(lambda s=s: self.trainers[s].shares(r, scale, value, reduced)) for s in f.mine}
            f.ok = f.ok and None not in parts.values()
            every = f.joined(
                self._exchange(f.step, f"shares {r}", {w: parts if f.ok else None for w in f.others}, f.others), parts
            )
            f.ok = every is not None
            if every is not None:
                mine_r = [i for i, (_, _, rr) in enumerate(end.reductions) if rr == r]
                for pos, i in enumerate(mine_r):
                    op, dt, _ = end.reductions[i]
                    reduced[i] = combine(op, dt, [every[t][pos] for t in range(S)])
        return reduced

    def _loss(self, stage: int, microbatches: int, scales: Sequence[float] | None) -> float:
        """The step's loss (the mean over microbatches, weighted by ``scales`` where given) on stage ``stage``,
        the last."""
        return step_loss(self.stage_workers[stage].fetch_losses(), microbatches, scales)

    def snapshot(self) -> dict[int, Snapshot]:
        """Per stage held: ``(params, optimizer state)`` as host arrays."""
        return {s: t.snapshot() for s, t in self.trainers.items()}

    def assign(self, parts: dict[int, Snapshot]) -> None:
        """Each stage held: its ``(params, optimizer state)`` of ``parts`` from now on; the last error forgotten."""
        for s, (params, state) in parts.items():
            self.trainers[s].assign(params, state)
        self.error = None

    def load_eval(self, programs: Mapping[int, bytes]) -> None:
        """Hold the evaluation programs of the stages this actor holds (``EvalProgram`` bytes, checked by the
        driver when it loaded them)."""
        self.eval_programs = {
            int(s): EvalProgram.from_bytes(data, f"stage {s}'s evaluation program") for s, data in programs.items()
        }

    def has_eval(self) -> bool:
        """Whether ``load_eval`` has run on this actor (a replaced actor has not)."""
        return bool(getattr(self, "eval_programs", None))

    def eval_op(self, stage: int, x: PyTree, side: list[Leaf], mb: int) -> PyTree:
        """Stage ``stage``'s forward on microbatch ``mb``: what it sends on, or the loss (last), as host arrays."""
        return host(eval_stage(self.stage_workers[stage], self.eval_programs[stage], x, side, mb))


@dataclasses.dataclass
class _Finishing:
    """One actor's end of step ``step`` as it goes: its stages (``mine``), the other workers, ``ok`` (False from
    the first failure here or a None received: from then on None is sent and nothing computed) and when the
    phase under way began (``at``)."""

    actor: TrainActor
    step: int
    mine: list[int] = dataclasses.field(init=False)
    others: list[int] = dataclasses.field(init=False)
    ok: bool = dataclasses.field(init=False)
    at: float = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        a = self.actor
        self.mine = sorted(a.trainers)
        self.others = sorted(set(a.worker_of.values()) - {a.worker})
        self.ok = a.error is None
        self.at = time.monotonic()

    def mark(self, name: str) -> None:
        """The phase ``name`` ends now (the actor's timeline), the next begins."""
        now = time.monotonic()
        self.actor.phases.append(Phase(self.actor.worker, name, self.at, now))
        self.at = now

    def run(self, fn: Callable[..., T]) -> T | None:
        """``fn()`` guarded (its error the actor's), or None once the step has failed."""
        return self.actor.guarded(fn) if self.ok else None

    def joined(self, got: Mapping[int, Any], own: Mapping[int, Any]) -> dict[int, Any] | None:
        """Every stage's part (this worker's ``own`` and the others' in ``got``); None if one is missing."""
        if not self.ok or any(v is None for v in own.values()) or any(v is None for v in got.values()):
            return None
        return {**own, **{s: v for part in got.values() for s, v in part.items()}}


def _host_arrays(part: Any) -> dict[str, np.ndarray]:
    """A stage's tied gradients (key -> array, on its device) as host arrays, as the wire carries them."""
    return {k: np.asarray(v) for k, v in part.items()}
