"""Compiled executables kept on disk, so that a repeated CLI command neither lowers nor compiles.

JAX's persistent compilation cache skips XLA compilation, but every command still
lowers the deserialized module (shape refinement, and on CPU the import of
scipy's LAPACK that ``jax.export`` does before lowering any module): about 0.3 s
of a 1.5 s command. ``jax.experimental.serialize_executable`` serializes the
compiled program itself, so a hit runs it straight away.

An entry is keyed by everything that could make another program: the artifact's
fingerprint and module, the argument structure, shapes, dtypes and weak types,
the platform and device kind, the jax and jaxlib versions, x64 and ``XLA_FLAGS``.
Loading runs pickle (jax's format), so only entries in a directory and files
owned by this user and writable by no one else are read, and each entry carries
a SHA-256 of its body: a corrupt, truncated or foreign entry is ignored and the
program compiled as usual. Any failure of the cache itself is silent: it is an
optimisation, never a reason for a command to fail.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile
from typing import Any, Callable, Sequence

import jax

from .. import config

_MAGIC = b"VJPSPLIT-EXEC-1\n"
_MAX_ENTRY = 1 << 30  # an executable is MiBs; anything bigger is not ours


def _encode_tree(treedef: Any) -> Any:
    """A treedef of tuples, lists, str-keyed dicts and None as JSON; raises ValueError otherwise."""

    def enc(x: Any) -> Any:
        if x is None:
            return {"n": 0}
        if type(x) is tuple:
            return {"t": [enc(v) for v in x]}
        if type(x) is list:
            return {"l": [enc(v) for v in x]}
        if type(x) is dict and all(isinstance(k, str) for k in x):
            return {"d": [[k, enc(v)] for k, v in x.items()]}
        if x is _LEAF:
            return 0
        raise ValueError(f"tree node {type(x).__name__} is not cacheable")

    return enc(jax.tree_util.tree_unflatten(treedef, [_LEAF] * treedef.num_leaves))


def _decode_tree(data: Any) -> Any:
    def dec(x: Any) -> Any:
        if x == 0:
            return _LEAF
        ((kind, v),) = x.items()
        if kind == "n":
            return None
        if kind == "t":
            return tuple(dec(e) for e in v)
        if kind == "l":
            return [dec(e) for e in v]
        if kind == "d":
            return {k: dec(e) for k, e in v}
        raise ValueError(kind)

    return jax.tree_util.tree_structure(dec(data), is_leaf=lambda x: x is _LEAF)


class _Leaf:
    __slots__ = ()


_LEAF = _Leaf()


def entry_key(args: Sequence, parts: Sequence[str]) -> str:
    """The cache key of calling a program named by ``parts`` on ``args``: a hex SHA-256."""
    import jaxlib

    leaves, tree = jax.tree_util.tree_flatten((tuple(args), {}))
    dev = jax.devices()[0]
    avals = []
    for a in leaves:
        weak = bool(getattr(a, "weak_type", False))
        avals.append([list(map(int, jax.numpy.shape(a))), str(jax.numpy.result_type(a)), weak])
    doc = {
        "parts": list(parts),
        "tree": str(tree),
        "avals": avals,
        "jax": jax.__version__,
        "jaxlib": getattr(jaxlib, "__version__", "?"),
        "platform": dev.platform,
        "device_kind": getattr(dev, "device_kind", ""),
        "x64": bool(jax.config.jax_enable_x64),  # type: ignore[attr-defined]  # jax.config is dynamic
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def _read(path: str) -> tuple[dict, bytes] | None:
    """Header and payload of a valid entry owned by us, else None."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022 or st.st_size > _MAX_ENTRY:
            return None
        data = f.read()
    if not data.startswith(_MAGIC) or len(data) < len(_MAGIC) + 32 + 8:
        return None
    digest, body = data[len(_MAGIC) : len(_MAGIC) + 32], data[len(_MAGIC) + 32 :]
    if hashlib.sha256(body).digest() != digest:
        return None
    n = int.from_bytes(body[:8], "little")
    try:
        header = json.loads(body[8 : 8 + n])
    except ValueError:
        return None
    return (header, body[8 + n :]) if isinstance(header, dict) else None


def _write(directory: str, name: str, header: dict, payload: bytes) -> None:
    head = json.dumps(header).encode()
    body = len(head).to_bytes(8, "little") + head + payload
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:  # mkstemp: mode 0600
            f.write(_MAGIC + hashlib.sha256(body).digest() + body)
        os.replace(tmp, os.path.join(directory, name))
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def compiled_call(jitted: Any, args: Sequence, parts: Sequence[str], directory: str) -> Callable:
    """``jitted``'s compiled program for ``args``, from ``directory`` if cached there, else compiled and saved.

    Errors of lowering or compiling (a refused shape) propagate as from calling
    ``jitted``; errors of the cache itself fall back to compiling, silently.
    """
    key = entry_key(args, parts)
    name = key + ".exe"
    usable = config.ensure_private_dir(directory)[0]
    if usable:
        try:
            found = _read(os.path.join(directory, name))
            if found is not None and found[0].get("key") == key:
                from jax.experimental import serialize_executable as se

                in_tree = jax.tree_util.tree_structure((tuple(args), {}))
                loaded = se.deserialize_and_load(found[1], in_tree, _decode_tree(found[0]["out_tree"]))
                return _guarded(loaded, jitted, os.path.join(directory, name))
        except Exception:  # a stale or damaged entry: compile instead
            pass
    if not usable:
        return jitted
    # An executable that JAX's persistent cache handed back serializes without its
    # CPU kernels ("Function ... not found" when run): compile this one afresh. (JAX
    # decides once per process whether its cache is used, so in a process that has
    # already compiled with it this may not take; _guarded catches such an entry.)
    before = jax.config.jax_enable_compilation_cache  # type: ignore[attr-defined]
    try:
        jax.config.update("jax_enable_compilation_cache", False)
        compiled = jitted.lower(*args).compile()
    finally:
        jax.config.update("jax_enable_compilation_cache", before)
    try:
        from jax.experimental import serialize_executable as se

        payload, _, out_tree = se.serialize(compiled)
        encoded = _encode_tree(out_tree)
        if _decode_tree(encoded) == out_tree:
            _write(directory, name, {"key": key, "out_tree": encoded}, payload)
    except Exception:  # not serializable here, disk full, read-only: run without caching
        pass
    return compiled


def _guarded(loaded: Callable, jitted: Callable, path: str) -> Callable:
    """``loaded``, but if running it fails (an entry the checks could not catch), drop the entry and use ``jitted``."""

    def call(*args: Any) -> Any:
        try:
            # Blocking here makes an execution failure of a bad entry surface now, not at a later read.
            return jax.block_until_ready(loaded(*args))
        except (ValueError, TypeError):
            raise
        except Exception:
            try:
                os.unlink(path)
            except OSError:
                pass
            return jitted(*args)

    return call
