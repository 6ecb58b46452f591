"""One stage's training state where it lives: parameters, optimizer state and the optimizer program (no optax).

A ``StageTrainer`` wraps a ``StageWorker`` (a thread's or a Ray actor's) and
keeps its stage's parameters and optimizer state as flat ``{global key: array}``
mappings on the stage's devices. After the schedule's last operation for the
stage, three small phases finish the step there:

1. ``tied_grads()``: the gradients of the leaves other stages hold too (device arrays);
2. ``prepare(contributions)``: each tied leaf's gradient becomes the sum of every
   holder's contribution, added on the stage's device in stage order (so every holder
   computes the very same array), and the stage's share of the squared global norm
   comes back, dispatched (``clipping.Squares``: fetched only where it is read);
3. ``apply(scale)``: the exported update on ``grads * scale``, in place; the
   worker's parameters are the new ones for the next step.

Only the scalars of step 2 (and, for tied leaves, their gradients) leave the
worker; in one process nothing of them passes through the host before the step's end. The optimizer arrives as ``OptimizerProgram.to_bytes`` and is loaded
here: neither optax nor the user's code is imported. ``finish_stages`` runs the
three phases for one worker's stages (any ``TrainsStage``: a ``StageTrainer`` or
``zero1``'s ``ReplicaTrainer``), joining the workers through an ``Exchange``.
"""

from __future__ import annotations

import time

from typing import Callable, Mapping, Protocol, Sequence, TypeVar

import numpy as np

from ...artifact.artifact import Artifact
from ...errors import VjpsplitError
from ...files.prng import to_data
from ...files.trees import decode_structure, flatten_with_keys, structure_keys
from .clipping import Squares
from .optimizer_program import OptimizerProgram, load_optimizer
from .leaf_labels import combine
from ..runtime.worker import StageWorker
from ...treetypes import JSON, Leaf, PyTree

T = TypeVar("T")


def param_node(artifact: Artifact) -> JSON:
    """The encoded structure of a stage artifact's parameter argument (its first)."""
    m = artifact.manifest
    return m.structure["args"][m.arg_names[0]]


def flat_grads(grads: PyTree | None, local: Mapping[str, str], stage_index: int) -> dict[str, Leaf]:
    """A stage's gradients (its worker's, or its replica group's reduced ones) flat by global key.

    Raises:
        VjpsplitError: the step computed none (the schedule did not run).
    """
    if grads is None:
        raise VjpsplitError(f"stage {stage_index}: the step computed no gradients; run the schedule first")
    return {local[k]: v for k, v in flatten_with_keys("", grads)}


def parameter_keys(artifact: Artifact, stage_index: int, names: Sequence[str]) -> tuple[JSON, dict[str, str]]:
    """A stage's parameter structure and its local leaf keys mapped to the model's keys (``names``, leaf order).

    Raises:
        VjpsplitError: ``names`` does not name every leaf of the stage's parameters, one each.
    """
    node = param_node(artifact)
    local = structure_keys("", node)
    if len(local) != len(names):
        raise VjpsplitError(f"stage {stage_index}: {len(names)} parameter names for {len(local)} leaves")
    return node, dict(zip(local, names))


def tie_keys(holders: Mapping[str, Sequence[int]], counted: Sequence[str]) -> tuple[dict[str, list[int]], set[str]]:
    """``holders`` as plain ints per tied key, and ``counted`` as a set (what both stage trainers keep)."""
    return {k: [int(s) for s in v] for k, v in holders.items()}, set(counted)


class TrainsStage(Protocol):
    """What ``finish_stages`` calls of a stage's trainer: a ``StageTrainer``, or ``zero1.ReplicaTrainer`` (a stage
    on replicas, its optimizer state sharded across them)."""

    @property
    def stage_index(self) -> int:
        """The stage's index."""
        ...

    @property
    def program(self) -> OptimizerProgram:
        """The stage's exported optimizer."""
        ...

    def tied_grads(self) -> Mapping[str, Leaf]:
        """The gradients of the stage's tied leaves (device or host arrays)."""
        ...

    def prepare(self, contributions: Mapping[int, Mapping[str, Leaf]]) -> float | Squares:
        """Each tied leaf's gradient summed over its holders; the stage's share of the squared global norm."""
        ...

    def shares(self, rnd: int, scale: float, value: float, reduced: Sequence[np.ndarray]) -> list[np.ndarray]:
        """The stage's shares of round ``rnd``'s reductions over leaves."""
        ...

    def apply(self, scale: float = 1.0, value: float = 0.0, reduced: Sequence[np.ndarray] = ()) -> None:
        """One optimizer step on the prepared gradients."""
        ...


class Exchange(Protocol):
    """``exchange(worker_part) -> everyone's``: what ``finish_stages`` joins the workers with, for each kind of
    part (tied gradients, squared sums, reduction shares): stage -> this worker's part in, every stage's out."""

    def __call__(self, part: Mapping[int, T]) -> Mapping[int, T]:
        """Every worker's ``part`` merged, once every worker gave its own."""
        ...


RESTORE_HINT = "; restore the last checkpoint into a new Trainer to run again"  # after a step that broke a worker


class StageTrainer:
    """One stage's parameters, optimizer state and program, next to the ``StageWorker`` that runs its schedule.

    ``names``: the global key of each of the stage's parameter leaves, in the
    artifact's leaf order. ``holders``: for each tied key of this stage, the
    stages holding it (ascending). ``counted``: the keys this stage counts in the
    global norm (a tied leaf by its first holder only). ``state``: a restored
    optimizer state, else the program's ``init``.
    """

    def __init__(
        self,
        worker: StageWorker,
        names: Sequence[str],
        program: bytes,
        holders: Mapping[str, Sequence[int]],
        counted: Sequence[str],
        state: Mapping[str, Leaf] | None = None,
    ):
        self.worker, self.names = worker, list(names)
        self.node, self.local = parameter_keys(worker.art, worker.stage_index, self.names)
        self.holders, self.counted = tie_keys(holders, counted)
        self.program = load_optimizer(
            program, source=f"stage {worker.stage_index}'s optimizer", devices=worker.art.devices or None
        )
        self.params = {self.local[k]: v for k, v in flatten_with_keys("", worker.params)}
        # A restored state arrives from host memory: onto the stage's device, beside its parameters.
        self.state = self.program.init(self.params) if state is None else self.worker.to_device(dict(state))
        self.grads: dict[str, Leaf] = {}

    @property
    def stage_index(self) -> int:
        """The stage's index."""
        return self.worker.stage_index

    def _flat_grads(self) -> dict[str, Leaf]:
        return flat_grads(self.worker.grads, self.local, self.stage_index)

    def tied_grads(self) -> dict[str, Leaf]:
        """This stage's gradients of its tied leaves, where they are (what the other holders add)."""
        g = self._flat_grads()
        return {k: g[k] for k in sorted(self.holders)}

    def prepare(self, contributions: Mapping[int, Mapping[str, Leaf]]) -> Squares:
        """Sum each tied leaf's gradient over its holders (``contributions``: stage -> its ``tied_grads``, device
        or host arrays), in stage order on this stage's device; return this stage's share of the squared global
        norm, dispatched (nothing waits)."""
        g = self._flat_grads()
        for k, holding in self.holders.items():
            parts = [g[k] if s == self.stage_index else contributions[s][k] for s in holding]
            # On the stage's one device; a stage without one (sharded, or placed by JAX) adds host copies.
            parts = self.worker.to_device(parts) if self.worker.device is not None else [np.asarray(p) for p in parts]
            total = parts[0]
            for p in parts[1:]:
                total = total + p
            g[k] = total
        self.grads = g
        return Squares.of(g, self.counted)

    def shares(self, rnd: int, scale: float, value: float, reduced: Sequence[np.ndarray]) -> list[np.ndarray]:
        """This stage's shares of the optimizer's reductions over leaves of round ``rnd`` (host scalars)."""
        if not self.grads:
            raise VjpsplitError(f"stage {self.stage_index}: shares before prepare; the step's gradients are not summed")
        got = self.program.shares(rnd, self.params, self.state, self.grads, scale, value, reduced)
        return [np.asarray(v) for v in got]

    def apply(self, scale: float = 1.0, value: float = 0.0, reduced: Sequence[np.ndarray] = ()) -> None:
        """One optimizer step on the prepared gradients times ``scale`` (``value``: the step's loss, ``reduced``:
        the reductions over leaves across stages); the worker runs the new parameters."""
        if not self.grads:
            raise VjpsplitError(f"stage {self.stage_index}: apply before prepare; the step's gradients are not summed")
        self.params, self.state = self.program.update(self.params, self.state, self.grads, scale, value, reduced)
        self.grads = {}
        self.worker.params = decode_structure(self.node, iter([self.params[n] for n in self.names]))
        self.worker.grads = None

    def snapshot(self) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """``(params, optimizer state)`` as host arrays, typed PRNG keys as their key data (a checkpoint's
        share, or ``params()``')."""
        return _host(self.params), _host(self.state)

    def assign(self, params: Mapping[str, Leaf], state: Mapping[str, Leaf]) -> None:
        """Hold ``params`` and optimizer ``state`` (flat by global key, as ``snapshot`` gives them) from now on:
        a checkpoint's, when the run returns to it."""
        missing = [k for k in self.names if k not in params] or [k for k in self.program.state_keys if k not in state]
        if missing:
            raise VjpsplitError(f"stage {self.stage_index}: the state to return to lacks '{missing[0]}'")
        tree = decode_structure(self.node, iter([params[n] for n in self.names]))
        w = self.worker
        w.params = w.place_params(tree)
        self.params = {self.local[k]: v for k, v in flatten_with_keys("", w.params)}
        self.state = w.to_device({k: state[k] for k in self.program.state_keys})
        self.grads = {}
        self.worker.grads = None


def _host(d: Mapping[str, Leaf]) -> dict[str, np.ndarray]:
    return {k: np.asarray(to_data(v)) for k, v in d.items()}


def reduce_rounds(
    program: OptimizerProgram, shares: Callable[[int, list[np.ndarray]], Mapping[int, Sequence[np.ndarray]]]
) -> list[np.ndarray]:
    """The optimizer's reductions over leaves, round by round: ``shares(round, reduced so far)`` gives every
    stage's shares of that round's reductions (stage -> list); each is joined over the stages in stage order."""
    reductions = program.reductions
    reduced: list[np.ndarray] = [np.zeros((), dt) for _, dt, _ in reductions]
    for r in range(program.rounds):
        got = shares(r, list(reduced))
        mine = [i for i, (_, _, rr) in enumerate(reductions) if rr == r]
        for pos, i in enumerate(mine):
            op, dt, _ = reductions[i]
            reduced[i] = combine(op, dt, [got[s][pos] for s in sorted(got)])
    return reduced


def finish_stages(
    trainers: Sequence[TrainsStage],
    exchange: Exchange,
    clip: Callable[[list[float]], float] | None,
    tied: bool,
    mark: Callable[[str, float, float], None] | None = None,
    value: Callable[[], float] | None = None,
) -> list[float | Squares]:
    """Phases 1-3 for one worker's stages; ``exchange(worker_part) -> everyone's`` joins the workers.

    ``exchange`` is called with a dict and returns the merged dict of every
    worker (a barrier in-process; every worker calls it equally often, so
    ``tied`` says for all of them whether any stage holds a tied leaf, and every
    stage's program has the same reductions over leaves, one exchange a round);
    ``clip(sums) -> scale`` turns every stage's squared sums (in stage order)
    into the clip scale; None: the scale is 1 and no sum is fetched (the sums come back as dispatched,
    ``clipping.Squares``, for the caller to fetch with the step's losses). ``mark(name, start, end)`` (``time.monotonic``), if given, hears of each
    phase: ``reduce tied``, ``reduce norms`` (each with its wait for the other workers) and ``update``
    (with the optimizer's reductions over leaves, a round each). ``value()`` is the step's loss, read
    only by an optimizer whose update takes ``value=``.
    """
    clock = time.monotonic
    at = clock()
    tied_parts = exchange({t.stage_index: t.tied_grads() for t in trainers}) if tied else {}
    sums = {t.stage_index: t.prepare(tied_parts) for t in trainers}
    if mark is not None and tied:
        mark("reduce tied", at, at := clock())
    everyone = exchange(sums)
    scale = 1.0 if clip is None else clip(Squares.fetch([everyone[s] for s in sorted(everyone)]))
    if mark is not None:
        mark("reduce norms", at, at := clock())
    program = trainers[0].program
    loss = value() if value is not None and program.uses_value else 0.0
    reduced = reduce_rounds(
        program, lambda r, red: exchange({tr.stage_index: tr.shares(r, scale, loss, red) for tr in trainers})
    )
    for tr in trainers:
        tr.apply(scale, loss, reduced)
    if mark is not None:
        mark("update", at, clock())
    return [sums[tr.stage_index] for tr in trainers]
