"""Training over pipeline stages: ``Trainer``, the optimizer step where each stage's parameters live.

``Trainer(stages, params, optimizer=optax_tx, ...)`` takes a ``Stages``
(``export_stages``) and the whole parameter pytree. The driver exports the
optimizer's ``init`` and ``update`` once per stage (``optimizer.export_optimizer``,
specs from that stage's parameters) and hands the bytes to the workers: threads
in this process (``runner="inprocess"``) or Ray actors (``runner="ray"``,
``ray_train``). Each worker keeps its stages' parameters and optimizer state
(``trainstage.StageTrainer``); a step runs the schedule and then, after each
worker's last operation, sums tied leaves' gradients over their holders, reports
each stage's squared gradient norm, and applies the update with the clip scale.
Only the loss and those scalars reach the driver.

Parameter leaves are named by their file keys in ``params`` (``params/embed``);
a leaf several stages read is one key held by each. The older per-stage form
(a list of artifacts and one parameter pytree per stage, ``tied=`` naming
``(stage, key)`` groups, keys ``"s/k"``) is accepted too.
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
from typing import Any, Mapping, Sequence

import jax
import numpy as np

from ...errors import VjpsplitError
from ...files.trees import decode_structure, encode_structure, flatten_with_keys, structure_keys
from .checkpoint import load_checkpoint, save_checkpoint
from .clipping import clip_scale, norm_owners
from ..runtime.dispatch import PreSplit
from ..runtime.inprocess import run_inprocess
from .optimizer import export_optimizer
from ..schedules.plans import layout_of, resolve
from ..runtime.ray.pipeline import STEP_TIMEOUT
from ..runtime.ray.setup import SCHEDULE_TIMEOUT
from .ray import RayBackend
from ..runtime.worker import StageWorker, split_batch, stage_devices
from ..stages.directory import is_stages
from ..schedules.timeline import plot_loss
from .stagestate import StageTrainer, finish_stages, param_node


class Layout:
    """Which parameter leaves each stage holds, under which global keys, and how to rebuild ``params``."""

    def __init__(self, stages, params, tied=None):
        self.from_one = is_stages(stages)
        self.artifacts = list(stages.artifacts) if self.from_one else list(stages)
        if self.from_one:
            self.stage_params = stages.stage_params(params)
            keys = [r["key"] for r in stages.index["params"]]
            self.names = [[keys[i] for i in st["params"]] for st in stages.info]
            self.keys, self.tree = keys, jax.tree_util.tree_structure(params)
            self.structure = encode_structure(params)
        else:
            if len(params) != len(self.artifacts):
                raise VjpsplitError(f"{len(self.artifacts)} stages but {len(params)} parameter sets")
            self.stage_params = list(params)
            self.names = global_keys([[k for k, _ in flatten_with_keys("", p)] for p in params], tied)
            flat = [dict(zip(n, jax.tree_util.tree_leaves(p))) for n, p in zip(self.names, params)]
            _check_tied_equal(flat)
            self.structure = None
        held: dict[str, list[int]] = {}
        for s, names in enumerate(self.names):
            for k in names:
                held.setdefault(k, []).append(s)
        self.holders = [{k: held[k] for k in names if len(held[k]) > 1} for names in self.names]
        self.counted = [sorted(c) for c in norm_owners(self.names)]
        self.tied = any(self.holders)

    def gather(self, snapshots: Sequence[Mapping[str, Any]]):
        """The parameters in the user's structure from each stage's flat ``{key: array}``."""
        if self.from_one:
            flat: dict[str, Any] = {}
            for snap in snapshots:
                for k, v in snap.items():
                    flat.setdefault(k, v)
            return jax.tree_util.tree_unflatten(self.tree, [flat[k] for k in self.keys])
        return [
            decode_structure(param_node(a), iter([snap[n] for n in names]))
            for a, names, snap in zip(self.artifacts, self.names, snapshots)
        ]


def global_keys(local: Sequence[Sequence[str]], tied) -> list[list[str]]:
    """Per-stage form: per stage, each leaf's global key (``"s/k"``, or its tied group's first member's)."""
    names = [{k: f"{s}/{k}" for k in keys} for s, keys in enumerate(local)]
    for group in tied or ():
        group = [(int(s), str(k)) for s, k in group]
        for s, k in group:
            if not 0 <= s < len(local) or k not in names[s]:
                raise VjpsplitError(f"tied leaf ({s}, {k!r}) is not a parameter of stage {s}; name (stage, key) pairs")
        first = names[group[0][0]][group[0][1]]
        for s, k in group:
            names[s][k] = first
    return [[n[k] for k in keys] for n, keys in zip(names, local)]


def optimizer_programs(optimizer, artifacts: Sequence, names: Sequence[Sequence[str]], placed: Sequence) -> list:
    """Each stage's exported optimizer as bytes, its specs from the stage's (placed) parameters."""
    out = []
    for art, n, p in zip(artifacts, names, placed):
        specs = {
            k: jax.ShapeDtypeStruct(np.shape(v), v.dtype, sharding=v.sharding if art.manifest.sharded else None)
            for k, v in zip(n, jax.tree_util.tree_leaves(p))
        }
        out.append(export_optimizer(optimizer, specs, platforms=art.manifest.platforms).to_bytes())
    return out


class _Rendezvous:
    """In-process: the workers' threads swap small dicts (tied gradients, squared sums) at a barrier."""

    def __init__(self, n: int):
        self.barrier = threading.Barrier(n)
        self.rounds: list[dict] = []
        self.lock = threading.Lock()

    def exchanger(self):
        count = itertools.count()

        def exchange(part: Mapping) -> dict:
            i = next(count)
            with self.lock:
                while len(self.rounds) <= i:
                    self.rounds.append({})
                self.rounds[i].update(part)
            self.barrier.wait()
            return self.rounds[i]

        return exchange


class InProcess:
    """The workers as threads of this process: one ``StageTrainer`` per stage, kept across steps."""

    def __init__(self, layout: Layout, arts: Sequence, programs: Sequence[bytes], states: Sequence):
        self.layout = layout
        S = len(arts)
        workers = [StageWorker(a, p, i, S) for i, (a, p) in enumerate(zip(arts, layout.stage_params))]
        self.trainers = [
            StageTrainer(w, layout.names[s], programs[s], layout.holders[s], layout.counted[s], states[s])
            for s, w in enumerate(workers)
        ]

    def step(self, mbs: PreSplit, schedule_name: str, schedule, microbatches: int, clip, progress: bool):
        """One step: the schedule in the workers' threads, each finishing with its stages' updates."""
        S = len(self.trainers)
        _, _, where = resolve(schedule_name, schedule, S, microbatches)
        rv, sums = _Rendezvous(len(where)), {}

        def tail(w: int, failed: bool) -> None:
            if failed:
                rv.barrier.abort()  # the others stop waiting; the failed operation is the step's error
                return
            mine = [self.trainers[c] for c in where[w]]
            try:
                got = finish_stages(mine, rv.exchanger(), lambda v: clip_scale(v, clip)[0], self.layout.tied)
            except threading.BrokenBarrierError:
                return  # another worker failed: its error is the step's
            except BaseException:
                rv.barrier.abort()
                raise
            sums.update({t.index: v for t, v in zip(mine, got)})

        r = run_inprocess(
            [t.worker.art for t in self.trainers],
            [t.worker.params for t in self.trainers],
            mbs,
            microbatches=microbatches,
            schedule_name=schedule_name,
            schedule=schedule,
            progress=progress,
            workers=[t.worker for t in self.trainers],
            tail=tail,
        )
        return r, [sums[s] for s in range(S)]

    def snapshots(self) -> list[tuple[dict, dict]]:
        """Every stage's ``(params, optimizer state)`` as host arrays."""
        return [t.snapshot() for t in self.trainers]

    def close(self) -> None:
        """Nothing to end in-process."""


class Trainer:
    """Pipelined training: ``step(batch)`` runs the schedule and every stage's optimizer update where it lives.

    ``stages``: a ``Stages`` and ``params`` the whole parameter pytree (or the
    per-stage form: artifacts and one pytree per stage, with ``tied``).
    ``optimizer``: an optax ``GradientTransformation``, exported per stage (the
    workers need no optax). ``clip_global_norm=c`` clips by the norm over all
    stages' gradients (a tied leaf counted once), as ``optax.chain(
    optax.clip_by_global_norm(c), optimizer)`` on one device; a clipping
    transformation inside ``optimizer`` acts per stage. ``runner``: ``inprocess``
    or ``ray`` (then ``address``, ``runtime_env``, ``actor_options``,
    ``step_timeout``, ``schedule_timeout`` as ``RayPipeline`` takes them).
    ``progress=True`` shows a bar over steps with the loss. ``history`` keeps per
    step the loss, the gradients' global norm (before clipping), the step time and
    the measured and modeled bubble.
    """

    def __init__(
        self,
        stages,
        params,
        *,
        optimizer,
        microbatches: int,
        schedule_name: str = "1f1b",
        runner: str = "inprocess",
        clip_global_norm: float | None = None,
        schedule=None,
        progress: bool = False,
        tied=None,
        devices: Sequence[Sequence] | None = None,
        address: str | None = None,
        runtime_env: dict | None = None,
        actor_options: Sequence[Mapping] | None = None,
        step_timeout: float = STEP_TIMEOUT,
        schedule_timeout: float = SCHEDULE_TIMEOUT,
        _restored: tuple[list, int] | None = None,
    ):
        clip_scale([], clip_global_norm)  # a bad value is refused now, not after the first step
        self.stages, self.layout = stages, Layout(stages, params, tied)
        S = len(self.layout.artifacts)
        self.microbatches, self.schedule_name, self.schedule = microbatches, schedule_name, schedule
        resolve(schedule_name, schedule, S, microbatches)  # an unknown schedule is refused before any export
        self.clip_global_norm, self.progress, self.runner = clip_global_norm, progress, runner
        self.optimizer_name = getattr(getattr(optimizer, "init", None), "__qualname__", type(optimizer).__name__)
        if runner not in ("inprocess", "ray"):
            raise VjpsplitError(f"unknown runner {runner!r}; use inprocess or ray")
        states = [None] * S if _restored is None else [st for _, st in _restored[0]]
        arts = stage_devices(self.layout.artifacts, devices)
        placed = [a.place_arg(0, p) for a, p in zip(arts, self.layout.stage_params)]
        programs = optimizer_programs(optimizer, arts, self.layout.names, placed)
        if runner == "inprocess":
            self.backend: Any = InProcess(self.layout, arts, programs, states)
        else:
            self.backend = RayBackend(
                self.layout,
                programs,
                states,
                layout=layout_of(schedule_name, schedule, S),
                address=address,
                runtime_env=runtime_env,
                actor_options=actor_options,
                step_timeout=step_timeout,
                schedule_timeout=schedule_timeout,
            )
        self.step_count = 0 if _restored is None else _restored[1]
        self.history: list[dict] = []
        self._bar: Any = None

    def _microbatches(self, batch) -> PreSplit:
        if self.layout.from_one:
            return PreSplit(self.stages.stage_batch(batch, self.microbatches))
        return PreSplit(split_batch(batch[0], list(batch[1:]), self.microbatches))

    def step(self, batch) -> float:
        """One optimizer step on ``batch`` (the function's batch inputs as a tuple); returns the step's loss."""
        t0 = time.monotonic()
        r, sums = self.backend.step(
            self._microbatches(batch),
            self.schedule_name,
            self.schedule,
            self.microbatches,
            self.clip_global_norm,
            False,
        )
        _, norm = clip_scale(sums, None)
        self.step_count += 1
        self.history.append(
            {
                "step": self.step_count,
                "loss": r.loss,
                "grad_norm": norm,
                "step_time": time.monotonic() - t0,
                "bubble": r.bubble_ratio,
                "modeled_bubble": r.modeled_bubble_ratio,
            }
        )
        self.last_result = r
        self._show(r.loss)
        return r.loss

    def _show(self, loss: float) -> None:
        if not self.progress:
            return
        if self._bar is None:
            try:
                from tqdm import tqdm
            except ImportError:
                self.progress = False
                return
            self._bar = tqdm(desc="train", unit="step", file=sys.stderr, initial=self.step_count - 1)
        self._bar.set_postfix(loss=f"{loss:.4g}", refresh=False)
        self._bar.update(1)

    def params(self):
        """The parameters now, in ``params``' structure (host arrays; per stage in the per-stage form)."""
        return self.layout.gather([p for p, _ in self.backend.snapshots()])

    def plot_loss(self, path, title: str | None = None) -> None:
        """A PNG of the loss per step (needs matplotlib), beside ``plot_timeline``'s chart of one step."""
        plot_loss([h["loss"] for h in self.history], path, title or f"{self.schedule_name}, {self.runner}")

    def save(self, directory) -> None:
        """Write every stage's parameters, optimizer state and the step count to ``directory`` (all or nothing)."""
        meta = {"schedule": self.schedule_name, "optimizer": self.optimizer_name, "structure": self.layout.structure}
        save_checkpoint(directory, self.backend.snapshots(), self.step_count, meta)

    @classmethod
    def restore(cls, directory, stages, **kwargs) -> "Trainer":
        """A Trainer continuing the run saved in ``directory``; takes ``Trainer``'s keyword arguments but ``params``."""
        saved, step, meta = load_checkpoint(directory)
        arts = list(stages.artifacts) if is_stages(stages) else list(stages)
        if len(saved) != len(arts):
            raise VjpsplitError(
                f"{directory}: holds {len(saved)} stages, not {len(arts)}; pass the stages it was saved from"
            )
        if is_stages(stages):
            names = [[stages.index["params"][i]["key"] for i in st["params"]] for st in stages.info]
        else:
            names = global_keys([structure_keys("", param_node(a)) for a in arts], kwargs.get("tied"))
        for s, (n, (p, _)) in enumerate(zip(names, saved)):
            missing = [k for k in n if k not in p]
            if missing:
                raise VjpsplitError(
                    f"{directory}: stage {s} lacks parameter '{missing[0]}'; pass the stages it was saved from"
                )
        if is_stages(stages):
            flat = {k: v for p, _ in saved for k, v in p.items()}
            keys = [r["key"] for r in stages.index["params"]]
            params = decode_structure(meta.get("structure"), iter([flat[k] for k in keys]))
        else:
            params = [
                decode_structure(param_node(a), iter([p[k] for k in n])) for a, n, (p, _) in zip(arts, names, saved)
            ]
        return cls(stages, params, _restored=(saved, step), **kwargs)

    def close(self) -> None:
        """End the workers (Ray actors) and the progress bar."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self.backend.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _check_tied_equal(flat: Sequence[Mapping[str, Any]]) -> None:
    first: dict[str, tuple[int, Any]] = {}
    for s, f in enumerate(flat):
        for k, v in f.items():
            if k in first:
                s0, v0 = first[k]
                if not np.array_equal(np.asarray(v0), np.asarray(v)):
                    raise VjpsplitError(
                        f"tied leaf '{k}' differs between stages {s0} and {s}; give every holder the same value"
                    )
            else:
                first[k] = (s, v)
