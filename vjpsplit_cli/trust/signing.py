"""Who made an artifact: Ed25519 keys, and the signature beside the manifest.

``sign`` adds ``{"alg": "ed25519", "key": <public key>, "sig": ...}`` under
``"signature"`` beside the manifest in the artifact's top-level msgpack map (older
readers ignore it). The signed message is a SHA-256 of the file's bytes without
that entry, so the manifest and every module are covered. A signed file must be
msgpack's canonical encoding of what it decodes to, so no byte can change without
changing what is signed. With trust keys, an unsigned file or another signer is
refused before any module is read. The cryptography is the ``cryptography``
package's, never hand-written.
"""

from __future__ import annotations

import hashlib
import os
from types import ModuleType
from typing import TYPE_CHECKING, Any, BinaryIO, Callable, Mapping

from .. import config
from ..errors import VjpsplitError
from ..safeio.outputs import StagedOutputs, atomic_write
from ..safeio.reading import read_bytes

if TYPE_CHECKING:  # cryptography is imported when a key is used (``_crypto``), not with this module
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

SIGNATURE = "signature"  # the top-level map entry that holds the signature
_DOMAIN = b"vjpsplit artifact signature v1\0"
TRUST_ENV = config.TRUST_KEYS
# One trusted key: a path to a public key file, or the key's 32 raw bytes.
TrustKey = str | os.PathLike[str] | bytes | bytearray
TrustKeys = TrustKey | list[TrustKey] | tuple[TrustKey, ...] | set[TrustKey] | frozenset[TrustKey]

# ------------------------------------------------------------------------------ keys


def _write_all(f: BinaryIO, data: bytes) -> None:
    f.write(data)


def _crypto() -> tuple[ModuleType, ModuleType]:
    try:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError as e:  # pragma: no cover - a core dependency
        raise VjpsplitError("signing needs the 'cryptography' package; pip install cryptography") from e
    return serialization, ed25519


def key_id(public_raw: bytes) -> str:
    """A public key's fingerprint as shown to users: ``ed25519:`` and 32 hex digits of its SHA-256."""
    return "ed25519:" + hashlib.sha256(public_raw).hexdigest()[:32]


def generate_key(path: str | os.PathLike[str]) -> str:
    """Write a new Ed25519 pair: ``path`` (PEM private key, mode 0600) and ``path.pub``; return its key id.

    Both files are written or neither; an existing file is never replaced (a lost
    private key cannot be recovered, and a replaced one would keep the old file's mode).
    """
    serialization, ed25519 = _crypto()
    path = os.fspath(path)
    for p in (path, path + ".pub"):
        if os.path.lexists(p):
            raise VjpsplitError(f"{p}: already exists; remove it first or choose another name for the key")
    key = ed25519.Ed25519PrivateKey.generate()
    private = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    public = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)

    def write_private(tmp: str) -> None:
        os.chmod(tmp, 0o600)  # before the key is in it: no moment where others can read it
        with open(tmp, "wb") as f:
            f.write(private)
            f.flush()
            os.fsync(f.fileno())

    with StagedOutputs({"KEY": path, "KEY.pub": path + ".pub"}, fsync=True) as out:
        out.write("KEY", write_private)
        out.write("KEY.pub", lambda tmp: atomic_write(tmp, lambda f: _write_all(f, public)))
    return key_id(_raw_public(key.public_key()))


def _raw_public(public: Ed25519PublicKey) -> bytes:
    serialization, _ = _crypto()
    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def load_private_key(path: str | os.PathLike[str]) -> Ed25519PrivateKey:
    """The Ed25519 private key in ``path`` (PEM, or 32 raw bytes); a clear error for anything else."""
    serialization, ed25519 = _crypto()
    data = read_bytes(path, "signing key")
    try:
        key = (
            ed25519.Ed25519PrivateKey.from_private_bytes(data)
            if len(data) == 32
            else serialization.load_pem_private_key(data, password=None)
        )
    except (ValueError, TypeError) as e:
        raise VjpsplitError(
            f"{path}: not an unencrypted Ed25519 private key ({e}); make one with `vjpsplit keygen -o KEY`"
        ) from e
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise VjpsplitError(f"{path}: not an Ed25519 private key; make one with `vjpsplit keygen -o KEY`")
    return key


def load_public_key(path: str | os.PathLike[str]) -> bytes:
    """The raw 32-byte Ed25519 public key in ``path`` (PEM or raw); a clear error for anything else."""
    serialization, ed25519 = _crypto()
    data = read_bytes(path, "trust key")
    if len(data) == 32:
        return data
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError) as e:
        hint = " (this is the private key: pass KEY.pub)" if b"PRIVATE KEY" in data else ""
        raise VjpsplitError(
            f"{path}: not an Ed25519 public key{hint}; pass the KEY.pub that `vjpsplit keygen` wrote"
        ) from e
    if not isinstance(key, ed25519.Ed25519PublicKey):
        raise VjpsplitError(f"{path}: not an Ed25519 public key; pass the KEY.pub that `vjpsplit keygen` wrote")
    return _raw_public(key)


def trusted_keys(trust: TrustKeys | None = None, *, env: bool = True) -> dict[bytes, str] | None:
    """The trusted public keys (raw bytes -> key id) from ``trust`` and ``VJPSPLIT_TRUST_KEYS``; None: none given.

    ``trust`` is a path, raw public key bytes, or a sequence of them; the
    environment variable holds paths separated by ``os.pathsep``.
    """
    items: list[TrustKey] = []
    if trust is not None:
        items += list(trust) if isinstance(trust, (list, tuple, set, frozenset)) else [trust]
    if env:
        items += config.trust_key_paths()
    if not items:
        return None
    keys = {}
    for item in items:
        if isinstance(item, (bytes, bytearray)):
            if len(item) != 32:
                raise VjpsplitError(
                    f"trust key: {len(item)} raw bytes, not an Ed25519 public key's 32; pass the path of the "
                    "KEY.pub that `vjpsplit keygen` wrote, or the key's 32 raw bytes"
                )
            raw = bytes(item)
        else:
            raw = load_public_key(item)
        keys[raw] = key_id(raw)
    return keys


# ------------------------------------------------------------------------------ signatures


def _message(unsigned: bytes) -> bytes:
    return _DOMAIN + hashlib.sha256(unsigned).digest()


def sign(unsigned: bytes, private_key: Ed25519PrivateKey) -> dict[str, str | bytes]:
    """The signature entry for an artifact whose bytes without it are ``unsigned``."""
    return {"alg": "ed25519", "key": _raw_public(private_key.public_key()), "sig": private_key.sign(_message(unsigned))}


def verify(
    top: Mapping[str, Any],
    body: bytes,
    source: str,
    trusted: Mapping[bytes, str] | None,
    pack: Callable[[dict[str, Any]], bytes],
) -> str | None:
    """Check the signature of a decoded artifact map ``top`` (``body``: its bytes); return the signer's key id.

    Unsigned: None, or refused when ``trusted`` is given. A signature that does not
    verify is refused whether or not keys are trusted (the file is damaged or forged).
    """
    entry = top.get(SIGNATURE)
    if entry is None:
        if trusted is not None:
            raise VjpsplitError(
                f"{source}: the artifact is unsigned, and trust keys were given; ask its author "
                "for a signed copy (export --sign-key KEY), or drop --trust-key/VJPSPLIT_TRUST_KEYS "
                "to run it"
            )
        return None
    _, ed25519 = _crypto()
    if not (
        isinstance(entry, dict)
        and entry.get("alg") == "ed25519"
        and isinstance(entry.get("key"), bytes)
        and len(entry["key"]) == 32
        and isinstance(entry.get("sig"), bytes)
    ):
        raise VjpsplitError(f"{source}: the artifact's signature is malformed; copy or export it again")
    signer = key_id(entry["key"])
    if trusted is not None and entry["key"] not in trusted:
        raise VjpsplitError(
            f"{source}: signed by {signer}, which is not among the trusted keys "
            f"({', '.join(trusted.values())}); "
            "pass that signer's KEY.pub with --trust-key if you trust it"
        )
    # What was signed is re-encoded from what was decoded, so the file must be that very encoding.
    if pack(dict(top)) != body:
        raise VjpsplitError(
            f"{source}: the signed artifact was modified after signing (not canonically encoded); "
            "copy or export it again"
        )
    unsigned = pack({k: v for k, v in top.items() if k != SIGNATURE})
    try:
        from cryptography.exceptions import InvalidSignature

        ed25519.Ed25519PublicKey.from_public_bytes(entry["key"]).verify(entry["sig"], _message(unsigned))
    except (InvalidSignature, ValueError) as e:
        raise VjpsplitError(
            f"{source}: the artifact's signature does not verify: it was modified after signing; "
            "copy or export it again"
        ) from e
    return signer
