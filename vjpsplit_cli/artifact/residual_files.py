"""Residual and intermediates files: the forward's residuals on disk, tied to the artifact (and inputs) that made them."""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

import jax
import numpy as np

from ..errors import VjpsplitError
from ..files import load_arrays, save_arrays
from ..files.dtypes import dtype_from_name, dtype_name
from ..files.prng import data_struct, from_data, impl_name, is_key, to_data
from ..files.shapes import MAX_DIM, format_shape
from ..safeio import checksum
from ..tracing.residuals import Intermediates, Residuals, SplitResiduals
from ..tracing.vjp import plan_for_token
from .manifest import as_computed, flatten_args
from .sharding import format_spec, spec_from_json, spec_of

KIND_ARTIFACT = "vjpsplit-residuals"
KIND_SPLIT = "vjpsplit-split-residuals"
KIND_INTERMEDIATES = "vjpsplit-intermediates"


def _crc32(a) -> int:
    a = np.ascontiguousarray(a) if np.ndim(a) else np.asarray(a)
    return checksum.crc32(memoryview(a.reshape(-1).view(np.uint8)) if a.size else b"")


def _save_checked(path, arrays: dict, meta: dict, fsync: bool = False) -> None:
    """Save with a CRC-32 per array: residuals travel between hosts, and a flipped bit in
    transit must fail loudly, not give quietly wrong gradients. Both formats keep one
    (zip's own per ``.npz`` member, a table beside the arrays in ``.msgpack``). No fsync
    unless asked (``fsync=True``, ``--fsync``, ``VJPSPLIT_FSYNC=1``): these files are
    transient, the rename is atomic."""
    save_arrays(path, arrays, meta, fsync=fsync)


def _load_checked(path, verify: bool):
    """``load_arrays``, with every array's CRC-32 checked when ``verify``."""
    arrays, meta = load_arrays(path, verify=verify)
    if verify and "crc32" in meta:  # a .msgpack of the old layout kept its CRCs in meta
        _verify(path, arrays, meta)
    return arrays, meta


def _verify(path, arrays: Mapping[str, Any], meta: Mapping) -> None:
    sums = meta.get("crc32")
    if not isinstance(sums, dict) or set(sums) != set(arrays):
        raise VjpsplitError(
            f"{path}: the CRC-32 list does not match the file's arrays; the file is corrupt, re-create it"
        )
    for k, v in arrays.items():
        if _crc32(v) != sums[k]:
            raise VjpsplitError(
                f"{path}: array {k!r} fails its CRC-32 check (its bytes changed after it was written); "
                "the file is corrupt, re-create it"
            )


def _is_str_list(v) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _is_dims(v) -> bool:
    return isinstance(v, dict) and all(
        isinstance(k, str) and isinstance(x, int) and not isinstance(x, bool) and 1 <= x <= MAX_DIM
        for k, x in v.items()
    )


def _is_crcs(v) -> bool:
    return isinstance(v, dict) and all(
        isinstance(k, str) and isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**32 for k, x in v.items()
    )


def _is_shapes(v) -> bool:
    return isinstance(v, dict) and all(
        isinstance(k, str)
        and isinstance(x, list)
        and all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_DIM for d in x)
        for k, x in v.items()
    )


def _is_names(v) -> bool:
    return isinstance(v, dict) and all(isinstance(k, str) and isinstance(x, str) for k, x in v.items())


def _is_shardings(v) -> bool:
    if not isinstance(v, dict):
        return False
    try:
        for k, spec in v.items():
            if not isinstance(k, str):
                return False
            spec_from_json(spec)
    except ValueError:
        return False
    return True


# What each kind of file's metadata holds: field -> (check, required). Files are
# data from elsewhere: every field is checked before it is used.
_SCHEMA = {
    KIND_ARTIFACT: {
        "fingerprint": (lambda v: isinstance(v, str), True),
        "arg_names": (_is_str_list, True),
        "dims": (_is_dims, True),
        "needs_inputs": (_is_str_list, False),
        "self_contained": (lambda v: isinstance(v, bool), False),
        "residuals_id": (lambda v: isinstance(v, str), False),
        "input_crc32": (_is_crcs, False),
        "input_shapes": (_is_shapes, False),
        "input_dtypes": (_is_names, False),
        "shardings": (_is_shardings, False),
    },
    KIND_SPLIT: {
        "token": (lambda v: isinstance(v, str), True),
        "pid": (lambda v: isinstance(v, int), False),
        "needs_inputs": (_is_str_list, False),
        "self_contained": (lambda v: isinstance(v, bool), False),
        "input_crc32": (_is_crcs, False),
        "input_shapes": (_is_shapes, False),
        "input_dtypes": (_is_names, False),
    },
    KIND_INTERMEDIATES: {
        "fingerprint": (lambda v: isinstance(v, str), True),
        "dims": (_is_dims, True),
        "residuals_id": (lambda v: isinstance(v, str), False),
        "arg_names": (_is_str_list, False),
        "needs_inputs": (_is_str_list, False),
        "input_crc32": (_is_crcs, False),
        "input_dtypes": (_is_names, False),
        "shardings": (_is_shardings, False),
    },
}


def _check_meta(path, meta: Mapping, kind: str, fix: str) -> None:
    """Refuse metadata that does not match ``kind``'s schema, naming the field."""
    for name, (ok, required) in _SCHEMA[kind].items():
        if name not in meta:
            if required:
                raise VjpsplitError(f"{path}: malformed metadata: '{name}' is missing; {fix}")
        elif not ok(meta[name]):
            raise VjpsplitError(f"{path}: malformed metadata: '{name}' has the wrong type or range; {fix}")


def input_crc32(a) -> int:
    """CRC-32 (zlib's polynomial, :mod:`.checksum`) of an array's bytes: binds a residuals file to its inputs.

    Not a defence against forgery; it catches the easy slip of pairing one
    microbatch's residuals with another's inputs, at about a memory copy's cost.
    """
    return _crc32(np.asarray(a))


def save_intermediates(
    path: str | os.PathLike,
    inter: Intermediates,
    *,
    self_contained: bool = False,
    arg_names: Sequence[str] = (),
    fsync: bool = False,
) -> None:
    """Write a split backward's intermediates (``Artifact.bwd_input``'s second result).

    The file holds what the weight part needs and nothing more: the ``c/i``
    arrays and the stored residuals it reads. Input arrays it reads are left out
    (their CRC-32 recorded, as in residual files) unless ``self_contained``;
    ``load_intermediates(path, inputs=...)`` supplies them. ``fsync=True`` (or
    ``VJPSPLIT_FSYNC=1``) flushes the file to disk before returning.
    """
    if not isinstance(inter, Intermediates):
        raise VjpsplitError(f"{path}: save_intermediates takes bwd_input's intermediates, got {type(inter).__name__}")
    arrays = {
        **{k: np.asarray(v) for k, v in inter.arrays.items()},
        **{k: np.asarray(v) for k, v in inter.stored.items()},
    }
    if self_contained:
        arrays.update({f"in/{k}": np.asarray(v) for k, v in inter.inputs.items()})
    meta = {
        "kind": KIND_INTERMEDIATES,
        "fingerprint": inter.fingerprint,
        "dims": dict(inter.dims),
        "residuals_id": inter.residuals_id,
        "arg_names": list(arg_names),
        "needs_inputs": [] if self_contained else sorted(inter.inputs),
        "input_crc32": {} if self_contained else {k: input_crc32(v) for k, v in inter.inputs.items()},
        "input_dtypes": {} if self_contained else {k: dtype_name(np.asarray(v).dtype) for k, v in inter.inputs.items()},
        **_shardings_meta({**inter.arrays, **inter.stored}),
    }
    _save_checked(path, arrays, meta, fsync)


def load_intermediates(
    path: str | os.PathLike, inputs=None, *, artifact=None, inputs_source: str | None = None, verify: bool = True
) -> Intermediates:
    """Read intermediates written by ``save_intermediates`` (or ``run-bwd --part input``).

    ``inputs`` (a flat ``{key: array}`` mapping, or the forward's arguments) supplies
    the input arrays the file left out. ``verify`` checks each array's CRC-32, that
    those inputs are the ones the forward ran on, and, in ``Artifact.bwd_weight``,
    that the intermediates come from the same forward run as any residuals given
    (on by default; see ``load_residuals``).
    """
    arrays, meta = _load_checked(path, verify)
    if meta.get("kind") != KIND_INTERMEDIATES:
        raise VjpsplitError(f"{path}: not an intermediates file; pass the --intermediates file of run-bwd --part input")
    _check_meta(path, meta, KIND_INTERMEDIATES, "rerun run-bwd --part input")
    fingerprint, dims = meta["fingerprint"], meta["dims"]
    _refuse_other_artifact(path, "intermediates", fingerprint, artifact, "run this artifact's input part first", meta)
    computed = {k: v for k, v in arrays.items() if k.startswith("c/")}
    stored = {k: v for k, v in arrays.items() if k.startswith("r/")}
    given = {k[3:]: v for k, v in arrays.items() if k.startswith("in/")}
    needs = meta.get("needs_inputs", [])
    if needs:
        flat, _ = _left_out_inputs(
            path,
            "intermediates",
            "load_intermediates(path, inputs=...)",
            needs,
            inputs,
            meta.get("arg_names", []),
            artifact,
        )
        given.update({k: flat[k] for k in needs})
        if verify:
            given_needs = {k: given[k] for k in needs}
            _check_bound_inputs(path, meta, given_needs, inputs_source or "inputs", _computed_dtypes(meta, artifact))
    return Intermediates(computed, dims, fingerprint, meta.get("residuals_id", "") if verify else "", stored, given)


def _refuse_other_artifact(path, what: str, fingerprint, artifact, fix: str, meta: Mapping | None = None) -> None:
    """A file tied to one artifact must not feed another: say so before anything else.

    Arrays saved from a sharded run record their shardings; one that differs from
    what the artifact expects is named, whether or not the fingerprints match.
    """
    if artifact is None:
        return
    differs = _sharding_difference(meta or {}, artifact.manifest)
    if fingerprint != artifact.manifest.fingerprint:
        raise VjpsplitError(
            f"{path}: these {what} were written by another artifact (fingerprint {str(fingerprint)[:12]}, "
            f"{artifact.source} is {artifact.manifest.fingerprint[:12]}{'; ' + differs if differs else ''}); {fix}"
        )
    if differs:
        raise VjpsplitError(f"{path}: these {what} were saved from another sharding ({differs}); {fix}")


def _shardings_meta(arrays: Mapping[str, Any]) -> dict:
    """``{"shardings": {key: spec}}`` for the arrays laid out over several devices; ``{}`` when none is."""
    out = {k: list(spec) for k, v in arrays.items() if (spec := spec_of(v)) is not None}
    return (
        {"shardings": {k: [list(e) if isinstance(e, tuple) else e for e in sp] for k, sp in out.items()}} if out else {}
    )


def _sharding_difference(meta: Mapping, manifest) -> str:
    """The first array whose recorded sharding is not the manifest's, described; "" when all agree.

    Files from one-device runs record none: nothing to compare, they are placed when the backward runs.
    """
    recorded = meta.get("shardings")
    if not isinstance(recorded, dict):
        return ""
    leaves = {leaf.key: leaf for leaf in (*manifest.residuals, *manifest.intermediates) if not leaf.input_backed}
    for key, spec in recorded.items():
        leaf = leaves.get(key)
        want = (leaf.sharding or ()) if leaf is not None and manifest.sharded else ()
        have = spec_from_json(spec)
        if have != want:
            return f"'{key}' was saved with sharding {format_spec(have)}, the artifact expects {format_spec(want)}"
    return ""


def save_residuals(path: str | os.PathLike, res, *, self_contained: bool = False, fsync: bool = False) -> None:
    """Write residuals (from ``Artifact.fwd`` or ``split``'s ``fwd``) to ``.npz``/``.msgpack``.

    Input-backed residuals are left out unless ``self_contained``: the file records
    which input keys it needs, and ``load_residuals(path, inputs=...)`` supplies them.
    ``fsync=True`` (or ``VJPSPLIT_FSYNC=1``) flushes the file to disk before returning,
    so it survives a power loss; by default it is not (residuals are transient).
    """
    if not isinstance(res, Residuals):
        raise VjpsplitError(f"{path}: save_residuals takes residuals from a fwd, got {type(res).__name__}")
    if not isinstance(res, SplitResiduals):  # an artifact's
        arrays: dict[str, Any] = {k: np.asarray(v) for k, v in res.stored.items()}
        if self_contained:
            arrays.update({f"in/{k}": np.asarray(v) for k, v in res.inputs.items()})
        meta = {
            "kind": KIND_ARTIFACT,
            "fingerprint": res.fingerprint,
            "arg_names": list(res.arg_names),
            "dims": dict(res.dims),
            "needs_inputs": [] if self_contained else sorted(res.inputs),
            "self_contained": bool(self_contained),
            "residuals_id": res.residuals_id,
            **_binding(res),
            **_shardings_meta(res.stored),
        }
    else:  # split's: keys r/i and flat argument positions
        arrays = {k: np.asarray(to_data(v)) for k, v in res.stored.items()}
        if self_contained:
            arrays.update({f"in/{k}": np.asarray(to_data(v)) for k, v in res.inputs.items()})
        meta = {
            "kind": KIND_SPLIT,
            "token": res.plan.token,
            "pid": os.getpid(),
            "needs_inputs": [] if self_contained else [str(k) for k in res.plan.input_backed],
            "self_contained": bool(self_contained),
            **_binding(res),
        }
    _save_checked(path, arrays, meta, fsync)


def _binding(res: Residuals) -> dict:
    """The metadata that binds a residuals file to every input its forward ran on: shapes and CRC-32s."""
    bound = {k: np.asarray(to_data(v)) for k, v in (res.bound_inputs or res.inputs).items()}
    return {
        "input_crc32": {k: input_crc32(a) for k, a in bound.items()},
        "input_shapes": {k: [int(d) for d in a.shape] for k, a in bound.items()},
        "input_dtypes": {k: dtype_name(a.dtype) for k, a in bound.items()},
    }


def _computed_dtypes(meta: Mapping, artifact) -> dict:
    """The dtype the forward computed on, per input key: the artifact's, else the one the file records."""
    if artifact is not None:
        return {leaf.key: dtype_from_name(leaf.dtype) for leaf in artifact.manifest.inputs if not leaf.prng_impl}
    out = {}
    for k, name in (meta.get("input_dtypes") or {}).items():
        try:
            out[k] = dtype_from_name(name)
        except VjpsplitError:
            pass  # unknown here: the value is compared as given
    return out


def load_residuals(
    path: str | os.PathLike, inputs=None, *, artifact=None, inputs_source: str | None = None, verify: bool = True
):
    """Read a residuals file; ``inputs`` supplies the input-backed residuals it left out.

    ``inputs`` is the forward's arguments tuple, or a flat ``{key: array}`` mapping
    (an inputs file's content; ``inputs_source`` names it in messages). With
    ``artifact``, residuals written by another artifact are refused here, before
    anything else is checked. ``verify`` (default on) checks each array's CRC-32,
    so a file damaged in transit fails here instead of giving wrong gradients, and
    checks that the inputs supplied for left-out residuals are the very ones the
    forward ran on (their CRC-32 is in the file), naming the first that differs.
    """
    arrays, meta = _load_checked(path, verify)
    kind = meta.get("kind")
    if kind == KIND_ARTIFACT:
        _refuse_other_artifact(
            path,
            "residuals",
            meta.get("fingerprint"),
            artifact,
            "run this artifact's forward to make matching residuals",
            meta,
        )
    if kind in (KIND_ARTIFACT, KIND_SPLIT):
        _check_meta(path, meta, kind, "rerun the forward")
    needs = meta.get("needs_inputs", [])
    if kind == KIND_ARTIFACT:
        res, flat = _load_artifact_residuals(path, arrays, meta, needs, inputs, artifact)
        res = res.replace(inputs_source=(inputs_source or "inputs") if needs else str(path), source=str(path))
        if verify:
            _check_bound_inputs(path, meta, flat, inputs_source or "inputs", _computed_dtypes(meta, artifact))
        return res
    if kind == KIND_SPLIT:
        res = _load_split_residuals(path, arrays, meta, needs, inputs)
        if verify and inputs is not None:
            flat = jax.tree_util.tree_leaves(inputs)
            _check_bound_inputs(path, meta, {str(i): v for i, v in enumerate(flat)}, inputs_source or "inputs")
        return res
    raise VjpsplitError(
        f"{path}: not a residuals file (no vjpsplit residuals metadata); pass the --residuals file written by run-fwd"
    )


def _check_bound_inputs(path, meta: Mapping, given: Mapping[str, Any], source: str, dtypes=None) -> None:
    """Refuse inputs whose dims or content differ from those the forward ran on, read by the backward or not.

    A Python scalar is compared as the forward computed on it (``dtypes``: its dtype
    per key, the artifact's or the file's). Files written before this rule record
    CRC-32s of the inputs they left out only, and no shapes.
    """
    sums = meta.get("input_crc32") or {}
    shapes = meta.get("input_shapes") or {}
    dtypes = dtypes or {}
    for key, value in given.items():
        if key in dtypes:
            value = as_computed(value, dtypes[key])
        value = np.asarray(to_data(value)) if key in sums or key in shapes else value
        if key in shapes and list(value.shape) != shapes[key]:
            raise VjpsplitError(
                f"{source}: input '{key}' is {format_shape(value.dtype, value.shape)}, but the forward that wrote "
                f"{path} ran on {format_shape(value.dtype, shapes[key])}; pass the inputs of the same microbatch, "
                "or --no-verify to skip this check"
            )
        if key in sums and input_crc32(value) != sums[key]:
            raise VjpsplitError(
                f"{source}: input '{key}' differs from the one the forward that wrote {path} ran on "
                "(CRC-32 mismatch); pass the inputs of the same microbatch, or --no-verify to skip this check"
            )


def _load_artifact_residuals(path, arrays, meta, needs, inputs, artifact) -> tuple[Residuals, Mapping[str, Any]]:
    """The residuals, and the given inputs as flat ``{key: array}`` (empty when none were given)."""
    fingerprint, dims, arg_names = meta["fingerprint"], meta["dims"], meta["arg_names"]
    stored = {k: v for k, v in arrays.items() if not k.startswith("in/")}
    given = {k[3:]: v for k, v in arrays.items() if k.startswith("in/")}
    flat: Mapping[str, Any] = {}
    trees: tuple = ()
    if needs:
        flat, trees = _left_out_inputs(
            path, "residuals", "load_residuals(path, inputs=args)", needs, inputs, arg_names, artifact
        )
        given.update({k: flat[k] for k in needs})
    elif inputs is not None:
        flat, trees = _flat_inputs(path, inputs, arg_names, artifact)
    res = Residuals(
        stored,
        given,
        dims=dims,
        fingerprint=fingerprint,
        arg_names=arg_names,
        arg_trees=trees,
        residuals_id=meta.get("residuals_id", ""),
    )
    return res, flat


def _left_out_inputs(path, what: str, loader: str, needs, inputs, arg_names, artifact):
    """``_flat_inputs`` of the inputs a file of ``what`` left out (``needs``), refusing absent or missing ones."""
    if inputs is None:
        raise VjpsplitError(
            f"{path}: these {what} leave out the inputs {', '.join(needs)} (to avoid copying them); "
            f"pass the forward's inputs (run-bwd --inputs FILE, or {loader})"
        )
    flat, trees = _flat_inputs(path, inputs, arg_names, artifact)
    missing = [k for k in needs if k not in flat]
    if missing:
        raise VjpsplitError(
            f"{path}: the {what} need input(s) {', '.join(missing)}, which the given inputs lack; "
            "pass the same inputs the forward ran on"
        )
    return flat, trees


def _flat_inputs(path, inputs, arg_names, artifact=None) -> tuple[Mapping[str, Any], tuple]:
    """Flat ``{key: array}`` inputs, and the arguments' structure when given as pytrees."""
    if isinstance(inputs, Mapping):
        return inputs, ()
    if not isinstance(inputs, (tuple, list)) or len(inputs) != len(arg_names):
        raise VjpsplitError(
            f"{path}: inputs must be the forward's {len(arg_names)} arguments ({', '.join(arg_names)}) "
            "as a tuple, or a flat {key: array} mapping"
        )
    return flatten_args(artifact.manifest if artifact is not None else None, inputs, str(path), arg_names)


def _load_split_residuals(path, arrays, meta, needs, inputs) -> Residuals:
    plan = plan_for_token(str(meta.get("token")))
    if plan is None:
        raise VjpsplitError(
            f"{path}: these residuals come from split() in another process (pid {meta.get('pid')}); "
            "their backward lives only there; use vs.export(...) artifacts to run the backward elsewhere"
        )
    try:
        stored = tuple(arrays[f"r/{i}"] for i in range(plan.n_stored))
    except KeyError as e:
        raise VjpsplitError(f"{path}: residual {e.args[0]!r} is missing; rerun the forward") from e
    if meta.get("self_contained"):
        try:
            ins = tuple(
                _from_file(path, f"in/{k}", arrays[f"in/{k}"], plan.arg_leaf_avals[k]) for k in plan.input_backed
            )
        except KeyError as e:
            raise VjpsplitError(f"{path}: input-backed residual {e.args[0]!r} is missing; rerun the forward") from e
    elif not plan.input_backed:
        ins = ()  # every residual is stored: the inputs are not needed at all
    else:
        if inputs is None:
            raise VjpsplitError(
                f"{path}: these residuals leave out input arrays (to avoid copies); "
                "pass load_residuals(path, inputs=args) with fwd's arguments"
            )
        flat = jax.tree_util.tree_leaves(inputs)
        if len(flat) != len(plan.arg_leaf_avals):
            raise VjpsplitError(
                f"{path}: inputs have {len(flat)} leaves, the forward had {len(plan.arg_leaf_avals)}; "
                "pass the arguments fwd ran on"
            )
        ins = tuple(flat[k] for k in plan.input_backed)
    stored = tuple(_from_file(path, f"r/{i}", v, aval) for i, (v, aval) in enumerate(zip(stored, plan.stored_avals)))
    return SplitResiduals(
        {f"r/{i}": v for i, v in enumerate(stored)}, {str(k): v for k, v in zip(plan.input_backed, ins)}, plan=plan
    )


def _from_file(path, key: str, v, aval):
    """A split residual as the backward wants it: checked, typed PRNG keys rewrapped."""
    want = data_struct(aval) if is_key(aval) else aval
    if tuple(v.shape) != tuple(want.shape) or np.dtype(v.dtype) != np.dtype(want.dtype):
        raise VjpsplitError(
            f"{path}: residual '{key}': expected {format_shape(want.dtype, want.shape)}, "
            f"file has {format_shape(v.dtype, v.shape)}; rerun the forward"
        )
    return from_data(v, impl_name(aval)) if is_key(aval) else v
