"""The artifact's manifest: what every key, dtype and shape is, and the checks that hold arrays to it.

Like ``jax.export``'s own ``Exported``, the manifest is a frozen dataclass with an
explicit format version; a reader refuses a newer version, naming both.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .._version import __version__
from ..errors import VjpsplitError
from ..files.dtypes import dtype_from_name
from ..files.prng import impl_name, is_key, key_ndim, to_data
from ..files.shapes import bind_dims, concrete_shape, format_shape
from ..files.trees import ArgTrees, decode_structure, flatten_with_keys, structure_keys
from ..safeio.system import host_memory
from ..tracing.vjp import is_differentiable
from .sharding import SpecJSON, spec_from_json

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


@dataclass(frozen=True)
class Leaf:
    """One array in the manifest: its file key, dtype name and shape (ints or dim names).

    A typed PRNG key is described by its key data (``uint32[..., 2]`` for
    threefry), with ``prng_impl`` naming the impl that wraps it back.
    """

    key: str
    dtype: str
    shape: tuple[int | str, ...]
    input_backed: bool = False  # residuals only: read from the inputs, not stored
    prng_impl: str = ""  # typed PRNG key: the impl of its key data; "" for plain arrays
    sharding: SpecJSON | None = None  # format >= 4: PartitionSpec on the artifact's mesh; None unsharded

    def describe(self) -> str:
        """``bf16[32,128]``, or ``key<threefry2x32>[4] as u32[4,2]`` for typed keys."""
        data = format_shape(self.dtype, self.shape)
        if not self.prng_impl:
            return data
        return f"key<{self.prng_impl}>[{','.join(str(d) for d in self.key_shape)}] as {data}"

    @property
    def key_shape(self) -> tuple[int | str, ...]:
        """The shape of the array the function sees: the key array's shape for typed keys."""
        if not self.prng_impl:
            return self.shape
        return self.shape[: len(self.shape) - key_ndim(self.prng_impl)]

    def to_json(self, residual: bool = False) -> dict:
        d = {"key": self.key, "dtype": self.dtype, "shape": list(self.shape)}
        if residual:
            d["input_backed"] = self.input_backed
        if self.prng_impl:
            d["prng_impl"] = self.prng_impl
        if self.sharding is not None:
            d["sharding"] = [list(e) if isinstance(e, tuple) else e for e in self.sharding]
        return d

    @classmethod
    def from_json(cls, d: Mapping) -> "Leaf":
        shape = tuple(d["shape"])
        if not all(isinstance(x, (int, str)) and not isinstance(x, bool) for x in shape):
            raise ValueError(f"bad shape {shape!r}")
        dtype_from_name(d["dtype"])
        impl = d.get("prng_impl", "")
        if not isinstance(impl, str):
            raise ValueError(f"bad prng_impl {impl!r}")
        sharding = d.get("sharding")
        if sharding is not None:
            sharding = spec_from_json(sharding)
            if len(sharding) > len(shape):
                raise ValueError(f"sharding of '{d['key']}' has more entries than its shape has dims")
        return cls(str(d["key"]), str(d["dtype"]), shape, bool(d.get("input_backed", False)), impl, sharding)


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
    """Everything an artifact says about itself, besides its two modules."""

    format_version: int
    vjpsplit_version: str
    jax_version: str
    calling_convention_version: int  # jax.export's, of both modules
    function: str
    arg_names: tuple[str, ...]
    wrt: tuple[str, ...]
    single_grad: bool  # Python API: one gradient, not a tuple
    has_aux: bool
    policy: str
    platforms: tuple[str, ...]
    x64: bool  # exported with jax_enable_x64
    dim_vars: tuple[str, ...]
    inputs: tuple[Leaf, ...]
    outputs: tuple[Leaf, ...]  # "out..." then "aux..." keys
    residuals: tuple[Leaf, ...]  # stored "r/i" in module order, then input-backed "in/<key>"
    grads: tuple[Leaf, ...]
    structure: Mapping[str, Any]  # {"args": {name: ...}, "out": ..., "aux": ...} (trees.encode_structure)
    weights: tuple[str, ...] = ()  # zero-bubble split: arguments whose gradients bwd_weight computes
    intermediates: tuple[Leaf, ...] = ()  # what bwd_input hands to bwd_weight ("c/i" keys)
    weight_residuals: tuple[str, ...] = ()  # format >= 3: the stored residuals ("r/i") bwd_weight reads
    weight_inputs: tuple[str, ...] = ()  # format >= 3: the input-backed residuals (input keys) it reads
    nr_devices: int = 1  # format >= 4: devices the modules run on (jax.export's)
    mesh: tuple[tuple[str, int], ...] = ()  # format >= 4: (axis name, size) of a sharded artifact's mesh
    fingerprint: str = ""

    def to_json(self) -> dict:
        """A JSON-able dict (msgpack-able too)."""
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
        """Validate and build; an unsupported format version names both versions."""
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
            if r.input_backed and (not r.key.startswith("in/") or r.key[3:] not in inputs):
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
        for what, keys in (("gradient", [g.key for g in self.grads]), ("input", list(inputs))):
            if len(set(keys)) != len(keys):
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
        keys = [k for n in self.arg_names for k in structure_keys(n, args[n])]
        if keys != [leaf.key for leaf in self.inputs]:
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
        """The gradient leaves of the arguments ``names``, in manifest order."""
        return tuple(g for g in self.grads if g.key.split("/", 1)[0] in names)

    @property
    def non_weight_wrt(self) -> tuple[str, ...]:
        return tuple(n for n in self.wrt if n not in self.weights)

    @property
    def stored_residuals(self) -> tuple[Leaf, ...]:
        return tuple(r for r in self.residuals if not r.input_backed)

    @property
    def weight_reads_subset(self) -> bool:
        """Whether ``bwd_weight`` takes only its own residuals (format >= 3) rather than all of them."""
        return bool(self.weights) and self.format_version >= 3

    @property
    def input_backed_keys(self) -> tuple[str, ...]:
        """Input keys the backward reads directly (``in/x`` residuals name input ``x``)."""
        return tuple(r.key[3:] for r in self.residuals if r.input_backed)

    @property
    def out_keys(self) -> tuple[str, ...]:
        return tuple(o.key for o in self.outputs if o.key == "out" or o.key.startswith("out/"))

    @property
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


def flatten_args(
    manifest: "Manifest | None", args: Sequence, source: str = "args", arg_names: Sequence[str] = ()
) -> tuple[dict[str, Any], tuple]:
    """The caller's argument pytrees as ``{file key: array}`` plus their structure.

    Typed PRNG keys become their key data, after checking the impl against the
    manifest; every refusal names the leaf by its key. Without a manifest the
    arguments are named by ``arg_names`` and keys are not checked.
    """
    specs = {leaf.key: leaf for leaf in manifest.inputs} if manifest is not None else None
    flat: dict[str, Any] = {}
    trees = []
    for name, arg in zip(manifest.arg_names if manifest is not None else arg_names, args):
        entries = flatten_with_keys(name, arg)
        trees.append((name, jax.tree_util.tree_structure(arg), tuple(k for k, _ in entries)))
        for key, value in entries:
            if specs is None:
                flat[key] = to_data(value)
                continue
            leaf = specs.get(key)
            if is_key(value):
                if leaf is None or not leaf.prng_impl:
                    want = f"expected {leaf.describe()}" if leaf is not None else "not an input of the artifact"
                    raise VjpsplitError(
                        f"{source}: input '{key}': got a typed PRNG key ({value.dtype}), {want}; "
                        "pass jax.random.key_data(key) for a legacy uint32 key"
                    )
                got = impl_name(value)
                if got != leaf.prng_impl:
                    raise VjpsplitError(
                        f"{source}: input '{key}': expected a {leaf.prng_impl} key, got a {got} key; "
                        f"make it with jax.random.key(seed, impl='{leaf.prng_impl}')"
                    )
                value = to_data(value)
            flat[key] = value
    return flat, tuple(trees)


def _weak_scalar_fits(value, want: np.dtype) -> bool:
    if isinstance(value, bool):
        return want == np.bool_
    if isinstance(value, int):
        return want.kind in "iufc"
    if isinstance(value, float):
        return want.kind in "fc" or jnp.issubdtype(want, jnp.floating)
    if isinstance(value, complex):
        return want.kind == "c"
    return False


def as_computed(value, want):
    """``value`` as an artifact computes on it: a Python scalar (weakly typed in JAX) takes the dtype ``want``."""
    want = np.dtype(want)
    return np.asarray(value, want) if _weak_scalar_fits(value, want) else value


def check_array(source: str, what: str, leaf: Leaf, value, dims: dict[str, int]):
    """``value`` as an array of ``leaf``'s dtype and shape, binding dims; else a clear error."""
    want = dtype_from_name(leaf.dtype)
    value = as_computed(value, want)
    a = value if hasattr(value, "dtype") and hasattr(value, "shape") else np.asarray(value)
    got = np.dtype(a.dtype)
    if got != want:
        # npz written by plain numpy holds bfloat16 & co. as raw void of the same width.
        if got.kind == "V" and got.itemsize == want.itemsize and not got.fields and isinstance(a, np.ndarray):
            a = a.view(want)
        else:
            raise VjpsplitError(
                f"{source}: {what} '{leaf.key}': expected {leaf.describe()}, got {format_shape(got, a.shape)}; "
                "write it with the expected dtype (no implicit casting)"
            )
    shape = tuple(int(d) for d in a.shape)
    ok = bind_dims(f"{source}: {what} '{leaf.key}'", leaf.shape, shape, dims)
    conc = concrete_shape(leaf.shape, dims) if ok else None
    if not ok or (conc is not None and conc != shape):
        bound = ", ".join(f"{k}={v}" for k, v in dims.items())
        raise VjpsplitError(
            f"{source}: {what} '{leaf.key}': expected {leaf.describe()}"
            f"{f' (with {bound})' if bound else ''}, got {format_shape(got, shape)}"
        )
    return a


def check_keys(source: str, what: str, expected: Sequence[str], given: Mapping[str, Any], allow_extra: bool = False):
    """Refuse missing keys and (unless ``allow_extra``) unknown ones, naming them and the expected set."""
    missing = [k for k in expected if k not in given]
    if missing:
        raise VjpsplitError(
            f"{source}: missing {what} key{'s' if len(missing) > 1 else ''} {', '.join(repr(k) for k in missing)}; "
            f"expected keys: {', '.join(expected) or '(none)'}"
        )
    if not allow_extra:
        extra = [k for k in given if k not in expected]
        if extra:
            raise VjpsplitError(
                f"{source}: unknown {what} key{'s' if len(extra) > 1 else ''} {', '.join(repr(k) for k in extra)}; "
                f"expected keys: {', '.join(expected) or '(none)'}"
            )


def recorded_dims(manifest: Manifest, recorded: Mapping[str, Any], source: str, what: str, fix: str) -> dict[str, int]:
    """The symbolic dims a residuals or intermediates file (``what``) records: each >= 1, all within memory.

    Dim sizes read from a file bound what the backward allocates. A dim that no
    stored residual mentions is checked against nothing else, so an edited file
    could otherwise ask for any amount of memory: refuse what no host could hold.
    """
    dims = {}
    for name in manifest.dim_vars:
        v = recorded.get(name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise VjpsplitError(f"{source}: symbolic dim {name!r} is missing or invalid in the {what}; {fix}")
        dims[name] = v
    total = 0
    for leaf in (*manifest.grads, *manifest.intermediates):
        shape = concrete_shape(leaf.shape, dims)
        if shape is not None:
            total += int(np.prod(shape, dtype=object)) * dtype_from_name(leaf.dtype).itemsize
    limit = host_memory()
    if total > limit:
        bound = ", ".join(f"{k}={v}" for k, v in dims.items())
        raise VjpsplitError(
            f"{source}: the recorded dims ({bound}) would make the backward's results {total / 2**30:.1f} GiB, "
            f"more than this host's {limit / 2**30:.1f} GiB of memory; the residuals metadata is corrupt, "
            "rerun the forward"
        )
    return dims


def grads_per_arg(
    manifest: Manifest, grads: Mapping[str, Any], names: Sequence[str], dims, arg_trees: ArgTrees = ()
) -> dict:
    """Flat gradient keys -> per-argument pytrees (float0 zeros for integer leaves).

    With ``arg_trees`` (from ``fwd``'s arguments) each gradient has the caller's
    own pytree type; otherwise the manifest's structure (user classes as dicts).
    """
    spec = {leaf.key: leaf for leaf in manifest.inputs}
    known = {name: (treedef, keys) for name, treedef, keys in arg_trees}

    def leaf_grad(k):
        if k in grads:
            return grads[k]
        return np.zeros(concrete_shape(spec[k].key_shape, dims), jax.dtypes.float0)

    out = {}
    for name in names:
        if name in known:
            treedef, keys = known[name]
            out[name] = jax.tree_util.tree_unflatten(treedef, [leaf_grad(k) for k in keys])
        else:
            keys = structure_keys(name, manifest.structure["args"][name])
            out[name] = decode_structure(manifest.structure["args"][name], iter(leaf_grad(k) for k in keys))
    return out
