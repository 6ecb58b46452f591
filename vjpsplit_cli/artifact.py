"""Artifacts: the forward and backward as ``jax.export`` modules in one self-contained file.

An artifact runs without the user's code: its manifest says every key, dtype and
(symbolic) shape, and its modules are serialized StableHLO for each platform.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import msgpack
import numpy as np
from jax import export as jexport

from ._version import __version__
from ._io import atomic_write, read_bytes
from .core import assemble_grads, is_differentiable, positional_names, trace_vjp, _wrt_positions
from .dtypes import dtype_from_name, dtype_name
from .errors import VjpsplitError
from .policies import apply_policy, normalize_policy
from .shapes import bind_dims, concrete_shape, dim_str, format_shape, to_struct
from .trees import decode_structure, encode_structure, flatten_with_keys, structure_keys

# Artifact format versions. Bump on any change a reader must know about, and keep
# reading the old ones where it is cheap.
#   1 (2026-11-30): MAGIC + msgpack map {"manifest": {...}, "fwd": bytes, "bwd": bytes};
#                   fwd/bwd are jax.export serializations; fingerprint = sha256 of
#                   the manifest (less the fingerprint) and both modules.
FORMAT_VERSION = 1
MAGIC = b"VJPSPLIT\x00"

DEFAULT_PLATFORMS = ("cpu", "cuda", "tpu")
_KNOWN_PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_DIM_FUNCS = {"mod", "floordiv", "max", "min", "non_negative"}


@dataclass(frozen=True)
class Leaf:
    """One array in the manifest: its file key, dtype name and shape (ints or dim names)."""

    key: str
    dtype: str
    shape: tuple[int | str, ...]
    input_backed: bool = False  # residuals only: read from the inputs, not stored

    def describe(self) -> str:
        """``bf16[32,128]``."""
        return format_shape(self.dtype, self.shape)

    def to_json(self, residual: bool = False) -> dict:
        d = {"key": self.key, "dtype": self.dtype, "shape": list(self.shape)}
        if residual:
            d["input_backed"] = self.input_backed
        return d

    @classmethod
    def from_json(cls, d: Mapping) -> "Leaf":
        shape = tuple(d["shape"])
        if not all(isinstance(x, (int, str)) and not isinstance(x, bool) for x in shape):
            raise ValueError(f"bad shape {shape!r}")
        dtype_from_name(d["dtype"])
        return cls(str(d["key"]), str(d["dtype"]), shape, bool(d.get("input_backed", False)))


@dataclass(frozen=True)
class Manifest:
    """Everything an artifact says about itself, besides its two modules."""

    format_version: int
    vjpsplit_version: str
    jax_version: str
    calling_convention_version: int   # jax.export's, of both modules
    function: str
    arg_names: tuple[str, ...]
    wrt: tuple[str, ...]
    single_grad: bool                 # Python API: one gradient, not a tuple
    has_aux: bool
    policy: str
    platforms: tuple[str, ...]
    x64: bool                         # exported with jax_enable_x64
    dim_vars: tuple[str, ...]
    inputs: tuple[Leaf, ...]
    outputs: tuple[Leaf, ...]         # "out..." then "aux..." keys
    residuals: tuple[Leaf, ...]       # stored "r/i" in module order, then input-backed "in/<key>"
    grads: tuple[Leaf, ...]
    structure: Mapping[str, Any]      # {"args": {name: ...}, "out": ..., "aux": ...} (trees.encode_structure)
    fingerprint: str = ""

    def to_json(self) -> dict:
        """A JSON-able dict (msgpack-able too)."""
        d = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "residuals":
                v = [leaf.to_json(residual=True) for leaf in v]
            elif f.name in ("inputs", "outputs", "grads"):
                v = [leaf.to_json() for leaf in v]
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
        try:
            kw = {}
            for f in dataclasses.fields(cls):
                val = d[f.name]
                if f.name == "residuals":
                    val = tuple(Leaf.from_json(x) for x in val)
                elif f.name in ("inputs", "outputs", "grads"):
                    val = tuple(Leaf.from_json(x) for x in val)
                elif f.name in ("arg_names", "wrt", "platforms", "dim_vars"):
                    val = tuple(str(x) for x in val)
                elif f.name == "structure":
                    if not isinstance(val, dict):
                        raise ValueError("structure is not a map")
                elif f.type in ("int",) and not isinstance(val, int):
                    raise ValueError(f"{f.name} is not an integer")
                elif f.type in ("bool",) and not isinstance(val, bool):
                    raise ValueError(f"{f.name} is not a bool")
                elif f.type in ("str",) and not isinstance(val, str):
                    raise ValueError(f"{f.name} is not a string")
                kw[f.name] = val
            return cls(**kw)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise VjpsplitError(f"{source}: malformed artifact manifest ({e}); re-export it") from e

    @property
    def stored_residuals(self) -> tuple[Leaf, ...]:
        return tuple(r for r in self.residuals if not r.input_backed)

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
            o for o in self.outputs
            if (o.key == "out" or o.key.startswith("out/")) and is_differentiable(dtype_from_name(o.dtype))
        )


def _fingerprint(manifest: Manifest, fwd: bytes, bwd: bytes) -> str:
    h = hashlib.sha256()
    body = manifest.to_json()
    body.pop("fingerprint")
    for part in (json.dumps(body, sort_keys=True).encode(), fwd, bwd):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


def _leaves_json_safe(entries) -> tuple[Leaf, ...]:
    return tuple(Leaf(k, dtype_name(s.dtype), tuple(dim_str(d) for d in s.shape)) for k, s in entries)


def _dim_vars(inputs: Sequence[Leaf]) -> tuple[str, ...]:
    """Symbolic dim names, in first-seen order; each must appear alone as some input dim."""
    plain, used = [], []
    for leaf in inputs:
        for d in leaf.shape:
            if isinstance(d, str):
                if _NAME_RE.fullmatch(d):
                    if d not in plain:
                        plain.append(d)
                else:
                    used += [n for n in _NAME_RE.findall(d) if n not in _DIM_FUNCS]
    for n in used:
        if n not in plain:
            raise VjpsplitError(
                f"symbolic dim {n!r} appears only inside expressions in the input shapes; "
                f"give some input a plain dim {n!r} so its size can be read from the inputs"
            )
    return tuple(plain)


_CALLBACK_PRIMITIVES = ("debug_callback", "debug_print", "pure_callback", "io_callback", "callback")


def _host_callbacks(jaxpr) -> list[str]:
    """Names of host-callback primitives anywhere in ``jaxpr`` (sub-jaxprs included)."""
    found: list[str] = []
    stack = [jaxpr]
    while stack:
        j = stack.pop()
        j = getattr(j, "jaxpr", j)  # ClosedJaxpr -> Jaxpr
        for eqn in getattr(j, "eqns", ()):
            if eqn.primitive.name in _CALLBACK_PRIMITIVES:
                found.append(eqn.primitive.name)
            for v in eqn.params.values():
                for item in v if isinstance(v, (tuple, list)) else (v,):
                    if hasattr(item, "eqns") or hasattr(getattr(item, "jaxpr", None), "eqns"):
                        stack.append(item)
    return found


def _refuse_host_callbacks(fn: Callable, structs) -> None:
    """jax.export cannot serialize host callbacks: say so before lowering fails obscurely."""
    try:
        jaxpr = jax.make_jaxpr(fn)(*structs)
    except Exception:
        return  # tracing errors surface, with context, from the export itself
    found = _host_callbacks(jaxpr)
    if found:
        raise VjpsplitError(
            f"cannot export {getattr(fn, '__name__', 'the function')}: it uses {sorted(set(found))[0]} "
            "(jax.debug.print, jax.debug.callback or another host callback), which jax.export cannot "
            "serialize; remove them before exporting"
        )


def _lower(what: str, fn: Callable, platforms: tuple[str, ...], args: Sequence):
    """``jax.export`` with errors that say what went wrong and, if one platform failed, which."""
    try:
        return jexport.export(jax.jit(fn), platforms=platforms)(*args)
    except NotImplementedError as e:
        if "host_callback" in str(e) or "callback" in str(e):
            raise VjpsplitError(
                f"cannot export the {what}: the function uses jax.debug.print, jax.debug.callback or "
                "another host callback, which jax.export cannot serialize; remove them before exporting"
            ) from e
        raise VjpsplitError(f"cannot export the {what}: {_first_line(e)}") from e
    except VjpsplitError:
        raise
    except Exception as e:
        failing = []
        if len(platforms) > 1:
            for p in platforms:
                try:
                    jexport.export(jax.jit(fn), platforms=(p,))(*args)
                except Exception:
                    failing.append(p)
        where = f" for platform(s) {', '.join(failing)}" if failing and len(failing) < len(platforms) else ""
        hint = f"; drop them with --platforms {','.join(p for p in platforms if p not in failing)}" if where else ""
        raise VjpsplitError(f"cannot export the {what}{where}: {_first_line(e)}{hint}") from e


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def export(
    fn: Callable,
    *specs,
    wrt=None,
    has_aux: bool = False,
    platforms: Sequence[str] | str = DEFAULT_PLATFORMS,
    policy: str | None = None,
    arg_names: Sequence[str] | None = None,
    name: str | None = None,
    memory_budget: int | str | None = None,
    at: Mapping[str, int] | Sequence[str] | None = None,
) -> "Artifact":
    """Export ``fn``'s forward (emitting residuals) and backward (consuming them).

    ``specs`` are one pytree of ``jax.ShapeDtypeStruct`` (or arrays) per positional
    argument; symbolic dims (``jax.export.symbolic_shape``, one scope) make the
    artifact shape-polymorphic. ``platforms`` lists the targets lowered into the one
    artifact (default cpu, cuda, tpu; no accelerator is needed to lower for them).
    ``memory_budget`` (bytes or ``"64MiB"``; symbolic dims sized by ``at``) picks
    the policy that recomputes least among those whose stored residuals fit.
    """
    if isinstance(platforms, str):
        platforms = tuple(p.strip() for p in platforms.split(",") if p.strip())
    platforms = tuple(platforms)
    for p in platforms:
        if p not in _KNOWN_PLATFORMS:
            raise VjpsplitError(f"unknown platform {p!r}; use some of {', '.join(_KNOWN_PLATFORMS)}")
    if not platforms:
        raise VjpsplitError("no platforms given; use e.g. cpu,cuda,tpu")
    if memory_budget is not None and policy not in (None, "everything"):
        raise VjpsplitError("give either a policy or a memory budget, not both")
    names = tuple(arg_names) if arg_names is not None else tuple(positional_names(fn, len(specs)))
    if len(names) != len(specs):
        raise VjpsplitError(f"{len(specs)} specs given for {len(names)} argument names")
    structs = tuple(jax.tree_util.tree_map(to_struct, s) for s in specs)
    input_entries = [kv for n, s in zip(names, structs) for kv in flatten_with_keys(n, s)]
    inputs = _leaves_json_safe(input_entries)
    dim_vars = _dim_vars(inputs)
    wrt_pos, single = _wrt_positions(fn, wrt, len(specs)) if arg_names is None else _wrt_by_names(names, wrt)
    if memory_budget is not None:
        from .economy import choose_policy

        policy, _ = choose_policy(fn, *structs, memory_budget=memory_budget, wrt=wrt_pos, has_aux=has_aux, at=at)
    policy = normalize_policy(policy)
    inner = apply_policy(fn, policy)
    _refuse_host_callbacks(fn, structs)

    captured: dict[str, Any] = {}

    def fwd_flat(*args):
        out, stored, aux, plan = trace_vjp(inner, args, wrt_pos, single, has_aux)
        captured.update(plan=plan, out=out, aux=aux)
        return (
            tuple(jax.tree_util.tree_leaves(out)),
            stored,
            tuple(jax.tree_util.tree_leaves(aux)),
        )

    fwd_exp = _lower("forward", fwd_flat, platforms, structs)
    plan = captured["plan"]
    n_out, n_stored = len(plan.out_avals), plan.n_stored
    stored_avals = list(fwd_exp.out_avals[n_out:n_out + n_stored])
    aux_avals = list(fwd_exp.out_avals[n_out + n_stored:])
    flat_structs = jax.tree_util.tree_leaves(structs)
    input_backed = [flat_structs[k] for k in plan.input_backed]
    ct_avals = [jax.ShapeDtypeStruct(plan.out_avals[i].shape, plan.out_avals[i].dtype) for i in plan.out_diff]
    carrier = None
    if dim_vars:
        scope = next(d for s in flat_structs for d in s.shape if not isinstance(d, int)).scope
        carrier = jax.ShapeDtypeStruct((0, *jexport.symbolic_shape(",".join(dim_vars), scope=scope)), jnp.bool_)

    def bwd_flat(stored, inputs_, cts, carrier_):
        # carrier_ is a zero-size array whose dims are the symbolic dims: it makes
        # them solvable even when no other backward input mentions them.
        del carrier_
        from .core import run_backward
        return run_backward(plan, stored, inputs_, cts)

    bwd_exp = _lower("backward", bwd_flat, platforms, (stored_avals, input_backed, ct_avals, carrier))

    out_keys = [k for k, _ in flatten_with_keys("out", captured["out"])]
    aux_keys = [k for k, _ in flatten_with_keys("aux", captured["aux"])]
    out_structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in fwd_exp.out_avals[:n_out]]
    input_keys = [k for k, _ in input_entries]
    grads = tuple(inputs[i] for i in plan.diff_leaves)
    manifest = Manifest(
        format_version=FORMAT_VERSION,
        vjpsplit_version=__version__,
        jax_version=jax.__version__,
        calling_convention_version=fwd_exp.calling_convention_version,
        function=name or f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}",
        arg_names=names,
        wrt=tuple(names[p] for p in wrt_pos),
        single_grad=single,
        has_aux=has_aux,
        policy=policy,
        platforms=platforms,
        x64=bool(jax.config.jax_enable_x64),
        dim_vars=dim_vars,
        inputs=inputs,
        outputs=_leaves_json_safe(list(zip(out_keys, out_structs)) + list(zip(aux_keys, aux_avals))),
        residuals=_leaves_json_safe([(f"r/{i}", a) for i, a in enumerate(stored_avals)])
        + tuple(dataclasses.replace(inputs[k], key=f"in/{input_keys[k]}", input_backed=True) for k in plan.input_backed),
        grads=grads,
        structure={
            "args": {n: encode_structure(s) for n, s in zip(names, structs)},
            "out": encode_structure(captured["out"]),
            "aux": encode_structure(captured["aux"]),
        },
    )
    fwd_bytes, bwd_bytes = bytes(fwd_exp.serialize()), bytes(bwd_exp.serialize())
    manifest = dataclasses.replace(manifest, fingerprint=_fingerprint(manifest, fwd_bytes, bwd_bytes))
    return Artifact(manifest, fwd_bytes, bwd_bytes, fwd_exp, bwd_exp)


def _wrt_by_names(names: Sequence[str], wrt) -> tuple[tuple[int, ...], bool]:
    if wrt is None:
        return tuple(range(len(names))), False
    single = isinstance(wrt, (int, str))
    items = [wrt] if single else list(wrt)
    out = []
    for w in items:
        if isinstance(w, str):
            if w not in names:
                raise VjpsplitError(f"--wrt names {w!r}, which is not an argument; the arguments are {', '.join(names)}")
            out.append(names.index(w))
        else:
            out.append(int(w))
    return tuple(out), single


class ArtifactResiduals:
    """Residuals of an artifact's forward: stored arrays, input references and dim sizes.

    ``stored`` maps ``r/i`` keys to arrays; ``inputs`` maps input keys to the very
    arrays the forward was given (never copies); ``dims`` binds the symbolic dims.
    A pytree, so it can be passed through ``jax.device_put`` or ``jax.jit``.
    """

    __slots__ = ("stored", "inputs", "dims", "fingerprint", "arg_names", "inputs_source")

    def __init__(self, stored: Mapping[str, Any], inputs: Mapping[str, Any], dims: Mapping[str, int],
                 fingerprint: str, arg_names: Sequence[str] = ()):
        self.stored = dict(stored)
        self.inputs = dict(inputs)
        self.dims = dict(dims)
        self.fingerprint = fingerprint
        self.arg_names = tuple(arg_names)
        self.inputs_source: str | None = None  # where the input-backed arrays came from, for messages

    def __repr__(self) -> str:
        return (
            f"ArtifactResiduals(stored={len(self.stored)}, input_backed={len(self.inputs)}, "
            f"dims={self.dims}, fingerprint={self.fingerprint[:12]})"
        )

    @property
    def stored_nbytes(self) -> int:
        """Bytes of the stored (not input-backed) residuals."""
        return sum(int(np.prod(np.shape(a))) * np.dtype(a.dtype).itemsize for a in self.stored.values())


jax.tree_util.register_pytree_node(
    ArtifactResiduals,
    lambda r: ((tuple(r.stored.values()), tuple(r.inputs.values())),
               (tuple(r.stored), tuple(r.inputs), tuple(sorted(r.dims.items())), r.fingerprint, r.arg_names)),
    lambda aux, ch: ArtifactResiduals(dict(zip(aux[0], ch[0])), dict(zip(aux[1], ch[1])), dict(aux[2]), aux[3], aux[4]),
)


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


def _check_array(source: str, what: str, leaf: Leaf, value, dims: dict[str, int]):
    """``value`` as an array of ``leaf``'s dtype and shape, binding dims; else a clear error."""
    want = dtype_from_name(leaf.dtype)
    if _weak_scalar_fits(value, want):
        value = np.asarray(value, want)  # Python scalars are weakly typed in JAX: take the expected dtype
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


def _current_platform() -> str:
    d = jax.devices()[0]
    if d.platform == "gpu":
        return "rocm" if "rocm" in getattr(d.client, "platform_version", "").lower() else "cuda"
    return d.platform


class Artifact:
    """A loaded or freshly exported artifact: manifest plus forward and backward modules."""

    def __init__(self, manifest: Manifest, fwd_bytes: bytes, bwd_bytes: bytes, fwd_exp=None, bwd_exp=None, source: str = "artifact"):
        self.manifest = manifest
        self.fwd_bytes = fwd_bytes
        self.bwd_bytes = bwd_bytes
        self.source = source
        self._fwd_exp = fwd_exp if fwd_exp is not None else _deserialize(fwd_bytes, source, manifest, "forward")
        self._bwd_exp = bwd_exp if bwd_exp is not None else _deserialize(bwd_bytes, source, manifest, "backward")
        # One jit per module: jax caches the compiled executable per input signature.
        self._fwd_call = jax.jit(self._fwd_exp.call)
        self._bwd_call = jax.jit(self._bwd_exp.call)

    def __repr__(self) -> str:
        m = self.manifest
        return f"Artifact({m.function}, args={list(m.arg_names)}, platforms={list(m.platforms)}, fingerprint={m.fingerprint[:12]})"

    # -- file ---------------------------------------------------------------
    def to_bytes(self) -> bytes:
        """The artifact file's bytes."""
        return MAGIC + msgpack.packb(
            {"manifest": self.manifest.to_json(), "fwd": self.fwd_bytes, "bwd": self.bwd_bytes}, use_bin_type=True
        )

    def save(self, path) -> None:
        """Write the artifact to ``path`` (atomically: no partial file on failure)."""
        data = self.to_bytes()
        atomic_write(path, lambda f: f.write(data))

    # -- running --------------------------------------------------------------
    def _check_runnable(self):
        plat = _current_platform()
        if plat not in self.manifest.platforms:
            raise VjpsplitError(
                f"{self.source}: this host runs on {plat}, but the artifact was exported for "
                f"{', '.join(self.manifest.platforms)} only; re-export with --platforms including {plat}"
            )
        if self.manifest.x64 and not jax.config.jax_enable_x64:
            raise VjpsplitError(
                f"{self.source}: the artifact was exported with 64-bit types enabled; "
                "set JAX_ENABLE_X64=1 (or jax.config.update('jax_enable_x64', True)) before running it"
            )

    def input_dims(self, inputs: Mapping[str, Any], source: str = "inputs") -> tuple[list, dict[str, int]]:
        """Check ``inputs`` (flat keys) against the manifest; return the arrays in order and the dims."""
        m = self.manifest
        check_keys(source, "input", [leaf.key for leaf in m.inputs], inputs)
        dims: dict[str, int] = {}
        arrays = [_check_array(source, "input", leaf, inputs[leaf.key], dims) for leaf in m.inputs]
        return arrays, dims

    def run_fwd_arrays(self, inputs: Mapping[str, Any], source: str = "inputs") -> tuple[dict, ArtifactResiduals]:
        """Forward on flat-keyed inputs: ``({out/aux key: array}, residuals)``."""
        self._check_runnable()
        m = self.manifest
        arrays, dims = self.input_dims(inputs, source)
        try:
            outs, stored, aux = self._fwd_call(*self._args_tree(arrays))
        except (ValueError, TypeError) as e:
            raise VjpsplitError(f"{source}: the forward refused these inputs: {_first_line(e)}") from e
        out_values = list(outs) + list(aux)
        outputs = {leaf.key: v for leaf, v in zip(m.outputs, out_values)}
        by_key = dict(zip((leaf.key for leaf in m.inputs), arrays))
        res = ArtifactResiduals(
            {leaf.key: v for leaf, v in zip(m.stored_residuals, stored)},
            {k: by_key[k] for k in m.input_backed_keys},
            dims,
            m.fingerprint,
            m.arg_names,
        )
        return outputs, res

    def _args_tree(self, arrays: list) -> list:
        m = self.manifest
        it = iter(arrays)
        return [decode_structure(m.structure["args"][n], it) for n in m.arg_names]

    def check_residuals(self, res: ArtifactResiduals, source: str = "residuals") -> tuple[list, list, dict]:
        """Validate residuals against this artifact; return stored, input-backed arrays and dims."""
        m = self.manifest
        if not isinstance(res, ArtifactResiduals):
            raise VjpsplitError(f"{source}: expected residuals from an artifact's fwd, got {type(res).__name__}")
        if res.fingerprint != m.fingerprint:
            raise VjpsplitError(
                f"{source}: these residuals were written by another artifact (fingerprint {res.fingerprint[:12]}, "
                f"this artifact is {m.fingerprint[:12]}); run the forward of this artifact to make matching residuals"
            )
        dims = {}
        for name in m.dim_vars:
            v = res.dims.get(name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise VjpsplitError(f"{source}: symbolic dim {name!r} is missing or invalid in the residuals; rerun the forward")
            dims[name] = v
        check_keys(source, "residual", [r.key for r in m.stored_residuals], res.stored)
        stored = [_check_array(source, "residual", leaf, res.stored[leaf.key], dict(dims)) for leaf in m.stored_residuals]
        inputs = []
        for leaf, key in zip([r for r in m.residuals if r.input_backed], m.input_backed_keys):
            if key not in res.inputs:
                raise VjpsplitError(
                    f"{source}: the residuals need input '{key}', which was left out of the file to avoid a copy; "
                    "pass the forward's inputs (--inputs FILE, or load_residuals(path, inputs=args))"
                )
            inputs.append(_check_array(res.inputs_source or source, "input", dataclasses.replace(leaf, key=key),
                                       res.inputs[key], dict(dims)))
        return stored, inputs, dims

    def run_bwd_arrays(self, res: ArtifactResiduals, cotangents: Mapping[str, Any] | None = None,
                       source: str = "residuals", ct_source: str = "cotangents") -> dict:
        """Backward from residuals and flat-keyed cotangents (None: 1 for a scalar output): ``{key: grad}``."""
        self._check_runnable()
        m = self.manifest
        stored, inputs, dims = self.check_residuals(res, source)
        ct_leaves = m.cotangent_leaves
        if cotangents is None:
            if len(m.out_keys) != 1 or len(ct_leaves) != 1 or ct_leaves[0].shape != ():
                raise VjpsplitError(
                    f"{self.source}: the output is not a single floating-point scalar, so cotangents are required; "
                    f"pass --cotangents FILE with keys {', '.join(m.out_keys)}"
                )
            cts = [np.ones((), dtype_from_name(ct_leaves[0].dtype))]
        else:
            expected = list(m.out_keys)
            check_keys(ct_source, "cotangent", expected, cotangents)
            cts = [_check_array(ct_source, "cotangent", leaf, cotangents[leaf.key], dict(dims)) for leaf in ct_leaves]
        carrier = np.zeros((0, *(dims[n] for n in m.dim_vars)), np.bool_) if m.dim_vars else None
        try:
            grads = self._bwd_call(stored, inputs, cts, carrier)
        except (ValueError, TypeError) as e:
            raise VjpsplitError(f"{source}: the backward refused these residuals: {_first_line(e)}") from e
        return {leaf.key: g for leaf, g in zip(m.grads, grads)}

    def fwd(self, *args):
        """Forward on pytree arguments: ``(out, res)``, or ``(out, res, aux)`` with has_aux."""
        m = self.manifest
        if len(args) != len(m.arg_names):
            raise VjpsplitError(f"{self.source}: fwd takes {len(m.arg_names)} arguments ({', '.join(m.arg_names)}), got {len(args)}")
        flat = dict(kv for n, a in zip(m.arg_names, args) for kv in flatten_with_keys(n, a))
        outputs, res = self.run_fwd_arrays(flat, source="args")
        it = iter(outputs[k] for k in m.out_keys)
        out = decode_structure(m.structure["out"], it)
        if m.has_aux:
            aux = decode_structure(m.structure["aux"], iter(v for k, v in outputs.items() if k not in m.out_keys))
            return out, res, aux
        return out, res

    def bwd(self, res: ArtifactResiduals, ct=None):
        """Backward from residuals: gradients shaped like the ``wrt`` arguments (float0 for ints)."""
        m = self.manifest
        cts = None if ct is None else dict(flatten_with_keys("out", ct))
        grads = self.run_bwd_arrays(res, cts, source="residuals", ct_source="cotangent")
        per_arg = []
        for name in m.wrt:
            keys = structure_keys(name, m.structure["args"][name])
            spec = {leaf.key: leaf for leaf in m.inputs}
            leaves = [
                grads[k] if k in grads
                else np.zeros(concrete_shape(spec[k].shape, res.dims), jax.dtypes.float0)
                for k in keys
            ]
            per_arg.append(decode_structure(m.structure["args"][name], iter(leaves)))
        return per_arg[0] if m.single_grad else tuple(per_arg)


def _deserialize(data: bytes, source: str, manifest: Manifest, what: str):
    try:
        exp = jexport.deserialize(bytearray(data))
    except Exception as e:
        lo = jexport.minimum_supported_calling_convention_version
        hi = jexport.maximum_supported_calling_convention_version
        raise VjpsplitError(
            f"{source}: cannot read the {what} module (exported with jax {manifest.jax_version}, calling convention "
            f"{manifest.calling_convention_version}; this jax {jax.__version__} reads {lo}..{hi}): {_first_line(e)}; "
            "install a jax close to the exporting one, or re-export the artifact with this jax"
        ) from e
    return exp


def load(path) -> Artifact:
    """Read an artifact file, checking its magic, format version and fingerprint."""
    source = str(path)
    data = read_bytes(path, "artifact")
    if not data.startswith(MAGIC):
        raise VjpsplitError(f"{source}: not a vjpsplit artifact (bad header); pass a file written by `vjpsplit export`")
    body = data[len(MAGIC):]
    try:
        top = msgpack.unpackb(
            body, raw=False, strict_map_key=True,
            max_bin_len=len(body), max_str_len=len(body), max_array_len=len(body), max_map_len=len(body),
            max_ext_len=0,
        )
    except Exception as e:
        raise VjpsplitError(f"{source}: the artifact is corrupt or truncated ({_first_line(e)}); copy or export it again") from e
    if not isinstance(top, dict) or not {"manifest", "fwd", "bwd"} <= set(top):
        raise VjpsplitError(f"{source}: the artifact is missing its manifest or modules; export it again")
    manifest = Manifest.from_json(top["manifest"], source)
    lo = jexport.minimum_supported_calling_convention_version
    hi = jexport.maximum_supported_calling_convention_version
    if not lo <= manifest.calling_convention_version <= hi:
        newer = manifest.calling_convention_version > hi
        raise VjpsplitError(
            f"{source}: exported by jax {manifest.jax_version} with calling convention "
            f"{manifest.calling_convention_version}; this jax {jax.__version__} runs {lo}..{hi}; "
            + ("upgrade jax on this host" if newer else f"re-export the artifact, or install a jax near {manifest.jax_version}")
        )
    fwd, bwd = top["fwd"], top["bwd"]
    if not isinstance(fwd, bytes) or not isinstance(bwd, bytes):
        raise VjpsplitError(f"{source}: the artifact's modules are malformed; export it again")
    if _fingerprint(manifest, fwd, bwd) != manifest.fingerprint:
        raise VjpsplitError(
            f"{source}: fingerprint mismatch: the artifact was modified after export; export it again"
        )
    art = Artifact(manifest, fwd, bwd, source=source)
    if tuple(art._fwd_exp.platforms) != manifest.platforms:
        raise VjpsplitError(f"{source}: the modules' platforms do not match the manifest; export it again")
    return art
