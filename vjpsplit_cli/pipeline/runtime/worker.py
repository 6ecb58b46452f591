"""Stage execution, shared by every runner: one stage's F, B, I and W calls and their bookkeeping.

A ``StageWorker`` holds a stage's artifact, parameters, the residuals of
microbatches in flight and the accumulated gradients; ``stageops.run_op`` executes
one scheduled operation on it. Threads (in-process) and Ray actors call the same.
Its jitted calls are ``stagecalls``' (kept per artifact).
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING, Callable, Sequence, TypeVar

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from ...errors import VjpsplitError
from ...files.dtypes import dtype_from_name
from ...tracing.residuals import Intermediates
from ..schedules.ops import Kind, Op
from .devices import default_device
from .hang_report import RING, RingOp
from .devicebytes import HeldBytes, is_array
from . import packing
from .offload import Away, Offload, Offloader
from .stagecalls import calls_for, signature_of
from ..schedules.timeline import Event, op_name
from ...treetypes import PyTree

if TYPE_CHECKING:
    from ...artifact.artifact import Artifact
    from .watcher import Lane
    from ...tracing.residuals import Residuals


class StageWorker:
    """One stage's F, B, I and W with their bookkeeping: its artifact, parameters, residuals and gradients.

    The runners' building block (threads and Ray actors run the same). Its state: ``res`` and ``inter`` (residuals
    and intermediates in flight, by microbatch), ``grads`` (``None`` before the first backward), ``events`` (timed
    steps), ``ring`` (the last operations, kept across steps for a stuck step's report), ``losses`` and ``aux`` (the
    last stage's, device values until fetched) and ``peak_residual_bytes``.

    Args:
        artifact: The stage's artifact (its parameters first, then, after the first stage, the activation it receives).
        params: The stage's parameter pytree.
        stage_index: The stage's index in the pipeline.
        num_stages: The pipeline's stage count.
        device: Where an unsharded stage runs; ``None`` leaves it where JAX puts it (a sharded one uses its mesh).
        offload: Which residuals leave the device between F and B (``offload.Offload``); ``None``: none.
        replica: Its index among its stage's replicas (``replicas.ReplicaGroup``); ``None`` alone.

    Raises:
        VjpsplitError: If the artifact does not differentiate its first argument, or (after the first stage) its second.
    """

    def __init__(
        self,
        artifact: Artifact,
        params: PyTree,
        stage_index: int,
        num_stages: int,
        device: jax.Device | None = None,
        offload: Offload | None = None,
        replica: int | None = None,
    ):
        self.art = artifact
        self.replica = replica  # its index among its stage's replicas (a ReplicaGroup's), recorded in its events
        m = artifact.manifest
        self.device = None if m.sharded else device
        self._sharding: SingleDeviceSharding | None = None if self.device is None else SingleDeviceSharding(self.device)
        # Host arrays go to the device through one jitted identity: its call's transfer is C++, where
        # jax.device_put's Python took 200-400 µs of CPU per call inside a busy Ray actor (40 µs idle).
        self._host_put = None if self._sharding is None else jax.jit(_identity, out_shardings=self._sharding)
        # On an accelerator the small host arrays go packed in one buffer (``packing``): one transfer, not one each.
        self._packs_host = self.device is not None and packing.packs_host_to(self.device)
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
        self.calls = calls_for(artifact, self.feeds_back)
        self._seeds: dict[int, PyTree] = {}  # the last stage's cotangent 1/microbatches, placed, by microbatches
        self._runs: dict[
            tuple[int, tuple[object, ...]], int
        ] = {}  # timed steps: how often each call ran per input signature (warm or not)
        self.offloader: Offloader | None = None
        self.set_offload(offload)
        self.timed = True
        self.lane: Lane | None = None  # in-process timed steps: where its operations are timed (``timed.Timeline``)
        # The last operations (kind, mb, start, end), kept across steps: what a stuck step's report shows.
        self.ring: deque[RingOp] = deque(maxlen=RING)
        self.reset()

    def set_offload(self, spec: Offload | None, replica: int | None = None) -> None:
        """Which of this stage's residuals leave its device between F and B from the next step (the offloader
        before is closed: ``None`` ends offloading, as ``close`` does).

        Args:
            spec: What leaves and where to (``offload.Offload``); ``None``: nothing.
            replica: This worker's index among its stage's replicas (it names their files apart); ``None``: alone.
        """
        if self.offloader is not None:
            self.offloader.close()  # its thread ends; residual files no B read back are removed
        self.offloader = None if spec is None else Offloader(spec, self.art, self.stage_index, replica)

    def discard_offloaded(self) -> None:
        """After a step failed or was interrupted: remove the residual files no B read back (``Offloader.discard``)."""
        if self.offloader is not None:
            self.offloader.discard()

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
        if self._sharding is None:
            return self.art.place_arg(0, params)
        placed = self.to_device(params)
        # Its own containers, never the caller's (to_device hands back a tree whose arrays are all there).
        return jax.tree_util.tree_map(lambda a: a, placed) if placed is params else placed

    @property
    def is_last(self) -> bool:
        """Whether this is the pipeline's last stage (its F gives the loss)."""
        return self.stage_index == self.num_stages - 1

    @property
    def splits_backward(self) -> bool:
        """Whether the stage's artifact has the split backward: its B can run as I then W."""
        return self.art.manifest.splits_backward

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        """The devices that hold this stage's parameters (a sharded stage's mesh devices, in order)."""
        if self.art.manifest.sharded:
            return tuple(self.art.devices)
        if self.device is not None:
            return (self.device,)
        leaves = [a for a in jax.tree_util.tree_leaves(self.params) if isinstance(a, jax.Array)]
        return tuple(sorted(leaves[0].devices(), key=lambda d: d.id)) if leaves else (default_device(),)

    def reset(
        self,
        timed: bool | None = None,
        plans: Sequence[Sequence[Op]] | None = None,
        scales: Sequence[float] | None = None,
        whole: bool = False,
    ) -> None:
        """Forget residuals, gradients and timings: ready for the next step (``timed``: see the class).

        Args:
            timed: Whether the next step is timed; ``None`` keeps the current setting.
            plans: The step's plans, which an offloading stage reads to start each copy back one operation early.
            scales: Per microbatch, the cotangent the last stage's backward starts from (its loss weight over the
                step's: ``Microbatches.scales``), placed on the device now, in one transfer; None:
                ``1 / microbatches`` each.
            whole: Every I of this step runs the whole backward in its call and its W runs nothing (the last
                stage's F directly followed by its I runs F, I and W in one call): what ``dispatch`` asks for where
                every stage shares one device that runs one program at a time (``dispatch.whole_backwards``).
        """
        if timed is not None:
            self.timed = timed
        self._scaled: list[PyTree] | None = None
        if scales is not None and self.is_last:
            dtype = dtype_from_name(self.art.manifest.cotangent_leaves[0].dtype)
            placed = self.to_device([np.asarray(v, dtype) for v in scales])
            self._scaled = [self.art.place_cotangent(v) for v in placed]
        if self.offloader is not None and plans is not None:
            self.offloader.schedule(plans)
        # Operations that directly follow another of the same microbatch in this stage's plan run in its call: the
        # last stage's B (or I, with the split backward) in its F's; the first stage's W in its I's (its I hands
        # nothing on, so the whole backward runs there). With ``whole``, every I runs its W too (the last stage's
        # F then I: F, I and W in one call, as F and B).
        last, first = self.is_last, not self.feeds_back
        split = self.calls.forward_input is not None
        p, i = plans or (), self.stage_index
        self._fusable = _adjacent(p, i, Kind.F, Kind.B) if last else set()  # F runs the whole backward too
        self._fusable_input = _adjacent(p, i, Kind.F, Kind.I) if last and split else set()
        self._whole = _adjacent(p, i, Kind.I, Kind.W) if first else set()
        if whole:
            self._fusable |= self._fusable_input
            self._fusable_input = set()
            self._whole = {op.mb for ops in p for op in ops if op.stage == i and op.kind == Kind.I}
        self._fused: dict[int, PyTree] = {}  # by microbatch: the input cotangent its fused F left for its B or I
        self._ran_whole: set[int] = set()  # microbatches whose I ran the whole backward: their W runs nothing
        self.peak_residual_bytes = 0
        self.res: dict[int, Residuals | Away] = {}
        self.inter: dict[int, Intermediates] = {}
        self._held = HeldBytes()  # the device arrays of res (those not away) and inter
        self.grads: PyTree = None
        self.events: list[Event] = []
        self.losses: dict[int, jax.Array] = {}  # the last stage's per microbatch: device scalars until fetched
        self.aux: dict[int, list[jax.Array]] = {}  # the last stage's aux leaves per microbatch (has_aux), likewise

    def to_device(self, tree: PyTree) -> PyTree:
        """``tree``'s arrays on this stage's device (those already there as they are); unchanged without one.

        Args:
            tree: A pytree of arrays.

        Returns:
            The same pytree, its arrays on this stage's device: ``tree`` itself where all are there already
            (stages sharing one device hand on their activations so, with no call of JAX).
        """
        s = self._sharding
        if s is None:
            return tree
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        host, move = [], []
        for i, a in enumerate(leaves):
            if type(a) is np.ndarray:
                host.append(i)
            elif not (is_array(a) and a.sharding == s):
                move.append(i)
        if not host and not move:  # all there already (every stage on one device): nothing to rebuild
            return tree
        if host:
            self._put_host(leaves, host)
        if move:
            for i, a in zip(move, jax.device_put([leaves[i] for i in move], s)):
                leaves[i] = a
        return jax.tree_util.tree_unflatten(treedef, leaves)

    def _put_host(self, leaves: list[PyTree], host: list[int]) -> None:
        """``leaves[i]`` for ``i`` in ``host`` (NumPy arrays) on this stage's device, in place: on an accelerator
        the small ones in one packed buffer and one compiled call (``packing``), the rest in one jitted identity."""
        s, put = self._sharding, self._host_put
        assert s is not None and put is not None  # made with the sharding
        small = [i for i in host if packing.host_packs(leaves[i])] if self._packs_host else []
        if len(small) > 1:
            arrays = [leaves[i] for i in small]
            specs = tuple((a.shape, a.dtype) for a in arrays)
            for i, a in zip(small, packing.unpacker(specs, s)(packing.pack_host(arrays))):
                leaves[i] = a
            packed = set(small)
            host = [i for i in host if i not in packed]
        if host:
            for i, a in zip(host, put(*[leaves[i] for i in host])):
                leaves[i] = a

    def fetch_losses(self) -> dict[int, float]:
        """The per-microbatch losses on the host, all in one transfer.

        Returns:
            The loss of each microbatch this step, by microbatch, as floats (empty but on the last stage).
        """
        keys = sorted(self.losses)
        return {m: float(v) for m, v in zip(keys, jax.device_get([self.losses[m] for m in keys]))}

    def fetch_outputs(self) -> tuple[dict[int, float], dict[int, list[np.ndarray]]]:
        """The per-microbatch losses and aux leaves on the host, all in one transfer (``fetch_losses`` with the aux).

        Returns:
            The losses as ``fetch_losses`` gives them, and each microbatch's aux leaves as host arrays (in the
            aux's leaf order; empty without aux: an artifact not exported with ``has_aux``, or not the last stage).
        """
        keys = sorted(self.losses)
        losses, aux = jax.device_get(([self.losses[m] for m in keys], [self.aux.get(m, []) for m in keys]))
        return {m: float(v) for m, v in zip(keys, losses)}, {
            m: [np.asarray(a) for a in leaves] for m, leaves in zip(keys, aux) if m in self.aux
        }

    def residual_bytes(self) -> int:
        """Bytes of the stored residuals (and W's intermediates) this stage holds on its device now.

        Returns:
            The bytes, each array counted once; offloaded residuals count while leaving and once back.
        """
        return self._held.total + (0 if self.offloader is None else self.offloader.device_bytes())

    def _note_peak(self) -> None:
        """At an operation's boundary: the most residual bytes held on the device so far this step."""
        self.peak_residual_bytes = max(self.peak_residual_bytes, self.residual_bytes())

    def _residuals(self, mb: int) -> Residuals:
        """Microbatch ``mb``'s residuals for its B, back on the device if they were away."""
        held = self.res.pop(mb)
        if not isinstance(held, Away):
            self._held.remove(held.stored)
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
        """``call(*args)``, in the ring; when timed, under a ``jax.profiler.TraceAnnotation`` named as the trace
        file's slice, and recorded as an ``Event`` of the operation's own time.

        Timed, the clock starts once the inputs exist (moved to this device, the batch's transfer and the
        previous step's update done: not this operation's time). With a ``lane`` (an in-process timed step,
        ``timed.Timeline``) a warm call is dispatched as untimed and its lane's watcher times it; without one
        (Ray, ``jax.distributed``) each call is waited for. A call that had not yet run ``warmup``
        times for these inputs' signature traced, compiled or took the checked first path: it is waited for
        (after its lane's operations before it) and run
        again (its results dropped; ``call`` changes nothing) until warm, and one warm run is timed as
        the event's ``own`` seconds, what the operation costs from then on.
        """
        if not self.timed:
            t0 = time.monotonic()
            out = call(*args)
            self.ring.append((kind, mb, t0, time.monotonic(), False))  # the dispatch's time: nothing waited
            return out
        key = (id(call), signature_of(args))
        runs = self._runs.get(key, 0)
        cold = runs < warmup
        w = self.stage_index if worker is None else worker
        lane = self.lane
        name = op_name(kind, self.stage_index, mb, self.replica)
        if lane is not None and not cold:  # dispatched as untimed, its lane's watcher records its event
            t0 = time.monotonic()
            with jax.profiler.TraceAnnotation(name):
                out = call(*args)
            self.ring.append((kind, mb, t0, time.monotonic(), False))
            self._runs[key] = runs + 1
            lane.watch(self.events, (w, kind, mb, self.stage_index, self.replica), t0, args, out)
            return out
        if lane is not None:
            lane.settle()  # the operations dispatched before it ended: its time is its own
        jax.block_until_ready(args)
        t0 = time.monotonic()
        with jax.profiler.TraceAnnotation(name):
            out = jax.block_until_ready(call(*args))
        t1 = time.monotonic()
        self.ring.append((kind, mb, t0, t1, True))
        self._runs[key] = runs + 1
        own = None
        if cold:
            while self._runs[key] < warmup:
                jax.block_until_ready(call(*args))
                self._runs[key] += 1
            a = time.monotonic()
            jax.block_until_ready(call(*args))
            own = time.monotonic() - a
        if lane is None:
            self.events.append(Event(w, kind, mb, t0, t1, self.stage_index, own, self.replica))
        else:  # after the lane's operations before it
            lane.waited(self.events, (w, kind, mb, self.stage_index, self.replica), (t0, t1), own)
        return out

    def start_cotangent(self, mb: int, microbatches: int) -> PyTree:
        """The last stage's cotangent its backward of ``mb`` starts from: ``1 / microbatches``, or the microbatch's
        scale given to ``reset``; placed on its device.

        Args:
            mb: The microbatch.
            microbatches: The step's microbatch count.

        Returns:
            The cotangent of the loss.
        """
        return self._ct(None, microbatches, mb)

    def _ct(self, ct: PyTree, microbatches: int, mb: int) -> PyTree:
        if self.is_last and self._scaled is not None:  # the step's loss weights (Microbatches)
            return self._scaled[mb]
        if self.is_last:
            seed = self._seeds.get(microbatches)
            if seed is None:  # made and placed once: not a host-to-device copy in every last-stage backward
                # In the loss's own dtype (float64 under x64): the artifact casts no cotangent.
                one = np.asarray(1.0 / microbatches, dtype_from_name(self.art.manifest.cotangent_leaves[0].dtype))
                seed = self._seeds[microbatches] = self.art.place_cotangent(self.to_device(one))
            return seed
        return self.art.place_cotangent(self.to_device(ct))

    def forward(
        self, mb: int, x: PyTree, side: Sequence[PyTree], worker: int | None = None, microbatches: int | None = None
    ) -> PyTree:
        """F: run the forward, keep the residuals; return the activation (the loss on the last stage).

        On the last stage, when the microbatch's B directly follows this F in the worker's plan (1F1B) and
        ``microbatches`` is given, F runs the backward too, in one compiled call: its residuals never leave
        that call, and its B hands on the input cotangent this call left.

        Args:
            mb: The microbatch.
            x: The stage's input: the batch's first input on stage 0, else the activation received.
            side: The stage's side inputs (batch leaves it reads directly).
            worker: The worker recorded in the event; ``None`` means the stage's index.
            microbatches: The step's microbatch count (the last stage's cotangent); ``None``: F alone.

        Returns:
            The activation to send on, or the loss on the last stage.
        """
        xs = self.to_device([x, *side])
        if self.art.manifest.sharded:
            # Activations arrive from the previous stage's devices: lay them out for this one first.
            xs = [self.art.place_arg(i + 1, v) for i, v in enumerate(xs)]
        if microbatches is not None and mb in self._fusable:
            return self._forward_backward(mb, xs, microbatches, worker)
        if microbatches is not None and mb in self._fusable_input:
            out = self._forward_backward_input(mb, xs, microbatches, worker)
            if out is not None:
                return out
        f = self.calls.forward
        out, res = self._run(worker, Kind.F, mb, (self.params, *xs), f, f.WARMUP)
        if mb in self._fusable_input:  # the fused call's first F: where W's inputs are among the arguments
            assert self.calls.forward_input is not None  # fusable only with the split backward
            self.calls.forward_input.learn((self.params, *xs), res)
        kept = self.res[mb] = res if self.offloader is None else self.offloader.send(mb, res)
        if not isinstance(kept, Away):
            self._held.add(kept.stored)
        self._note_peak()
        if self.is_last:
            if self.art.manifest.has_aux:  # (loss, aux): the loss goes on, the aux waits for the step's end
                out, aux = out
                self.aux[mb] = jax.tree_util.tree_leaves(aux)
            self.losses[mb] = out
        return out

    def _forward_backward(self, mb: int, xs: list[PyTree], microbatches: int, worker: int | None) -> PyTree:
        """The last stage's F and B of microbatch ``mb`` in one call (see ``forward``); returns the loss."""
        c = self._ct(None, microbatches, mb)
        if self.grads is None:
            out, self.grads, gx = self._run(worker, Kind.F, mb, (self.params, xs, c), self.calls.forward_backward, 1)
        else:
            args = (self.grads, self.params, xs, c)
            out, self.grads, gx = self._run(worker, Kind.F, mb, args, self.calls.forward_backward_acc, 1)
        self._fused[mb] = gx
        if self.art.manifest.has_aux:  # (loss, aux), as ``forward`` keeps them
            out, aux = out
            self.aux[mb] = jax.tree_util.tree_leaves(aux)
        self.losses[mb] = out
        return out

    def _forward_backward_input(
        self, mb: int, xs: list[PyTree], microbatches: int, worker: int | None
    ) -> PyTree | None:
        """The last stage's F and I of microbatch ``mb`` in one call (see ``forward``); returns the loss, or ``None``
        (nothing ran) before an unfused F of these inputs' signature showed the call where W's inputs are."""
        fi = self.calls.forward_input
        assert fi is not None  # fusable only with the split backward
        if not fi.ready(self.params, xs):
            return None
        args = (self.params, xs, self._ct(None, microbatches, mb))
        out, gx, inter = self._run(worker, Kind.F, mb, args, fi, 1)
        self._fused[mb] = gx
        self.inter[mb] = inter
        self._held.add((inter.arrays, inter.stored))
        self._note_peak()
        if self.art.manifest.has_aux:  # (loss, aux), as ``forward`` keeps them
            out, aux = out
            self.aux[mb] = jax.tree_util.tree_leaves(aux)
        self.losses[mb] = out
        return out

    def weight_pending(self, mb: int) -> bool:
        """Whether microbatch ``mb``'s W is to run: its I ran, leaving W's intermediates or (``reset``) the whole
        backward, whose W then runs nothing but its record.

        Args:
            mb: The microbatch.

        Returns:
            True from that I until the W.
        """
        return mb in self.inter or mb in self._ran_whole

    def backward_in_forward(self, mb: int) -> bool:
        """Whether microbatch ``mb``'s F runs its backward in its call this step (``reset``): the last stage's F
        directly followed by its B (or, on one serial device, its I) in the worker's plan.

        Args:
            mb: The microbatch.

        Returns:
            True where that F holds no residuals past its call.
        """
        return mb in self._fusable

    def fused(self, mb: int) -> bool:
        """Whether microbatch ``mb``'s F ran its B too (``forward``): its B only hands on the input cotangent.

        Args:
            mb: The microbatch.

        Returns:
            True once that F ran, until the B.
        """
        return mb in self._fused

    def _ran_before(self, kind: Kind, mb: int, worker: int | None) -> None:
        """Record operation ``kind`` of ``mb`` that the operation before it ran in its call (``reset``): a ``kind``
        of no time (its event's ``own`` 0.0, so the costs cut that call's time in two: ``measured.step_samples``)."""
        t = time.monotonic()
        self.ring.append((kind, mb, t, t, self.timed))
        if self.timed:
            with jax.profiler.TraceAnnotation(op_name(kind, self.stage_index, mb, self.replica)):
                pass  # in a profile too, as the trace file's slice of no time
            w = self.stage_index if worker is None else worker
            if self.lane is None:
                self.events.append(Event(w, kind, mb, t, t, self.stage_index, 0.0, self.replica))
            else:  # at the end of the operation that ran it
                self.lane.waited(self.events, (w, kind, mb, self.stage_index, self.replica), (t, t), 0.0)

    def backward(self, mb: int, ct: PyTree, microbatches: int, worker: int | None = None) -> PyTree | None:
        """B, the whole backward (GPipe, 1F1B): accumulate the weight gradient, return the input cotangent.

        Args:
            mb: The microbatch, whose forward already ran.
            ct: The cotangent from the next stage (ignored on the last stage, which starts
                from ``1 / microbatches``, or the microbatch's scale given to ``reset``).
            microbatches: The step's microbatch count.
            worker: The worker recorded in the event; ``None`` means the stage's index.

        Returns:
            The cotangent of the stage's input, for the stage before; ``None`` on the first stage.
        """
        if mb in self._fused:
            self._ran_before(Kind.B, mb, worker)
            return self._fused.pop(mb)
        return self._whole_backward(Kind.B, mb, ct, microbatches, worker)

    def _whole_backward(self, kind: Kind, mb: int, ct: PyTree, microbatches: int, worker: int | None) -> PyTree | None:
        """The whole backward of ``mb``, recorded as ``kind`` (a B, or an I that runs its W too: ``reset``)."""
        res, c = self._residuals(mb), self._ct(ct, microbatches, mb)
        if self.grads is None:
            self.grads, gx = self._run(worker, kind, mb, (res, c), self.calls.backward, 1)
        else:
            self.grads, gx = self._run(worker, kind, mb, (self.grads, res, c), self.calls.backward_acc, 1)
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
        if mb in self._fused:  # the last stage's F ran it
            self._ran_before(Kind.I, mb, worker)
            if mb in self._fusable:  # the whole backward: its W runs nothing
                self._ran_whole.add(mb)
            return self._fused.pop(mb)
        if mb in self._whole:  # the first stage's W follows: both in one call, the whole backward
            self._ran_whole.add(mb)
            return self._whole_backward(Kind.I, mb, ct, microbatches, worker)
        # I is the last reader of most residuals: drop them, keeping only W's share (in inter).
        res, c = self._residuals(mb), self._ct(ct, microbatches, mb)
        gx, inter = self._run(worker, Kind.I, mb, (res, c), _split(self.calls.backward_input), 1)
        self.inter[mb] = inter
        self._held.add((inter.arrays, inter.stored))
        del res
        self._note_peak()
        return gx

    def backward_weight(self, mb: int, worker: int | None = None) -> None:
        """W, the backward's weight part (split schedules): the weight gradient of a microbatch whose I already ran.

        Args:
            mb: The microbatch.
            worker: The worker recorded in the event; ``None`` means the stage's index.
        """
        if mb in self._ran_whole:
            self._ran_whole.remove(mb)
            self._ran_before(Kind.W, mb, worker)
            return
        inter = self.inter.pop(mb)
        self._held.remove((inter.arrays, inter.stored))
        if self.grads is None:
            self.grads = self._run(worker, Kind.W, mb, (inter,), _split(self.calls.backward_weight), 1)
        else:
            self.grads = self._run(worker, Kind.W, mb, (self.grads, inter), _split(self.calls.backward_weight_acc), 1)
        self._note_peak()


C = TypeVar("C")


def _split(call: C | None) -> C:
    """A split backward's call: plans with I or W never reach a stage without one (``Model.check_plans``)."""
    assert call is not None
    return call


def _adjacent(plans: Sequence[Sequence[Op]], stage: int, first: Kind, then: Kind) -> set[int]:
    """The microbatches whose ``then`` directly follows their ``first`` on ``stage`` in its worker's plan."""
    return {
        a.mb
        for ops in plans
        for a, b in zip(ops, ops[1:])
        if a.kind == first and b.kind == then and a.stage == b.stage == stage and a.mb == b.mb
    }


def _identity(*arrays: jax.Array) -> tuple[jax.Array, ...]:
    return arrays
