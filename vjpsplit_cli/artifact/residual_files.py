"""Residual and intermediates files: the forward's residuals on disk, tied to the artifact (and inputs) that made them.

Saving and loading them; what their metadata records and the checks on it are ``residual_meta``;
what a file of ``split``'s residuals holds, and reading one back, ``split_residual_files``.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

import jax
import numpy as np

from ..errors import VjpsplitError
from ..files import keys
from ..files.dtypes import dtype_name
from ..tracing.residuals import Intermediates, Residuals, SplitResiduals
from .arguments import flatten_args
from .artifact import Artifact
from .residual_meta import (
    KIND_ARTIFACT,
    KIND_INTERMEDIATES,
    KIND_SPLIT,
    binding,
    check_bound_inputs,
    check_meta,
    computed_dtypes,
    input_crc32,
    load_checked,
    refuse_other_artifact,
    save_checked,
    shardings_meta,
)
from .split_residual_files import load_split_residuals, split_contents

__all__ = ["input_crc32", "load_intermediates", "load_residuals", "save_intermediates", "save_residuals"]


# The forward's arguments (a tuple of pytrees) or a flat ``{key: array}`` mapping; None: not given.
Inputs = Sequence[Any] | Mapping[str, Any] | None


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

    Args:
        path: The file to write (``.npz`` or ``.msgpack``; written atomically).
        inter: The intermediates ``Artifact.bwd_input`` returned.
        self_contained: Whether to write the input arrays the weight part reads too.
        arg_names: The artifact's argument names, recorded so the forward's arguments
            can supply the left-out inputs on loading.
        fsync: Whether to flush the file to disk before returning.

    Raises:
        VjpsplitError: If ``inter`` is not an ``Intermediates``, or the file cannot be written.
    """
    if not isinstance(inter, Intermediates):
        raise VjpsplitError(f"{path}: save_intermediates takes bwd_input's intermediates, got {type(inter).__name__}")
    arrays = {
        **{k: np.asarray(v) for k, v in inter.arrays.items()},
        **{k: np.asarray(v) for k, v in inter.stored.items()},
    }
    if self_contained:
        arrays.update({keys.input_backed(k): np.asarray(v) for k, v in inter.inputs.items()})
    meta = {
        "kind": KIND_INTERMEDIATES,
        "fingerprint": inter.fingerprint,
        "dims": dict(inter.dims),
        "residuals_id": inter.residuals_id,
        "arg_names": list(arg_names),
        "needs_inputs": [] if self_contained else sorted(inter.inputs),
        "input_crc32": {} if self_contained else {k: input_crc32(v) for k, v in inter.inputs.items()},
        "input_dtypes": {} if self_contained else {k: dtype_name(np.asarray(v).dtype) for k, v in inter.inputs.items()},
        **shardings_meta({**inter.arrays, **inter.stored}),
    }
    save_checked(path, arrays, meta, fsync)


def load_intermediates(
    path: str | os.PathLike,
    inputs: Inputs = None,
    *,
    artifact: Artifact | None = None,
    inputs_source: str | None = None,
    verify: bool = True,
) -> Intermediates:
    """Read intermediates written by ``save_intermediates`` (or ``run-bwd --part input``).

    Args:
        path: The intermediates file.
        inputs: The input arrays the file left out: a flat ``{key: array}`` mapping or the forward's arguments;
            ``None`` when none are needed.
        artifact: The artifact whose weight part will read them (another artifact's are refused here); ``None`` skips
            that check.
        inputs_source: What to call ``inputs`` in messages (their file name, say).
        verify: Whether to check each array's CRC-32, that the supplied inputs are the ones the forward ran on and,
            in ``Artifact.bwd_weight``, that the intermediates come from the same forward run as any residuals given.

    Returns:
        The ``Intermediates``.

    Raises:
        VjpsplitError: If the file cannot be read or is damaged, is not an intermediates file, comes from another
            artifact, or needs inputs that are missing or not the ones the forward ran on.
    """
    arrays, meta = load_checked(path, verify)
    if meta.get("kind") != KIND_INTERMEDIATES:
        raise VjpsplitError(f"{path}: not an intermediates file; pass the --intermediates file of run-bwd --part input")
    check_meta(path, meta, KIND_INTERMEDIATES, "rerun run-bwd --part input")
    fingerprint, dims = meta["fingerprint"], meta["dims"]
    refuse_other_artifact(path, "intermediates", fingerprint, artifact, "run this artifact's input part first", meta)
    computed = {k: v for k, v in arrays.items() if keys.is_intermediate(k)}
    stored = {k: v for k, v in arrays.items() if keys.is_stored(k)}
    given = _input_backed_arrays(arrays)
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
            check_bound_inputs(path, meta, given_needs, inputs_source or "inputs", computed_dtypes(meta, artifact))
    return Intermediates(computed, dims, fingerprint, meta.get("residuals_id", "") if verify else "", stored, given)


def save_residuals(
    path: str | os.PathLike, res: Residuals, *, self_contained: bool = False, fsync: bool = False
) -> None:
    """Write residuals (from ``Artifact.fwd`` or ``split``'s ``fwd``) to ``.npz``/``.msgpack``.

    Input-backed residuals are left out unless ``self_contained``: the file records
    which input keys it needs, and ``load_residuals(path, inputs=...)`` supplies them.
    ``fsync=True`` (or ``VJPSPLIT_FSYNC=1``) flushes the file to disk before returning,
    so it survives a power loss; by default it is not (residuals are transient).

    Args:
        path: The file to write (``.npz`` or ``.msgpack``; written atomically).
        res: The residuals.
        self_contained: Whether to write the input-backed residuals too.
        fsync: Whether to flush the file to disk before returning.

    Raises:
        VjpsplitError: If ``res`` is not a ``Residuals``, or the file cannot be written.
    """
    if not isinstance(res, Residuals):
        raise VjpsplitError(f"{path}: save_residuals takes residuals from a fwd, got {type(res).__name__}")
    if not isinstance(res, SplitResiduals):  # an artifact's
        arrays: dict[str, Any] = {k: np.asarray(v) for k, v in res.stored.items()}
        if self_contained:
            arrays.update({keys.input_backed(k): np.asarray(v) for k, v in res.inputs.items()})
        meta = {
            "kind": KIND_ARTIFACT,
            "fingerprint": res.fingerprint,
            "arg_names": list(res.arg_names),
            "dims": dict(res.dims),
            "needs_inputs": [] if self_contained else sorted(res.inputs),
            "self_contained": bool(self_contained),
            "residuals_id": res.residuals_id,
            **binding(res),
            **shardings_meta(res.stored),
        }
    else:  # split's: keys r/i and flat argument positions
        arrays, meta = split_contents(res, self_contained)
    save_checked(path, arrays, meta, fsync)


def load_residuals(
    path: str | os.PathLike,
    inputs: Inputs = None,
    *,
    artifact: Artifact | None = None,
    inputs_source: str | None = None,
    verify: bool = True,
) -> Residuals:
    """Read a residuals file; ``inputs`` supplies the input-backed residuals it left out.

    Args:
        path: The residuals file.
        inputs: The input-backed residuals the file left out: the forward's arguments tuple or a flat
            ``{key: array}`` mapping (an inputs file's content); ``None`` when none are needed.
        artifact: The artifact whose backward will read them: another artifact's are refused here, before anything
            else is checked; ``None`` skips that check.
        inputs_source: What to call ``inputs`` in messages.
        verify: Whether to check each array's CRC-32 (a file damaged in transit fails here, not as wrong gradients)
            and that the supplied inputs are the very ones the forward ran on (naming the first that differs).

    Returns:
        The ``Residuals`` (a ``SplitResiduals`` for ``split``'s, in the process that made them).

    Raises:
        VjpsplitError: If the file cannot be read or is damaged, is not a residuals file, comes from another artifact
            (or another process, for ``split``'s), or needs inputs that are missing or not the ones the forward ran on.
    """
    arrays, meta = load_checked(path, verify)
    kind = meta.get("kind")
    if kind == KIND_ARTIFACT:
        refuse_other_artifact(
            path,
            "residuals",
            meta.get("fingerprint"),
            artifact,
            "run this artifact's forward to make matching residuals",
            meta,
        )
    if kind in (KIND_ARTIFACT, KIND_SPLIT):
        check_meta(path, meta, kind, "rerun the forward")
    needs = meta.get("needs_inputs", [])
    if kind == KIND_ARTIFACT:
        res, flat = _load_artifact_residuals(path, arrays, meta, needs, inputs, artifact)
        res = res.replace(inputs_source=(inputs_source or "inputs") if needs else str(path), source=str(path))
        if verify:
            check_bound_inputs(path, meta, flat, inputs_source or "inputs", computed_dtypes(meta, artifact))
        return res
    if kind == KIND_SPLIT:
        res = load_split_residuals(path, arrays, meta, needs, inputs)
        if verify and inputs is not None:
            leaves = jax.tree_util.tree_leaves(inputs)
            check_bound_inputs(path, meta, {str(i): v for i, v in enumerate(leaves)}, inputs_source or "inputs")
        return res
    raise VjpsplitError(
        f"{path}: not a residuals file (no vjpsplit residuals metadata); pass the --residuals file written by run-fwd"
    )


def _load_artifact_residuals(
    path: str | os.PathLike,
    arrays: Mapping[str, Any],
    meta: Mapping[str, Any],
    needs: Sequence[str],
    inputs: Inputs,
    artifact: Artifact | None,
) -> tuple[Residuals, Mapping[str, Any]]:
    """The residuals, and the given inputs as flat ``{key: array}`` (empty when none were given)."""
    fingerprint, dims, arg_names = meta["fingerprint"], meta["dims"], meta["arg_names"]
    stored = {k: v for k, v in arrays.items() if not keys.is_input_backed(k)}
    given = _input_backed_arrays(arrays)
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


def _left_out_inputs(
    path: str | os.PathLike,
    what: str,
    loader: str,
    needs: Sequence[str],
    inputs: Inputs,
    arg_names: Sequence[str],
    artifact: Artifact | None,
) -> tuple[Mapping[str, Any], tuple]:
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


def _flat_inputs(
    path: str | os.PathLike, inputs: Inputs, arg_names: Sequence[str], artifact: Artifact | None = None
) -> tuple[Mapping[str, Any], tuple]:
    """Flat ``{key: array}`` inputs, and the arguments' structure when given as pytrees."""
    if isinstance(inputs, Mapping):
        return inputs, ()
    if not isinstance(inputs, (tuple, list)) or len(inputs) != len(arg_names):
        raise VjpsplitError(
            f"{path}: inputs must be the forward's {len(arg_names)} arguments ({', '.join(arg_names)}) "
            "as a tuple, or a flat {key: array} mapping"
        )
    return flatten_args(artifact.manifest if artifact is not None else None, inputs, str(path), arg_names)


def _input_backed_arrays(arrays: Mapping[str, Any]) -> dict[str, Any]:
    """The input-backed residuals a self-contained file holds, by their input keys."""
    return {keys.input_of(k): v for k, v in arrays.items() if keys.is_input_backed(k)}
