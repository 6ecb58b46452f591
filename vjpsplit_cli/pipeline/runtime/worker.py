"""Stage execution, shared by every runner: one stage's F, B and W calls and their bookkeeping.

A ``StageWorker`` holds a stage's artifact, parameters, the residuals of
microbatches in flight and the accumulated gradients; ``run_op`` executes one
scheduled operation on it. Threads (in-process) and Ray actors call the same.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any, Mapping, Sequence

import numpy as np

from ...errors import VjpsplitError
from ...tracing.residuals import Intermediates
from .dispatch import PreSplit
from ..schedules.builtins import LABELS, SPLIT_BACKWARD, Op, check_schedule
from ..schedules.timeline import Event


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
            # Without the residuals W reads: out of a jitted call they would come back as copies
            # (XLA copies an argument it returns), the stage's own arrays are put back below.
            return (g[x] if x else None), Intermediates(inter.arrays, inter.dims, inter.fingerprint)

        def b_input_with_residuals(res, ct):
            gx, inter = self.backward_input_jitted(res, ct)
            stored, inputs = artifact.weight_part_residuals(res)
            return gx, Intermediates(
                inter.arrays, inter.dims, inter.fingerprint, res.residuals_id, stored, inputs, res.arg_trees
            )

        def b_weight(inter):
            # The intermediates carry the residuals W reads: the rest were freed after B.
            return artifact.bwd_weight(inter)[w]

        self.forward = _Forward(artifact)
        self.backward, self.backward_acc = jax.jit(fused), jax.jit(fused_acc)
        self.backward_input_jitted = jax.jit(b_input) if m.weights else None  # the compiled part (FLOPs, HLO)
        self.backward_input = b_input_with_residuals if m.weights else None
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
            raise VjpsplitError(
                f"stage {index}: export it with wrt including its input "
                f"({names[1] if len(names) > 1 else 'the second argument'}): the stage before "
                "waits for that gradient"
            )
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
        t0 = time.monotonic()
        out = fn()
        self.events.append(Event(worker, kind, mb, t0, time.monotonic(), self.index))
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


def split_batch(x, side: Mapping[str, Any] | Sequence, microbatches: int) -> list[tuple[Any, list]]:
    """The batch and its side inputs cut into ``microbatches`` equal ``(x, side)`` pieces along axis 0."""
    if isinstance(x, PreSplit):
        if len(x.mbs) != microbatches:
            raise VjpsplitError(f"{len(x.mbs)} microbatches prepared, {microbatches} asked for")
        return list(x.mbs)
    n = np.shape(x)[0]
    if n % microbatches:
        raise VjpsplitError(f"batch of {n} does not split into {microbatches} equal microbatches")
    k = n // microbatches
    sides = list(side.values()) if isinstance(side, Mapping) else list(side)
    return [(x[i * k : (i + 1) * k], [s[i * k : (i + 1) * k] for s in sides]) for i in range(microbatches)]


def check_stages(artifacts: Sequence, name: str, plans: Sequence[Sequence[Op]] | None = None) -> None:
    """Refuse a schedule the stages cannot run (split schedules need artifacts with the split backward).

    With ``plans`` (a checked schedule), the stages that have a W in them need it.
    """
    if plans is not None:
        need = {o.chunk for ops in plans for o in ops if o.kind == "W"}
    else:
        check_schedule(name, len(artifacts))
        need = set(range(len(artifacts))) if name in SPLIT_BACKWARD else set()
    if need:
        for i, a in enumerate(artifacts):
            if i in need and not a.manifest.weights:
                raise VjpsplitError(
                    f"{LABELS.get(name, name)} needs the split backward: export stage {i} with "
                    f"weights=('{a.manifest.arg_names[0]}',)"
                )


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
        out.append(a.on_devices(have[start : start + n]) if disjoint else a)
        start += n if disjoint else 0
    return out


def run_op(stage: StageWorker, op: Op, data, side: Sequence, microbatches: int, split: bool, worker: int):
    """Execute scheduled operation ``op`` on ``stage``: F takes the activation, B the cotangent; W takes nothing.

    Returns what the operation hands on: the activation (or loss), the input
    cotangent, or None for W.
    """
    if op.kind == "F":
        return stage.forward(op.mb, data, side, worker=worker)
    if op.kind == "B":
        return (stage.backward_input if split else stage.backward)(op.mb, data, microbatches, worker=worker)
    stage.backward_weight(op.mb, worker=worker)
    return None
