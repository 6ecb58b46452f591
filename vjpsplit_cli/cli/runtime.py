"""What a command needs to run an artifact: the caches it may use, x64, loading with one-line errors.

The cache directory is :func:`vjpsplit_cli.config.cache_dir`; every cache in it (JAX's
compilation cache, serialized executables, trust verdicts) must pass the private-directory
rule (:func:`vjpsplit_cli.config.ensure_private_dir`), since its entries become programs.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import click

from .. import config
from ..errors import VjpsplitError, one_line
from .app import debug_enabled, global_flag, log

if TYPE_CHECKING:  # imported when a command runs: ``vjpsplit --help`` imports neither JAX nor numpy
    import numpy as np

    from ..artifact.artifact import Artifact


def _active_cache_dir() -> str | None:
    """``config.cache_dir()`` when caching is on and the directory is private to this user; else None (no cache at all)."""
    if global_flag(click.get_current_context(), "no_cache"):
        return None
    path = config.cache_dir()
    return path if path is not None and config.ensure_private_dir(path)[0] else None


def executable_cache() -> str | None:
    """Where run-fwd/run-bwd keep serialized executables (``executables`` under ``config.cache_dir()``); None when off."""
    path = _active_cache_dir()
    return None if path is None else os.path.join(path, "executables")


def use_compilation_cache() -> None:
    """Turn on JAX's persistent compilation cache, so a repeated run skips XLA compilation."""
    if global_flag(click.get_current_context(), "no_cache"):
        return
    import jax

    configured = jax.config.jax_compilation_cache_dir  # type: ignore[attr-defined]  # jax.config is dynamic
    if configured:  # the user configured JAX's own cache: keep it, if it is safe to read programs from
        if "://" in str(configured) or config.ensure_private_dir(str(configured))[0]:
            return
        jax.config.update("jax_enable_compilation_cache", False)
        if debug_enabled(click.get_current_context()):
            log(
                f"debug: compilation cache {configured} unusable ({config.ensure_private_dir(str(configured))[1]}); "
                "running without it"
            )
        return
    path = config.cache_dir()
    if path is None:
        return
    usable, problem = config.ensure_private_dir(path)
    if not usable:
        # A cache is an optimisation: without one the command still works, so say so only when asked.
        if debug_enabled(click.get_current_context()):
            log(f"debug: compilation cache {path} unusable ({problem}); running without it")
        return
    if not debug_enabled(click.get_current_context()):
        import warnings

        # JAX warns per entry when the cache fails later (disk full, removed); the run is fine without it.
        warnings.filterwarnings("ignore", message=".*persistent compilation cache.*")
    jax.config.update("jax_compilation_cache_dir", path)
    # Small programs compile fast but a CLI pays for every one: cache them all.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def enable_x64_if(needed: bool) -> None:
    if needed:
        import jax

        jax.config.update("jax_enable_x64", True)


def wants_x64(specs: Sequence[Any]) -> bool:
    """Whether any leaf of ``specs`` has a dtype that needs ``jax_enable_x64`` (the CLI then turns it on)."""
    import jax

    from ..files.shapes import is_64bit

    return any(is_64bit(s) for s in jax.tree_util.tree_leaves(specs))


def load_artifact(
    path: str | os.PathLike[str], trust_keys: Sequence[str] = (), allow_kernels: bool = False, *, x64: bool = True
) -> Artifact:
    """Load an artifact; a manifest that decodes but does not fit the format is one line naming the file."""
    from ..artifact.loading import load

    try:
        art = load(path, trust=list(trust_keys) or None, allow_kernels=allow_kernels, cache_dir=_active_cache_dir())
    except (VjpsplitError, MemoryError, OSError):
        raise
    except Exception as e:  # e.g. a hand-edited manifest whose fingerprint was recomputed
        raise VjpsplitError(
            f"{path}: the artifact's manifest is malformed ({type(e).__name__} {one_line(e, 80)}); "
            "re-export it with vjpsplit export"
        ) from e
    if x64:
        # Read the manifest's x64 flag before jax touches any array.
        enable_x64_if(art.manifest.x64)
    return art


def to_numpy(values: Mapping[str, Any]) -> dict[str, np.ndarray]:
    import numpy as np

    return {k: np.asarray(v) for k, v in values.items()}
