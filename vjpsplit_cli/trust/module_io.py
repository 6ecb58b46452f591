"""The table of each module's signature: its inputs and outputs, in order, from a manifest.

The one place that says what ``fwd``, ``bwd``, ``bwd_input`` and ``bwd_weight`` take and
return, as named groups of manifest leaves (``Slot``) in calling order. The trust checks
compare a module's avals with it (``checks.manifest_avals``) and the artifact runner binds
and places arguments and names results by it, so the argument order is written once.

The manifest is taken duck-typed (``inputs``, ``outputs``, ``residuals``, ``grads`` ...):
this layer judges artifacts and sits below ``artifact``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping, Sequence

from ..files import keys

# Slot names. Backward modules take (stored, input-backed, cotangents or intermediates, the dims argument).
INPUTS = "inputs"  # the forward's flat input leaves
OUT = "out"  # the forward's differentiable output ``out`` (its leaves)
STORED = "stored"  # stored residuals (``r/<i>``)
AUX = "aux"  # the forward's auxiliary outputs (``has_aux``)
INPUT_BACKED = "input_backed"  # residuals that are inputs (``in/<input key>``)
COTANGENTS = "cotangents"  # cotangents of ``out``'s floating leaves
INTERMEDIATES = "intermediates"  # what the input part computed for the weight part (``c/<i>``)
# The dims argument: a zero-size bool array whose dims are the symbolic dims (none without them).
DIMS_ARG = "dims_arg"
GRADS = "grads"  # gradients, in manifest order


@dataclasses.dataclass(frozen=True)
class DimsArgLeaf:
    """The dims argument as a leaf: ``bool[0, *dim_vars]``, replicated."""

    shape: tuple[Any, ...]
    key: str = DIMS_ARG
    dtype: str = "bool"
    sharding: tuple = ()
    prng_impl: str | None = None


@dataclasses.dataclass(frozen=True)
class Slot:
    """One positional group of a module's arguments or results: its name and leaves, in order."""

    name: str
    leaves: tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class ModuleIO:
    """A module's signature: its argument slots (None: not fixed by the manifest) and result slots."""

    module: str
    inputs: tuple[Slot, ...] | None
    outputs: tuple[Slot, ...]

    def input(self, name: str) -> tuple[Any, ...]:
        """The leaves of argument slot ``name``."""
        return _slot(self.inputs or (), name, self.module)

    def output(self, name: str) -> tuple[Any, ...]:
        """The leaves of result slot ``name``."""
        return _slot(self.outputs, name, self.module)

    def arguments(self, by_slot: Mapping[str, Any]) -> tuple:
        """The module's positional arguments from values by slot name.

        The forward takes its input leaves one argument each; a backward module takes
        one list per slot (the dims argument: an array, or None without symbolic dims).
        """
        if self.inputs is None:
            raise ValueError(f"the manifest does not fix the {self.module} module's arguments")
        if self.module == "fwd":
            return tuple(by_slot[INPUTS])
        return tuple([by_slot[name] for name in self.input_names])

    def results(self, result: Any) -> dict[str, Sequence[Any]]:
        """A call's results by slot name, each slot's leaves as the call returned them (a tuple or list).

        A module with one result slot returns that slot's sequence itself.
        """
        names = self.output_names
        parts = (result,) if len(names) == 1 else tuple(result)
        if len(parts) != len(names):
            raise ValueError(f"the {self.module} module returned {len(parts)} groups, not {len(names)}")
        return dict(zip(names, parts))

    @functools.cached_property  # both are read on every call
    def input_names(self) -> tuple[str, ...]:
        """The argument slots' names, in calling order (() where the manifest does not fix them)."""
        return tuple(s.name for s in self.inputs or ())

    @functools.cached_property
    def output_names(self) -> tuple[str, ...]:
        """The result slots' names, in order."""
        return tuple(s.name for s in self.outputs)

    @property
    def input_leaves(self) -> tuple[Any, ...] | None:
        """Every argument leaf in calling order; None where the manifest does not fix them."""
        return None if self.inputs is None else tuple(x for s in self.inputs for x in s.leaves)

    @property
    def output_leaves(self) -> tuple[Any, ...]:
        """Every result leaf in order."""
        return tuple(x for s in self.outputs for x in s.leaves)


def _slot(slots: tuple[Slot, ...], name: str, module: str) -> tuple[Any, ...]:
    for s in slots:
        if s.name == name:
            return s.leaves
    raise KeyError(f"the {module} module has no {name!r} slot")


def is_out_key(key: str) -> bool:
    """Whether an output key belongs to ``out`` (rather than to ``aux``)."""
    return key == "out" or key.startswith("out/")


def dims_arg_leaves(manifest: Any) -> tuple[Any, ...]:
    """The dims argument's leaf when the manifest has symbolic dims; () otherwise."""
    dim_vars = tuple(manifest.dim_vars)
    return (DimsArgLeaf((0, *dim_vars)),) if dim_vars else ()


def input_backed_leaves(manifest: Any) -> tuple[Any, ...]:
    """The input-backed residual leaves, in manifest order."""
    return tuple(r for r in manifest.residuals if r.input_backed)


def weight_part_residuals(manifest: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """The stored and input-backed residual leaves ``bwd_weight`` reads (every one for formats <= 2)."""
    if not manifest.weight_reads_subset:
        return tuple(manifest.stored_residuals), input_backed_leaves(manifest)
    by_key = {r.key: r for r in manifest.residuals}
    return (
        tuple(by_key[k] for k in manifest.weight_residuals),
        tuple(by_key[keys.input_backed(k)] for k in manifest.weight_inputs),
    )


def _forward(m: Any) -> ModuleIO:
    outs = tuple(o for o in m.outputs if is_out_key(o.key))
    aux = tuple(o for o in m.outputs if not is_out_key(o.key))
    # Format 1 lowered the forward over one pytree per argument: its inputs are not fixed here.
    ins = (Slot(INPUTS, tuple(m.inputs)),) if m.format_version >= 2 else None
    return ModuleIO("fwd", ins, (Slot(OUT, outs), Slot(STORED, tuple(m.stored_residuals)), Slot(AUX, aux)))


def _backward(m: Any, module: str) -> ModuleIO:
    ins = (
        Slot(STORED, tuple(m.stored_residuals)),
        Slot(INPUT_BACKED, input_backed_leaves(m)),
        Slot(COTANGENTS, tuple(m.cotangent_leaves)),
        Slot(DIMS_ARG, dims_arg_leaves(m)),
    )
    if module == "bwd":
        return ModuleIO(module, ins, (Slot(GRADS, tuple(m.grads)),))
    outs = (Slot(GRADS, tuple(m.grads_of(m.non_weight_wrt))), Slot(INTERMEDIATES, tuple(m.intermediates)))
    return ModuleIO(module, ins, outs)


def _weight_part(m: Any) -> ModuleIO:
    stored, backed = weight_part_residuals(m)
    ins = (
        Slot(STORED, stored),
        Slot(INPUT_BACKED, backed),
        Slot(INTERMEDIATES, tuple(m.intermediates)),
        Slot(DIMS_ARG, dims_arg_leaves(m)),
    )
    return ModuleIO("bwd_weight", ins, (Slot(GRADS, tuple(m.grads_of(m.weights))),))


def module_io(manifest: Any, module: str) -> ModuleIO | None:
    """The signature of ``module`` as ``manifest`` fixes it; None for a module it does not know."""
    if module == "fwd":
        return _forward(manifest)
    if module in ("bwd", "bwd_input"):
        return _backward(manifest, module)
    if module == "bwd_weight":
        return _weight_part(manifest)
    return None


MODULE_NAMES = ("fwd", "bwd", "bwd_input", "bwd_weight")


def module_table(manifest: Any) -> dict[str, ModuleIO]:
    """Every module's signature by name (``module_io`` of each), computed once for an artifact."""
    table = {name: module_io(manifest, name) for name in MODULE_NAMES}
    return {name: io for name, io in table.items() if io is not None}
