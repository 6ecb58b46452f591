"""Pipeline parallelism over artifacts: GPipe, 1F1B and ZB-H1 schedules, in-process or on Ray.

A model is cut into S stages, one artifact each. Stage ``s`` is a function
``stage(params, x, *side)``: ``x`` is the previous stage's output (the batch input
for stage 0) and ``side`` are per-microbatch inputs such as labels. The last stage
returns the microbatch's scalar loss (a mean over the microbatch); the pipeline's
loss is the mean over microbatches, so its gradients equal ``value_and_grad`` of
the whole model on the whole batch.

Each stage runs its own list of operations in order: ``F`` (forward, keeping
residuals), ``B`` (backward; in ZB-H1 only its input part, which the previous
stage waits for) and ``W`` (the weight part, deferred into what would be idle
time). Residuals never leave the stage; activations and cotangents go between
stages (through Ray's object store with the Ray runner).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from .errors import VjpsplitError

SCHEDULES = ("gpipe", "1f1b", "zbh1")


@dataclass(frozen=True)
class Op:
    """One operation of a stage: ``kind`` F, B or W on microbatch ``mb``."""

    kind: str
    mb: int


def schedule(name: str, stages: int, microbatches: int) -> list[list[Op]]:
    """Per-stage operation lists for GPipe, 1F1B or ZB-H1.

    GPipe runs every forward, then every backward. 1F1B starts ``S - s - 1``
    forwards ahead, then alternates one forward and one backward. ZB-H1 keeps
    1F1B's order of F and B (B being only the input part, so cotangents flow up
    the pipeline sooner) and places each W where the stage would otherwise wait,
    found by playing the schedule with unit-time F, B and W (the paper's model);
    a stage holds at most ``S - s`` microbatches' residuals, as in 1F1B.
    """
    S, M = stages, microbatches
    if name not in SCHEDULES:
        raise VjpsplitError(f"unknown schedule {name!r}; use one of {', '.join(SCHEDULES)}")
    if S < 1 or M < 1:
        raise VjpsplitError("a pipeline needs at least one stage and one microbatch")
    if name == "gpipe":
        return [[Op("F", m) for m in range(M)] + [Op("B", m) for m in range(M)] for _ in range(S)]
    plans = []
    for s in range(S):
        warm = min(S - s - 1, M)
        ops = [Op("F", m) for m in range(warm)]
        f = warm
        for b in range(M):
            if f < M:
                ops.append(Op("F", f))
                f += 1
            ops.append(Op("B", b))
        plans.append(ops)
    return plans if name == "1f1b" else _place_weight_passes(plans, S)


def _place_weight_passes(fb: list[list[Op]], S: int) -> list[list[Op]]:
    """Insert W passes into 1F1B's F/B lists where a unit-time replay shows the stage idle."""
    done: dict[tuple, int] = {}
    nxt = [0] * S
    pending: list[list[int]] = [[] for _ in range(S)]
    out: list[list[Op]] = [[] for _ in range(S)]
    live = [0] * S  # microbatches whose residuals the stage still holds (F done, W not yet)
    t = 0
    while any(nxt[s] < len(fb[s]) or pending[s] for s in range(S)):
        for s in range(S):
            op = fb[s][nxt[s]] if nxt[s] < len(fb[s]) else None
            if op is not None:
                if op.kind == "F":
                    dep = (s - 1, "F", op.mb) if s > 0 else None
                else:
                    dep = (s + 1, "B", op.mb) if s < S - 1 else (s, "F", op.mb)
                ready = dep is None or done.get(dep, t + 1) <= t
                if op.kind == "F" and live[s] >= S - s:
                    ready = False  # keep 1F1B's memory bound: finish a W first
            else:
                ready = False
            if ready:
                out[s].append(op)
                done[(s, op.kind, op.mb)] = t + 1
                nxt[s] += 1
                if op.kind == "F":
                    live[s] += 1
                else:
                    pending[s].append(op.mb)
            elif pending[s]:
                mb = pending[s].pop(0)
                out[s].append(Op("W", mb))
                done[(s, "W", mb)] = t + 1
                live[s] -= 1
        t += 1
    return out


@dataclass(frozen=True)
class Event:
    """One executed operation: stage, kind, microbatch, start and end (seconds, one clock)."""

    stage: int
    kind: str
    mb: int
    start: float
    end: float


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

    @property
    def bubble_ratio(self) -> float:
        """Idle share of the stages' time between the first start and the last end."""
        return bubble_ratio(self.events, self.stages)

    @property
    def modeled_bubble_ratio(self) -> float:
        """The bubble ratio if every stage had a device of its own: measured op times, replayed."""
        return bubble_ratio(replay(self.events, self.schedule, self.stages, self.microbatches), self.stages)

    def per_stage(self) -> list[dict]:
        """Busy seconds per stage and kind, and idle seconds."""
        t0 = min(e.start for e in self.events)
        t1 = max(e.end for e in self.events)
        rows = []
        for s in range(self.stages):
            row = {"stage": s, "F": 0.0, "B": 0.0, "W": 0.0}
            for e in self.events:
                if e.stage == s:
                    row[e.kind] += e.end - e.start
            row["idle"] = (t1 - t0) - row["F"] - row["B"] - row["W"]
            rows.append(row)
        return rows

    def plot(self, path, title: str | None = None) -> None:
        """Write a PNG timeline (stages as rows; F, B, W coloured; idle left blank)."""
        plot_timeline(self.events, self.stages, path,
                      title or f"{self.schedule}: {self.stages} stages, {self.microbatches} microbatches, "
                               f"bubble {self.bubble_ratio:.0%} ({self.runner})")


def bubble_ratio(events: Sequence[Event], stages: int) -> float:
    """1 - busy time / (stages x makespan)."""
    if not events:
        return 0.0
    span = max(e.end for e in events) - min(e.start for e in events)
    busy = sum(e.end - e.start for e in events)
    return max(0.0, 1.0 - busy / (stages * span)) if span > 0 else 0.0


def replay(events: Sequence[Event], name: str, stages: int, microbatches: int) -> list[Event]:
    """The timeline the schedule would have on ``stages`` independent devices, given each op's measured time."""
    dur = {(e.stage, e.kind, e.mb): e.end - e.start for e in events}
    plans = schedule(name, stages, microbatches)
    done: dict[tuple, float] = {}
    free = [0.0] * stages
    idx = [0] * stages
    out = []
    progress = True
    while progress:
        progress = False
        for s in range(stages):
            while idx[s] < len(plans[s]):
                op = plans[s][idx[s]]
                if op.kind == "F":
                    dep = ("F", s - 1, op.mb) if s > 0 else None
                elif op.kind == "B":
                    dep = ("B", s + 1, op.mb) if s < stages - 1 else ("F", s, op.mb)
                else:
                    dep = ("B", s, op.mb)
                if dep is not None and (dep[1], dep[0], dep[2]) not in done:
                    break
                ready = done[(dep[1], dep[0], dep[2])] if dep is not None else 0.0
                start = max(free[s], ready)
                end = start + dur.get((s, op.kind, op.mb), 0.0)
                done[(s, op.kind, op.mb)] = end
                free[s] = end
                out.append(Event(s, op.kind, op.mb, start, end))
                idx[s] += 1
                progress = True
    return out


def plot_timeline(events: Sequence[Event], stages: int, path, title: str) -> None:
    """A Gantt chart of ``events`` as a PNG (needs matplotlib: ``pip install vjpsplit[pipeline]``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise VjpsplitError("plotting needs matplotlib; pip install 'vjpsplit[pipeline]'") from e
    colors = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868"}
    t0 = min(e.start for e in events)
    fig, ax = plt.subplots(figsize=(10, 0.6 * stages + 1.2), dpi=110)
    for e in events:
        ax.barh(e.stage, (e.end - e.start) * 1e3, left=(e.start - t0) * 1e3, color=colors[e.kind],
                edgecolor="white", linewidth=0.5)
        if (e.end - e.start) * 1e3 > 0:
            ax.text((e.start - t0 + (e.end - e.start) / 2) * 1e3, e.stage, f"{e.kind}{e.mb}", ha="center",
                    va="center", fontsize=6, color="white")
    ax.set_yticks(range(stages), [f"stage {s}" for s in range(stages)])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(title, fontsize=9)
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color=c, label=k) for k, c in colors.items()], loc="upper right", fontsize=7)
    fig.tight_layout()
    tmp = f"{path}.tmp.png"
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------------------
# The work of one stage, shared by both runners.


class StageWorker:
    """One stage: its artifact, parameters, residuals in flight and accumulated gradients."""

    def __init__(self, artifact, params, index: int, stages: int):
        self.art = artifact
        self.params = params
        self.index = index
        self.stages = stages
        m = artifact.manifest
        self.feeds_back = len(m.arg_names) > 1 and m.arg_names[1] in m.wrt and index > 0
        if m.arg_names[0] not in m.wrt:
            raise VjpsplitError(f"stage {index}: its first argument ({m.arg_names[0]}) must be differentiated")
        self.reset()

    def reset(self):
        self.res: dict[int, Any] = {}
        self.inter: dict[int, Any] = {}
        self.grads = None
        self.events: list[Event] = []
        self.losses: dict[int, float] = {}

    def _timed(self, kind, mb, fn):
        t0 = time.time()
        out = fn()
        self.events.append(Event(self.index, kind, mb, t0, time.time()))
        return out

    def _accumulate(self, g):
        import jax

        self.grads = g if self.grads is None else jax.tree_util.tree_map(lambda a, b: a + b, self.grads, g)

    def forward(self, mb: int, x, side: Sequence):
        def run():
            import jax

            out, res = self.art.fwd(self.params, x, *side)
            out = jax.block_until_ready(out)
            self.res[mb] = res
            return out

        out = self._timed("F", mb, run)
        if self.index == self.stages - 1:
            self.losses[mb] = float(out)
        return out

    def _ct(self, ct, microbatches: int):
        return np.float32(1.0 / microbatches) if self.index == self.stages - 1 else ct

    def backward(self, mb: int, ct, microbatches: int):
        """Full backward (GPipe, 1F1B): accumulate the weight gradient, return the input cotangent."""
        def run():
            import jax

            grads = self.art.bwd(self.res.pop(mb), self._ct(ct, microbatches))
            grads = jax.block_until_ready(grads)
            names = self.art.manifest.wrt
            g = dict(zip(names, grads)) if isinstance(grads, tuple) else {names[0]: grads}
            self._accumulate(g[self.art.manifest.arg_names[0]])
            return g.get(self.art.manifest.arg_names[1]) if self.feeds_back else None

        return self._timed("B", mb, run)

    def backward_input(self, mb: int, ct, microbatches: int):
        """ZB-H1's B: the input cotangent now, the weight part later."""
        def run():
            import jax

            grads, inter = self.art.bwd_input(self.res[mb], self._ct(ct, microbatches))
            grads, inter = jax.block_until_ready((grads, inter))
            self.inter[mb] = inter
            return grads.get(self.art.manifest.arg_names[1]) if self.feeds_back else None

        return self._timed("B", mb, run)

    def backward_weight(self, mb: int):
        """ZB-H1's W: the weight gradient of a microbatch whose B already ran."""
        def run():
            import jax

            g = jax.block_until_ready(self.art.bwd_weight(self.res.pop(mb), self.inter.pop(mb)))
            self._accumulate(g[self.art.manifest.arg_names[0]])

        self._timed("W", mb, run)


def _split_batch(x, side: Mapping[str, Any] | Sequence, microbatches: int):
    n = np.shape(x)[0]
    if n % microbatches:
        raise VjpsplitError(f"batch of {n} does not split into {microbatches} equal microbatches")
    k = n // microbatches
    sides = list(side.values()) if isinstance(side, Mapping) else list(side)
    return [(x[i * k:(i + 1) * k], [s[i * k:(i + 1) * k] for s in sides]) for i in range(microbatches)]


def _check_stages(artifacts, name):
    if name == "zbh1":
        for i, a in enumerate(artifacts):
            if not a.manifest.weights:
                raise VjpsplitError(f"ZB-H1 needs the split backward: export stage {i} with weights=('{a.manifest.arg_names[0]}',)")


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="pipeline ops", file=sys.stderr, leave=False)


def run_inprocess(artifacts: Sequence, params: Sequence, x, side=(), *, microbatches: int, schedule_name: str = "1f1b",
                  progress: bool = False) -> PipelineResult:
    """Run one training step in this process: one thread per stage, mailboxes between them."""
    S = len(artifacts)
    if len(params) != S:
        raise VjpsplitError(f"{S} stages but {len(params)} parameter sets")
    _check_stages(artifacts, schedule_name)
    plans = schedule(schedule_name, S, microbatches)
    mbs = _split_batch(x, side, microbatches)
    workers = [StageWorker(a, p, i, S) for i, (a, p) in enumerate(zip(artifacts, params))]
    acts: dict[tuple, Any] = {}
    cts: dict[tuple, Any] = {}
    cond = threading.Condition()
    errors: list[BaseException] = []
    bar = _progress(sum(len(p) for p in plans), progress)

    def wait(box, key):
        with cond:
            while key not in box and not errors:
                cond.wait()
            if errors:
                raise RuntimeError("another stage failed")
            return box.pop(key)

    def post(box, key, value):
        with cond:
            box[key] = value
            cond.notify_all()

    def run_stage(s):
        w = workers[s]
        try:
            for op in plans[s]:
                if op.kind == "F":
                    inp, side_mb = mbs[op.mb] if s == 0 else (wait(acts, (s, op.mb)), mbs[op.mb][1])
                    out = w.forward(op.mb, inp, side_mb if s == S - 1 else [])
                    if s < S - 1:
                        post(acts, (s + 1, op.mb), out)
                elif op.kind == "B":
                    ct = None if s == S - 1 else wait(cts, (s, op.mb))
                    back = (w.backward_input if schedule_name == "zbh1" else w.backward)(op.mb, ct, microbatches)
                    if s > 0:
                        post(cts, (s - 1, op.mb), back)
                else:
                    w.backward_weight(op.mb)
                if bar is not None:
                    with cond:
                        bar.update(1)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            with cond:
                errors.append(e)
                cond.notify_all()

    t0 = time.time()
    threads = [threading.Thread(target=run_stage, args=(s,), name=f"stage-{s}") for s in range(S)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if bar is not None:
        bar.close()
    if errors:
        first = next((e for e in errors if not isinstance(e, RuntimeError)), errors[0])
        raise first
    step = time.time() - t0
    last = workers[-1]
    return PipelineResult(schedule_name, float(np.mean([last.losses[m] for m in range(microbatches)])),
                          [w.grads for w in workers], sorted((e for w in workers for e in w.events), key=lambda e: e.start),
                          S, microbatches, "in-process", step)


class RayPipeline:
    """Stages as Ray actors (one process each); activations and cotangents go through Ray's object store.

    ``address=None`` starts (or joins) a local Ray instance; pass a cluster address
    (``ray://host:10001`` or ``auto``) for multi-host. Actors persist across
    ``run`` calls; ``close()`` (or ``with``) ends them.
    """

    def __init__(self, artifacts: Sequence, params: Sequence, *, address: str | None = None,
                 runtime_env: dict | None = None, num_cpus_per_stage: float = 0):
        try:
            import ray
        except ImportError as e:
            raise VjpsplitError("the Ray runner needs Ray; pip install 'vjpsplit[ray]'") from e
        self.ray = ray
        self.started = False
        if not ray.is_initialized():
            kwargs = {"address": address} if address else {"num_cpus": max(len(artifacts), os.cpu_count() or 1)}
            ray.init(include_dashboard=False, log_to_driver=False, runtime_env=runtime_env, **kwargs)
            self.started = True
        actor_cls = ray.remote(num_cpus=num_cpus_per_stage)(_RayStage)
        self.stages = len(artifacts)
        self.artifacts = list(artifacts)
        self.actors = [actor_cls.remote(a.to_bytes(), p, i, self.stages) for i, (a, p) in enumerate(zip(artifacts, params))]

    def run(self, x, side=(), *, microbatches: int, schedule_name: str = "1f1b", progress: bool = False) -> PipelineResult:
        """One training step under ``schedule_name``; gradients accumulate over microbatches."""
        ray = self.ray
        S = self.stages
        _check_stages(self.artifacts, schedule_name)
        plans = schedule(schedule_name, S, microbatches)
        mbs = _split_batch(x, side, microbatches)
        ray.get([a.reset.remote() for a in self.actors])
        t0 = time.time()
        acts: dict[tuple, Any] = {}
        cts: dict[tuple, Any] = {}
        refs = []
        idx = [0] * S
        # Submit in an order that respects every stage's list and every data dependency;
        # each actor then runs its tasks in submission order.
        while any(idx[s] < len(plans[s]) for s in range(S)):
            moved = False
            for s in range(S):
                while idx[s] < len(plans[s]):
                    op = plans[s][idx[s]]
                    actor = self.actors[s]
                    if op.kind == "F":
                        if s > 0 and (s, op.mb) not in acts:
                            break
                        inp = mbs[op.mb][0] if s == 0 else acts.pop((s, op.mb))
                        ref = actor.forward.remote(op.mb, inp, mbs[op.mb][1] if s == S - 1 else [])
                        if s < S - 1:
                            acts[(s + 1, op.mb)] = ref
                    elif op.kind == "B":
                        if s < S - 1 and (s, op.mb) not in cts:
                            break
                        ct = None if s == S - 1 else cts.pop((s, op.mb))
                        method = actor.backward_input if schedule_name == "zbh1" else actor.backward
                        ref = method.remote(op.mb, ct, microbatches)
                        if s > 0:
                            cts[(s - 1, op.mb)] = ref
                    else:
                        ref = actor.backward_weight.remote(op.mb)
                    refs.append(ref)
                    idx[s] += 1
                    moved = True
            if not moved:
                raise VjpsplitError(f"schedule {schedule_name} deadlocks (a bug in the schedule)")
        bar = _progress(len(refs), progress)
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            ray.get(ready)  # raises a stage's error here
            if bar is not None:
                bar.update(len(ready))
        if bar is not None:
            bar.close()
        step = time.time() - t0
        states = ray.get([a.state.remote() for a in self.actors])
        losses = states[-1]["losses"]
        return PipelineResult(schedule_name, float(np.mean([losses[m] for m in range(microbatches)])),
                              [st["grads"] for st in states],
                              sorted((e for st in states for e in st["events"]), key=lambda e: e.start),
                              S, microbatches, "ray", step)

    def close(self) -> None:
        """End the actors (and the local Ray instance, if this object started it)."""
        for a in self.actors:
            self.ray.kill(a)
        self.actors = []
        if self.started:
            self.ray.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _RayStage:
    """The Ray actor around a StageWorker; loads the artifact from bytes (no user code needed)."""

    def __init__(self, artifact_bytes: bytes, params, index: int, stages: int):
        from .artifact import loads

        self.worker = StageWorker(loads(artifact_bytes, source=f"stage {index}"), params, index, stages)

    def reset(self):
        self.worker.reset()

    def forward(self, mb, x, side):
        return np.asarray(self.worker.forward(mb, x, side))

    def backward(self, mb, ct, microbatches):
        out = self.worker.backward(mb, ct, microbatches)
        return None if out is None else np.asarray(out)

    def backward_input(self, mb, ct, microbatches):
        out = self.worker.backward_input(mb, ct, microbatches)
        return None if out is None else np.asarray(out)

    def backward_weight(self, mb):
        self.worker.backward_weight(mb)

    def state(self):
        import jax

        w = self.worker
        return {"grads": jax.tree_util.tree_map(np.asarray, w.grads), "events": w.events, "losses": w.losses}


def run(artifacts: Sequence, params: Sequence, x, side=(), *, microbatches: int, schedule_name: str = "1f1b",
        runner: str = "inprocess", address: str | None = None, progress: bool = False) -> PipelineResult:
    """One pipelined training step: ``runner`` is ``inprocess`` (default) or ``ray``."""
    if runner == "inprocess":
        return run_inprocess(artifacts, params, x, side, microbatches=microbatches, schedule_name=schedule_name,
                             progress=progress)
    if runner == "ray":
        with RayPipeline(artifacts, params, address=address) as rp:
            return rp.run(x, side, microbatches=microbatches, schedule_name=schedule_name, progress=progress)
    raise VjpsplitError(f"unknown runner {runner!r}; use inprocess or ray")
