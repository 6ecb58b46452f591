"""Kernel checks at the call's shapes: a symbolic artifact's LAPACK calls, vouched for once the shapes are known.

A shape-polymorphic module's LAPACK (and cuSOLVER) calls carry symbolic dims when
it is loaded, so their operand and result shapes cannot be compared then (module
``custom_calls`` defers them). JAX refines every symbolic module to the call's concrete
shapes before it compiles; this module does the same refinement first, walks the
refined module's custom calls and applies ``custom_calls``' shape rule to them, before
anything compiles. The verdict is kept per module and refined signature (the
arguments' shapes and dtypes), in this process and in vjpsplit's private cache
directory, so a repeated call at the same shapes costs a dictionary look-up.
"""

from __future__ import annotations

import hashlib
import io
import os
import sys
from typing import TYPE_CHECKING, Any, Protocol, Sequence

import jax
import numpy as np

from ..errors import VjpsplitError, first_line
from . import verdicts
from .custom_calls import check_calls

if TYPE_CHECKING:
    from jaxlib.mlir import ir


class Lowerable(Protocol):
    """A ``jax.jit``-wrapped function: it can be lowered for arguments."""

    def lower(self, *args: Any) -> jax.stages.Lowered: ...


def signature_of(args: Sequence[Any]) -> str:
    """The refined signature of a call: every argument leaf's dtype and shape (and sharding spec, if any)."""
    parts = []
    for a in jax.tree_util.tree_leaves(args):
        spec = getattr(getattr(a, "sharding", None), "spec", None)
        parts.append(f"{np.dtype(a.dtype).name}{list(np.shape(a))}{'' if spec is None else spec}")
    return ";".join(parts)


def verdict_name(data: bytes, args: Sequence[Any]) -> str:
    """The cache name of the verdict on module bytes ``data`` at the call signature of ``args``."""
    import jaxlib

    h = hashlib.sha256()
    for part in (b"refined", getattr(jaxlib, "__version__", "?").encode(), bytes(data), signature_of(args).encode()):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest() + ".json"


def _bytecode(module: ir.Module) -> bytes:
    buf = io.BytesIO()
    module.operation.write_bytecode(file=buf)
    return buf.getvalue()


def refined_calls(jitted: Lowerable, args: Sequence[Any], source: str, module: str) -> list[dict[str, Any]]:
    """The custom calls of ``jitted``'s module lowered for ``args`` and refined to their shapes.

    The module was parsed safely when it was loaded; this lowers it as a call would
    and refines it as JAX does before compiling (MLIR's diagnostics kept off the
    terminal). A failure is one ``VjpsplitError``.
    """
    from .mlirprobe import probe_refined

    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
        lowered = jitted.lower(*args)
        shardy = bool(getattr(jax.config, "jax_use_shardy_partitioner", True))
        stablehlo = lowered.compiler_ir("stablehlo")
        if stablehlo is None:  # jax gives no module for a dialect it cannot lower to: refused as below
            raise ValueError("the lowering has no StableHLO module")
        calls: list[dict[str, Any]] = probe_refined(_bytecode(stablehlo), shardy=shardy)["calls"]
        return calls
    except VjpsplitError:
        raise
    except Exception as e:
        raise VjpsplitError(
            f"{source}: the {module} module could not be refined to these shapes to check its kernels "
            f"({first_line(e)[:160]}); the artifact is damaged or forged: export it again"
        ) from e
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def check_at_call(
    source: str, module: str, jitted: Lowerable, args: Sequence[Any], data: bytes, cache_dir: str | None
) -> None:
    """Vouch for ``module``'s kernels at the shapes of ``args`` before it compiles, or refuse it in one line.

    ``data``: the module's serialized bytes (the verdict's key, with the signature);
    ``cache_dir``: where verdicts persist (``verdicts.DEFAULT``, a directory, or None).
    """
    name = verdict_name(data, args)
    if verdicts.known_verdict(name, cache_dir):
        return
    calls = refined_calls(jitted, args, source, module)
    check_calls(source, module, calls, trusted_signer=False, allow_kernels=False, refined=True)
    verdicts.keep_verdict(name, {"refined": True, "calls": len(calls)}, cache_dir)
