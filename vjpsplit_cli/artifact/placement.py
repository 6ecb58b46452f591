"""Device placement: where a sharded artifact's arrays go before a module runs.

``Placement`` owns an artifact's device group and mesh (this host's first ``nr_devices``
devices by default) and lays arrays out as the manifest's leaves record; an unsharded
artifact's arrays stay where JAX puts them.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from ..errors import VjpsplitError
from ..files.prng import to_data
from ..files.trees import flatten_with_keys
from ..trust.module_io import DIMS_ARG, ModuleIO
from .callplan import wrap_keys
from .manifest import Manifest
from .sharding import host_mesh, named, place


_DIMS_ARGS_KEPT = 64


class Placement:
    """An artifact's device group and mesh, and its arrays laid out on them."""

    def __init__(self, manifest: Manifest, source: str, devices: tuple | None = None) -> None:
        self.manifest = manifest
        self.source = source
        self.devices = devices  # a sharded artifact's device group; None: this host's first devices
        self._mesh: Mesh | None = None if devices is None else host_mesh(manifest.mesh, devices, source)
        self._dims_args: dict[tuple[int, ...], Any] = {}  # dims arguments by shape

    @property
    def mesh(self) -> Mesh | None:
        """The mesh a sharded artifact runs on; None when unsharded."""
        if self._mesh is None and self.manifest.sharded:
            self._mesh = host_mesh(self.manifest.mesh, self.devices, self.source)
        return self._mesh

    def place(self, leaves: Sequence[Any], values: Sequence) -> list:
        """``values`` laid out as the manifest's ``leaves`` say (sharded artifacts); unchanged otherwise."""
        mesh = self.mesh
        if mesh is None:
            return list(values)
        return [place(v, named(mesh, leaf.sharding)) for leaf, v in zip(leaves, values)]

    def place_arg(self, name: str | int, value: Any) -> Any:
        """Argument ``name`` (or position) laid out as the forward takes it (see ``Artifact.place_arg``)."""
        m = self.manifest
        arg = m.arg_names[name] if isinstance(name, int) else name
        if self.mesh is None:
            return jax.device_put(value)
        by_key = {leaf.key: leaf for leaf in m.inputs}
        entries = flatten_with_keys(arg, value)
        try:
            leaves = [by_key[k] for k, _ in entries]
        except KeyError as e:
            raise VjpsplitError(
                f"{self.source}: argument {arg!r} has leaf {e.args[0]!r}, which is not an input of the artifact"
            ) from e
        placed = wrap_keys(leaves, self.place(leaves, [to_data(v) for _, v in entries]))
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(value), placed)

    def place_cotangent(self, ct: Any) -> Any:
        """A cotangent of the output laid out as the backward takes it (see ``place_arg``)."""
        mesh = self.mesh
        if mesh is None or ct is None:
            return ct
        by_key = {leaf.key: leaf for leaf in self.manifest.cotangent_leaves}
        entries = flatten_with_keys("out", ct)
        placed = [place(v, named(mesh, by_key[k].sharding)) if k in by_key else v for k, v in entries]
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(ct), placed)

    def dims_arg(self, dims: Mapping[str, int]) -> Any:
        """The dims argument: a zero-size array whose shape gives a backward module the symbolic dims; None without them."""
        m = self.manifest
        if not m.dim_vars:
            return None
        shape = (0, *(dims[n] for n in m.dim_vars))
        # Kept by shape only for int dims: 5.0 == 5 as a key, but numpy refuses a float dim.
        kept = all(type(d) is int for d in shape)
        arg = self._dims_args.get(shape) if kept else None
        if arg is None:
            arg = np.zeros(shape, np.bool_)
            arg.flags.writeable = False  # holds no element; shared by the calls at these dims
            if kept:
                if len(self._dims_args) >= _DIMS_ARGS_KEPT:
                    self._dims_args.clear()
                self._dims_args[shape] = arg
        # Placed per call: under a caller's jit (the pipeline's) device_put gives a tracer, never kept.
        return arg if self.mesh is None else jax.device_put(arg, named(self.mesh, ()))

    def arguments(self, io: ModuleIO, bound: Mapping[str, Sequence], dims: Mapping[str, int]) -> dict[str, Any]:
        """A backward module's arguments by slot: ``bound``'s arrays placed, and the dims argument for ``dims``."""
        inputs = io.inputs or ()
        out: dict[str, Any]
        if self.manifest.sharded:
            out = {s.name: self.place(s.leaves, bound[s.name]) for s in inputs if s.name != DIMS_ARG}
        else:
            out = {s.name: bound[s.name] for s in inputs if s.name != DIMS_ARG}
        out[DIMS_ARG] = self.dims_arg(dims)
        return out

    def call_arguments(self, io: ModuleIO, bound: Mapping[str, Sequence], dims: Mapping[str, int]) -> tuple:
        """A backward module's positional arguments: ``arguments`` in the module's slot order."""
        if self.manifest.sharded:
            return io.arguments(self.arguments(io, bound, dims))
        dims_arg = self.dims_arg(dims)
        return tuple([dims_arg if name == DIMS_ARG else bound[name] for name in io.input_names])
