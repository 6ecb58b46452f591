"""Reading artifacts: the file's header, manifest, signature and fingerprint, then each module, checked.

``load`` and ``loads`` refuse a file before any module is deserialized when its
signature does not satisfy the trust keys (module ``signing``), and check every
module (module ``trust.checks``) before anything compiles.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import msgpack
from jax import export as jexport

from ..errors import CorruptModule, VjpsplitError, first_line
from ..safeio.reading import read_bytes
from ..trust import checks, probes, signing
from ..trust.verdicts import DEFAULT
from .artifact import Artifact
from .artifact_file import pack, unreadable_module
from .manifest import MAGIC, MODULES, Manifest, fingerprint


def load(
    path: str | os.PathLike, *, trust: Any = None, allow_kernels: bool = False, cache_dir: str | None = DEFAULT
) -> Artifact:
    """Read an artifact file, checking its magic, format version, fingerprint, signature and modules.

    Args:
        path: The artifact file.
        trust: Trusted Ed25519 public keys (paths to ``KEY.pub`` files or raw bytes): an unsigned artifact or another
            signer is then refused before any module is read; ``None`` reads ``VJPSPLIT_TRUST_KEYS``, and with none
            there, signatures are not required.
        allow_kernels: Whether to accept the file's kernel custom calls (LAPACK & co.) without a signature.
        cache_dir: A private directory where module check verdicts are kept between processes; by default vjpsplit's
            cache directory (``VJPSPLIT_CACHE_DIR``); ``None`` keeps none.

    Returns:
        The loaded ``Artifact``.

    Raises:
        VjpsplitError: If the file cannot be read, is not an artifact, is corrupt or truncated, has a newer or
            malformed format or manifest, fails its fingerprint, signature or trust keys, or holds a module that does
            not parse or calls what it may not.
    """
    return loads(
        read_bytes(path, "artifact"), source=str(path), trust=trust, allow_kernels=allow_kernels, cache_dir=cache_dir
    )


def loads(
    data: bytes,
    source: str = "artifact",
    *,
    trust: Any = None,
    allow_kernels: bool = False,
    cache_dir: str | None = DEFAULT,
) -> Artifact:
    """An artifact from its file's bytes (``Artifact.to_bytes``), checked like ``load``.

    Args:
        data: The file's bytes.
        source: What to call the artifact in messages.
        trust: Trusted Ed25519 public keys, as ``load`` takes them.
        allow_kernels: Whether to accept the file's kernel custom calls without a signature.
        cache_dir: A private directory for module check verdicts, as ``load`` takes it.

    Returns:
        The ``Artifact``.

    Raises:
        VjpsplitError: As ``load`` raises, and if the manifest is nested too deeply.
    """
    try:
        return _loads(data, source, trust, allow_kernels, cache_dir)
    except RecursionError as e:  # a manifest nested thousands deep
        raise VjpsplitError(
            f"{source}: the artifact's manifest is nested too deeply to be ours; "
            "it is damaged or forged: export it again"
        ) from e


def _read_top(data: bytes, source: str) -> tuple[dict, bytes]:
    """The artifact's top-level map and the bytes it was decoded from; refused when not an artifact's."""
    if not data.startswith(MAGIC):
        raise VjpsplitError(f"{source}: not a vjpsplit artifact (bad header); pass a file written by `vjpsplit export`")
    body = data[len(MAGIC) :]
    try:
        top = msgpack.unpackb(
            body,
            raw=False,
            strict_map_key=True,
            max_bin_len=len(body),
            max_str_len=len(body),
            max_array_len=len(body),
            max_map_len=len(body),
            max_ext_len=0,
        )
    except Exception as e:
        raise VjpsplitError(
            f"{source}: the artifact is corrupt or truncated ({first_line(e)}); copy or export it again"
        ) from e
    if not isinstance(top, dict) or not {"manifest", "fwd", "bwd"} <= set(top):
        raise VjpsplitError(f"{source}: the artifact is missing its manifest or modules; export it again")
    return top, body


def _check_calling_convention(manifest: Manifest, source: str) -> None:
    lo = jexport.minimum_supported_calling_convention_version
    hi = jexport.maximum_supported_calling_convention_version
    if not lo <= manifest.calling_convention_version <= hi:
        newer = manifest.calling_convention_version > hi
        raise VjpsplitError(
            f"{source}: exported by jax {manifest.jax_version} with calling convention "
            f"{manifest.calling_convention_version}; this jax {jax.__version__} runs {lo}..{hi}; "
            + (
                "upgrade jax on this host"
                if newer
                else f"re-export the artifact, or install a jax near {manifest.jax_version}"
            )
        )


def _loads(data: bytes, source: str, trust: Any, allow_kernels: bool, cache_dir: str | None) -> Artifact:
    trusted = signing.trusted_keys(trust)
    top, body = _read_top(data, source)
    signature = top.get(signing.SIGNATURE)
    signer = signing.verify(top, body, source, trusted, pack)  # before any module is read
    manifest = Manifest.from_json(top["manifest"], source)
    _check_calling_convention(manifest, source)
    modules = {k: top[k] for k in MODULES if k in top}
    if not all(isinstance(v, bytes) for v in modules.values()) or manifest.splits_backward != ("bwd_input" in modules):
        raise VjpsplitError(f"{source}: the artifact's modules are malformed; export it again")
    if fingerprint(manifest, modules) != manifest.fingerprint:
        raise VjpsplitError(f"{source}: fingerprint mismatch: the artifact was modified after export; export it again")
    art = Artifact(manifest, modules, source=source)  # reads the modules' headers (Python), not their StableHLO
    if tuple(art.exported["fwd"].platforms) != manifest.platforms:
        raise VjpsplitError(f"{source}: the modules' platforms do not match the manifest; export it again")
    vouched = signer is not None and trusted is not None  # signed by a key the caller trusts
    try:
        probed = probes.probe_modules(
            {k: e.mlir_module_serialized for k, e in art.exported.items()},
            source,
            in_process=vouched,
            cache_dir=cache_dir,
        )
    except CorruptModule as e:
        # Written whole by another jax (a newer StableHLO dialect, Shardy), not damaged: say which to run.
        if not e.unreadable or manifest.jax_version == jax.__version__:
            raise
        raise VjpsplitError(unreadable_module(source, manifest, e.module)) from e
    deferred = checks.check_modules(
        source, manifest, art.exported, probed, trusted_signer=vouched, allow_kernels=allow_kernels
    )
    art.check_kernels_at_call(deferred, cache_dir)
    checks.prepare_kernels(probed)
    art.signature, art.signer = signature, signer
    return art
