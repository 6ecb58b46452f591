"""Data parallel x pipeline: one stage on N devices, each microbatch split N ways, one reduction per step.

A ``ReplicaGroup`` is what a runner hands a stage's operations to when the stage
has N replicas: N ``StageWorker``s over the same artifact, one per device. It
takes the place of the stage's single worker (the same ``forward``, ``backward``,
``backward_input``, ``backward_weight``, ``reset``, ``fetch_losses``): the first
stage's batch inputs and every stage's side inputs are cut into N equal parts
along axis 0 (replica r takes part r), and what a stage hands on is a ``Parts``
(replica r's output goes to replica r of the next stage). Each replica runs the
stage's own programs on its device, so those programs hold no collective.

Each replica sums its weight gradients over the step's microbatches alone, as a
single worker does. When the stage's last gradient operation of the step is
dispatched (its m-th B or W), the group dispatches the stage's ``Reducer``
(module ``reduction``): one reduce-scatter across the replicas, leaving each
device its ``zero_spec`` shard of every gradient.

The loss is the mean over the replicas' losses (each the mean over its part), and
each replica's seed cotangent is ``1 / (microbatches * N)``: the step computes the
gradient of the mean over the whole batch, as one process does. Also where a
stage's replicas run (``replica_placement``).

A sharded stage's replicas each run its artifact on a device group of its own
(``Artifact.on_devices``, the same mesh shape): replica r's parameters and
gradients are laid out over group r as the export says, and the reduction runs
over the replicas' axis of ``replicas_mesh`` alone (in-process and in a Ray
actor alike).
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING, Iterable, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from ...errors import VjpsplitError
from ...treetypes import PyTree
from ..schedules.ops import Op
from ..schedules.timeline import Phase
from .model import Microbatch
from .offload import Offload
from .reduction import AXIS, Reducer, replica_mesh, replicas_mesh
from .worker import StageWorker

# The reduction's; named here too for their importers (``training.zero1``).

if TYPE_CHECKING:
    from .hang_report import RingOp
    from ...artifact.artifact import Artifact
    from ...tracing.residuals import Intermediates
    from ..schedules.timeline import Event

REDUCE = "reduce replicas"  # a timed step's cross-replica reduction, as its trace names the phase


class Parts(tuple):  # type: ignore[type-arg]
    """Per replica, what one stage hands the next (replica r's activation or cotangent for replica r).

    A pytree node (its replicas' values are its children), so that a Ray actor's sender copies each part to the
    host and the receiver gets a ``Parts`` back, not the parts stacked into one array."""


jax.tree_util.register_pytree_node(Parts, lambda p: (tuple(p), None), lambda _, children: Parts(children))


def split_parts(tree: PyTree, n: int) -> list[PyTree]:
    """``tree``'s arrays cut into ``n`` equal parts along axis 0: per replica, the tree of its part."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    parts: list[list[object]] = [[] for _ in range(n)]
    for a in leaves:
        rows = int(np.shape(a)[0]) if np.ndim(a) else 0
        if rows % n or rows == 0:
            raise VjpsplitError(
                f"data_parallel={n}: a microbatch of {rows} rows does not split into {n} equal replica batches; "
                f"give a batch whose first dim divides by microbatches x {n}"
            )
        k = rows // n
        for r in range(n):
            parts[r].append(a[r * k : (r + 1) * k])
    return [jax.tree_util.tree_unflatten(treedef, p) for p in parts]


def check_split(mbs: Sequence[Microbatch], n: int) -> None:
    """Refuse, before any operation runs, microbatches whose batch inputs do not split into ``n`` equal parts."""
    if mbs:
        x, side = mbs[0]
        split_parts((x, list(side.values()) if isinstance(side, dict) else side), n)  # a StageInputs: its lists


def stage_need(artifact: Artifact) -> int:
    """The devices one replica of a stage runs on: its mesh's for a sharded stage, else 1."""
    return int(artifact.manifest.nr_devices) if artifact.manifest.sharded else 1


def replica_placement(
    artifacts: Sequence[Artifact],
    workers: Sequence[Sequence[int]],
    n: int,
    devices: Sequence[Sequence[jax.Device]] | None = None,
) -> list[tuple[jax.Device, ...]]:
    """Per stage, its ``n`` replicas' devices, replica-major (a sharded stage's replica r on its ``k`` mesh
    devices ``r*k ... r*k + k - 1`` of the list): ``devices`` as given (one list of ``n * k`` per stage), or by
    default worker w's stages on this host's next ``n * k`` devices, ``k`` the most of its stages' (one error
    when there are too few)."""
    if devices is not None:
        if len(devices) != len(artifacts):
            raise VjpsplitError(f"{len(artifacts)} stages but {len(devices)} device groups")
        out = [tuple(g) for g in devices]
        for s, g in enumerate(out):
            k = stage_need(artifacts[s])
            if len(g) != n * k or len(set(g)) != n * k:
                each = "one per replica" if k == 1 else f"{n} replicas x its mesh of {k}, replica r's at r*{k}..."
                raise VjpsplitError(
                    f"data_parallel={n}: stage {s} is given {len(g)} devices ({len(set(g))} distinct) in devices=; "
                    f"give it {n * k} distinct devices, {each}"
                )
        return out
    need = [n * max(stage_need(artifacts[s]) for s in held) for held in workers]
    have = jax.local_devices()
    if sum(need) > len(have):
        hint = (
            f" (on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count={sum(need)} before JAX starts)"
            if have[0].platform == "cpu"
            else ""
        )
        raise VjpsplitError(
            f"data_parallel={n} with {len(workers)} workers needs {sum(need)} devices, this host has "
            f"{len(have)}{hint}; or give devices= one list of {n} x each stage's mesh devices per stage"
        )
    out_by_stage = {}
    start = 0
    for held, want in zip(workers, need):
        block, width = have[start : start + want], want // n
        for s in held:
            k = stage_need(artifacts[s])
            out_by_stage[s] = tuple(d for r in range(n) for d in block[r * width : r * width + k])
        start += want
    return [out_by_stage[s] for s in range(len(artifacts))]


class ReplicaGroup:
    """A stage's N replicas, standing where its one ``StageWorker`` would (see the module).

    ``devices``: one per replica (the mesh ``AXIS`` in this order); a sharded stage's, each replica's mesh
    devices in turn (``replica_placement``): each replica runs the artifact on its own. After the step's
    last gradient operation ``grads`` holds the reduced gradients (the stage's
    parameter structure, each leaf laid out by ``zero_spec`` over the replicas) and
    ``squares`` the replicas' squared sums (``Reducer``); ``squared`` says, per
    parameter leaf, whether it counts in them (set by whoever owns the norm).
    ``reductions`` counts the cross-replica reductions run (one per step); ``phases`` holds a timed step's,
    waited for, as ``reduce replicas`` on its worker's track. ``events``: every replica's operations.
    ``offload``: every replica's residuals off its own device between F and B, as a single worker's.
    """

    def __init__(
        self,
        artifact: Artifact,
        params: PyTree,
        stage_index: int,
        num_stages: int,
        devices: Sequence[jax.Device],
        offload: Offload | None = None,
    ):
        k = stage_need(artifact)
        if len(devices) % k or not devices:
            raise VjpsplitError(
                f"stage {stage_index}: its replicas are given {len(devices)} devices, not a multiple of its mesh's {k}"
            )
        if artifact.mesh is not None and AXIS in artifact.mesh.axis_names:
            raise VjpsplitError(
                f"stage {stage_index}: its mesh has an axis named {AXIS!r}, the axis data_parallel puts its replicas "
                "on; rename that axis of the export's mesh"
            )
        groups = [tuple(devices[i : i + k]) for i in range(0, len(devices), k)]
        self.replicas = [
            StageWorker(artifact.on_devices(g), params, stage_index, num_stages, g[0], replica=i)
            for i, g in enumerate(groups)
        ]
        for i, r in enumerate(self.replicas):
            r.set_offload(offload, replica=i)
        self.n = len(self.replicas)
        self.sharded = bool(artifact.manifest.sharded)
        meshes = [r.art.mesh for r in self.replicas]
        self.mesh = replicas_mesh([m for m in meshes if m is not None]) if self.sharded else replica_mesh(devices)
        self.art = artifact
        self.stage_index, self.num_stages = stage_index, num_stages
        self.treedef = jax.tree_util.tree_structure(self.replicas[0].params)
        self.squared: list[bool] = [True] * len(jax.tree_util.tree_leaves(self.replicas[0].params))
        self.reductions = 0
        # Reduce after every gradient operation too (results unchanged): the per-microbatch reduction that
        # benchmarks/data_parallel.py measures this design against. Never set by the Trainer.
        self.per_microbatch = False
        self._reducer: Reducer | None = None
        self.timed = True
        self.reset()

    @property
    def is_last(self) -> bool:
        """Whether this is the pipeline's last stage."""
        return self.stage_index == self.num_stages - 1

    @property
    def splits_backward(self) -> bool:
        """Whether the stage's artifact has the split backward (every replica runs the same)."""
        return self.replicas[0].splits_backward

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        """The replicas' devices, in mesh order (a sharded stage's: each replica's mesh devices in turn)."""
        return tuple(d for r in self.replicas for d in r.devices)

    @property
    def specs(self) -> list[PartitionSpec]:
        """Per parameter leaf (JAX's order), its layout over the stage's own mesh axes (unsharded: whole)."""
        leaves = jax.tree_util.tree_leaves(self.replicas[0].params)
        return [
            a.sharding.spec if self.sharded and isinstance(a.sharding, NamedSharding) else PartitionSpec()
            for a in leaves
        ]

    @property
    def params(self) -> PyTree:
        """The first replica's parameters (every replica holds the same)."""
        return self.replicas[0].params

    @property
    def inter(self) -> dict[int, Intermediates]:
        """The first replica's split-backward intermediates by microbatch (which W operations have work)."""
        return self.replicas[0].inter

    def weight_pending(self, mb: int) -> bool:
        """Whether microbatch ``mb``'s W is to run on every replica (``StageWorker.weight_pending``)."""
        return all(r.weight_pending(mb) for r in self.replicas)

    @property
    def ring(self) -> deque[RingOp]:
        """The first replica's last operations (what a stuck step's report shows)."""
        return self.replicas[0].ring

    @property
    def events(self) -> list[Event]:
        """A timed step's events: every replica's, each naming its replica (timed, they run one after another)."""
        return [e for r in self.replicas for e in r.events]

    @property
    def peak_residual_bytes(self) -> int:
        """The step's most residual bytes on any one replica's device (``StageWorker.peak_residual_bytes``)."""
        return max(r.peak_residual_bytes for r in self.replicas)

    def set_offload(self, spec: Offload | None) -> None:
        """Every replica's residuals off its device between F and B from the next step (None: none)."""
        for i, r in enumerate(self.replicas):
            r.set_offload(spec, replica=i)

    def discard_offloaded(self) -> None:
        """After a step failed or was interrupted: every replica's residual files no B read back are removed."""
        for r in self.replicas:
            r.discard_offloaded()

    def before(self, op: Op) -> None:
        """Before ``op``: every replica starts its copy back of the next B's residuals, if away."""
        for r in self.replicas:
            r.before(op)

    def reset(
        self,
        timed: bool | None = None,
        plans: Sequence[Sequence[Op]] | None = None,
        scales: Sequence[float] | None = None,
        whole: bool = False,
    ) -> None:
        """Every replica ready for the next step; no gradients yet (``plans``, ``scales``, ``whole``: as
        ``StageWorker.reset``; each replica's scale is its microbatch's over the replicas, as
        ``1 / (microbatches * N)`` is)."""
        if timed is not None:
            self.timed = timed
        for r in self.replicas:
            r.reset(timed, plans, None if scales is None else [v / self.n for v in scales], whole)
        self.grads: PyTree = None
        self.squares: jax.Array | None = None
        self.done, self.m = 0, 0
        self.phases: list[Phase] = []  # a timed step's reduction, "reduce replicas"

    def to_device(self, tree: PyTree) -> PyTree:
        """``tree`` as it is: a microbatch is cut per replica first, and each part goes to its replica's device."""
        return tree

    def fetch_losses(self) -> dict[int, float]:
        """Per microbatch, the mean of the replicas' losses (each the mean over its part of the microbatch)."""
        per = [r.fetch_losses() for r in self.replicas]
        return {m: float(np.mean([p[m] for p in per])) for m in sorted(per[0])}

    def fetch_outputs(self) -> tuple[dict[int, float], dict[int, list[np.ndarray]]]:
        """Per microbatch, the mean of the replicas' losses and of each of their aux leaves (each replica's over its
        part of the microbatch), as ``StageWorker.fetch_outputs`` gives them."""
        per = [r.fetch_outputs() for r in self.replicas]
        losses = {m: float(np.mean([p[m] for p, _ in per])) for m in sorted(per[0][0])}
        aux = {m: [np.mean(parts, axis=0) for parts in zip(*(a[m] for _, a in per))] for m in sorted(per[0][1])}
        return losses, aux

    def _per(self, data: PyTree, whole: bool) -> list[PyTree]:
        if isinstance(data, Parts):
            return list(data)
        if data is None:
            return [None] * self.n
        return split_parts(data, self.n) if whole else [data] * self.n

    def forward(
        self, mb: int, x: PyTree, side: Sequence[PyTree], worker: int | None = None, microbatches: int | None = None
    ) -> Parts:
        """F on every replica, each on its part of the microbatch (``microbatches``: as ``StageWorker.forward``)."""
        xs = self._per(x, True)
        sides = split_parts(list(side), self.n) if side else [[] for _ in range(self.n)]
        m = None if microbatches is None else microbatches * self.n
        return Parts(r.forward(mb, xs[i], sides[i], worker, m) for i, r in enumerate(self.replicas))

    def fused(self, mb: int) -> bool:
        """Whether microbatch ``mb``'s F ran its B too on every replica (``StageWorker.forward``)."""
        return all(r.fused(mb) for r in self.replicas)

    def backward(self, mb: int, ct: PyTree, microbatches: int, worker: int | None = None) -> Parts:
        """Whole backward on every replica; the step's last one dispatches the reduction."""
        cts = self._per(ct, False)
        self.m = microbatches
        out = Parts(r.backward(mb, cts[i], microbatches * self.n, worker) for i, r in enumerate(self.replicas))
        self._accumulated(worker)
        return out

    def backward_input(self, mb: int, ct: PyTree, microbatches: int, worker: int | None = None) -> Parts:
        """Split schedules' B on every replica."""
        cts = self._per(ct, False)
        self.m = microbatches
        return Parts(r.backward_input(mb, cts[i], microbatches * self.n, worker) for i, r in enumerate(self.replicas))

    def backward_weight(self, mb: int, worker: int | None = None) -> None:
        """Split schedules' W on every replica; the step's last one dispatches the reduction."""
        for r in self.replicas:
            r.backward_weight(mb, worker)
        self._accumulated(worker)

    def _accumulated(self, worker: int | None) -> None:
        self.done += 1
        if self.done == self.m:  # the step's last gradient operation of this stage: reduce now
            self.reduce(worker)
        elif self.per_microbatch:  # what a program reducing in its backward does: same result, m reductions
            self.reducer([jax_leaves(r.grads) for r in self.replicas])
            self.reductions += 1

    @property
    def reducer(self) -> Reducer:
        """The stage's ``Reducer`` (built on first use, kept across steps)."""
        if self._reducer is None:
            shapes = [tuple(np.shape(a)) for a in jax.tree_util.tree_leaves(self.replicas[0].params)]
            self._reducer = Reducer(self.mesh, shapes, self.squared, self.specs if self.sharded else None)
        return self._reducer

    def reduce(self, worker: int | None = None) -> None:
        """The one cross-replica reduction of the step's summed gradients: dispatched, not waited for; in a
        timed step waited for and recorded in ``phases`` as ``reduce replicas`` on ``worker``'s track (``None``:
        the stage's index, as its events)."""
        if any(r.grads is None for r in self.replicas):
            raise VjpsplitError(f"stage {self.stage_index}: a replica computed no gradients this step")
        t0 = time.monotonic()
        leaves, squares = self.reducer([jax.tree_util.tree_leaves(r.grads) for r in self.replicas])
        if self.timed:
            jax.block_until_ready((leaves, squares))
            w = self.stage_index if worker is None else worker
            self.phases.append(Phase(w, REDUCE, t0, time.monotonic()))
        self.grads, self.squares = jax.tree_util.tree_unflatten(self.treedef, leaves), squares
        for r in self.replicas:
            r.grads = None  # the per-replica sums are spent
        self.reductions += 1

    def set_params(self, per_replica: Sequence[PyTree]) -> None:
        """Replica r runs ``per_replica[r]`` (the stage's parameter structure, on its device) from now on."""
        for r, p in zip(self.replicas, per_replica):
            r.params = p
            r.grads = None
        self.grads = self.squares = None


def reductions(workers: Iterable[object]) -> list[Phase]:
    """A timed step's cross-replica reductions: the ``phases`` of those of ``workers`` that are a ``ReplicaGroup``."""
    return [p for w in workers if isinstance(w, ReplicaGroup) for p in w.phases]


def jax_leaves(tree: PyTree) -> list[jax.Array]:
    """``tree``'s leaves in JAX's order (a stage's gradients: its arrays)."""
    return jax.tree_util.tree_leaves(tree)
