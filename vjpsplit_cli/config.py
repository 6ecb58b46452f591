"""Every environment variable vjpsplit reads, read here and nowhere else, with one rule for each kind.

| variable | meaning | values |
| --- | --- | --- |
| ``VJPSPLIT_FSYNC`` | flush every written file (and its directory) to disk | on/off |
| ``VJPSPLIT_DEBUG`` | the CLI prints tracebacks, as ``--debug`` does | on/off |
| ``VJPSPLIT_CACHE_DIR`` | where verdicts and executables are cached | a path, or off |
| ``VJPSPLIT_TRUST_KEYS`` | trusted public keys, as if each were given with ``--trust-key`` | paths separated by ``os.pathsep`` |
| ``VJPSPLIT_RAY_TRANSPORT`` | how a Ray runner's actors send each other a step's values | ``socket`` (default) or ``ray`` |

On/off values are ``1 true yes on`` and ``0 false no off`` (any case; unset or empty is the
default). Anything else is a :class:`VjpsplitError` naming the variable, rather than a guess: a
typo in ``VJPSPLIT_FSYNC=ture`` must not silently turn durability off. Each function reads the
environment when called, so a variable set before a call (or by a test) is honoured.

The private-directory rule for caches lives here too (``private_dir``, ``ensure_private_dir``):
entries in a cache become programs this process runs, so a cache directory must be this user's
and writable by no one else.
"""

from __future__ import annotations

import os
import stat

from .errors import VjpsplitError

FSYNC = "VJPSPLIT_FSYNC"
DEBUG = "VJPSPLIT_DEBUG"
CACHE_DIR = "VJPSPLIT_CACHE_DIR"
TRUST_KEYS = "VJPSPLIT_TRUST_KEYS"
RAY_TRANSPORT = "VJPSPLIT_RAY_TRANSPORT"
RAY_TRANSPORTS = ("socket", "ray")

_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


def flag(name: str, default: bool = False) -> bool:
    """The on/off variable ``name``: the one rule for every switch vjpsplit reads."""
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in _ON:
        return True
    if raw in _OFF:
        return False
    raise VjpsplitError(
        f"environment variable {name}={os.environ[name]!r} is neither on ({'/'.join(_ON)}) nor off ({'/'.join(_OFF)})"
    )


def fsync_always() -> bool:
    """True when ``VJPSPLIT_FSYNC`` asks for every write to be flushed to disk."""
    return flag(FSYNC)


def debug() -> bool:
    """True when ``VJPSPLIT_DEBUG`` asks the CLI for tracebacks."""
    return flag(DEBUG)


def cache_dir() -> str | None:
    """vjpsplit's cache directory: ``VJPSPLIT_CACHE_DIR`` (off, or empty: None), else ``vjpsplit/jax`` under
    ``$XDG_CACHE_HOME`` (``~/.cache``)."""
    env = os.environ.get(CACHE_DIR)
    if env is not None:
        return None if env.strip().lower() in ("", "none", *_OFF) else env
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "vjpsplit", "jax")


def trust_key_paths() -> list[str]:
    """The public key paths in ``VJPSPLIT_TRUST_KEYS`` (``os.pathsep``-separated), blanks dropped."""
    return [p for p in os.environ.get(TRUST_KEYS, "").split(os.pathsep) if p.strip()]


def ray_transport() -> str:
    """How a Ray runner's actors send each other a step's values: ``VJPSPLIT_RAY_TRANSPORT``, ``socket`` (one TCP
    connection between each two actors; the default) or ``ray`` (a Ray actor call per delivery)."""
    raw = os.environ.get(RAY_TRANSPORT, "").strip().lower()
    if not raw:
        return RAY_TRANSPORTS[0]
    if raw not in RAY_TRANSPORTS:
        raise VjpsplitError(
            f"environment variable {RAY_TRANSPORT}={os.environ[RAY_TRANSPORT]!r} is not one of "
            f"{', '.join(RAY_TRANSPORTS)}"
        )
    return raw


def private_dir(path: str | os.PathLike) -> bool:
    """True if ``path`` is a directory owned by this user that no one else can write.

    The rule for every cache whose entries become programs this process runs.
    """
    try:
        st = os.stat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022


def ensure_private_dir(path: str | os.PathLike) -> tuple[bool, str]:
    """Create ``path`` (mode 0700) if missing; whether it may hold a cache, and why not.

    The one place the cache rule is applied: the verdict cache, the executable cache and
    JAX's compilation cache all go through it.
    """
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as e:
        return False, e.strerror or str(e)
    if not os.path.isdir(path) or not os.access(path, os.W_OK | os.X_OK):
        return False, "not a writable directory"
    if not private_dir(path):
        return False, "owned by another user or writable by others; make it yours with mode 0700"
    return True, ""
