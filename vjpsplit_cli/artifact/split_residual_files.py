"""``split``'s residuals in a file: what one holds, and reading it back in the process that made them.

``split``'s residuals are keyed ``r/i`` with their input-backed ones by flat argument
position, and tied to the forward's plan by its token: only the process whose
``split`` made them has their backward. The file's reading and checks common to every
residual file are ``residual_files`` and ``residual_meta``.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

import jax
import numpy as np

from ..errors import VjpsplitError
from ..files import keys
from ..files.prng import data_struct, from_data, impl_name, is_key, to_data
from ..files.shapes import format_shape
from ..tracing.residuals import Residuals, SplitResiduals
from ..tracing.vjp import plan_for_token
from .residual_meta import KIND_SPLIT, binding


def split_contents(res: SplitResiduals, self_contained: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """The arrays and metadata a file of ``split``'s residuals holds.

    Args:
        res: ``split``'s residuals.
        self_contained: Whether the input-backed residuals are written too.

    Returns:
        The arrays by key (typed PRNG keys as their key data) and the metadata.
    """
    arrays = {k: np.asarray(to_data(v)) for k, v in res.stored.items()}
    if self_contained:
        arrays.update({keys.input_backed(k): np.asarray(to_data(v)) for k, v in res.inputs.items()})
    meta = {
        "kind": KIND_SPLIT,
        "token": res.plan.token,
        "pid": os.getpid(),
        "needs_inputs": [] if self_contained else [str(k) for k in res.plan.input_backed],
        "self_contained": bool(self_contained),
        **binding(res),
    }
    return arrays, meta


def load_split_residuals(
    path: str | os.PathLike, arrays: Mapping[str, Any], meta: Mapping[str, Any], needs: Sequence[str], inputs: Any
) -> Residuals:
    """``split``'s residuals from a file's ``arrays`` and ``meta``, in the process that made them.

    Args:
        path: The file, for messages.
        arrays: The file's arrays by key.
        meta: The file's metadata (a ``KIND_SPLIT`` one).
        needs: The input keys the file left out (its ``needs_inputs``).
        inputs: The forward's arguments (any pytree), for the input-backed residuals
            the file left out; ``None`` when none are given.

    Returns:
        The ``SplitResiduals``, tied to their plan.

    Raises:
        VjpsplitError: If the residuals come from another process, a residual is
            missing or has another shape or dtype than the forward's, or the inputs
            are needed but not given or not the forward's arguments.
    """
    plan = plan_for_token(str(meta.get("token")))
    if plan is None:
        raise VjpsplitError(
            f"{path}: these residuals come from split() in another process (pid {meta.get('pid')}); "
            "their backward lives only there; use vs.export(...) artifacts to run the backward elsewhere"
        )
    try:
        stored = tuple(arrays[keys.stored(i)] for i in range(plan.n_stored))
    except KeyError as e:
        raise VjpsplitError(f"{path}: residual {e.args[0]!r} is missing; rerun the forward") from e
    if meta.get("self_contained"):
        try:
            ins = tuple(
                _from_file(path, keys.input_backed(str(k)), arrays[keys.input_backed(str(k))], plan.arg_leaf_avals[k])
                for k in plan.input_backed
            )
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
            raise VjpsplitError(
                f"{path}: inputs have {len(flat)} leaves, the forward had {len(plan.arg_leaf_avals)}; "
                "pass the arguments fwd ran on"
            )
        ins = tuple(flat[k] for k in plan.input_backed)
    stored = tuple(
        _from_file(path, keys.stored(i), v, aval) for i, (v, aval) in enumerate(zip(stored, plan.stored_avals))
    )
    return SplitResiduals(
        {keys.stored(i): v for i, v in enumerate(stored)},
        {str(k): v for k, v in zip(plan.input_backed, ins)},
        plan=plan,
    )


def _from_file(path: str | os.PathLike, key: str, v: Any, aval: Any) -> Any:
    """A split residual as the backward wants it: checked, typed PRNG keys rewrapped."""
    want = data_struct(aval) if is_key(aval) else aval
    if tuple(v.shape) != tuple(want.shape) or np.dtype(v.dtype) != np.dtype(want.dtype):
        raise VjpsplitError(
            f"{path}: residual '{key}': expected {format_shape(want.dtype, want.shape)}, "
            f"file has {format_shape(v.dtype, v.shape)}; rerun the forward"
        )
    return from_data(v, impl_name(aval)) if is_key(aval) else v
