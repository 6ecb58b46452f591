"""The artifact's manifest: its schema (every key, dtype and shape), the format versions and the fingerprint.

Like ``jax.export``'s own ``Exported``, the manifest is a frozen dataclass with an
explicit format version; a reader refuses a newer version, naming both. One array's
entry (``Leaf``) is module ``leaf``; holding the caller's arrays to the manifest at
run time is module ``arguments``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from .._version import __version__
from ..errors import VjpsplitError
from ..files import keys
from ..files.dtypes import dtype_from_name
from ..files.trees import structure_keys
from ..tracing.vjp import is_differentiable
from .leaf import Leaf

# Artifact format versions. Bump on any change a reader must know about, and keep
# reading the old ones where it is cheap.
#   1 (2026-11-30): MAGIC + msgpack map {"manifest": {...}, "fwd": bytes, "bwd": bytes,
#                   optionally "bwd_input": bytes, "bwd_weight": bytes (the zero-bubble
#                   split of bwd, when exported with weights=)}; modules are jax.export
#                   serializations; fingerprint = sha256 of the manifest (less the
#                   fingerprint) and every module.
#   2 (2026-11-30): the forward takes the flat input leaves (manifest ``inputs`` order)
#                   instead of one pytree per argument, so no user class is serialized;
#                   key segments escape ``%`` and ``/`` (``%25``, ``%2F``); structures may
#                   hold ``{"node": ..., "type": ...}`` and int dict keys; leaves may carry
#                   ``prng_impl`` (typed PRNG keys travel as their key data).
#   3 (2026-11-30): the zero-bubble weight part reads only what it needs: the manifest
#                   lists ``weight_residuals`` (stored residual keys) and
#                   ``weight_inputs`` (input keys), and ``bwd_weight`` takes just those
#                   (then the intermediates), so a stage frees the rest after the input part.
#   4 (2026-11-30): sharded artifacts: ``nr_devices`` and an abstract ``mesh`` (axis names
#                   and sizes, no device ids); leaves may carry ``sharding``, their
#                   PartitionSpec as a JSON list (null, an axis name or a list of names
#                   per dim). The backward takes residuals as the forward sharded them.
#                   Written only when set: an unsharded artifact's manifest is format 3's.
FORMAT_VERSION = 4
MAGIC = b"VJPSPLIT\x00"


# Fields added after format 2, written only when set, so that older manifests
# re-serialize byte for byte (their fingerprints cover the JSON).
_ADDED_LATER = ("weight_residuals", "weight_inputs", "nr_devices", "mesh")


# The scalar fields and their types, spelled out: dataclass annotations are strings here
# (``from __future__ import annotations``), not types to check against.
_SCALARS = {
    "format_version": int,
    "calling_convention_version": int,
    "nr_devices": int,
    "vjpsplit_version": str,
    "jax_version": str,
    "function": str,
    "policy": str,
    "fingerprint": str,
    "single_grad": bool,
    "has_aux": bool,
    "x64": bool,
}
_SCALAR_NAMES = {int: "an integer", str: "a string", bool: "a bool"}


@dataclass(frozen=True)
class Manifest:
    """Everything an artifact says about itself, besides its two modules: a frozen dataclass (``Artifact.manifest``).

    A reader refuses a newer ``format_version``, naming both; each field added after format 2 says which format added it.
    """

    format_version: int
    """The artifact format's version (``FORMAT_VERSION`` when written by this vjpsplit)."""
    vjpsplit_version: str
    """The vjpsplit that exported it."""
    jax_version: str
    """The jax that exported it."""
    calling_convention_version: int
    """``jax.export``'s calling convention, of both modules."""
    function: str
    """The exported function's name."""
    arg_names: tuple[str, ...]
    """The argument names, in order."""
    wrt: tuple[str, ...]
    """The differentiated arguments' names."""
    single_grad: bool
    """Whether the Python API gives one gradient rather than a tuple."""
    has_aux: bool
    """Whether the function returns ``(out, aux)``."""
    policy: str
    """The rematerialization policy the modules were lowered under."""
    platforms: tuple[str, ...]
    """The platforms the modules were lowered for."""
    x64: bool
    """Whether it was exported with ``jax_enable_x64``."""
    dim_vars: tuple[str, ...]
    """The symbolic dims' names."""
    inputs: tuple[Leaf, ...]
    """The input leaves."""
    outputs: tuple[Leaf, ...]
    """The output leaves: ``out...`` then ``aux...`` keys."""
    residuals: tuple[Leaf, ...]
    """The residual leaves: stored ones in module order, then input-backed ones."""
    grads: tuple[Leaf, ...]
    """The gradient leaves."""
    structure: Mapping[str, Any]
    """The pytree structures: ``{"args": {name: ...}, "out": ..., "aux": ...}``."""
    weights: tuple[str, ...] = ()
    """Zero-bubble split: the arguments whose gradients ``bwd_weight`` computes; ``()`` unsplit."""
    intermediates: tuple[Leaf, ...] = ()
    """What ``bwd_input`` hands to ``bwd_weight``."""
    weight_residuals: tuple[str, ...] = ()
    """Format >= 3: the stored residuals ``bwd_weight`` reads."""
    weight_inputs: tuple[str, ...] = ()
    """Format >= 3: the input-backed residuals (input keys) it reads."""
    nr_devices: int = 1
    """Format >= 4: the devices the modules run on."""
    mesh: tuple[tuple[str, int], ...] = ()
    """Format >= 4: ``(axis name, size)`` of a sharded artifact's mesh; ``()`` unsharded."""
    fingerprint: str = ""
    """The hash that names this manifest and its modules."""

    def to_json(self) -> dict:
        """A JSON-able dict (msgpack-able too).

        Returns:
            The fields by name; fields added after format 2 only where set, so older
            manifests re-serialize byte for byte.
        """
        d = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in _ADDED_LATER and v == f.default:
                continue  # absent, as in the files written before the field existed: same fingerprint
            if f.name == "residuals":
                v = [leaf.to_json(residual=True) for leaf in v]
            elif f.name in ("inputs", "outputs", "grads", "intermediates"):
                v = [leaf.to_json() for leaf in v]
            elif f.name == "mesh":
                v = [[name, size] for name, size in v]
            elif isinstance(v, tuple):
                v = list(v)
            d[f.name] = v
        return d

    @classmethod
    def from_json(cls, d: Any, source: str) -> "Manifest":
        """Validate and build; an unsupported format version names both versions.

        Args:
            d: The manifest as read from the file.
            source: What to call the file in messages.

        Returns:
            The ``Manifest``.

        Raises:
            VjpsplitError: If ``d`` is not a manifest, its format version is malformed or
                newer than this vjpsplit reads, or a field is missing, mistyped or
                inconsistent (sharding, keys that name no leaf).
        """
        if not isinstance(d, dict) or "format_version" not in d:
            raise VjpsplitError(f"{source}: not a vjpsplit artifact (no manifest); re-export it with `vjpsplit export`")
        v = d["format_version"]
        if not isinstance(v, int) or v < 1:
            raise VjpsplitError(f"{source}: malformed artifact format version {v!r}; re-export it")
        if v > FORMAT_VERSION:
            raise VjpsplitError(
                f"{source}: artifact format version {v} is newer than this vjpsplit ({__version__}) reads "
                f"(up to {FORMAT_VERSION}); upgrade vjpsplit on this host"
            )
        field = ""
        try:
            kw = {}
            for f in dataclasses.fields(cls):
                if f.name not in d and f.default is not dataclasses.MISSING:
                    continue
                field = f.name
                if f.name not in d:
                    raise ValueError(f"'{f.name}' is missing")
                val = d[f.name]
                if f.name in ("residuals", "inputs", "outputs", "grads", "intermediates"):
                    val = tuple(Leaf.from_json(x) for x in val)
                elif f.name in (
                    "arg_names",
                    "wrt",
                    "platforms",
                    "dim_vars",
                    "weights",
                    "weight_residuals",
                    "weight_inputs",
                ):
                    val = tuple(str(x) for x in val)
                elif f.name == "structure":
                    if not isinstance(val, dict):
                        raise ValueError("structure is not a map")
                elif f.name == "mesh":
                    val = tuple((str(n), int(k)) for n, k in val)
                    if any(k < 1 or isinstance(k, bool) for _, k in val):
                        raise ValueError("mesh axis sizes must be >= 1")
                elif f.name in _SCALARS:
                    want = _SCALARS[f.name]
                    if not isinstance(val, want) or (want is int and isinstance(val, bool)):
                        raise ValueError(f"{f.name} is not {_SCALAR_NAMES[want]}")
                kw[f.name] = val
            field = ""
            manifest = cls(**kw)
            manifest._check_sharding()
            manifest._check_references()
            return manifest
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            # Our own checks say what is wrong; Python's errors on a forged value would quote its internals.
            own = type(e) is ValueError or isinstance(e, VjpsplitError)
            what = str(e) if own else f"'{field}' has the wrong type or misses an entry" if field else "a wrong type"
            raise VjpsplitError(f"{source}: malformed artifact manifest ({what}); re-export it") from e

    def _check_sharding(self) -> None:
        """The mesh, device count and leaf shardings agree; raises ValueError otherwise."""
        if not 1 <= self.nr_devices <= 2**20 or isinstance(self.nr_devices, bool):
            raise ValueError(f"nr_devices {self.nr_devices!r} is out of range")
        if self.nr_devices > 1 and not self.mesh:
            raise ValueError(f"nr_devices {self.nr_devices} without a mesh")
        if self.mesh and math.prod(size for _, size in self.mesh) != self.nr_devices:
            raise ValueError(
                f"the mesh's {math.prod(size for _, size in self.mesh)} devices are not nr_devices {self.nr_devices}"
            )
        names = {name for name, _ in self.mesh}
        for leaf in self.all_leaves:
            used = [a for e in leaf.sharding or () for a in ((e,) if isinstance(e, str) else e or ())]
            if any(a not in names for a in used) or len(used) != len(set(used)):
                raise ValueError(f"sharding of '{leaf.key}' names axes that are not the mesh's, or one twice")

    def _check_references(self) -> None:
        """Keys that point at other leaves point at ones that exist; raises ValueError otherwise."""
        inputs = {leaf.key for leaf in self.inputs}
        stored = {r.key for r in self.stored_residuals}
        for r in self.residuals:
            if r.input_backed and (not keys.is_input_backed(r.key) or keys.input_of(r.key) not in inputs):
                raise ValueError(f"input-backed residual '{r.key}' names no input")
        for k in self.weight_residuals:
            if k not in stored:
                raise ValueError(f"weight residual '{k}' is not a stored residual")
        for k in self.weight_inputs:
            if k not in self.input_backed_keys:
                raise ValueError(f"weight input '{k}' is not an input-backed residual")
        bad = next((g.key for g in self.grads if g.key not in inputs), None)
        if bad is not None:
            raise ValueError(f"gradient '{bad}' names no input")
        for what, listed in (("gradient", [g.key for g in self.grads]), ("input", list(inputs))):
            if len(set(listed)) != len(listed):
                raise ValueError(f"an {what} key appears twice" if what == "input" else "a gradient appears twice")
        if len(set(self.arg_names)) != len(self.arg_names):
            raise ValueError("an argument name appears twice")
        for names, what in ((self.wrt, "differentiated argument"), (self.weights, "weight")):
            bad = next((n for n in names if n not in self.arg_names), None)
            if bad is not None:
                raise ValueError(f"{what} '{bad}' is not an argument")
        args = self.structure.get("args")
        if not isinstance(args, dict) or any(n not in args for n in self.arg_names):
            raise ValueError("the structure does not describe every argument")
        arg_keys = [k for n in self.arg_names for k in structure_keys(n, args[n])]
        if arg_keys != [leaf.key for leaf in self.inputs]:
            raise ValueError("the argument structure's keys are not the inputs'")

    @property
    def all_leaves(self) -> tuple[Leaf, ...]:
        """Every leaf the manifest describes."""
        return (*self.inputs, *self.outputs, *self.residuals, *self.grads, *self.intermediates)

    @property
    def sharded(self) -> bool:
        """Whether the modules run on a mesh (format >= 4 with a mesh recorded)."""
        return bool(self.mesh)

    def grads_of(self, names: Sequence[str]) -> tuple[Leaf, ...]:
        """The gradient leaves of the arguments ``names``, in manifest order.

        Args:
            names: Argument names.

        Returns:
            Their gradient leaves.
        """
        return tuple(g for g in self.grads if keys.arg_of(g.key) in names)

    @functools.cached_property  # read on every call: the manifest is frozen
    def non_weight_wrt(self) -> tuple[str, ...]:
        """The differentiated arguments that are not weights (the input part of a split backward gives their grads)."""
        return tuple(n for n in self.wrt if n not in self.weights)

    @functools.cached_property  # read on every call: the manifest is frozen
    def stored_residuals(self) -> tuple[Leaf, ...]:
        """The residuals a residual file stores (the input-backed ones are read from the inputs)."""
        return tuple(r for r in self.residuals if not r.input_backed)

    @property
    def splits_backward(self) -> bool:
        """Whether the backward is split (exported with ``weights``): ``bwd_input`` and ``bwd_weight`` exist."""
        return bool(self.weights)

    @property
    def weight_reads_subset(self) -> bool:
        """Whether ``bwd_weight`` takes only its own residuals (format >= 3) rather than all of them."""
        return self.splits_backward and self.format_version >= 3

    @functools.cached_property  # read on every call: the manifest is frozen
    def input_backed_keys(self) -> tuple[str, ...]:
        """Input keys the backward reads directly (``in/x`` residuals name input ``x``)."""
        return tuple(keys.input_of(r.key) for r in self.residuals if r.input_backed)

    @functools.cached_property  # read on every call: the manifest is frozen
    def out_keys(self) -> tuple[str, ...]:
        """The keys of the function's outputs (``out`` or ``out/...``), without the ``aux`` ones."""
        return tuple(o.key for o in self.outputs if o.key == "out" or o.key.startswith("out/"))

    @functools.cached_property  # read on every call: the manifest is frozen
    def cotangent_leaves(self) -> tuple[Leaf, ...]:
        """Outputs that take a cotangent: the floating leaves of ``out``."""
        return tuple(
            o
            for o in self.outputs
            if (o.key == "out" or o.key.startswith("out/")) and is_differentiable(dtype_from_name(o.dtype))
        )


MODULES = ("fwd", "bwd", "bwd_input", "bwd_weight")


def fingerprint(manifest: Manifest, modules: Mapping[str, bytes]) -> str:
    """sha256 over the manifest (less its fingerprint) and every module, length-prefixed."""
    return fingerprint_json(manifest.to_json(), modules)


def fingerprint_json(body: Mapping[str, Any], modules: Mapping[str, bytes]) -> str:
    """``fingerprint`` of a manifest given as its JSON dict (any ``fingerprint`` entry is ignored).

    A manifest's JSON is what the file holds, so this is also how a tool (or a
    test) re-fingerprints a manifest it edited, valid or not.
    """
    h = hashlib.sha256()
    body = {k: v for k, v in body.items() if k != "fingerprint"}
    parts = [json.dumps(body, sort_keys=True).encode()] + [modules[k] for k in MODULES if k in modules]
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()
