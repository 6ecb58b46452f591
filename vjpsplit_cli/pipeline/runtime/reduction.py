"""The cross-replica gradient reduction: the ZeRO layout of a leaf over a stage's replicas, and ``Reducer``.

``Reducer`` is one program over the 1-D mesh of the replicas' devices (``AXIS``)
that packs every leaf into one buffer per dtype and reduces it across replicas
with **one** reduce-scatter, leaving each device its ``zero_spec`` shard of every
gradient (the layout the sharded optimizer state has, ``training.zero1``). A leaf
none of whose dimensions divides by N is packed whole into every device's row, so
it comes out whole on every device from the same reduce-scatter. A
``replicas.ReplicaGroup`` dispatches it once per step.

Replicas of a sharded stage (each on a device group of the stage's mesh shape)
make a mesh of the ``AXIS`` before the stage's own axes (``replicas_mesh``): each
device holds its shard of its replica's gradient, and the reduce-scatter runs
over ``AXIS`` alone, leaving each device 1/N of its shard (``zero_spec`` with the
leaf's spec: ``AXIS`` after the stage's axes on the dimension it splits). May
import JAX and numpy only: no other module of the pipeline.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

AXIS = "replicas"  # the one mesh axis of a stage's replica devices


def zero_dim(shape: Sequence[int], n: int) -> int | None:
    """The dimension a leaf of ``shape`` is sharded along over ``n`` replicas: its largest that divides by ``n``
    (the first of equals), or None (the leaf stays whole on every replica: a scalar, or no dimension divides)."""
    best = None
    for i, d in enumerate(shape):
        if d >= n and d % n == 0 and (best is None or d > shape[best]):
            best = i
    return best


def spec_axes(entry: object) -> tuple[str, ...]:
    """The mesh axes one entry of a ``PartitionSpec`` names (None: none; a name; a tuple of names)."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (str(entry),)


def _entries(spec: PartitionSpec | None, ndim: int) -> list[object]:
    """``spec``'s entries, one per dimension (the missing ones None)."""
    got = list(spec) if spec is not None else []
    return got + [None] * (ndim - len(got))


def shard_shape(shape: Sequence[int], spec: PartitionSpec | None, sizes: Mapping[str, int]) -> tuple[int, ...]:
    """The shape of one device's shard of a leaf of ``shape`` laid out by ``spec`` on a mesh of axis ``sizes``."""
    out = []
    for d, e in zip(shape, _entries(spec, len(shape))):
        k = int(np.prod([sizes[a] for a in spec_axes(e)], dtype=np.int64))
        out.append(d // k)
    return tuple(out)


def zero_spec(
    shape: Sequence[int], n: int, spec: PartitionSpec | None = None, sizes: Mapping[str, int] | None = None
) -> PartitionSpec:
    """The ``PartitionSpec`` of a leaf's gradient and optimizer state over ``n`` replicas (``zero_dim``).

    ``spec``, ``sizes``: a sharded stage's layout of the leaf and its mesh's axis sizes: each device's shard is
    split ``n`` ways along its largest dimension that divides (``AXIS`` after the stage's axes there); without
    them, the leaf whole."""
    if spec is None or sizes is None:
        d = zero_dim(shape, n)
        return PartitionSpec() if d is None else PartitionSpec(*([None] * d), AXIS)
    entries = _entries(spec, len(shape))
    d = zero_dim(shard_shape(shape, spec, sizes), n)
    if d is not None:
        entries[d] = (*spec_axes(entries[d]), AXIS)
    return PartitionSpec(*entries)


def replica_mesh(devices: Sequence[jax.Device]) -> Mesh:
    """The 1-D mesh (axis ``AXIS``) over a stage's replica devices, in order."""
    return Mesh(np.asarray(list(devices), dtype=object), (AXIS,))


def replicas_mesh(meshes: Sequence[Mesh]) -> Mesh:
    """The mesh of a sharded stage's replicas: ``AXIS`` (replica r: ``meshes[r]``'s devices) before their axes."""
    return Mesh(np.stack([m.devices for m in meshes]), (AXIS, *meshes[0].axis_names))


class Reducer:
    """One stage's cross-replica gradient reduction: a jitted ``shard_map`` with one reduce-scatter per dtype.

    Called with, per leaf, the global array whose shard on replica r is replica r's
    summed gradient (stacked along axis 0); returns each leaf's sum over the
    replicas laid out by ``zero_spec`` (whole leaves replicated), and each
    device's squared sums of the ``squared`` leaves' shards (a leaf held whole by
    several devices counted on one of them only), an ``(devices, len(squared))``
    array: the stage's share of the global norm without another collective.

    ``specs``: a sharded stage's layout of each leaf over the stage's own axes of
    ``mesh`` (``replicas_mesh``); None: unsharded replicas on the 1-D ``replica_mesh``.
    """

    def __init__(
        self,
        mesh: Mesh,
        shapes: Sequence[tuple[int, ...]],
        squared: Sequence[bool],
        specs: Sequence[PartitionSpec] | None = None,
    ):
        self.mesh, self.shapes, self.squared = mesh, [tuple(s) for s in shapes], list(squared)
        sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
        n = int(sizes[AXIS])
        self.n = n
        self.specs = list(specs) if specs is not None else None
        per = self.specs if self.specs is not None else [None] * len(self.shapes)
        model = {k: v for k, v in sizes.items() if k != AXIS} if self.specs is not None else None
        self.local = [shard_shape(s, p, model or {}) for s, p in zip(self.shapes, per)]  # one device's block
        self.dims = [zero_dim(s, n) for s in self.local]
        self.out = [zero_spec(s, n, p, model) for s, p in zip(self.shapes, per)]
        # The axes a leaf's reduced block is the same on (a device other than the first of them adds no square).
        self.alike = [
            tuple(a for a in mesh.axis_names if a not in {x for e in o for x in spec_axes(e)}) for o in self.out
        ]
        self.stacked = [
            PartitionSpec((AXIS, *spec_axes(_entries(p, len(s))[0])), *_entries(p, len(s))[1:])
            if s
            else PartitionSpec(AXIS)
            for s, p in zip(self.shapes, per)
        ]
        out_specs = (self.out, PartitionSpec(tuple(mesh.axis_names)))
        # check_vma=False: a whole leaf comes out of the reduce-scatter equal on every replica, which the
        # replication check cannot see.
        body = jax.shard_map(
            self.reduce_replicas, mesh=mesh, in_specs=tuple(self.stacked), out_specs=out_specs, check_vma=False
        )
        self.program = jax.jit(body)

    def reduce_replicas(self, *blocks: jax.Array) -> tuple[list[jax.Array], jax.Array]:
        """Inside ``shard_map``: each replica's gradient blocks reduce-scattered, one collective per dtype; what
        each replica keeps (its slice of every leaf, or the whole leaf) and the squared norm of the sum."""
        n = self.n
        groups: dict[np.dtype, list[tuple[int, jax.Array]]] = {}
        for i, (b, s, d) in enumerate(zip(blocks, self.local, self.dims)):
            b = b.reshape(s)
            # Row r is what replica r keeps: its slice along the sharded dim, or the whole leaf.
            row = jnp.broadcast_to(b.reshape(1, -1), (n, b.size)) if d is None else jnp.moveaxis(b, d, 0).reshape(n, -1)
            groups.setdefault(b.dtype, []).append((i, row))
        out: dict[int, jax.Array] = {}  # by leaf, each set below
        for rows in groups.values():
            buf = jnp.concatenate([r for _, r in rows], axis=1)
            red = jax.lax.psum_scatter(buf, AXIS, scatter_dimension=0, tiled=True)[0]
            off = 0
            for i, r in rows:
                piece = red[off : off + r.shape[1]]
                off += r.shape[1]
                s, d = self.local[i], self.dims[i]
                if d is None:
                    out[i] = piece.reshape(s)
                else:
                    moved = (s[d] // n, *(x for j, x in enumerate(s) if j != d))
                    out[i] = jnp.moveaxis(piece.reshape(moved), 0, d)
        sq = []
        for i in range(len(blocks)):
            if not self.squared[i]:
                continue
            g = out[i]
            v = jnp.sum(jnp.square(jnp.abs(g) if jnp.iscomplexobj(g) else g))
            if self.alike[i]:
                first = jnp.all(jnp.stack([jax.lax.axis_index(a) == 0 for a in self.alike[i]]))
                v = jnp.where(first, v, jnp.zeros_like(v))
            sq.append(v)
        wide = jnp.result_type(*[v.dtype for v in sq]) if sq else jnp.float32
        squares = jnp.stack([v.astype(wide) for v in sq]) if sq else jnp.zeros((0,), wide)
        return [out[i] for i in range(len(blocks))], squares.reshape(1, -1)

    def __call__(self, per_replica: Sequence[Sequence[jax.Array]]) -> tuple[list[jax.Array], jax.Array]:
        """``per_replica[r]``: replica r's gradient leaves (on its device, or a sharded stage's on its group, laid
        out as ``specs`` say: moved there where not); the reduced leaves and the squares."""
        args = []
        for i, s in enumerate(self.shapes):
            blocks = {d: b for r, leaves in enumerate(per_replica) for d, b in self._blocks(i, r, leaves[i])}
            parts = [blocks[d] if s else blocks[d].reshape(1) for d in self.mesh.devices.flat]
            shape = (self.n * s[0], *s[1:]) if s else (self.n,)
            args.append(
                jax.make_array_from_single_device_arrays(shape, NamedSharding(self.mesh, self.stacked[i]), parts)
            )
        return self.program(*args)

    def _blocks(self, i: int, r: int, leaf: jax.Array) -> list[tuple[jax.Device, jax.Array]]:
        """Replica ``r``'s leaf ``i`` as its devices' blocks (a sharded stage's laid out by ``specs[i]`` first)."""
        if self.specs is None:
            return [(self.mesh.devices[r], leaf)]
        own = NamedSharding(Mesh(self.mesh.devices[r], tuple(self.mesh.axis_names[1:])), self.specs[i])
        if not leaf.sharding.is_equivalent_to(own, leaf.ndim):
            leaf = jax.device_put(leaf, own)
        return [(sh.device, sh.data) for sh in leaf.addressable_shards]
