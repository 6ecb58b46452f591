"""Pipeline parallelism over artifacts: GPipe, 1F1B, ZB-H1 and ZB-V schedules, in-process or on Ray.

A model is cut into S stages, one artifact each. Stage ``s`` is a function
``stage(params, x, *side)``: ``x`` is the previous stage's output (the batch input
for stage 0) and ``side`` are per-microbatch inputs such as labels. The last stage
returns the microbatch's scalar loss (a mean over the microbatch); the pipeline's
loss is the mean over microbatches, so its gradients equal ``value_and_grad`` of
the whole model on the whole batch.

Stages run on *workers* (threads or Ray actors). GPipe, 1F1B and ZB-H1 put one
stage on each worker; ZB-V puts two on each, in a V: worker ``w`` of ``p = S/2``
holds stages ``w`` and ``2p-1-w``. Each worker runs its own list of operations in
order (``schedule``): ``F`` (forward, keeping residuals), ``B`` (backward; in
ZB-H1 and ZB-V only its input part, which the previous stage waits for) and ``W``
(the weight part, deferred into what would be idle time). Residuals never leave
their worker; activations and cotangents go between stages (through Ray's object
store with the Ray runner).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from .errors import VjpsplitError

SCHEDULES = ("gpipe", "1f1b", "zbh1", "zbv")
SPLIT_BACKWARD = ("zbh1", "zbv")  # schedules that run B and W as separate operations
_LABELS = {"gpipe": "GPipe", "1f1b": "1F1B", "zbh1": "ZB-H1", "zbv": "ZB-V"}


@dataclass(frozen=True)
class Op:
    """One operation of a worker: ``kind`` F, B or W on microbatch ``mb`` of stage ``chunk``.

    ``chunk`` indexes the pipeline's stages (its artifacts). It equals the worker's
    index except in ZB-V, where each worker runs two stages.
    """

    kind: str
    mb: int
    chunk: int


def _check_name(name: str, stages: int, microbatches: int = 1) -> None:
    if name not in SCHEDULES:
        raise VjpsplitError(f"unknown schedule {name!r}; use one of {', '.join(SCHEDULES)}")
    if stages < 1 or microbatches < 1:
        raise VjpsplitError("a pipeline needs at least one stage and one microbatch")
    if name == "zbv" and stages % 2:
        raise VjpsplitError(f"ZB-V runs two stages per worker in a V: it needs an even number of stages, not {stages}")


def placement(name: str, stages: int) -> list[tuple[int, ...]]:
    """The stages each worker holds under schedule ``name``: ``(s,)`` each, or ZB-V's V ``(w, 2p-1-w)``."""
    _check_name(name, stages)
    if name == "zbv":
        p = stages // 2
        return [(w, 2 * p - 1 - w) for w in range(p)]
    return [(s,) for s in range(stages)]


def dependencies(op: Op, stages: int, split: bool) -> list[tuple[str, int, int]]:
    """The ``(kind, mb, chunk)`` operations whose results ``op`` reads.

    F reads the previous stage's activation; B reads its own stage's residuals and
    the next stage's cotangent (the last stage starts from its loss); W (``split``
    schedules only) reads what its B left.
    """
    k, mb, c = op.kind, op.mb, op.chunk
    if k == "F":
        return [("F", mb, c - 1)] if c > 0 else []
    if k == "B":
        return [("F", mb, c)] + ([("B", mb, c + 1)] if c < stages - 1 else [])
    if not split:
        raise VjpsplitError("a W operation in a schedule without the split backward")
    return [("B", mb, c)]


def schedule(name: str, stages: int, microbatches: int) -> list[list[Op]]:
    """Per worker, the ordered operations of schedule ``name`` for ``stages`` stages and ``microbatches``.

    * ``gpipe``: every forward, then every backward.
    * ``1f1b``: worker ``s`` runs ``S-s-1`` forwards ahead, then alternates one
      forward and one (whole) backward; at most ``S-s`` microbatches in flight.
    * ``zbh1`` (Qi et al., *Zero Bubble Pipeline Parallelism*, ICLR 2024): 1F1B's
      order of F and B, B being only the input part; each W goes where the worker
      would otherwise wait, found by playing the schedule with F = B = W = 1. With
      those times the step takes 3m + (p-1) units against 1F1B's 3(m+p-1). A worker
      never holds more than ``S`` microbatches between F and W (1F1B's peak, on its
      first worker), nor more than 1F1B's ``S-s`` between F and B.
    * ``zbv`` (the same paper's V schedule, arXiv v2 section 6; PyTorch's
      ``ScheduleZBVZeroBubble``): ``S = 2p`` stages on ``p`` workers in a V. With
      F = B = W and at least ``2p-1`` microbatches no worker idles between its
      first and its last operation, at 1F1B's peak activation memory.

    Worker ``i``'s list is ``schedule(...)[i]``; ``placement`` says which stages it holds.
    """
    _check_name(name, stages, microbatches)
    S, M = stages, microbatches
    if name == "gpipe":
        return [[Op("F", m, s) for m in range(M)] + [Op("B", m, s) for m in range(M)] for s in range(S)]
    if name == "zbv":
        return _zbv(S // 2, M)
    plans = []
    for s in range(S):
        warm = min(S - s - 1, M)
        ops = [Op("F", m, s) for m in range(warm)]
        f = warm
        for b in range(M):
            if f < M:
                ops.append(Op("F", f, s))
                f += 1
            ops.append(Op("B", b, s))
        plans.append(ops)
    return plans if name == "1f1b" else _place_weight_passes(plans, S)


def _place_weight_passes(fb: list[list[Op]], S: int) -> list[list[Op]]:
    """ZB-H1: insert W passes into 1F1B's F/B lists where a unit-time play shows the worker idle.

    A forward waits while the worker holds ``S`` microbatches between F and W: the
    first worker's 1F1B peak, which bounds every worker (the paper's memory rule:
    W holds less than B, so the first worker, which holds most, stays at 1F1B's
    peak). Bounding each worker by its *own* 1F1B count (``S-s``) instead forces
    W right behind B wherever a forward follows, and costs ``p-1`` more units.
    """
    done: dict[tuple, int] = {}
    nxt = [0] * S
    pending: list[list[int]] = [[] for _ in range(S)]
    out: list[list[Op]] = [[] for _ in range(S)]
    live = [0] * S
    t = 0
    while any(nxt[s] < len(fb[s]) or pending[s] for s in range(S)):
        for s in range(S):
            op = fb[s][nxt[s]] if nxt[s] < len(fb[s]) else None
            ready = op is not None and all(done.get(d, t + 1) <= t for d in dependencies(op, S, True))
            if ready and op.kind == "F" and live[s] >= S:
                ready = False
            if ready:
                out[s].append(op)
                done[(op.kind, op.mb, op.chunk)] = t + 1
                nxt[s] += 1
                if op.kind == "F":
                    live[s] += 1
                else:
                    pending[s].append(op.mb)
            elif pending[s]:
                mb = pending[s].pop(0)
                out[s].append(Op("W", mb, s))
                done[("W", mb, s)] = t + 1
                live[s] -= 1
        t += 1
    return out


def _zbv(p: int, M: int) -> list[list[Op]]:
    """ZB-V's lists: warm-up forwards down the V, then F-B-W pairs on both chunks, then the drain.

    The pattern needs ``2p-1`` microbatches to fill the V; with fewer, it is built
    for ``2p-1`` and the missing microbatches' operations are dropped, which keeps
    the order valid but leaves gaps.
    """
    n = max(2 * p - 1, M)
    plans = []
    for w in range(p):
        lo, hi = w, 2 * p - 1 - w
        count = {k: {lo: 0, hi: 0} for k in "FBW"}
        ops: list[Op] = []

        def add(kind, chunk):
            ops.append(Op(kind, count[kind][chunk], chunk))
            count[kind][chunk] += 1

        for _ in range(2 * (p - w) - 1):  # forwards of the first chunk, down the V
            add("F", lo)
        for _ in range(w):
            add("F", hi)
            add("F", lo)
        for _ in range(p - w):  # the second chunk's first backwards come back up
            add("F", hi)
            add("B", hi)
            add("W", hi)
        while count["F"][hi] < count["F"][lo] or count["F"][lo] < n:
            if count["F"][lo] < n:
                add("F", lo)
            add("B", lo)
            add("W", lo)
            add("F", hi)
            add("B", hi)
            add("W", hi)
        for _ in range(w):  # drain: input backwards first, weight passes fill the tail
            add("B", lo)
            add("B", hi)
        for _ in range(p - w):
            add("B", lo)
            add("W", lo)
        for chunk in (hi, lo):
            while count["W"][chunk] < count["B"][chunk]:
                add("W", chunk)
        plans.append([o for o in ops if o.mb < M])
    return plans


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


def simulate(plans: Sequence[Sequence[Op]], stages: int, duration: Callable[[Op], float],
             split: bool | None = None) -> list[Event]:
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

    @property
    def workers(self) -> int:
        """How many workers (threads or actors) ran the stages."""
        return len(placement(self.schedule, self.stages))

    @property
    def bubble_ratio(self) -> float:
        """Idle share of the workers' time between the first start and the last end."""
        return bubble_ratio(self.events, self.workers)

    @property
    def modeled_bubble_ratio(self) -> float:
        """The bubble ratio if every worker had a device of its own: measured op times, replayed."""
        return bubble_ratio(replay(self.events, self.schedule, self.stages, self.microbatches), self.workers)

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
        plot_timeline(self.events, self.workers, path,
                      title or f"{_LABELS[self.schedule]}: {self.stages} stages on {self.workers} workers, "
                               f"{self.microbatches} microbatches, bubble {self.bubble_ratio:.0%} ({self.runner})")


def bubble_ratio(events: Sequence[Event], workers: int) -> float:
    """1 - busy time / (workers x makespan)."""
    if not events:
        return 0.0
    span = max(e.end for e in events) - min(e.start for e in events)
    busy = sum(e.end - e.start for e in events)
    return max(0.0, 1.0 - busy / (workers * span)) if span > 0 else 0.0


def replay(events: Sequence[Event], name: str, stages: int, microbatches: int) -> list[Event]:
    """The timeline the schedule would have with one device per worker, given each op's measured time."""
    dur = {(e.stage, e.kind, e.mb): e.end - e.start for e in events}
    return simulate(schedule(name, stages, microbatches), stages,
                    lambda op: dur.get((op.chunk, op.kind, op.mb), 0.0), split=name in SPLIT_BACKWARD)


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
    first = {}
    for e in events:
        first[e.worker] = min(first.get(e.worker, e.stage), e.stage)
    t0 = min(e.start for e in events)
    fig, ax = plt.subplots(figsize=(10, 0.6 * workers + 1.2), dpi=110)
    for e in events:
        second = e.stage != first[e.worker]
        ax.barh(e.worker, (e.end - e.start) * 1e3, left=(e.start - t0) * 1e3, color=colors[e.kind],
                edgecolor="white", linewidth=0.5, hatch="///" if second else None)
        if (e.end - e.start) * 1e3 > 0:
            ax.text((e.start - t0 + (e.end - e.start) / 2) * 1e3, e.worker, f"{e.kind}{e.mb}", ha="center",
                    va="center", fontsize=6, color="white")
    ax.set_yticks(range(workers), [f"worker {w}" for w in range(workers)])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(title, fontsize=9)
    from matplotlib.patches import Patch

    handles = [Patch(color=c, label=k) for k, c in colors.items()]
    if any(e.stage != first[e.worker] for e in events):
        handles.append(Patch(facecolor="white", edgecolor="grey", hatch="///", label="2nd stage"))
    ax.legend(handles=handles, loc="upper right", fontsize=7)
    fig.tight_layout()
    tmp = f"{path}.tmp.png"
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------------------
# The work of one stage, shared by both runners.


class _Forward:
    """``art.fwd`` as one dispatch per microbatch.

    The first call for an input signature goes through the public ``fwd`` and all
    its checks. It also notes which residual leaves are the caller's own arrays
    (input-backed: ``fwd`` never copies them). Later calls run one jitted
    function that returns the other leaves; the input-backed ones are put back
    from the arguments, since returning them from ``jit`` would copy them.
    """

    def __init__(self, art):
        self.art = art
        self.cache: dict = {}

    def __call__(self, *args):
        import jax

        leaves, tree = jax.tree_util.tree_flatten(args)
        key = (tree, tuple((np.shape(a), str(getattr(a, "dtype", type(a)))) for a in leaves))
        hit = self.cache.get(key)
        if hit is None:
            out, res = self.art.fwd(*args)
            res_leaves = jax.tree_util.tree_leaves(res)
            where = {id(a): i for i, a in enumerate(leaves)}
            backed = {j: where[id(r)] for j, r in enumerate(res_leaves) if id(r) in where}
            traced: dict = {}

            def run(*a):
                o, r = self.art.fwd(*a)
                flat, traced["tree"] = jax.tree_util.tree_flatten(r)
                return o, [x for j, x in enumerate(flat) if j not in backed]

            self.cache[key] = (jax.jit(run), backed, len(res_leaves), traced)
            return out, res
        fn, backed, n, traced = hit
        out, kept = fn(*args)
        it = iter(kept)
        flat = [leaves[backed[j]] if j in backed else next(it) for j in range(n)]
        return out, traced["tree"].unflatten(flat)


class _Calls:
    """One stage artifact's operations, each one jitted call around the artifact's public methods.

    The checks those methods make (keys, shapes, dtypes, fingerprints) run when a
    signature is first traced rather than on every microbatch, and the gradient
    sum is in the same call as the weight gradient.
    """

    def __init__(self, artifact, feeds_back: bool):
        import jax

        m = artifact.manifest
        w, x = m.arg_names[0], (m.arg_names[1] if feeds_back else None)

        def add(acc, g):
            return jax.tree_util.tree_map(lambda a, b: a + b, acc, g)

        def fused(res, ct):
            g = artifact.bwd(res, ct)
            g = {m.wrt[0]: g} if m.single_grad else dict(zip(m.wrt, g))
            return g[w], (g[x] if x else None)

        def fused_acc(acc, res, ct):
            gw, gx = fused(res, ct)
            return add(acc, gw), gx

        def b_input(res, ct):
            g, inter = artifact.bwd_input(res, ct)
            return (g[x] if x else None), inter

        def b_weight(inter):
            # The intermediates carry the residuals W reads: the rest were freed after B.
            return artifact.bwd_weight(inter)[w]

        self.forward = _Forward(artifact)
        self.backward, self.backward_acc = jax.jit(fused), jax.jit(fused_acc)
        self.backward_input = jax.jit(b_input) if m.weights else None
        self.backward_weight = jax.jit(b_weight) if m.weights else None
        self.backward_weight_acc = jax.jit(lambda acc, inter: add(acc, b_weight(inter))) if m.weights else None


# Compiled calls live as long as their artifact, so repeated steps (and run_inprocess
# calls) reuse them instead of tracing and compiling again.
_CALLS: "weakref.WeakKeyDictionary[Any, dict[bool, _Calls]]" = weakref.WeakKeyDictionary()
_CALLS_LOCK = threading.Lock()


def _calls_for(artifact, feeds_back: bool) -> _Calls:
    with _CALLS_LOCK:
        per = _CALLS.setdefault(artifact, {})
        if feeds_back not in per:
            per[feeds_back] = _Calls(artifact, feeds_back)
        return per[feeds_back]


class StageWorker:
    """One stage: its artifact, parameters, residuals in flight and accumulated gradients."""

    def __init__(self, artifact, params, index: int, stages: int):
        import jax

        self.art = artifact
        # Once, not on every microbatch: on a sharded stage, by its recorded shardings on its devices.
        self.params = artifact.place_arg(0, params)
        self.index = index
        self.stages = stages
        m = artifact.manifest
        names = m.arg_names
        if names[0] not in m.wrt:
            raise VjpsplitError(f"stage {index}: its first argument ({names[0]}) must be differentiated")
        self.feeds_back = index > 0
        if self.feeds_back and (len(names) < 2 or names[1] not in m.wrt):
            raise VjpsplitError(f"stage {index}: export it with wrt including its input "
                                f"({names[1] if len(names) > 1 else 'the second argument'}): the stage before "
                                "waits for that gradient")
        self.calls = _calls_for(artifact, self.feeds_back)
        self.reset()

    def reset(self):
        """Forget residuals, gradients and timings: ready for the next step."""
        self.res: dict[int, Any] = {}
        self.inter: dict[int, Any] = {}
        self.grads = None
        self.events: list[Event] = []
        self.losses: dict[int, float] = {}

    def _timed(self, worker, kind, mb, fn):
        t0 = time.time()
        out = fn()
        self.events.append(Event(worker, kind, mb, t0, time.time(), self.index))
        return out

    def _ct(self, ct, microbatches: int):
        return np.float32(1.0 / microbatches) if self.index == self.stages - 1 else ct

    def forward(self, mb: int, x, side: Sequence, worker: int | None = None):
        """F: run the forward, keep the residuals; return the activation (the loss on the last stage)."""
        def run():
            import jax

            xs = (x, *side)
            if self.art.manifest.sharded:
                # Activations arrive from the previous stage's devices: lay them out for this one first.
                xs = [self.art.place_arg(i + 1, v) for i, v in enumerate(xs)]
            out, res = self.calls.forward(self.params, *xs)
            out = jax.block_until_ready(out)
            self.res[mb] = res
            return out

        out = self._timed(self.index if worker is None else worker, "F", mb, run)
        if self.index == self.stages - 1:
            self.losses[mb] = float(out)
        return out

    def backward(self, mb: int, ct, microbatches: int, worker: int | None = None):
        """Whole backward (GPipe, 1F1B): accumulate the weight gradient, return the input cotangent."""
        def run():
            import jax

            res, c = self.res.pop(mb), self.art.place_cotangent(self._ct(ct, microbatches))
            if self.grads is None:
                self.grads, gx = jax.block_until_ready(self.calls.backward(res, c))
            else:
                self.grads, gx = jax.block_until_ready(self.calls.backward_acc(self.grads, res, c))
            return gx

        return self._timed(self.index if worker is None else worker, "B", mb, run)

    def backward_input(self, mb: int, ct, microbatches: int, worker: int | None = None):
        """Split schedules' B: the input cotangent now, the weight part later."""
        def run():
            import jax

            # B is the last reader of most residuals: drop them, keeping only W's share (in inter).
            c = self.art.place_cotangent(self._ct(ct, microbatches))
            gx, inter = jax.block_until_ready(self.calls.backward_input(self.res.pop(mb), c))
            self.inter[mb] = inter
            return gx

        return self._timed(self.index if worker is None else worker, "B", mb, run)

    def backward_weight(self, mb: int, worker: int | None = None):
        """Split schedules' W: the weight gradient of a microbatch whose B already ran."""
        def run():
            import jax

            inter = self.inter.pop(mb)
            if self.grads is None:
                self.grads = jax.block_until_ready(self.calls.backward_weight(inter))
            else:
                self.grads = jax.block_until_ready(self.calls.backward_weight_acc(self.grads, inter))

        self._timed(self.index if worker is None else worker, "W", mb, run)


def _split_batch(x, side: Mapping[str, Any] | Sequence, microbatches: int):
    n = np.shape(x)[0]
    if n % microbatches:
        raise VjpsplitError(f"batch of {n} does not split into {microbatches} equal microbatches")
    k = n // microbatches
    sides = list(side.values()) if isinstance(side, Mapping) else list(side)
    return [(x[i * k:(i + 1) * k], [s[i * k:(i + 1) * k] for s in sides]) for i in range(microbatches)]


def _check_stages(artifacts, name):
    _check_name(name, len(artifacts))
    if name in SPLIT_BACKWARD:
        for i, a in enumerate(artifacts):
            if not a.manifest.weights:
                raise VjpsplitError(f"{_LABELS[name]} needs the split backward: export stage {i} with "
                                    f"weights=('{a.manifest.arg_names[0]}',)")


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="pipeline ops", file=sys.stderr, leave=False)


def stage_devices(artifacts: Sequence, devices: Sequence[Sequence] | None = None) -> list:
    """Each stage's artifact on its device group (sharded stages); unsharded stages as they are.

    ``devices`` gives one group per stage. By default, stages take consecutive
    disjoint groups of this host's devices when there are enough (stage s on
    devices n*s ... n*s+n-1), else all share the first ones (one mesh).
    """
    import jax

    if devices is not None:
        if len(devices) != len(artifacts):
            raise VjpsplitError(f"{len(artifacts)} stages but {len(devices)} device groups")
        return [a.on_devices(g) if a.manifest.sharded else a for a, g in zip(artifacts, devices)]
    have = jax.devices()
    need = [a.manifest.nr_devices if a.manifest.sharded else 0 for a in artifacts]
    if not any(need):
        return list(artifacts)
    out, start = [], 0
    disjoint = sum(need) <= len(have)
    for a, n in zip(artifacts, need):
        if not n:
            out.append(a)
            continue
        out.append(a.on_devices(have[start:start + n]) if disjoint else a)
        start += n if disjoint else 0
    return out


def run_inprocess(artifacts: Sequence, params: Sequence, x, side=(), *, microbatches: int, schedule_name: str = "1f1b",
                  progress: bool = False, devices: Sequence[Sequence] | None = None) -> PipelineResult:
    """Run one training step in this process: one thread per worker, mailboxes between stages.

    Sharded stages run on their device groups (``devices``, one per stage; see
    ``stage_devices`` for the default); activations and cotangents are moved
    onto the next stage's shardings.
    """
    S = len(artifacts)
    if len(params) != S:
        raise VjpsplitError(f"{S} stages but {len(params)} parameter sets")
    artifacts = stage_devices(artifacts, devices)
    _check_stages(artifacts, schedule_name)
    plans = schedule(schedule_name, S, microbatches)
    split = schedule_name in SPLIT_BACKWARD
    mbs = _split_batch(x, side, microbatches)
    stages = [StageWorker(a, p, i, S) for i, (a, p) in enumerate(zip(artifacts, params))]
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
                raise RuntimeError("another worker failed")
            return box.pop(key)

    def post(box, key, value):
        with cond:
            box[key] = value
            cond.notify_all()

    def run_worker(w):
        try:
            for op in plans[w]:
                c, st = op.chunk, stages[op.chunk]
                if op.kind == "F":
                    inp = mbs[op.mb][0] if c == 0 else wait(acts, (c, op.mb))
                    out = st.forward(op.mb, inp, mbs[op.mb][1] if c == S - 1 else [], worker=w)
                    if c < S - 1:
                        post(acts, (c + 1, op.mb), out)
                elif op.kind == "B":
                    ct = None if c == S - 1 else wait(cts, (c, op.mb))
                    back = (st.backward_input if split else st.backward)(op.mb, ct, microbatches, worker=w)
                    if c > 0:
                        post(cts, (c - 1, op.mb), back)
                else:
                    st.backward_weight(op.mb, worker=w)
                if bar is not None:
                    with cond:
                        bar.update(1)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            with cond:
                errors.append(e)
                cond.notify_all()

    t0 = time.time()
    threads = [threading.Thread(target=run_worker, args=(w,), name=f"worker-{w}") for w in range(len(plans))]
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
    last = stages[-1]
    return PipelineResult(schedule_name, float(np.mean([last.losses[m] for m in range(microbatches)])),
                          [st.grads for st in stages], sorted((e for st in stages for e in st.events),
                                                              key=lambda e: e.start),
                          S, microbatches, "in-process", step)


def layout(schedule_name: str) -> str:
    """How a schedule places stages on workers: ``"v"`` (two per worker, ZB-V) or ``"stage"`` (one each)."""
    _check_name(schedule_name, 2)
    return "v" if schedule_name == "zbv" else "stage"


class RayPipeline:
    """Workers as Ray actors (one process each); activations and cotangents go through Ray's object store.

    ``layout="stage"`` (default) puts one stage on each actor, for GPipe, 1F1B and
    ZB-H1; ``layout="v"`` puts two on each in ZB-V's V. ``address=None`` starts (or
    joins) a local Ray instance; pass a cluster address (``ray://host:10001`` or
    ``auto``) for multi-host. Actors persist across ``run`` calls; ``close()`` (or
    ``with``) ends them. The driver sends the batch and fetches the gradients,
    losses and timings once per step; activations and cotangents pass from actor
    to actor without reaching it.
    """

    def __init__(self, artifacts: Sequence, params: Sequence, *, address: str | None = None,
                 runtime_env: dict | None = None, num_cpus_per_stage: float = 0, layout: str = "stage",
                 actor_options: Sequence[Mapping[str, Any]] | None = None):
        try:
            import ray
        except ImportError as e:
            raise VjpsplitError("the Ray runner needs Ray; pip install 'vjpsplit[ray]'") from e
        if layout not in ("stage", "v"):
            raise VjpsplitError(f"unknown layout {layout!r}; use stage or v")
        if len(params) != len(artifacts):
            raise VjpsplitError(f"{len(artifacts)} stages but {len(params)} parameter sets")
        self.ray = ray
        self.layout = layout
        self.stages = len(artifacts)
        self.artifacts = list(artifacts)
        self.placement = placement("zbv" if layout == "v" else "1f1b", self.stages)
        self.started = False
        if not ray.is_initialized():
            kwargs = {"address": address} if address else {"num_cpus": max(len(self.placement), os.cpu_count() or 1)}
            ray.init(include_dashboard=False, log_to_driver=False, runtime_env=runtime_env, **kwargs)
            self.started = True
        if actor_options is not None and len(actor_options) != len(self.placement):
            raise VjpsplitError(f"actor_options has {len(actor_options)} entries for {len(self.placement)} workers; "
                                "give one dict of Ray actor options per worker")
        self.actors = []
        for w, chunks in enumerate(self.placement):
            opts = {"num_cpus": num_cpus_per_stage, **(dict(actor_options[w]) if actor_options else {})}
            _devices_for(opts, max(artifacts[c].manifest.nr_devices for c in chunks))
            actor = ray.remote(_RayWorker).options(**opts)
            self.actors.append(actor.remote([(c, artifacts[c].to_bytes(), params[c]) for c in chunks], self.stages))

    def run(self, x, side=(), *, microbatches: int, schedule_name: str = "1f1b", progress: bool = False) -> PipelineResult:
        """One training step under ``schedule_name``; gradients accumulate over microbatches."""
        ray = self.ray
        S = self.stages
        _check_stages(self.artifacts, schedule_name)
        if layout(schedule_name) != self.layout:
            raise VjpsplitError(f"{_LABELS[schedule_name]} needs RayPipeline(layout={layout(schedule_name)!r}); "
                                f"this one was made with layout={self.layout!r}")
        plans = schedule(schedule_name, S, microbatches)
        split = schedule_name in SPLIT_BACKWARD
        mbs = _split_batch(x, side, microbatches)
        ray.get([a.reset.remote() for a in self.actors])
        t0 = time.time()
        acts: dict[tuple, Any] = {}
        cts: dict[tuple, Any] = {}
        refs = []
        idx = [0] * len(plans)
        # Submit in an order that respects every worker's list and every data dependency;
        # each actor then runs its tasks in submission order.
        while any(idx[w] < len(plans[w]) for w in range(len(plans))):
            moved = False
            for w, ops in enumerate(plans):
                actor = self.actors[w]
                while idx[w] < len(ops):
                    op = ops[idx[w]]
                    c = op.chunk
                    if op.kind == "F":
                        if c > 0 and (c, op.mb) not in acts:
                            break
                        inp = mbs[op.mb][0] if c == 0 else acts.pop((c, op.mb))
                        ref = actor.forward.remote(c, op.mb, inp, mbs[op.mb][1] if c == S - 1 else [])
                        if c < S - 1:
                            acts[(c + 1, op.mb)] = ref
                    elif op.kind == "B":
                        if c < S - 1 and (c, op.mb) not in cts:
                            break
                        ct = None if c == S - 1 else cts.pop((c, op.mb))
                        ref = (actor.backward_input if split else actor.backward).remote(c, op.mb, ct, microbatches)
                        if c > 0:
                            cts[(c - 1, op.mb)] = ref
                    else:
                        ref = actor.backward_weight.remote(c, op.mb)
                    if progress:
                        refs.append(ref)
                    idx[w] += 1
                    moved = True
            if not moved:
                raise VjpsplitError(f"schedule {schedule_name} deadlocks (a bug in the schedule)")
        bar = _progress(len(refs), progress)
        pending = list(refs)
        while pending:
            # fetch_local=False: wait for completion without copying the values here
            ready, pending = ray.wait(pending, num_returns=1, fetch_local=False)
            if bar is not None:
                bar.update(len(ready))
        if bar is not None:
            bar.close()
        states = ray.get([a.state.remote() for a in self.actors])  # each actor answers after its last op
        step = time.time() - t0
        failed = [st["error"] for st in states if st["error"] is not None]
        if failed:
            raise failed[0]
        grads = {c: g for st in states for c, g in st["grads"].items()}
        losses = next(st["losses"] for st in states if S - 1 in st["grads"])
        return PipelineResult(schedule_name, float(np.mean([losses[m] for m in range(microbatches)])),
                              [grads[c] for c in range(S)],
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


def _devices_for(opts: dict, n: int) -> None:
    """Let an actor that drives an ``n``-device sharded stage see ``n`` devices.

    Accelerators come from the actor options (``num_gpus``, ``resources``); on
    CPU, XLA makes ``n`` host devices when the actor's process starts with
    ``XLA_FLAGS=--xla_force_host_platform_device_count=n`` (added unless the
    options set XLA_FLAGS themselves). It only affects JAX's CPU platform.
    """
    if n <= 1:
        return
    env = dict(opts.get("runtime_env") or {})
    env_vars = dict(env.get("env_vars") or {})
    if "XLA_FLAGS" not in env_vars:
        flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
                 if not f.startswith("--xla_force_host_platform_device_count")]
        env_vars["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={n}"])
    env["env_vars"] = env_vars
    opts["runtime_env"] = env


class _RayWorker:
    """The Ray actor around one worker's StageWorkers; loads the artifacts from bytes (no user code needed).

    An operation that fails records its error and returns None; operations that get
    None in place of an activation or cotangent skip, so ``state`` reports the first
    error and nothing downstream runs on garbage.
    """

    def __init__(self, chunks, stages: int):
        from .loading import loads

        self.stages = {c: StageWorker(loads(data, source=f"stage {c}"), params, c, stages) for c, data, params in chunks}
        self.worker = min(self.stages)  # a worker's index is its first stage's, in both layouts
        self.error: BaseException | None = None

    def _guard(self, fn, needed=True):
        if self.error is not None or not needed:
            return None
        try:
            return fn()
        except BaseException as e:  # noqa: BLE001 - handed to the driver by state()
            self.error = _picklable(e)
            return None

    def reset(self):
        for st in self.stages.values():
            st.reset()
        self.error = None

    def forward(self, chunk, mb, x, side):
        st = self.stages[chunk]
        return self._guard(lambda: np.asarray(st.forward(mb, x, side, worker=self.worker)), needed=x is not None)

    def backward(self, chunk, mb, ct, microbatches):
        st = self.stages[chunk]
        needed = ct is not None or chunk == st.stages - 1
        return self._guard(lambda: _host(st.backward(mb, ct, microbatches, worker=self.worker)), needed)

    def backward_input(self, chunk, mb, ct, microbatches):
        st = self.stages[chunk]
        needed = ct is not None or chunk == st.stages - 1
        return self._guard(lambda: _host(st.backward_input(mb, ct, microbatches, worker=self.worker)), needed)

    def backward_weight(self, chunk, mb):
        st = self.stages[chunk]
        self._guard(lambda: st.backward_weight(mb, worker=self.worker), needed=mb in st.inter)

    def state(self):
        import jax

        return {"grads": {c: jax.tree_util.tree_map(np.asarray, st.grads) for c, st in self.stages.items()},
                "device_count": jax.device_count(),
                "devices": {c: [d.id for d in st.art.devices] for c, st in self.stages.items()},
                "events": [e for st in self.stages.values() for e in st.events],
                "losses": {m: v for st in self.stages.values() for m, v in st.losses.items()},
                "error": self.error}


def _picklable(e: BaseException) -> BaseException:
    import pickle

    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001 - some runtime errors do not survive pickling; keep their text
        return RuntimeError(f"{type(e).__name__}: {e}")


def _host(value):
    return None if value is None else np.asarray(value)


def run(artifacts: Sequence, params: Sequence, x, side=(), *, microbatches: int, schedule_name: str = "1f1b",
        runner: str = "inprocess", address: str | None = None, progress: bool = False) -> PipelineResult:
    """One pipelined training step: ``runner`` is ``inprocess`` (default) or ``ray``."""
    if runner == "inprocess":
        return run_inprocess(artifacts, params, x, side, microbatches=microbatches, schedule_name=schedule_name,
                             progress=progress)
    if runner == "ray":
        with RayPipeline(artifacts, params, address=address, layout=layout(schedule_name)) as rp:
            return rp.run(x, side, microbatches=microbatches, schedule_name=schedule_name, progress=progress)
    raise VjpsplitError(f"unknown runner {runner!r}; use inprocess or ray")
