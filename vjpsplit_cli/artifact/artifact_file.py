"""The artifact file: its top-level msgpack map (manifest, modules, signature), packed, signed and written,
and each module read back as a ``jax.export.Exported``.

``loading`` reads a file with every check; this module owns the bytes both ways.
"""

from __future__ import annotations

import dataclasses
from typing import Any, BinaryIO, Mapping

import jax
import msgpack
from jax import export as jexport

from ..errors import VjpsplitError, first_line
from ..safeio.outputs import atomic_write
from ..trust import signing
from .manifest import MAGIC, Manifest


def pack(top: Mapping) -> bytes:
    """The artifact's top-level map as msgpack (canonical: what a signature covers)."""
    return msgpack.packb(top, use_bin_type=True)


def unsigned_map(manifest: Manifest, modules: Mapping[str, bytes]) -> dict:
    """The top-level map without its signature: what a signature covers."""
    return {"manifest": manifest.to_json(), **modules}


def file_bytes(manifest: Manifest, modules: Mapping[str, bytes], signature: dict | None) -> bytes:
    """The artifact file's bytes (with ``signature``, if given)."""
    top = unsigned_map(manifest, modules)
    if signature is not None:
        top[signing.SIGNATURE] = signature
    return MAGIC + pack(top)


def signature_of(manifest: Manifest, modules: Mapping[str, bytes], key: Any) -> dict:
    """The signature entry for manifest and modules, by an Ed25519 private key or the path of its file."""
    if not hasattr(key, "sign"):
        key = signing.load_private_key(key)
    return signing.sign(pack(unsigned_map(manifest, modules)), key)


def save_file(path: Any, data: bytes) -> None:
    """Write an artifact's bytes to ``path`` atomically (no partial file on failure) and durably."""

    def write(f: BinaryIO) -> None:
        f.write(data)

    # Unlike residuals, an artifact is kept and copied around: make it durable.
    atomic_write(path, write, fsync=True)


def unreadable_module(source: str, manifest: Manifest, module: str) -> str:
    """The message for a module this jax cannot deserialize though another jax wrote it whole."""
    why = (
        " (sharded modules from jax >= 0.7 use the Shardy partitioner, which jax 0.6 cannot read)"
        if manifest.sharded
        else ""
    )
    return (
        f"{source}: this jax {jax.__version__} cannot read the {module} module that "
        f"jax {manifest.jax_version} exported{why}; run it with jax {manifest.jax_version} or newer, or "
        "re-export it with this jax"
    )


def deserialize_module(data: bytes, source: str, manifest: Manifest, what: str) -> jexport.Exported:
    """A module's ``jax.export.Exported``, its device count reconciled with the manifest; one-line errors."""
    try:
        exp = jexport.deserialize(bytearray(data))
    except Exception as e:
        lo = jexport.minimum_supported_calling_convention_version
        hi = jexport.maximum_supported_calling_convention_version
        raise VjpsplitError(
            f"{source}: cannot read the {what} module (exported with jax {manifest.jax_version}, calling convention "
            f"{manifest.calling_convention_version}; this jax {jax.__version__} reads {lo}..{hi}): {first_line(e)}; "
            "install a jax close to the exporting one, or re-export the artifact with this jax"
        ) from e
    if exp.nr_devices == 0:
        # jax >= 0.9.1 writes the device count only in the 32-bit field added in 0.8;
        # jax <= 0.7 reads the old 16-bit one and gets 0, which Exported.call refuses.
        # 0 is never a real count: the manifest has the true one (1 before format 4).
        exp = dataclasses.replace(exp, nr_devices=manifest.nr_devices)
    elif exp.nr_devices != manifest.nr_devices:
        raise VjpsplitError(
            f"{source}: the {what} module runs on {exp.nr_devices} devices, the manifest says "
            f"{manifest.nr_devices}; export it again"
        )
    return exp
