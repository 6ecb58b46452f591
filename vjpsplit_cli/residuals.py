"""Residual files: the forward's residuals on disk, tied to the artifact that wrote them."""

from __future__ import annotations

import os
import zlib
from typing import Any, Mapping

import jax
import numpy as np

from .arrays import load_arrays, save_arrays
from .artifact import ArtifactResiduals, Intermediates, flatten_args
from .core import Residuals, plan_for_token
from .errors import VjpsplitError
from .prng import data_struct, from_data, impl_name, is_key, to_data
from .shapes import format_shape
from .trees import flatten_with_keys

KIND_ARTIFACT = "vjpsplit-residuals"
KIND_SPLIT = "vjpsplit-split-residuals"
KIND_INTERMEDIATES = "vjpsplit-intermediates"


def _crc32(a) -> int:
    a = np.ascontiguousarray(a) if np.ndim(a) else np.asarray(a)
    return zlib.crc32(memoryview(a.reshape(-1).view(np.uint8)) if a.size else b"")


def _save_checked(path, arrays: dict, meta: dict) -> None:
    """Save with a CRC-32 per array: residuals travel between hosts, and a flipped bit in
    transit must fail loudly, not give quietly wrong gradients. Both formats keep one
    (zip's own per ``.npz`` member, a table beside the arrays in ``.msgpack``). No fsync
    unless asked (``VJPSPLIT_FSYNC=1``): these files are transient, the rename is atomic."""
    save_arrays(path, arrays, meta)


def _load_checked(path, verify: bool):
    """``load_arrays``, with every array's CRC-32 checked when ``verify``."""
    arrays, meta = load_arrays(path, verify=verify)
    if verify and "crc32" in meta:  # a .msgpack of the old layout kept its CRCs in meta
        _verify(path, arrays, meta)
    return arrays, meta


def _verify(path, arrays: Mapping[str, Any], meta: Mapping) -> None:
    sums = meta.get("crc32")
    if not isinstance(sums, dict) or set(sums) != set(arrays):
        raise VjpsplitError(f"{path}: the CRC-32 list does not match the file's arrays; the file is corrupt, re-create it")
    for k, v in arrays.items():
        if _crc32(v) != sums[k]:
            raise VjpsplitError(
                f"{path}: array {k!r} fails its CRC-32 check (its bytes changed after it was written); "
                "the file is corrupt, re-create it"
            )


def save_intermediates(path: str | os.PathLike, inter: Intermediates) -> None:
    """Write a split backward's intermediates (``Artifact.bwd_input``'s second result)."""
    if not isinstance(inter, Intermediates):
        raise VjpsplitError(f"{path}: save_intermediates takes bwd_input's intermediates, got {type(inter).__name__}")
    meta = {"kind": KIND_INTERMEDIATES, "fingerprint": inter.fingerprint, "dims": dict(inter.dims)}
    _save_checked(path, dict(inter.arrays), meta)


def load_intermediates(path: str | os.PathLike, *, artifact=None, verify: bool = True) -> Intermediates:
    """Read intermediates written by ``save_intermediates`` (or ``run-bwd --part input``).

    ``verify`` checks each array's CRC-32 (on by default; see ``load_residuals``).
    """
    arrays, meta = _load_checked(path, verify)
    if meta.get("kind") != KIND_INTERMEDIATES:
        raise VjpsplitError(f"{path}: not an intermediates file; pass the --intermediates file of run-bwd --part input")
    fingerprint, dims = meta.get("fingerprint"), meta.get("dims")
    if not isinstance(fingerprint, str) or not isinstance(dims, dict):
        raise VjpsplitError(f"{path}: malformed intermediates metadata; rerun run-bwd --part input")
    _refuse_other_artifact(path, "intermediates", fingerprint, artifact, "run this artifact's input part first")
    return Intermediates(arrays, dims, fingerprint)


def _refuse_other_artifact(path, what: str, fingerprint, artifact, fix: str) -> None:
    """A file tied to one artifact must not feed another: say so before anything else."""
    if artifact is not None and fingerprint != artifact.manifest.fingerprint:
        raise VjpsplitError(
            f"{path}: these {what} were written by another artifact (fingerprint {str(fingerprint)[:12]}, "
            f"{artifact.source} is {artifact.manifest.fingerprint[:12]}); {fix}"
        )


def save_residuals(path: str | os.PathLike, res, *, self_contained: bool = False) -> None:
    """Write residuals (from ``Artifact.fwd`` or ``split``'s ``fwd``) to ``.npz``/``.msgpack``.

    Input-backed residuals are left out unless ``self_contained``: the file records
    which input keys it needs, and ``load_residuals(path, inputs=...)`` supplies them.
    """
    if isinstance(res, ArtifactResiduals):
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
        }
    elif isinstance(res, Residuals):
        arrays = {f"r/{i}": np.asarray(to_data(v)) for i, v in enumerate(res.stored)}
        if self_contained:
            arrays.update({f"in/{k}": np.asarray(to_data(v)) for k, v in zip(res.plan.input_backed, res.inputs)})
        meta = {
            "kind": KIND_SPLIT,
            "token": res.plan.token,
            "pid": os.getpid(),
            "needs_inputs": [] if self_contained else [str(k) for k in res.plan.input_backed],
            "self_contained": bool(self_contained),
        }
    else:
        raise VjpsplitError(f"{path}: save_residuals takes residuals from a fwd, got {type(res).__name__}")
    _save_checked(path, arrays, meta)


def load_residuals(path: str | os.PathLike, inputs=None, *, artifact=None, inputs_source: str | None = None,
                   verify: bool = True):
    """Read a residuals file; ``inputs`` supplies the input-backed residuals it left out.

    ``inputs`` is the forward's arguments tuple, or a flat ``{key: array}`` mapping
    (an inputs file's content; ``inputs_source`` names it in messages). With
    ``artifact``, residuals written by another artifact are refused here, before
    anything else is checked. ``verify`` (default on) checks each array's CRC-32,
    so a file damaged in transit fails here instead of giving wrong gradients.
    """
    arrays, meta = _load_checked(path, verify)
    kind = meta.get("kind")
    if kind == KIND_ARTIFACT:
        _refuse_other_artifact(path, "residuals", meta.get("fingerprint"), artifact,
                               "run this artifact's forward to make matching residuals")
    needs = meta.get("needs_inputs", [])
    if not isinstance(needs, list):
        raise VjpsplitError(f"{path}: malformed residuals metadata (needs_inputs); rerun the forward")
    if kind == KIND_ARTIFACT:
        res = _load_artifact_residuals(path, arrays, meta, needs, inputs, artifact)
        res.inputs_source = (inputs_source or "inputs") if needs else str(path)
        return res
    if kind == KIND_SPLIT:
        return _load_split_residuals(path, arrays, meta, needs, inputs)
    raise VjpsplitError(
        f"{path}: not a residuals file (no vjpsplit residuals metadata); pass the --residuals file written by run-fwd"
    )


def _load_artifact_residuals(path, arrays, meta, needs, inputs, artifact) -> ArtifactResiduals:
    fingerprint, dims, arg_names = meta.get("fingerprint"), meta.get("dims"), meta.get("arg_names")
    if not isinstance(fingerprint, str) or not isinstance(dims, dict) or not isinstance(arg_names, list):
        raise VjpsplitError(f"{path}: malformed residuals metadata (fingerprint/dims); rerun the forward")
    stored = {k: v for k, v in arrays.items() if not k.startswith("in/")}
    given = {k[3:]: v for k, v in arrays.items() if k.startswith("in/")}
    trees: tuple = ()
    if needs:
        if inputs is None:
            raise VjpsplitError(
                f"{path}: these residuals leave out the inputs {', '.join(needs)} (to avoid copying them); "
                "pass the forward's inputs (run-bwd --inputs FILE, or load_residuals(path, inputs=args))"
            )
        flat, trees = _flat_inputs(path, inputs, arg_names, artifact)
        missing = [k for k in needs if k not in flat]
        if missing:
            raise VjpsplitError(
                f"{path}: the residuals need input(s) {', '.join(missing)}, which the given inputs lack; "
                "pass the same inputs the forward ran on"
            )
        given.update({k: flat[k] for k in needs})
    elif inputs is not None and not isinstance(inputs, Mapping):
        _, trees = _flat_inputs(path, inputs, arg_names, artifact)
    return ArtifactResiduals(stored, given, dims, fingerprint, arg_names, trees)


def _flat_inputs(path, inputs, arg_names, artifact=None) -> tuple[Mapping[str, Any], tuple]:
    """Flat ``{key: array}`` inputs, and the arguments' structure when given as pytrees."""
    if isinstance(inputs, Mapping):
        return inputs, ()
    if not isinstance(inputs, (tuple, list)) or len(inputs) != len(arg_names):
        raise VjpsplitError(
            f"{path}: inputs must be the forward's {len(arg_names)} arguments ({', '.join(arg_names)}) "
            "as a tuple, or a flat {key: array} mapping"
        )
    if artifact is not None:
        return flatten_args(artifact.manifest, inputs, str(path))
    flat = {k: to_data(v) for n, a in zip(arg_names, inputs) for k, v in flatten_with_keys(n, a)}
    trees = tuple((n, jax.tree_util.tree_structure(a), tuple(k for k, _ in flatten_with_keys(n, a)))
                  for n, a in zip(arg_names, inputs))
    return flat, trees


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
            ins = tuple(_from_file(path, f"in/{k}", arrays[f"in/{k}"], plan.arg_leaf_avals[k]) for k in plan.input_backed)
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
            raise VjpsplitError(f"{path}: inputs have {len(flat)} leaves, the forward had {len(plan.arg_leaf_avals)}; "
                                "pass the arguments fwd ran on")
        ins = tuple(flat[k] for k in plan.input_backed)
    stored = tuple(_from_file(path, f"r/{i}", v, aval) for i, (v, aval) in enumerate(zip(stored, plan.stored_avals)))
    return Residuals(stored, ins, plan)


def _from_file(path, key: str, v, aval):
    """A split residual as the backward wants it: checked, typed PRNG keys rewrapped."""
    want = data_struct(aval) if is_key(aval) else aval
    if tuple(v.shape) != tuple(want.shape) or np.dtype(v.dtype) != np.dtype(want.dtype):
        raise VjpsplitError(
            f"{path}: residual '{key}': expected {format_shape(want.dtype, want.shape)}, "
            f"file has {format_shape(v.dtype, v.shape)}; rerun the forward"
        )
    return from_data(v, impl_name(aval)) if is_key(aval) else v
