"""Data parallel x pipeline training: a stage's optimizer state sharded across its replicas (ZeRO-1).

``ReplicaTrainer`` stands where a ``StageTrainer`` would (the same phases for
``stage_trainer.finish_stages``) for a stage run by a ``runtime.replicas.ReplicaGroup``
of N replicas. The stage's optimizer is exported over the 1-D mesh of the
replicas' devices with every parameter laid out by ``zero_spec`` (its largest
dimension that divides by N sharded, else whole), so the optimizer state that
mirrors a parameter (Adam's ``mu`` and ``nu``) takes the same layout and each
device holds 1/N of it; step counts and leaves no dimension of which divides by N
stay whole on every device. The update is the exported optimizer's own program,
partitioned by XLA over the mesh: each device updates its shard, and an optimizer
that couples leaves (a norm over them) stays the same computation.

A step, per stage: the group's one reduce-scatter leaves each device its shard of
every summed gradient; tied leaves are summed over their holders as a single
worker's are; the update runs on the shards; one program gathers the new
parameters whole onto every replica. ``snapshot`` and ``assign`` speak the whole
model's form (host arrays, whole leaves), so a checkpoint moves between any N.

A sharded stage's replicas (each on a device group of the stage's mesh): its
optimizer is exported over the mesh of the replicas' axis before the stage's own
(``reduction.replicas_mesh``), each parameter laid out as the stage shards it
with each device's shard split N ways (``zero_spec`` with the leaf's spec); the
new parameters are gathered over the replicas' axis only, back to the stage's layout.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

from ...artifact.artifact import Artifact
from ...artifact.sharding import named, partition_spec
from ...errors import VjpsplitError
from ...files.prng import to_data
from ...files.trees import decode_structure, flatten_with_keys
from ...treetypes import Leaf, PyTree
from ..runtime.devicebytes import bytes_per_device
from ..runtime.offload import Offload
from ..runtime.reduction import AXIS, zero_spec
from ..runtime.replicas import ReplicaGroup, replica_placement
from .arguments import Optimizer
from .clipping import Squares
from .optimizer import export_optimizer, load_optimizer
from .ownership import Ownership
from .separable import WholeOptimizer
from .stage_trainer import flat_grads, parameter_keys, tie_keys


def replica_program(
    optimizer: Optimizer,
    art: Artifact,
    params: PyTree,
    stage: int,
    n: int,
    names: Sequence[str],
    whole: WholeOptimizer,
    counted: Sequence[str],
) -> bytes:
    """Stage ``stage``'s optimizer exported over the mesh of its ``n`` replicas, every parameter laid out by
    ``zero_spec`` (its share of ``whole``, the reductions' terms of its ``counted`` keys, as
    ``optimizer.stage_programs``).

    The mesh is abstract (its one axis and size, no devices; a sharded stage's axes after it): the program is
    the same module wherever it is exported, and runs on any ``n`` devices (``n`` groups of the stage's mesh) of
    the artifact's platforms (a Ray actor's, not the driver's)."""
    axes = [(AXIS, n), *(art.manifest.mesh if art.manifest.sharded else ())]
    mesh = AbstractMesh(tuple(size for _, size in axes), tuple(name for name, _ in axes))
    sizes = dict(axes[1:]) if art.manifest.sharded else None
    layouts = stage_specs(art, params) if sizes is not None else [None] * len(names)
    specs = {
        k: jax.ShapeDtypeStruct(
            np.shape(v), v.dtype, sharding=NamedSharding(mesh, zero_spec(np.shape(v), n, spec, sizes))
        )
        for k, v, spec in zip(names, jax.tree_util.tree_leaves(params), layouts)
    }
    prog = export_optimizer(
        optimizer, specs, platforms=art.manifest.platforms, whole=whole, stage=stage, counted=counted
    )
    return prog.to_bytes()


def stage_specs(art: Artifact, params: PyTree) -> list[PartitionSpec]:
    """Per leaf of a sharded stage's ``params`` (JAX's order), its layout over the stage's mesh, as exported."""
    by_key = {leaf.key: leaf for leaf in art.manifest.inputs}
    entries = flatten_with_keys(art.manifest.arg_names[0], params)
    return [partition_spec(by_key[k].sharding or ()) if k in by_key else PartitionSpec() for k, _ in entries]


class ReplicaTrainer:
    """One stage's parameters (whole on every replica) and optimizer state (sharded across them); see the module.

    ``names``, ``holders``, ``counted`` and ``state`` as ``StageTrainer`` takes them.
    """

    def __init__(
        self,
        group: ReplicaGroup,
        names: Sequence[str],
        program: bytes,
        holders: Mapping[str, Sequence[int]],
        counted: Sequence[str],
        state: Mapping[str, Leaf] | None = None,
    ):
        self.worker, self.names = group, list(names)
        self.node, self.local = parameter_keys(group.art, group.stage_index, self.names)
        self.holders, self.counted = tie_keys(holders, counted)
        # The group's squares: the counted leaves no other stage holds (a tied leaf's sum is known only later).
        order = [self.local[k] for k, _ in flatten_with_keys("", group.params)]
        group.squared = [k in self.counted and k not in self.holders for k in order]
        self.program = load_optimizer(
            program, source=f"stage {group.stage_index}'s optimizer", devices=list(group.devices)
        )
        if self.program.mesh is None:  # exported over the replicas' mesh just above
            raise VjpsplitError(f"stage {group.stage_index}: its optimizer program has no mesh; export it again")
        self.mesh = self.program.mesh
        # Each parameter whole over the replicas' axis (a sharded stage's: as the stage lays it out).
        self._whole = [NamedSharding(self.mesh, spec) for spec in group.specs]
        self._gather = jax.jit(lambda xs: xs, out_shardings=self._whole)
        self.params = self._joined()
        self.state = self.program.init(self.params) if state is None else self._placed_state(state)
        self.grads: dict[str, Leaf] = {}

    @property
    def stage_index(self) -> int:
        """The stage's index."""
        return self.worker.stage_index

    def _joined(self) -> dict[str, jax.Array]:
        """The replicas' parameters as one whole (replicated) array per key over the mesh: no copy."""
        per = [dict(flatten_with_keys("", r.params)) for r in self.worker.replicas]
        out: dict[str, jax.Array] = {}
        for k, whole in zip(per[0], self._whole):
            blocks = {sh.device: sh.data for p in per for sh in p[k].addressable_shards}
            parts = [blocks[d] for d in self.mesh.devices.flat]
            out[self.local[k]] = jax.make_array_from_single_device_arrays(np.shape(per[0][k]), whole, parts)
        return out

    def _placed_state(self, state: Mapping[str, Leaf]) -> dict[str, jax.Array]:
        missing = [k for k in self.program.state_keys if k not in state]
        if missing:
            raise VjpsplitError(f"stage {self.stage_index}: the state to return to lacks '{missing[0]}'")
        return {
            leaf.key: jax.device_put(np.asarray(to_data(state[leaf.key])), named(self.mesh, leaf.sharding))
            for leaf in self.program.state_leaves
        }

    def _flat_grads(self) -> dict[str, Leaf]:
        return flat_grads(self.worker.grads, self.local, self.stage_index)

    def tied_grads(self) -> dict[str, Leaf]:
        """This stage's gradients of its tied leaves (summed over the replicas), where they are: on its devices."""
        g = self._flat_grads()
        return {k: g[k] for k in sorted(self.holders)}

    def prepare(self, contributions: Mapping[int, Mapping[str, Leaf]]) -> Squares:
        """Each tied leaf's gradient summed over its holders in stage order (as ``StageTrainer.prepare``), on this
        stage's devices in its own gradient's layout (``contributions``: stage -> its ``tied_grads``, device or host
        arrays); this stage's share of the squared global norm (its replicas' shards, from the reduction, and tied
        leaves), dispatched: nothing waits, nothing comes to the host."""
        g = self._flat_grads()
        for k, holding in self.holders.items():
            mine = g[k]
            parts = [mine if s == self.stage_index else contributions[s][k] for s in holding]
            if isinstance(mine, jax.Array):  # the others' copies laid out as this stage's own gradient
                parts = [p if p is mine else jax.device_put(p, mine.sharding) for p in parts]
            total = parts[0]
            for p in parts[1:]:
                total = total + p
            g[k] = total
        self.grads = g
        tied = Squares.of(g, [k for k in self.counted if k in self.holders])
        squares = [] if self.worker.squares is None else [self.worker.squares]
        return Squares([*squares, *tied.parts])

    def shares(self, rnd: int, scale: float, value: float, reduced: Sequence[np.ndarray]) -> list[np.ndarray]:
        """This stage's shares of the optimizer's reductions over leaves of round ``rnd`` (host scalars), from
        its replicas' shards (the exported program, partitioned over the mesh)."""
        if not self.grads:
            raise VjpsplitError(f"stage {self.stage_index}: shares before prepare; the step's gradients are not summed")
        got = self.program.shares(rnd, self.params, self.state, self.grads, scale, value, reduced)
        return [np.asarray(v) for v in got]

    def apply(self, scale: float = 1.0, value: float = 0.0, reduced: Sequence[np.ndarray] = ()) -> None:
        """The exported update on every replica's shards (``value``, ``reduced``: as ``StageTrainer.apply``),
        then the new parameters gathered whole onto each."""
        if not self.grads:
            raise VjpsplitError(f"stage {self.stage_index}: apply before prepare; the step's gradients are not summed")
        new, self.state = self.program.update(self.params, self.state, self.grads, scale, value, reduced)
        self.grads = {}
        whole = self._gather([new[n] for n in self.names])  # the one all-gather of the step's parameters
        self.params = dict(zip(self.names, whole))
        self._spread(whole)

    def _spread(self, whole: Sequence[jax.Array]) -> None:
        per_device = [{s.device: s.data for s in a.addressable_shards} for a in whole]
        if not self.worker.sharded:
            self.worker.set_params(
                [decode_structure(self.node, iter([d[r.device] for d in per_device])) for r in self.worker.replicas]
            )
            return
        # A sharded stage: replica r's leaf joined from its group's blocks, laid out as its parameters were.
        mine = []
        for r in self.worker.replicas:
            laid = jax.tree_util.tree_leaves(r.params)
            mine.append(
                decode_structure(
                    self.node,
                    iter(
                        [
                            jax.make_array_from_single_device_arrays(
                                a.shape, old.sharding, [d[dev] for dev in r.devices]
                            )
                            for a, old, d in zip(whole, laid, per_device)
                        ]
                    ),
                )
            )
        self.worker.set_params(mine)

    def snapshot(self) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """``(params, optimizer state)`` as whole host arrays (the state's shards joined)."""
        return _host(self.params), _host(self.state)

    def assign(self, params: Mapping[str, Leaf], state: Mapping[str, Leaf]) -> None:
        """Hold ``params`` and ``state`` (whole, flat by global key, as ``snapshot`` gives them) from now on."""
        missing = [k for k in self.names if k not in params]
        if missing:
            raise VjpsplitError(f"stage {self.stage_index}: the state to return to lacks '{missing[0]}'")
        tree = decode_structure(self.node, iter([np.asarray(params[n]) for n in self.names]))
        self.state = self._placed_state(state)
        self.worker.set_params([r.place_params(tree) for r in self.worker.replicas])
        self.params = self._joined()
        self.grads = {}

    def optimizer_bytes(self) -> tuple[int, int]:
        """``(most bytes of optimizer state on one device, bytes of the whole state)``, from the arrays' shards."""
        per = bytes_per_device(self.state)
        whole = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in self.state.values())
        return max(per.values(), default=0), whole


def _host(d: Mapping[str, Leaf]) -> dict[str, np.ndarray]:
    return {k: np.asarray(to_data(v)) for k, v in d.items()}


def replica_trainers(
    ownership: Ownership,
    optimizer: Optimizer,
    states: Sequence[Mapping[str, Leaf] | None],
    whole: WholeOptimizer,
    *,
    n: int,
    workers: Sequence[Sequence[int]],
    devices: Sequence[Sequence[jax.Device]] | None = None,
    offload: Offload | None = None,
) -> list[ReplicaTrainer]:
    """Per stage, its ``n`` replicas (``replica_placement``) and their ``ReplicaTrainer``; ``offload``: every
    replica's residuals off its device between F and B."""
    own = ownership
    where = replica_placement(own.artifacts, workers, n, devices)
    S = len(own.artifacts)
    groups = [
        ReplicaGroup(a, p, s, S, g, offload) for s, (a, p, g) in enumerate(zip(own.artifacts, own.stage_params, where))
    ]
    return [
        ReplicaTrainer(
            g,
            own.names[s],
            replica_program(optimizer, g.art, g.params, s, n, own.names[s], whole, own.counted[s]),
            own.holders[s],
            own.counted[s],
            states[s],
        )
        for s, g in enumerate(groups)
    ]
