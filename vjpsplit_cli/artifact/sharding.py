"""Shardings in artifacts: PartitionSpecs as JSON, the abstract mesh, and placing arrays on this host's devices.

An artifact records the mesh only abstractly (axis names and sizes, no device
ids), like ``jax.export`` itself: the HLO shardings in its modules index the
devices of whatever mesh of that shape the caller builds. Each leaf records
its ``PartitionSpec`` as a JSON list: ``null`` for an unsharded dim, an axis
name, or a list of axis names.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

if TYPE_CHECKING:
    from jax.sharding import AbstractMesh

from ..errors import VjpsplitError

SpecJSON = tuple  # one entry per dim: None, an axis name, or a tuple of axis names


def spec_to_json(spec: PartitionSpec) -> SpecJSON:
    """``P('data', None, ('x', 'y'))`` -> ``('data', None, ('x', 'y'))``; trailing ``None``s dropped."""
    out: list[str | tuple[str, ...] | None] = []
    for entry in spec:
        if entry is None or entry is PartitionSpec.UNCONSTRAINED:
            out.append(None)
        elif isinstance(entry, str):
            out.append(entry)
        else:
            names = tuple(str(n) for n in entry)
            out.append(names[0] if len(names) == 1 else (names or None))
    while out and out[-1] is None:
        out.pop()
    return tuple(out)


def spec_from_json(value: Any) -> SpecJSON:
    """A spec read from a manifest or a file, validated; raises ValueError when malformed."""
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"sharding {value!r} is not a list")
    out: list[str | tuple[str, ...] | None] = []
    for entry in value:
        if entry is None or isinstance(entry, str):
            out.append(entry)
        elif isinstance(entry, (list, tuple)) and entry and all(isinstance(n, str) for n in entry):
            out.append(tuple(entry))
        else:
            raise ValueError(f"sharding entry {entry!r} is not null, an axis name or a list of them")
    return tuple(out)


def partition_spec(spec: SpecJSON) -> PartitionSpec:
    """The ``PartitionSpec`` of a recorded spec."""
    return PartitionSpec(*spec)


def format_spec(spec: SpecJSON | None) -> str:
    """``P('data', None)`` for messages and tables; ``-`` when unspecified."""
    if spec is None:
        return "-"
    return (
        "P(" + ", ".join("None" if e is None else repr(e) if isinstance(e, str) else repr(tuple(e)) for e in spec) + ")"
    )


def axes_of(spec: SpecJSON) -> list[tuple[str, ...]]:
    """The mesh axes each dim is split over (``()`` for an unsharded dim)."""
    return [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in spec]


def mesh_of(shardings: Sequence[Any]) -> Mesh | AbstractMesh | None:
    """The one mesh that every ``NamedSharding`` among ``shardings`` uses; None when none is sharded.

    Raises VjpsplitError for a sharding of another kind or for two different meshes:
    an artifact runs on one mesh.
    """
    mesh = None
    for s in shardings:
        if s is None:
            continue
        if not isinstance(s, NamedSharding):
            raise VjpsplitError(
                f"sharding {s!r} is not a jax.sharding.NamedSharding; "
                "give specs NamedSharding(mesh, PartitionSpec(...)) shardings"
            )
        if mesh is None:
            mesh = s.mesh
        elif (
            tuple(s.mesh.shape.items()) != tuple(mesh.shape.items())
            # An AbstractMesh has no devices (asking raises): only two concrete meshes are compared by device.
            or isinstance(s.mesh, Mesh)
            and isinstance(mesh, Mesh)
            and not np.array_equal(
                np.vectorize(lambda d: d.id)(s.mesh.devices), np.vectorize(lambda d: d.id)(mesh.devices)
            )
        ):
            raise VjpsplitError(
                f"specs use two meshes ({dict(mesh.shape)} and {dict(s.mesh.shape)}); "
                "one artifact runs on one mesh: give every spec the same mesh"
            )
    return mesh


def mesh_axes(mesh: Mesh | AbstractMesh) -> tuple[tuple[str, int], ...]:
    """The abstract mesh: ``(axis name, size)`` pairs in the mesh's order."""
    return tuple((str(k), int(v)) for k, v in mesh.shape.items())


def host_mesh(axes: Sequence[tuple[str, int]], devices: Sequence | None = None, source: str = "artifact") -> Mesh:
    """A mesh of ``axes``'s shape over ``devices`` (default: this host's first devices).

    A host with too few devices is refused, naming both counts: running a
    sharded program on fewer devices would silently compute something else.
    """
    need = math.prod(size for _, size in axes)
    if devices is not None:
        have = list(devices)
        if len(have) != need:
            raise VjpsplitError(
                f"{source}: the artifact runs on {need} devices, {len(have)} were given; give exactly {need}"
            )
    else:
        have = jax.devices()
        if len(have) < need:
            hint = (
                f"; on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count={need} before JAX starts"
                if have[0].platform == "cpu"
                else "; run it on a host with that many devices"
            )
            raise VjpsplitError(
                f"{source}: the artifact was exported for {need} devices (mesh "
                f"{', '.join(f'{n}={s}' for n, s in axes)}), but this host has {len(have)}{hint}"
            )
    grid = np.array(have[:need], dtype=object).reshape(tuple(size for _, size in axes))
    return Mesh(grid, tuple(name for name, _ in axes))


def named(mesh: Mesh, spec: SpecJSON | None) -> NamedSharding:
    """The ``NamedSharding`` of a recorded spec on ``mesh`` (replicated when unspecified)."""
    return NamedSharding(mesh, PartitionSpec(*(spec or ())))


def place(value: Any, sharding: NamedSharding) -> Any:
    """``value`` laid out by ``sharding``: a matching ``jax.Array`` as it is, anything else moved or copied there."""
    if isinstance(value, jax.core.Tracer):
        return value  # inside a caller's jit: the module's own shardings lay it out
    if isinstance(value, jax.Array):
        try:
            if value.sharding.is_equivalent_to(sharding, value.ndim):
                return value
        except (ValueError, TypeError, AttributeError):
            pass  # not comparable (another kind of sharding): move it
    return jax.device_put(value, sharding)


def divisibility_problem(what: str, shape: Sequence, spec: SpecJSON, mesh_sizes: dict[str, int]) -> str | None:
    """Why ``shape`` (of ``what``, e.g. ``input 'x'``) cannot be split by ``spec``: the dim, the axes, the fix.

    None when it can. A symbolic dim must be declared a multiple of the split
    (a constraint of its scope), or jax.export refuses it with IndivisibleError.
    """
    for i, (d, axes) in enumerate(zip(shape, axes_of(spec))):
        ways = math.prod(mesh_sizes[a] for a in axes) if axes else 1
        if ways == 1:
            continue
        where = f"{what} dim {i} ({d}) is split {ways} ways by mesh axis {'/'.join(axes)}"
        if isinstance(d, (int, np.integer)):
            if int(d) % ways:
                return f"{where}, but {int(d)} is not a multiple of {ways}; pick a size that is, or shard it over fewer devices"
            continue
        try:
            ok = (d % ways) == 0
        except Exception:  # jax.export cannot decide: not known divisible
            ok = False
        if ok is not True:
            name = str(d)
            return (
                f"{where}, but {name} is not known to be a multiple of {ways}; declare it so: "
                f"jax.export.symbolic_shape('{name}', constraints=('mod({name}, {ways}) == 0',))"
            )
    return None


def spec_of(value: Any) -> SpecJSON | None:
    """The recorded spec of an array laid out over several devices by a ``NamedSharding``; None otherwise."""
    sharding = getattr(value, "sharding", None)
    if not isinstance(sharding, NamedSharding) or len(sharding.device_set) < 2:
        return None
    return spec_to_json(sharding.spec)
