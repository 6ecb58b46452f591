"""The function and its backward over flat leaves, as ``export`` lowers them.

``jax.export`` serializes modules over flat arrays, so the forward takes the flat
input leaves and gives flat outputs, residuals and aux, with typed PRNG keys as
their key data; the user's classes live only in this closure. The trace and the
backward run through the shared ``tracing.traced.TracedVjp``.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax import export as jexport

from ..files.prng import from_data, impl_name, is_key, to_data
from ..tracing.traced import TracedVjp
from ..tracing.vjp import Plan


def _impls(leaves: Sequence[Any]) -> list[str]:
    return [impl_name(x) if is_key(x) else "" for x in leaves]


class FlatForward:
    """The forward over flat leaves (typed keys as key data), and what its last trace learned.

    The user's classes live only in this closure, never in the serialized
    artifact; jax.export traces it, and the backward and the manifest read
    ``plan``, ``out``, ``aux`` and the PRNG impls of its outputs from here.
    """

    def __init__(self, traced: TracedVjp, in_tree: Any, in_impls: Sequence[str]) -> None:
        self.traced, self.in_tree, self.in_impls = traced, in_tree, list(in_impls)
        self.out: Any = None
        self.aux: Any = None
        self.out_impls: list[str] = []
        self.aux_impls: list[str] = []
        self.stored_impls: list[str] = []

    @property
    def plan(self) -> Plan:
        """The plan of the last trace."""
        return self.traced.plan

    def __call__(self, *leaves: Any) -> tuple[tuple, tuple, tuple]:
        args = jax.tree_util.tree_unflatten(self.in_tree, [from_data(x, i) for x, i in zip(leaves, self.in_impls)])
        out, stored, aux = self.traced.forward(*args)
        out_leaves, aux_leaves = jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(aux)
        self.out, self.aux = out, aux
        self.out_impls, self.aux_impls, self.stored_impls = _impls(out_leaves), _impls(aux_leaves), _impls(stored)
        return (
            tuple(to_data(x) for x in out_leaves),
            tuple(to_data(x) for x in stored),
            tuple(to_data(x) for x in aux_leaves),
        )

    def backward(self, input_backed_impls: Sequence[str]) -> Callable:
        """The backward of the last trace over flat leaves: ``(stored, input-backed, cts, dims_arg) -> grads``."""
        replay, stored_impls = TracedVjp.of_plan(self.plan), self.stored_impls

        def bwd_flat(stored: Sequence[Any], inputs_: Sequence[Any], cts: Sequence[Any], dims_arg: Any) -> Any:
            # dims_arg, the dims argument, is a zero-size array whose dims are the symbolic dims: it makes
            # them solvable even when no other backward input mentions them.
            del dims_arg
            stored = [from_data(x, i) for x, i in zip(stored, stored_impls)]
            inputs_ = [from_data(x, i) for x, i in zip(inputs_, input_backed_impls)]
            return replay.backward(stored, inputs_, cts)

        return bwd_flat


def dims_arg_struct(dim_vars: Sequence[str], flat_structs: Sequence[Any]) -> jax.ShapeDtypeStruct | None:
    """The dims argument's struct: a zero-size bool array whose dims are the symbolic dims (None without any)."""
    if not dim_vars:
        return None
    scope = next(d for s in flat_structs for d in s.shape if not isinstance(d, int)).scope
    return jax.ShapeDtypeStruct((0, *jexport.symbolic_shape(",".join(dim_vars), scope=scope)), jnp.bool_)
