"""What a residuals or intermediates file records beside its arrays, and the checks that hold it to them.

The kinds of file, the schema of their metadata, a CRC-32 per array, the binding to
the inputs the forward ran on (shapes, dtypes, CRC-32s) and to the artifact
(fingerprint, shardings). Files are data from elsewhere: every field is checked
before it is used, and every refusal names the file and what to do.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import numpy as np

from ..errors import VjpsplitError
from ..files import load_arrays, save_arrays
from ..files.dtypes import dtype_from_name, dtype_name
from ..files.prng import to_data
from ..files.dimtext import MAX_DIM
from ..files.shapes import format_shape
from ..safeio import checksum
from ..tracing.residuals import Residuals
from .arguments import as_computed
from .artifact import Artifact
from .manifest import Manifest
from .sharding import format_spec, spec_from_json, spec_of

KIND_ARTIFACT = "vjpsplit-residuals"
KIND_SPLIT = "vjpsplit-split-residuals"
KIND_INTERMEDIATES = "vjpsplit-intermediates"


def _crc32(a: Any) -> int:
    a = np.ascontiguousarray(a) if np.ndim(a) else np.asarray(a)
    return checksum.crc32(memoryview(a.reshape(-1).view(np.uint8)) if a.size else b"")


def save_checked(path: str | os.PathLike, arrays: dict, meta: dict, fsync: bool = False) -> None:
    """Save with a CRC-32 per array: residuals travel between hosts, and a flipped bit in
    transit must fail loudly, not give quietly wrong gradients. Both formats keep one
    (zip's own per ``.npz`` member, a table beside the arrays in ``.msgpack``). No fsync
    unless asked (``fsync=True``, ``--fsync``, ``VJPSPLIT_FSYNC=1``): these files are
    transient, the rename is atomic."""
    save_arrays(path, arrays, meta, fsync=fsync)


def load_checked(path: str | os.PathLike, verify: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """``load_arrays``, with every array's CRC-32 checked when ``verify``."""
    arrays, meta = load_arrays(path, verify=verify)
    if verify and "crc32" in meta:  # a .msgpack of the old layout kept its CRCs in meta
        _verify(path, arrays, meta)
    return arrays, meta


def _verify(path: str | os.PathLike, arrays: Mapping[str, Any], meta: Mapping) -> None:
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


def _is_str_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _is_dims(v: Any) -> bool:
    return isinstance(v, dict) and all(
        isinstance(k, str) and isinstance(x, int) and not isinstance(x, bool) and 1 <= x <= MAX_DIM
        for k, x in v.items()
    )


def _is_crcs(v: Any) -> bool:
    return isinstance(v, dict) and all(
        isinstance(k, str) and isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**32 for k, x in v.items()
    )


def _is_shapes(v: Any) -> bool:
    return isinstance(v, dict) and all(
        isinstance(k, str)
        and isinstance(x, list)
        and all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_DIM for d in x)
        for k, x in v.items()
    )


def _is_names(v: Any) -> bool:
    return isinstance(v, dict) and all(isinstance(k, str) and isinstance(x, str) for k, x in v.items())


def _is_shardings(v: Any) -> bool:
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


def check_meta(path: str | os.PathLike, meta: Mapping, kind: str, fix: str) -> None:
    """Refuse metadata that does not match ``kind``'s schema, naming the field."""
    for name, (ok, required) in _SCHEMA[kind].items():
        if name not in meta:
            if required:
                raise VjpsplitError(f"{path}: malformed metadata: '{name}' is missing; {fix}")
        elif not ok(meta[name]):
            raise VjpsplitError(f"{path}: malformed metadata: '{name}' has the wrong type or range; {fix}")


def input_crc32(a: Any) -> int:
    """CRC-32 (zlib's polynomial, :mod:`.checksum`) of an array's bytes: binds a residuals file to its inputs.

    Not a defence against forgery; it catches the easy slip of pairing one
    microbatch's residuals with another's inputs, at about a memory copy's cost.
    """
    return _crc32(np.asarray(a))


def refuse_other_artifact(
    path: str | os.PathLike,
    what: str,
    fingerprint: Any,
    artifact: Artifact | None,
    fix: str,
    meta: Mapping | None = None,
) -> None:
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


def shardings_meta(arrays: Mapping[str, Any]) -> dict:
    """``{"shardings": {key: spec}}`` for the arrays laid out over several devices; ``{}`` when none is."""
    out = {k: list(spec) for k, v in arrays.items() if (spec := spec_of(v)) is not None}
    return (
        {"shardings": {k: [list(e) if isinstance(e, tuple) else e for e in sp] for k, sp in out.items()}} if out else {}
    )


def _sharding_difference(meta: Mapping, manifest: Manifest) -> str:
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


def binding(res: Residuals) -> dict:
    """The metadata that binds a residuals file to every input its forward ran on: shapes and CRC-32s."""
    bound = {k: np.asarray(to_data(v)) for k, v in (res.bound_inputs or res.inputs).items()}
    return {
        "input_crc32": {k: input_crc32(a) for k, a in bound.items()},
        "input_shapes": {k: [int(d) for d in a.shape] for k, a in bound.items()},
        "input_dtypes": {k: dtype_name(a.dtype) for k, a in bound.items()},
    }


def computed_dtypes(meta: Mapping, artifact: Artifact | None) -> dict:
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


def check_bound_inputs(
    path: str | os.PathLike, meta: Mapping, given: Mapping[str, Any], source: str, dtypes: Mapping | None = None
) -> None:
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
