"""The cross-replica gradient reduction: the ZeRO layout of a leaf over a stage's replicas, and ``Reducer``.

``Reducer`` is one program over the 1-D mesh of the replicas' devices (``AXIS``)
that packs every leaf into one buffer per dtype and reduces it across replicas
with **one** reduce-scatter, leaving each device its ``zero_spec`` shard of every
gradient (the layout the sharded optimizer state has, ``training.zero1``). A leaf
none of whose dimensions divides by N is packed whole into every device's row, so
it comes out whole on every device from the same reduce-scatter. A
``replicas.ReplicaGroup`` dispatches it once per step. May import JAX and numpy
only: no other module of the pipeline.
"""

from __future__ import annotations

from typing import Sequence

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


def zero_spec(shape: Sequence[int], n: int) -> PartitionSpec:
    """The ``PartitionSpec`` of a leaf's gradient and optimizer state over ``n`` replicas (``zero_dim``)."""
    d = zero_dim(shape, n)
    return PartitionSpec() if d is None else PartitionSpec(*([None] * d), AXIS)


def replica_mesh(devices: Sequence[jax.Device]) -> Mesh:
    """The 1-D mesh (axis ``AXIS``) over a stage's replica devices, in order."""
    return Mesh(np.asarray(list(devices), dtype=object), (AXIS,))


class Reducer:
    """One stage's cross-replica gradient reduction: a jitted ``shard_map`` with one reduce-scatter per dtype.

    Called with, per leaf, the global array whose shard on replica r is replica r's
    summed gradient (stacked along axis 0); returns each leaf's sum over the
    replicas laid out by ``zero_spec`` (whole leaves replicated), and each
    replica's squared sums of the ``squared`` leaves' shards (a whole leaf counted
    on the first replica only), an ``(N, len(squared))`` array: the stage's share of
    the global norm without another collective.
    """

    def __init__(self, mesh: Mesh, shapes: Sequence[tuple[int, ...]], squared: Sequence[bool]):
        self.mesh, self.shapes, self.squared = mesh, [tuple(s) for s in shapes], list(squared)
        n = int(mesh.size)
        self.n = n
        self.dims = [zero_dim(s, n) for s in self.shapes]
        out_specs = ([zero_spec(s, n) for s in self.shapes], PartitionSpec(AXIS))
        in_specs = tuple(PartitionSpec(AXIS) for _ in self.shapes)
        # check_vma=False: a whole leaf comes out of the reduce-scatter equal on every replica, which the
        # replication check cannot see.
        body = jax.shard_map(self.reduce_replicas, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
        self.program = jax.jit(body)

    def reduce_replicas(self, *blocks: jax.Array) -> tuple[list[jax.Array], jax.Array]:
        """Inside ``shard_map``: each replica's gradient blocks reduce-scattered, one collective per dtype; what
        each replica keeps (its slice of every leaf, or the whole leaf) and the squared norm of the sum."""
        n = self.n
        groups: dict[np.dtype, list[tuple[int, jax.Array]]] = {}
        for i, (b, s, d) in enumerate(zip(blocks, self.shapes, self.dims)):
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
                s, d = self.shapes[i], self.dims[i]
                if d is None:
                    out[i] = piece.reshape(s)
                else:
                    moved = (s[d] // n, *(x for j, x in enumerate(s) if j != d))
                    out[i] = jnp.moveaxis(piece.reshape(moved), 0, d)
        first = jax.lax.axis_index(AXIS) == 0
        sq = []
        for i in range(len(blocks)):
            if not self.squared[i]:
                continue
            g = out[i]
            v = jnp.sum(jnp.square(jnp.abs(g) if jnp.iscomplexobj(g) else g))
            sq.append(v if self.dims[i] is not None else jnp.where(first, v, jnp.zeros_like(v)))
        wide = jnp.result_type(*[v.dtype for v in sq]) if sq else jnp.float32
        squares = jnp.stack([v.astype(wide) for v in sq]) if sq else jnp.zeros((0,), wide)
        return [out[i] for i in range(len(blocks))], squares.reshape(1, -1)

    def __call__(self, per_replica: Sequence[Sequence[jax.Array]]) -> tuple[list[jax.Array], jax.Array]:
        """``per_replica[r]``: replica r's gradient leaves (on its device); the reduced leaves and the squares."""
        stacked = NamedSharding(self.mesh, PartitionSpec(AXIS))
        args = []
        for i, s in enumerate(self.shapes):
            parts = [leaves[i] if s else leaves[i].reshape(1) for leaves in per_replica]
            shape = (self.n * s[0], *s[1:]) if s else (self.n,)
            args.append(jax.make_array_from_single_device_arrays(shape, stacked, parts))
        return self.program(*args)
