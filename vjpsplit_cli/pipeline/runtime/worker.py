"""Stage execution, shared by every runner: one stage's F, B, I and W calls and their bookkeeping.

A ``StageWorker`` holds a stage's artifact, parameters, the residuals of
microbatches in flight and the accumulated gradients; ``run_op`` executes one
scheduled operation on it. Threads (in-process) and Ray actors call the same.
``RunsOps`` is what ``run_op`` and the runners call on a stage: a ``StageWorker``,
or a ``replicas.ReplicaGroup`` standing in its place.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from typing import TYPE_CHECKING, Callable, Protocol, Sequence, TypeVar

import numpy as np

from ...errors import VjpsplitError
from ...files.dtypes import dtype_from_name
from ...tracing.residuals import Intermediates
from ..schedules.ops import Kind, Op
from .devices import default_device
from .flight import RING
from .offload import Away, Offload, Offloader, device_bytes
from ..schedules.timeline import Event, op_name
from ...treetypes import Leaf, PyTree

if TYPE_CHECKING:
    import jax
    from jax.sharding import SingleDeviceSharding
    from jax.tree_util import PyTreeDef

    from ...artifact.artifact import Artifact
    from ...tracing.residuals import Residuals

    Signature = tuple[tuple[int, ...], object]  # a leaf's shape, and its dtype (a Python scalar's type)
    # A split backward's input part: the input cotangent now, and what its weight part reads.
    SplitInput = Callable[[Residuals, PyTree], tuple[PyTree | None, Intermediates]]
    # A forward signature's jitted call, which residual leaves are its inputs, how many leaves, their structure.
    Traced = tuple[Callable[..., tuple[PyTree, list[jax.Array]]], dict[int, int], int, dict[str, PyTreeDef]]


class RunsOps(Protocol):
    """What runs one stage's scheduled operations: a ``StageWorker``, or a ``replicas.ReplicaGroup`` in its place.

    What ``run_op`` and the runners call on a stage; both classes document each member.
    """

    grads: PyTree

    @property
    def events(self) -> list[Event]: ...

    @property
    def ring(self) -> deque[tuple[str, int, float, float]]: ...

    @property
    def is_last(self) -> bool: ...

    @property
    def inter(self) -> dict[int, Intermediates]: ...

    @property
    def peak_residual_bytes(self) -> int: ...

    def set_offload(self, spec: Offload | None) -> None: ...

    def before(self, op: Op) -> None: ...

    def reset(self, timed: bool | None = None, plans: Sequence[Sequence[Op]] | None = None) -> None: ...

    def to_device(self, tree: PyTree) -> PyTree: ...

    def fetch_losses(self) -> dict[int, float]: ...

    def forward(self, mb: int, x: PyTree, side: Sequence[PyTree], worker: int | None = None) -> PyTree: ...

    def backward(self, mb: int, ct: PyTree, microbatches: int, worker: int | None = None) -> PyTree | None: ...

    def backward_input(self, mb: int, ct: PyTree, microbatches: int, worker: int | None = None) -> PyTree | None: ...

    def backward_weight(self, mb: int, worker: int | None = None) -> None: ...


class _Forward:
    """``art.fwd`` as one dispatch per microbatch.

    The first call for an input signature goes through the public ``fwd`` and all
    its checks. It also notes which residual leaves are the caller's own arrays
    (input-backed: ``fwd`` never copies them). Later calls run one jitted
    function that returns the other leaves; the input-backed ones are put back
    from the arguments, since returning them from ``jit`` would copy them.
    """

    WARMUP = 2  # the calls before a signature's are warm: the checked first one, then the jitted one compiles

    def __init__(self, art: Artifact):
        self.art = art
        self.cache: dict[tuple[PyTreeDef, tuple[Signature, ...]], Traced] = {}

    def __call__(self, *args: PyTree) -> tuple[PyTree, Residuals]:
        import jax

        leaves, tree = jax.tree_util.tree_flatten(args)
        key = (tree, tuple(map(_signature, leaves)))
        hit = self.cache.get(key)
        if hit is None:
            out, res = self.art.fwd(*args)
            res_leaves = jax.tree_util.tree_leaves(res)
            where = {id(a): i for i, a in enumerate(leaves)}
            backed = {j: where[id(r)] for j, r in enumerate(res_leaves) if id(r) in where}
            traced: dict[str, PyTreeDef] = {}

            def run(*a: PyTree) -> tuple[PyTree, list[jax.Array]]:
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


def _signature(a: Leaf | complex) -> Signature:
    try:
        return a.shape, a.dtype  # type: ignore[union-attr]  # a Python scalar has neither: below
    except AttributeError:  # a Python scalar
        return np.shape(a), type(a)


class _Calls:
    """One stage artifact's operations, each one jitted call around the artifact's public methods.

    The checks those methods make (keys, shapes, dtypes, fingerprints) run when a
    signature is first traced rather than on every microbatch, and the gradient
    sum is in the same call as the weight gradient.
    """

    def __init__(self, artifact: Artifact, feeds_back: bool):
        import jax

        m = artifact.manifest
        w, x = m.arg_names[0], (m.arg_names[1] if feeds_back else None)

        def add(acc: PyTree, g: PyTree) -> PyTree:
            return jax.tree_util.tree_map(lambda a, b: a + b, acc, g)

        def fused(res: Residuals, ct: PyTree) -> tuple[PyTree, PyTree | None]:
            g = artifact.bwd(res, ct)
            g = {m.wrt[0]: g} if m.single_grad else dict(zip(m.wrt, g))
            return g[w], (g[x] if x else None)

        def fused_acc(acc: PyTree, res: Residuals, ct: PyTree) -> tuple[PyTree, PyTree | None]:
            gw, gx = fused(res, ct)
            return add(acc, gw), gx

        def b_input(res: Residuals, ct: PyTree) -> tuple[PyTree | None, Intermediates]:
            g, inter = artifact.bwd_input(res, ct)
            # Without the residuals W reads: out of a jitted call they would come back as copies
            # (XLA copies an argument it returns), the stage's own arrays are put back below.
            return (g[x] if x else None), Intermediates(inter.arrays, inter.dims, inter.fingerprint)

        def b_input_with_residuals(res: Residuals, ct: PyTree) -> tuple[PyTree | None, Intermediates]:
            gx, inter = jitted_input(res, ct)
            stored, inputs = artifact.weight_part_residuals(res)
            return gx, Intermediates(
                inter.arrays, inter.dims, inter.fingerprint, res.residuals_id, stored, inputs, res.arg_trees
            )

        def b_weight(inter: Intermediates) -> PyTree:
            # The intermediates carry the residuals W reads: the rest were freed after B.
            return artifact.bwd_weight(inter)[w]

        jitted_input = jax.jit(b_input)  # traced at its first call: none without the split backward
        self.forward = _Forward(artifact)
        self.backward, self.backward_acc = jax.jit(fused), jax.jit(fused_acc)
        # The split backward's calls, None without one (plans with I or W are refused before they run).
        self.backward_input_jitted: SplitInput | None = (
            jitted_input if m.weights else None
        )  # the compiled part (FLOPs, HLO)
        self.backward_input: SplitInput | None = b_input_with_residuals if m.weights else None
        self.backward_weight: Callable[[Intermediates], PyTree] | None = jax.jit(b_weight) if m.weights else None
        self.backward_weight_acc: Callable[[PyTree, Intermediates], PyTree] | None = (
            jax.jit(lambda acc, inter: add(acc, b_weight(inter))) if m.weights else None
        )


# Compiled calls live as long as their artifact, so repeated steps (and run_inprocess
# calls) reuse them instead of tracing and compiling again.
_CALLS: "weakref.WeakKeyDictionary[Artifact, dict[bool, _Calls]]" = weakref.WeakKeyDictionary()
_CALLS_LOCK = threading.Lock()


def _calls_for(artifact: Artifact, feeds_back: bool) -> _Calls:
    with _CALLS_LOCK:
        per = _CALLS.setdefault(artifact, {})
        if feeds_back not in per:
            per[feeds_back] = _Calls(artifact, feeds_back)
        return per[feeds_back]


class StageWorker:
    """One stage's F, B, I and W with their bookkeeping: its artifact, parameters, residuals and gradients.

    It holds the residuals in flight and the accumulated gradients. The runners'
    building block (threads and Ray actors run the same).

    ``device``: where an unsharded stage runs (its parameters are committed there,
    arriving activations and cotangents moved there; ``jit`` runs where its inputs
    are); None leaves them where JAX puts them. A sharded stage runs on its
    artifact's devices (``Artifact.on_devices``). ``timed`` (per step, see
    ``reset``): each operation waits for its results and records an ``Event`` of
    its compute time; otherwise operations are dispatched and nothing waits.

    Args:
        artifact: The stage's artifact (its first argument the parameters, its second,
            after the first stage, the activation it receives; both differentiated).
        params: The stage's parameter pytree.
        stage_index: The stage's index in the pipeline.
        num_stages: The pipeline's stage count.
        device: Where an unsharded stage runs; ``None`` leaves it where JAX puts it.
        offload: Which residuals leave the device between F and B (``offload.Offload``); ``None``: none.

    Attributes:
        art: The stage's artifact.
        device: Where an unsharded stage runs, or ``None``.
        params: The parameters, placed.
        stage_index: The stage's index.
        num_stages: The pipeline's stage count.
        feeds_back: Whether the stage sends a cotangent to the stage before (every stage but the first).
        timed: Whether operations wait and record events (set per step by ``reset``).
        ring: The last operations ``(kind, mb, start, end)``, kept across steps for a stuck step's report.
        res: The residuals in flight, by microbatch.
        inter: The weight part's intermediates in flight, by microbatch.
        grads: The gradients accumulated this step; ``None`` before the first backward.
        events: This step's ``Event``s (timed steps only).
        losses: The last stage's loss per microbatch, device scalars until fetched.
        peak_residual_bytes: The step's most stored residual bytes on the device at an operation's boundary.

    Raises:
        VjpsplitError: If the artifact does not differentiate its first argument, or
            (after the first stage) its second.
    """

    def __init__(
        self,
        artifact: Artifact,
        params: PyTree,
        stage_index: int,
        num_stages: int,
        device: jax.Device | None = None,
        offload: Offload | None = None,
    ):
        self.art = artifact
        m = artifact.manifest
        self.device = None if m.sharded else device
        self._sharding: SingleDeviceSharding | None = None if self.device is None else _single(self.device)
        self.params = self.place_params(params)
        self.stage_index = stage_index
        self.num_stages = num_stages
        names = m.arg_names
        if names[0] not in m.wrt:
            raise VjpsplitError(f"stage {stage_index}: its first argument ({names[0]}) must be differentiated")
        self.feeds_back = stage_index > 0
        if self.feeds_back and (len(names) < 2 or names[1] not in m.wrt):
            raise VjpsplitError(
                f"stage {stage_index}: export it with wrt including its input "
                f"({names[1] if len(names) > 1 else 'the second argument'}): the stage before "
                "waits for that gradient"
            )
        self.calls = _calls_for(artifact, self.feeds_back)
        self._runs: dict[
            tuple[int, tuple[object, ...]], int
        ] = {}  # timed steps: how often each call ran per input signature (warm or not)
        self.set_offload(offload)
        self.timed = True
        # The last operations (kind, mb, start, end), kept across steps: what a stuck step's report shows.
        self.ring: deque[tuple[str, int, float, float]] = deque(maxlen=RING)
        self.reset()

    def set_offload(self, spec: Offload | None, replica: int | None = None) -> None:
        """Which of this stage's residuals leave its device between F and B from the next step.

        Args:
            spec: What leaves and where to (``offload.Offload``); ``None``: nothing.
            replica: This worker's index among its stage's replicas (it names their files apart); ``None``: alone.
        """
        self.offloader = None if spec is None else Offloader(spec, self.art, self.stage_index, replica)

    def before(self, op: Op) -> None:
        """Before this stage runs ``op``: start the copy back of its next B's residuals if they are away.

        Args:
            op: The operation about to run on this stage.
        """
        if self.offloader is not None:
            self.offloader.before(op)

    def place_params(self, params: PyTree) -> PyTree:
        """``params`` where this stage keeps them: on its device, or by a sharded stage's recorded shardings.

        A sharded stage's go on its devices; once, not on every microbatch.

        Args:
            params: The stage's parameter pytree.

        Returns:
            The same pytree, placed.
        """
        return self.to_device(params) if self._sharding is not None else self.art.place_arg(0, params)

    @property
    def is_last(self) -> bool:
        """Whether this is the pipeline's last stage (its F gives the loss)."""
        return self.stage_index == self.num_stages - 1

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        """The devices that hold this stage's parameters (a sharded stage's mesh devices, in order)."""
        if self.art.manifest.sharded:
            return tuple(self.art.devices)
        if self.device is not None:
            return (self.device,)
        import jax

        leaves = [a for a in jax.tree_util.tree_leaves(self.params) if isinstance(a, jax.Array)]
        return tuple(sorted(leaves[0].devices(), key=lambda d: d.id)) if leaves else (default_device(),)

    def reset(self, timed: bool | None = None, plans: Sequence[Sequence[Op]] | None = None) -> None:
        """Forget residuals, gradients and timings: ready for the next step (``timed``: see the class).

        Args:
            timed: Whether the next step is timed; ``None`` keeps the current setting.
            plans: The step's plans, which an offloading stage reads to start each copy back one operation early.
        """
        if timed is not None:
            self.timed = timed
        if self.offloader is not None and plans is not None:
            self.offloader.schedule(plans)
        self.peak_residual_bytes = 0
        self.res: dict[int, Residuals | Away] = {}
        self.inter: dict[int, Intermediates] = {}
        self.grads: PyTree = None
        self.events: list[Event] = []
        self.losses: dict[int, jax.Array] = {}  # the last stage's per microbatch: device scalars until fetched

    def to_device(self, tree: PyTree) -> PyTree:
        """``tree``'s arrays on this stage's device (those already there as they are); unchanged without one.

        Args:
            tree: A pytree of arrays.

        Returns:
            The same pytree, its arrays on this stage's device.
        """
        s = self._sharding
        if s is None:
            return tree
        import jax

        leaves, treedef = jax.tree_util.tree_flatten(tree)
        move = [i for i, a in enumerate(leaves) if not (isinstance(a, jax.Array) and a.sharding == s)]
        if move:
            moved = jax.device_put([leaves[i] for i in move], s)
            for i, a in zip(move, moved):
                leaves[i] = a
        return jax.tree_util.tree_unflatten(treedef, leaves)

    def fetch_losses(self) -> dict[int, float]:
        """The per-microbatch losses on the host, all in one transfer.

        Returns:
            The loss of each microbatch this step, by microbatch, as floats (empty but on the last stage).
        """
        import jax

        keys = sorted(self.losses)
        return {m: float(v) for m, v in zip(keys, jax.device_get([self.losses[m] for m in keys]))}

    def residual_bytes(self) -> int:
        """Bytes of the stored residuals (and W's intermediates) this stage holds on its device now.

        Returns:
            The bytes, each array counted once; offloaded residuals count while leaving and once back.
        """
        held = [r.stored for r in self.res.values() if hasattr(r, "stored")]
        held += [(i.arrays, i.stored) for i in self.inter.values()]
        return device_bytes(held) + (0 if self.offloader is None else self.offloader.device_bytes())

    def _note_peak(self) -> None:
        """At an operation's boundary: the most residual bytes held on the device so far this step."""
        self.peak_residual_bytes = max(self.peak_residual_bytes, self.residual_bytes())

    def _residuals(self, mb: int) -> Residuals:
        """Microbatch ``mb``'s residuals for its B, back on the device if they were away."""
        held = self.res.pop(mb)
        if self.offloader is not None:
            return self.offloader.take(mb, held)
        assert not isinstance(held, Away)  # nothing leaves the device without an offloader
        return held

    def _run(
        self,
        worker: int | None,
        kind: Kind,
        mb: int,
        args: Sequence[PyTree],
        call: Callable[..., PyTree],
        warmup: int,
    ) -> PyTree:
        """``call(*args)``, in the ring; when timed, waited for (under a ``jax.profiler.TraceAnnotation`` named
        as the trace file's slice) and recorded as an ``Event`` of the operation's own time.

        Timed, the clock starts once the inputs exist (moved to this device, the batch's transfer and the
        previous step's update done: not this operation's time). A call that had not yet run ``warmup``
        times for these inputs' signature traced, compiled or took the checked first path: it is run
        again (its results dropped; ``call`` changes nothing) until warm, and one warm run is timed as
        the event's ``own`` seconds, what the operation costs from then on.
        """
        if not self.timed:
            t0 = time.monotonic()
            out = call(*args)
            self.ring.append((kind, mb, t0, time.monotonic()))  # the dispatch's time: nothing waited
            return out
        import jax

        jax.block_until_ready(args)
        key = (id(call), _signature_of(args))
        cold = self._runs.get(key, 0) < warmup
        t0 = time.monotonic()
        with jax.profiler.TraceAnnotation(op_name(kind, self.stage_index, mb)):
            out = jax.block_until_ready(call(*args))
        t1 = time.monotonic()
        self.ring.append((kind, mb, t0, t1))
        self._runs[key] = self._runs.get(key, 0) + 1
        own = None
        if cold:
            while self._runs[key] < warmup:
                jax.block_until_ready(call(*args))
                self._runs[key] += 1
            a = time.monotonic()
            jax.block_until_ready(call(*args))
            own = time.monotonic() - a
        w = self.stage_index if worker is None else worker
        self.events.append(Event(w, kind, mb, t0, t1, self.stage_index, own))
        return out

    def _ct(self, ct: PyTree, microbatches: int) -> PyTree:
        if self.is_last:
            # In the loss's own dtype (float64 under x64): the artifact casts no cotangent.
            ct = np.asarray(1.0 / microbatches, dtype_from_name(self.art.manifest.cotangent_leaves[0].dtype))
        else:
            ct = self.to_device(ct)
        return self.art.place_cotangent(ct)

    def forward(self, mb: int, x: PyTree, side: Sequence[PyTree], worker: int | None = None) -> PyTree:
        """F: run the forward, keep the residuals; return the activation (the loss on the last stage).

        Args:
            mb: The microbatch.
            x: The stage's input: the batch's first input on stage 0, else the activation received.
            side: The stage's side inputs (batch leaves it reads directly).
            worker: The worker recorded in the event; ``None`` means the stage's index.

        Returns:
            The activation to send on, or the loss on the last stage.
        """
        xs = self.to_device([x, *side])
        if self.art.manifest.sharded:
            # Activations arrive from the previous stage's devices: lay them out for this one first.
            xs = [self.art.place_arg(i + 1, v) for i, v in enumerate(xs)]
        f = self.calls.forward
        out, res = self._run(worker, Kind.F, mb, (self.params, *xs), f, f.WARMUP)
        self.res[mb] = res if self.offloader is None else self.offloader.send(mb, res)
        self._note_peak()
        if self.is_last:
            self.losses[mb] = out
        return out

    def backward(self, mb: int, ct: PyTree, microbatches: int, worker: int | None = None) -> PyTree | None:
        """B, the whole backward (GPipe, 1F1B): accumulate the weight gradient, return the input cotangent.

        Args:
            mb: The microbatch, whose forward already ran.
            ct: The cotangent from the next stage (ignored on the last stage, which starts
                from ``1 / microbatches``).
            microbatches: The step's microbatch count.
            worker: The worker recorded in the event; ``None`` means the stage's index.

        Returns:
            The cotangent of the stage's input, for the stage before; ``None`` on the first stage.
        """
        res, c = self._residuals(mb), self._ct(ct, microbatches)
        if self.grads is None:
            self.grads, gx = self._run(worker, Kind.B, mb, (res, c), self.calls.backward, 1)
        else:
            self.grads, gx = self._run(worker, Kind.B, mb, (self.grads, res, c), self.calls.backward_acc, 1)
        del res
        self._note_peak()
        return gx

    def backward_input(self, mb: int, ct: PyTree, microbatches: int, worker: int | None = None) -> PyTree | None:
        """I, the backward's input part (split schedules): the input cotangent now, the weight part (W) later.

        Args:
            mb: The microbatch, whose forward already ran.
            ct: The cotangent from the next stage (ignored on the last stage).
            microbatches: The step's microbatch count.
            worker: The worker recorded in the event; ``None`` means the stage's index.

        Returns:
            The cotangent of the stage's input, for the stage before; ``None`` on the first stage.
        """
        # I is the last reader of most residuals: drop them, keeping only W's share (in inter).
        res, c = self._residuals(mb), self._ct(ct, microbatches)
        gx, self.inter[mb] = self._run(worker, Kind.I, mb, (res, c), _split(self.calls.backward_input), 1)
        del res
        self._note_peak()
        return gx

    def backward_weight(self, mb: int, worker: int | None = None) -> None:
        """W, the backward's weight part (split schedules): the weight gradient of a microbatch whose I already ran.

        Args:
            mb: The microbatch.
            worker: The worker recorded in the event; ``None`` means the stage's index.
        """
        inter = self.inter.pop(mb)
        if self.grads is None:
            self.grads = self._run(worker, Kind.W, mb, (inter,), _split(self.calls.backward_weight), 1)
        else:
            self.grads = self._run(worker, Kind.W, mb, (self.grads, inter), _split(self.calls.backward_weight_acc), 1)
        self._note_peak()


def _signature_of(args: Sequence[PyTree]) -> tuple[object, ...]:
    """What a compiled call is cached by: the inputs' structure, and each leaf's shape, dtype and placement."""
    import jax

    leaves, tree = jax.tree_util.tree_flatten(args)
    return (tree, *((*_signature(a), getattr(a, "sharding", None)) for a in leaves))


C = TypeVar("C")


def _split(call: C | None) -> C:
    """A split backward's call: plans with I or W never reach a stage without one (``Model.check_plans``)."""
    assert call is not None
    return call


def _single(device: jax.Device) -> SingleDeviceSharding:
    from jax.sharding import SingleDeviceSharding

    return SingleDeviceSharding(device)


def run_op(stage: RunsOps, op: Op, data: PyTree, side: Sequence[PyTree], microbatches: int, worker: int) -> PyTree:
    """Execute scheduled operation ``op`` on ``stage`` by its kind: F takes the activation, B and I the cotangent;
    W takes nothing.

    Returns what the operation hands on: the activation (or loss), the input
    cotangent, or None for W.
    """
    stage.before(op)  # the copy back of the stage's next backward overlaps this operation
    if op.kind == Kind.F:
        return stage.forward(op.mb, data, side, worker=worker)
    if op.kind == Kind.B:
        return stage.backward(op.mb, data, microbatches, worker=worker)
    if op.kind == Kind.I:
        return stage.backward_input(op.mb, data, microbatches, worker=worker)
    stage.backward_weight(op.mb, worker=worker)
    return None
