"""Artifacts: the forward and backward as ``jax.export`` modules in one self-contained file.

An artifact runs without the user's code: its manifest says every key, dtype and
(symbolic) shape, and its modules are serialized StableHLO for each platform.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import msgpack
import numpy as np
from jax import export as jexport

from ._version import __version__
from ._io import atomic_write, read_bytes
from .core import is_differentiable, positional_names, run_backward, trace_vjp, wrt_positions
from .dtypes import dtype_from_name, dtype_name
from .errors import VjpsplitError
from .policies import apply_policy, normalize_policy
from .prng import data_struct, from_data, impl_name, is_key, key_ndim, to_data
from .shapes import bind_dims, concrete_shape, dim_str, format_shape, to_struct
from .trees import decode_structure, encode_structure, flatten_with_keys, structure_keys

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
FORMAT_VERSION = 2
MAGIC = b"VJPSPLIT\x00"

DEFAULT_PLATFORMS = ("cpu", "cuda", "tpu")
_KNOWN_PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_DIM_FUNCS = {"mod", "floordiv", "max", "min", "non_negative"}


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
    prng_impl: str = ""         # typed PRNG key: the impl of its key data; "" for plain arrays

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
        return self.shape[:len(self.shape) - key_ndim(self.prng_impl)]

    def to_json(self, residual: bool = False) -> dict:
        d = {"key": self.key, "dtype": self.dtype, "shape": list(self.shape)}
        if residual:
            d["input_backed"] = self.input_backed
        if self.prng_impl:
            d["prng_impl"] = self.prng_impl
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
        return cls(str(d["key"]), str(d["dtype"]), shape, bool(d.get("input_backed", False)), impl)


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
    weights: tuple[str, ...] = ()     # zero-bubble split: arguments whose gradients bwd_weight computes
    intermediates: tuple[Leaf, ...] = ()  # what bwd_input hands to bwd_weight ("c/i" keys)
    fingerprint: str = ""

    def to_json(self) -> dict:
        """A JSON-able dict (msgpack-able too)."""
        d = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "residuals":
                v = [leaf.to_json(residual=True) for leaf in v]
            elif f.name in ("inputs", "outputs", "grads", "intermediates"):
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
                if f.name not in d and f.default is not dataclasses.MISSING:
                    continue
                val = d[f.name]
                if f.name in ("residuals", "inputs", "outputs", "grads", "intermediates"):
                    val = tuple(Leaf.from_json(x) for x in val)
                elif f.name in ("arg_names", "wrt", "platforms", "dim_vars", "weights"):
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


MODULES = ("fwd", "bwd", "bwd_input", "bwd_weight")


def _fingerprint(manifest: Manifest, modules: Mapping[str, bytes]) -> str:
    h = hashlib.sha256()
    body = manifest.to_json()
    body.pop("fingerprint")
    parts = [json.dumps(body, sort_keys=True).encode()] + [modules[k] for k in MODULES if k in modules]
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


def _leaves_json_safe(entries, what: str = "leaf", impls: Sequence[str] | None = None) -> tuple[Leaf, ...]:
    """Manifest leaves for ``(key, struct)`` pairs; typed keys become their key data.

    ``impls`` gives the PRNG impl of each entry whose struct is already key data.
    """
    out = []
    for i, (k, s) in enumerate(entries):
        impl = impls[i] if impls else ""
        if is_key(s):
            impl, s = impl_name(s), data_struct(s)
        try:
            dtype = dtype_name(s.dtype)
        except (VjpsplitError, TypeError) as e:
            raise VjpsplitError(f"{what} '{k}': {e}; pass arrays of a numeric, bool or PRNG key dtype") from e
        out.append(Leaf(k, dtype, tuple(dim_str(d) for d in s.shape), prng_impl=impl))
    return tuple(out)


def _spec_structs(name: str, spec) -> Any:
    """``spec`` with every leaf a ShapeDtypeStruct; a bad leaf is refused by its file key."""
    entries = flatten_with_keys(name, spec)
    leaves, treedef = jax.tree_util.tree_flatten(spec)
    structs = []
    for (key, _), leaf in zip(entries, leaves):
        try:
            structs.append(to_struct(leaf))
        except VjpsplitError as e:
            raise VjpsplitError(f"input '{key}': {e}") from e
    return jax.tree_util.tree_unflatten(treedef, structs)


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
    from .jaxprs import iter_eqns

    return [e.primitive.name for e in iter_eqns(jaxpr) if e.primitive.name in _CALLBACK_PRIMITIVES]


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
    weights: Sequence[str] | str | None = None,
) -> "Artifact":
    """Export ``fn``'s forward (emitting residuals) and backward (consuming them).

    ``specs`` are one pytree of ``jax.ShapeDtypeStruct`` (or arrays) per positional
    argument; symbolic dims (``jax.export.symbolic_shape``, one scope) make the
    artifact shape-polymorphic. ``platforms`` lists the targets lowered into the one
    artifact (default cpu, cuda, tpu; no accelerator is needed to lower for them).
    ``memory_budget`` (bytes or ``"64MiB"``; symbolic dims sized by ``at``) picks
    the policy that recomputes least among those whose stored residuals fit.
    ``weights`` (argument names) adds the zero-bubble split of the backward:
    ``bwd_input`` (gradients of the other arguments, on the critical path) and
    ``bwd_weight`` (the weight gradients, schedulable later).
    """
    if isinstance(platforms, str):
        platforms = tuple(p.strip() for p in platforms.split(",") if p.strip())
    try:
        platforms = tuple(platforms)
    except TypeError:
        raise VjpsplitError(f"platforms={platforms!r} is not a list of platform names; "
                            "pass e.g. 'cpu,cuda,tpu' or ['cpu']") from None
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
    structs = tuple(_spec_structs(n, s) for n, s in zip(names, specs))
    input_entries = [kv for n, s in zip(names, structs) for kv in flatten_with_keys(n, s)]
    inputs = _leaves_json_safe(input_entries, "input")
    # The modules take and give flat leaves (typed keys as key data): the user's
    # classes live only in this closure, never in the serialized artifact.
    flat_structs, in_tree = jax.tree_util.tree_flatten(structs)
    in_impls = [leaf.prng_impl for leaf in inputs]
    data_structs = [jax.ShapeDtypeStruct(data_struct(s).shape, data_struct(s).dtype) if is_key(s) else s
                    for s in flat_structs]
    dim_vars = _dim_vars(inputs)
    wrt_pos, single = wrt_positions(names, wrt, getattr(fn, "__qualname__", ""))
    if memory_budget is not None:
        from .economy import choose_policy

        policy, _ = choose_policy(fn, *structs, memory_budget=memory_budget, wrt=wrt_pos, has_aux=has_aux, at=at)
    policy = normalize_policy(policy)
    inner = apply_policy(fn, policy)
    _refuse_host_callbacks(fn, structs)

    captured: dict[str, Any] = {}

    def fwd_flat(*leaves):
        args = jax.tree_util.tree_unflatten(in_tree, [from_data(x, i) for x, i in zip(leaves, in_impls)])
        out, stored, aux, plan = trace_vjp(inner, tuple(args), wrt_pos, single, has_aux)
        out_leaves, aux_leaves = jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(aux)
        captured.update(plan=plan, out=out, aux=aux,
                        out_impls=[impl_name(x) if is_key(x) else "" for x in out_leaves],
                        aux_impls=[impl_name(x) if is_key(x) else "" for x in aux_leaves],
                        stored_impls=[impl_name(x) if is_key(x) else "" for x in stored])
        return (
            tuple(to_data(x) for x in out_leaves),
            tuple(to_data(x) for x in stored),
            tuple(to_data(x) for x in aux_leaves),
        )

    fwd_exp = _lower("forward", fwd_flat, platforms, data_structs)
    plan = captured["plan"]
    stored_impls = captured["stored_impls"]
    n_out, n_stored = len(plan.out_avals), plan.n_stored
    stored_avals = list(fwd_exp.out_avals[n_out:n_out + n_stored])
    aux_avals = list(fwd_exp.out_avals[n_out + n_stored:])
    input_backed = [data_structs[k] for k in plan.input_backed]
    input_backed_impls = [in_impls[k] for k in plan.input_backed]
    ct_avals = [jax.ShapeDtypeStruct(plan.out_avals[i].shape, plan.out_avals[i].dtype) for i in plan.out_diff]
    carrier = None
    if dim_vars:
        scope = next(d for s in flat_structs for d in s.shape if not isinstance(d, int)).scope
        carrier = jax.ShapeDtypeStruct((0, *jexport.symbolic_shape(",".join(dim_vars), scope=scope)), jnp.bool_)

    def bwd_flat(stored, inputs_, cts, carrier_):
        # carrier_ is a zero-size array whose dims are the symbolic dims: it makes
        # them solvable even when no other backward input mentions them.
        del carrier_
        stored = [from_data(x, i) for x, i in zip(stored, stored_impls)]
        inputs_ = [from_data(x, i) for x, i in zip(inputs_, input_backed_impls)]
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
        outputs=_leaves_json_safe(list(zip(out_keys, out_structs)) + list(zip(aux_keys, aux_avals)), "output",
                                  captured["out_impls"] + captured["aux_impls"]),
        residuals=_leaves_json_safe([(f"r/{i}", a) for i, a in enumerate(stored_avals)], "residual", stored_impls)
        + tuple(dataclasses.replace(inputs[k], key=f"in/{input_keys[k]}", input_backed=True) for k in plan.input_backed),
        grads=grads,
        structure={
            "args": {n: encode_structure(s, n) for n, s in zip(names, structs)},
            "out": encode_structure(captured["out"], "out"),
            "aux": encode_structure(captured["aux"], "aux"),
        },
    )
    exps = {"fwd": fwd_exp, "bwd": bwd_exp}
    if weights:
        weight_names = (weights,) if isinstance(weights, str) else tuple(weights)
        bad = [w for w in weight_names if w not in manifest.wrt]
        if bad:
            raise VjpsplitError(f"weights {', '.join(bad)} are not differentiated arguments ({', '.join(manifest.wrt)})")
        exps["bwd_input"], exps["bwd_weight"], inter = _export_split_backward(
            plan, manifest, weight_names, bwd_flat, stored_avals, input_backed, ct_avals, carrier, platforms)
        manifest = dataclasses.replace(manifest, weights=weight_names, intermediates=inter)
    modules = {k: bytes(e.serialize()) for k, e in exps.items()}
    manifest = dataclasses.replace(manifest, fingerprint=_fingerprint(manifest, modules))
    return Artifact(manifest, modules, exps)


def _export_split_backward(plan, manifest, weight_names, bwd_flat, stored_avals, input_backed, ct_avals, carrier,
                           platforms):
    """Lower the zero-bubble halves of the backward: (bwd_input, bwd_weight, intermediate leaves)."""
    from jax.extend import core as jcore

    from .zerobubble import partition

    closed = jax.make_jaxpr(lambda st, ib, ct: bwd_flat(st, ib, ct, None))(stored_avals, input_backed, ct_avals)
    weight_outs = [i for i, g in enumerate(manifest.grads) if g.key.split("/", 1)[0] in weight_names]
    n_st, n_ib = len(stored_avals), len(input_backed)
    ct_pos = list(range(n_st + n_ib, n_st + n_ib + len(ct_avals)))
    part = partition(closed, weight_outs, ct_pos)
    n_in_grads = len(manifest.grads) - len(weight_outs)
    input_fn, weight_fn = jcore.jaxpr_as_fun(part.input_part), jcore.jaxpr_as_fun(part.weight_part)

    def bwd_input(stored, inputs_, cts, carrier_):
        outs = input_fn(*stored, *inputs_, *cts)
        return tuple(outs[:n_in_grads]), tuple(outs[n_in_grads:])

    def bwd_weight(stored, inputs_, inter, carrier_):
        return tuple(weight_fn(*stored, *inputs_, *inter))

    in_exp = _lower("input part of the backward", bwd_input, platforms, (stored_avals, input_backed, ct_avals, carrier))
    inter_avals = list(in_exp.out_avals[n_in_grads:])
    w_exp = _lower("weight part of the backward", bwd_weight, platforms, (stored_avals, input_backed, inter_avals, carrier))
    return in_exp, w_exp, _leaves_json_safe([(f"c/{i}", a) for i, a in enumerate(inter_avals)])


class ArtifactResiduals:
    """Residuals of an artifact's forward: stored arrays, input references and dim sizes.

    ``stored`` maps ``r/i`` keys to arrays; ``inputs`` maps input keys to the very
    arrays the forward was given (never copies); ``dims`` binds the symbolic dims.
    A pytree, so it can be passed through ``jax.device_put`` or ``jax.jit``.
    """

    __slots__ = ("stored", "inputs", "dims", "fingerprint", "arg_names", "arg_trees", "residuals_id", "inputs_source")

    def __init__(self, stored: Mapping[str, Any], inputs: Mapping[str, Any], dims: Mapping[str, int],
                 fingerprint: str, arg_names: Sequence[str] = (), arg_trees: "ArgTrees" = (),
                 residuals_id: str = ""):
        self.stored = dict(stored)
        self.inputs = dict(inputs)
        self.dims = dict(dims)
        self.fingerprint = fingerprint
        self.arg_names = tuple(arg_names)
        # The structure of the arguments fwd was called with, so bwd can give
        # gradients in the caller's own pytree types; () when not known (files).
        self.arg_trees = tuple(arg_trees)
        # Names one forward run, so the weight part can refuse another run's
        # intermediates; "" for files written before residuals had one.
        self.residuals_id = residuals_id
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
               (tuple(r.stored), tuple(r.inputs), tuple(sorted(r.dims.items())), r.fingerprint, r.arg_names,
                r.arg_trees, r.residuals_id)),
    lambda aux, ch: ArtifactResiduals(dict(zip(aux[0], ch[0])), dict(zip(aux[1], ch[1])), dict(aux[2]), aux[3], aux[4],
                                      aux[5], aux[6]),
)

# Per argument: (name, treedef, file key of each leaf in the treedef's leaf order).
ArgTrees = Sequence[tuple[str, Any, tuple[str, ...]]]


def flatten_args(manifest: "Manifest", args: Sequence, source: str = "args") -> tuple[dict[str, Any], tuple]:
    """The caller's argument pytrees as ``{file key: array}`` plus their structure.

    Typed PRNG keys become their key data, after checking the impl against the
    manifest; every refusal names the leaf by its key.
    """
    specs = {leaf.key: leaf for leaf in manifest.inputs}
    flat: dict[str, Any] = {}
    trees = []
    for name, arg in zip(manifest.arg_names, args):
        entries = flatten_with_keys(name, arg)
        trees.append((name, jax.tree_util.tree_structure(arg), tuple(k for k, _ in entries)))
        for key, value in entries:
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


class Intermediates:
    """What the input part of a split backward hands to the weight part (``c/i`` arrays)."""

    __slots__ = ("arrays", "dims", "fingerprint", "residuals_id")

    def __init__(self, arrays: Mapping[str, Any], dims: Mapping[str, int], fingerprint: str, residuals_id: str = ""):
        self.arrays = dict(arrays)
        self.dims = dict(dims)
        self.fingerprint = fingerprint
        self.residuals_id = residuals_id  # the forward run whose residuals the input part read; "" unknown

    def __repr__(self) -> str:
        return f"Intermediates({len(self.arrays)} arrays, dims={self.dims}, fingerprint={self.fingerprint[:12]})"


jax.tree_util.register_pytree_node(
    Intermediates,
    lambda r: (tuple(r.arrays.values()), (tuple(r.arrays), tuple(sorted(r.dims.items())), r.fingerprint,
                                          r.residuals_id)),
    lambda aux, ch: Intermediates(dict(zip(aux[0], ch)), dict(aux[1]), aux[2], aux[3]),
)


def _host_memory() -> int:
    """Physical memory in bytes (2**63 where the platform does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 2**63


def _current_platform() -> str:
    d = jax.devices()[0]
    if d.platform == "gpu":
        return "rocm" if "rocm" in getattr(d.client, "platform_version", "").lower() else "cuda"
    return d.platform


class Artifact:
    """A loaded or freshly exported artifact: manifest plus forward and backward modules."""

    def __init__(self, manifest: Manifest, modules: Mapping[str, bytes], exps: Mapping[str, Any] | None = None,
                 source: str = "artifact"):
        self.manifest = manifest
        self.modules = dict(modules)
        self.source = source
        exps = dict(exps or {})
        for k in self.modules:
            if k not in exps:
                exps[k] = _deserialize(self.modules[k], source, manifest, k)
        self._exps = exps
        # One jit per module: jax caches the compiled executable per input signature.
        self._calls = {k: jax.jit(e.call) for k, e in exps.items()}

    def __repr__(self) -> str:
        m = self.manifest
        return f"Artifact({m.function}, args={list(m.arg_names)}, platforms={list(m.platforms)}, fingerprint={m.fingerprint[:12]})"

    # -- file ---------------------------------------------------------------
    def to_bytes(self) -> bytes:
        """The artifact file's bytes."""
        return MAGIC + msgpack.packb({"manifest": self.manifest.to_json(), **self.modules}, use_bin_type=True)

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
        # Format 1 lowered the forward over one pytree per argument; 2 over the flat leaves.
        call_args = arrays if m.format_version >= 2 else self._args_tree(arrays)
        outs, stored, aux = self._run("fwd", call_args, f"{source}: the forward refused these inputs")
        out_values = list(outs) + list(aux)
        outputs = {leaf.key: v for leaf, v in zip(m.outputs, out_values)}
        by_key = dict(zip((leaf.key for leaf in m.inputs), arrays))
        res = ArtifactResiduals(
            {leaf.key: v for leaf, v in zip(m.stored_residuals, stored)},
            {k: by_key[k] for k in m.input_backed_keys},
            dims,
            m.fingerprint,
            m.arg_names,
            residuals_id=uuid.uuid4().hex,
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
        self._refuse_huge_dims(source, dims)
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

    def _refuse_huge_dims(self, source: str, dims: Mapping[str, int]) -> None:
        """Dim sizes read from a file bound what the backward allocates: refuse what no host could hold.

        A dim that no stored residual mentions is checked against nothing else,
        so an edited file could otherwise ask for any amount of memory.
        """
        m = self.manifest
        total = 0
        for leaf in (*m.grads, *m.intermediates):
            shape = concrete_shape(leaf.shape, dims)
            if shape is not None:
                total += int(np.prod(shape, dtype=object)) * dtype_from_name(leaf.dtype).itemsize
        limit = _host_memory()
        if total > limit:
            bound = ", ".join(f"{k}={v}" for k, v in dims.items())
            raise VjpsplitError(
                f"{source}: the recorded dims ({bound}) would make the backward's results {total / 2**30:.1f} GiB, "
                f"more than this host's {limit / 2**30:.1f} GiB of memory; the residuals metadata is corrupt, "
                "rerun the forward"
            )

    def run_bwd_arrays(self, res: ArtifactResiduals, cotangents: Mapping[str, Any] | None = None,
                       source: str = "residuals", ct_source: str = "cotangents") -> dict:
        """Backward from residuals and flat-keyed cotangents (None: 1 for a scalar output): ``{key: grad}``."""
        self._check_runnable()
        stored, inputs, dims = self.check_residuals(res, source)
        cts = self._cotangents(cotangents, dims, ct_source)
        grads = self._run("bwd", (stored, inputs, cts, self._carrier(dims)),
                          f"{source}: the backward refused these residuals")
        return {leaf.key: g for leaf, g in zip(self.manifest.grads, grads)}

    def _run(self, module: str, args, refused: str):
        """Call one module; jax's own shape/dtype refusals become one-line errors prefixed ``refused``."""
        try:
            return self._calls[module](*args)
        except (ValueError, TypeError) as e:
            raise VjpsplitError(f"{refused}: {_first_line(e)}") from e

    def _carrier(self, dims: Mapping[str, int]):
        m = self.manifest
        return np.zeros((0, *(dims[n] for n in m.dim_vars)), np.bool_) if m.dim_vars else None

    def _cotangents(self, cotangents, dims, ct_source: str) -> list:
        m = self.manifest
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
        return cts

    # -- zero-bubble split backward ----------------------------------------------
    def _require_split(self):
        if not self.manifest.weights:
            raise VjpsplitError(
                f"{self.source}: the artifact has no split backward; export it with --weights NAMES "
                "(weights=...) to get bwd_input and bwd_weight"
            )

    def run_bwd_input_arrays(self, res: ArtifactResiduals, cotangents: Mapping[str, Any] | None = None,
                             source: str = "residuals", ct_source: str = "cotangents") -> tuple[dict, "Intermediates"]:
        """Input part (B): gradients of the non-weight arguments, and what the weight part needs."""
        self._check_runnable()
        self._require_split()
        m = self.manifest
        stored, inputs, dims = self.check_residuals(res, source)
        cts = self._cotangents(cotangents, dims, ct_source)
        grads, inter = self._run("bwd_input", (stored, inputs, cts, self._carrier(dims)),
                                 f"{source}: the backward refused these residuals")
        keys = [g.key for g in m.grads_of(m.non_weight_wrt)]
        return dict(zip(keys, grads)), Intermediates({leaf.key: v for leaf, v in zip(m.intermediates, inter)},
                                                     dims, m.fingerprint, res.residuals_id)

    def run_bwd_weight_arrays(self, res: ArtifactResiduals, inter: "Intermediates", source: str = "residuals",
                              inter_source: str = "intermediates") -> dict:
        """Weight part (W): the weight gradients, from residuals and the input part's intermediates."""
        self._check_runnable()
        self._require_split()
        m = self.manifest
        stored, inputs, dims = self.check_residuals(res, source)
        if not isinstance(inter, Intermediates) or inter.fingerprint != m.fingerprint:
            raise VjpsplitError(
                f"{inter_source}: these intermediates were not written by this artifact's input part; "
                "run run-bwd --part input of this artifact first"
            )
        if inter.dims != dims or (inter.residuals_id and res.residuals_id and inter.residuals_id != res.residuals_id):
            raise VjpsplitError(f"{inter_source}: the intermediates were made from other residuals than {source} "
                                "(another forward run or microbatch); pass the pair from one microbatch")
        check_keys(inter_source, "intermediate", [leaf.key for leaf in m.intermediates], inter.arrays)
        values = [_check_array(inter_source, "intermediate", leaf, inter.arrays[leaf.key], dict(dims))
                  for leaf in m.intermediates]
        grads = self._run("bwd_weight", (stored, inputs, values, self._carrier(dims)),
                          f"{inter_source}: the weight backward refused these intermediates")
        return dict(zip([g.key for g in m.grads_of(m.weights)], grads))

    def bwd_input(self, res: ArtifactResiduals, ct=None) -> tuple[dict, "Intermediates"]:
        """Input part of the backward: ``({arg name: grad} for non-weight args, intermediates)``."""
        cts = None if ct is None else dict(flatten_with_keys("out", ct))
        grads, inter = self.run_bwd_input_arrays(res, cts, ct_source="cotangent")
        return self._per_arg(grads, self.manifest.non_weight_wrt, res.dims, res.arg_trees), inter

    def bwd_weight(self, res: ArtifactResiduals, inter: "Intermediates") -> dict:
        """Weight part of the backward: ``{weight arg name: grad}``."""
        grads = self.run_bwd_weight_arrays(res, inter)
        return self._per_arg(grads, self.manifest.weights, res.dims, res.arg_trees)

    def _per_arg(self, grads: Mapping[str, Any], names: Sequence[str], dims, arg_trees: ArgTrees = ()) -> dict:
        """Flat gradient keys -> per-argument pytrees (float0 zeros for integer leaves).

        With ``arg_trees`` (from ``fwd``'s arguments) each gradient has the caller's
        own pytree type; otherwise the manifest's structure (user classes as dicts).
        """
        m = self.manifest
        spec = {leaf.key: leaf for leaf in m.inputs}
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
                keys = structure_keys(name, m.structure["args"][name])
                out[name] = decode_structure(m.structure["args"][name], iter(leaf_grad(k) for k in keys))
        return out

    def _wrap_keys(self, leaves: Sequence[Leaf], values: Sequence) -> list:
        """Typed PRNG keys back from their key data, where the manifest says so."""
        return [from_data(jnp.asarray(v), leaf.prng_impl) if leaf.prng_impl else v for leaf, v in zip(leaves, values)]

    def fwd(self, *args):
        """Forward on pytree arguments: ``(out, res)``, or ``(out, res, aux)`` with has_aux."""
        m = self.manifest
        if len(args) != len(m.arg_names):
            raise VjpsplitError(f"{self.source}: fwd takes {len(m.arg_names)} arguments ({', '.join(m.arg_names)}), got {len(args)}")
        flat, trees = flatten_args(m, args)
        outputs, res = self.run_fwd_arrays(flat, source="args")
        res.arg_trees = trees
        values = self._wrap_keys(m.outputs, [outputs[leaf.key] for leaf in m.outputs])
        by_key = dict(zip((leaf.key for leaf in m.outputs), values))
        out = decode_structure(m.structure["out"], iter(by_key[k] for k in m.out_keys))
        if m.has_aux:
            aux = decode_structure(m.structure["aux"], iter(v for k, v in by_key.items() if k not in m.out_keys))
            return out, res, aux
        return out, res

    def bwd(self, res: ArtifactResiduals, ct=None):
        """Backward from residuals: gradients shaped like the ``wrt`` arguments (float0 for ints)."""
        m = self.manifest
        cts = None if ct is None else dict(flatten_with_keys("out", ct))
        grads = self.run_bwd_arrays(res, cts, source="residuals", ct_source="cotangent")
        per_arg = self._per_arg(grads, m.wrt, res.dims, res.arg_trees)
        return per_arg[m.wrt[0]] if m.single_grad else tuple(per_arg[n] for n in m.wrt)


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
    if exp.nr_devices == 0:
        # jax >= 0.9.1 writes the device count only in the 32-bit field added in 0.8;
        # jax <= 0.7 reads the old 16-bit one and gets 0, which Exported.call refuses.
        # vjpsplit always exports for one device, and 0 is never a real count.
        exp = dataclasses.replace(exp, nr_devices=1)
    return exp


def load(path) -> Artifact:
    """Read an artifact file, checking its magic, format version and fingerprint."""
    return loads(read_bytes(path, "artifact"), source=str(path))


def loads(data: bytes, source: str = "artifact") -> Artifact:
    """An artifact from its file's bytes (``Artifact.to_bytes``), checked like ``load``."""
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
    modules = {k: top[k] for k in MODULES if k in top}
    if not all(isinstance(v, bytes) for v in modules.values()) or bool(manifest.weights) != ("bwd_input" in modules):
        raise VjpsplitError(f"{source}: the artifact's modules are malformed; export it again")
    if _fingerprint(manifest, modules) != manifest.fingerprint:
        raise VjpsplitError(
            f"{source}: fingerprint mismatch: the artifact was modified after export; export it again"
        )
    art = Artifact(manifest, modules, source=source)
    if tuple(art._exps["fwd"].platforms) != manifest.platforms:
        raise VjpsplitError(f"{source}: the modules' platforms do not match the manifest; export it again")
    return art
