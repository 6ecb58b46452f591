"""One trace of ``jax.vjp``, cut into a forward and a backward: the mechanics under split and export.

Only public JAX is used. ``jax.vjp`` returns its backward as a pytree whose
leaves are the residuals and whose treedef holds the backward program; we
return those leaves from the forward as plain arrays and rebuild the callable
with ``tree_unflatten`` in the backward. Leaves that *are* inputs of the
function (identified with ``is`` while tracing) are not returned: the residuals
refer to the caller's arrays instead of copying them.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Literal, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.tree_util import PyTreeDef
from jax.typing import ArrayLike, DTypeLike

from ..errors import VjpsplitError
from ..files.shapes import format_shape

# Their home is ``signatures``; named here too for the importers outside tracing that take them from ``vjp``.
from .signatures import fn_name

if TYPE_CHECKING:
    from jax.extend.core import Jaxpr

float0 = jax.dtypes.float0

# Where one vjp leaf comes from in the backward (see ``Plan.slots``).
Slot = tuple[Literal["stored", "input", "unused"], int]


def struct_of(x: ArrayLike) -> jax.ShapeDtypeStruct:
    """The shape and dtype of an array, tracer or Python scalar (weakly typed as JAX types it)."""
    return jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))


def is_differentiable(dtype: DTypeLike) -> bool:
    """Floating and complex leaves get gradients; integer and bool ones get float0 zeros."""
    return jnp.issubdtype(dtype, jnp.inexact)


@dataclass(frozen=True, eq=False)
class Plan:
    """What one trace of the forward learned; static, compared by identity.

    ``slots[i]`` says where vjp leaf ``i`` comes from in the backward:
    ``("stored", j)`` the j-th stored residual, ``("input", k)`` the k-th
    leaf of the flattened arguments, ``("unused", z)`` a leaf the backward never
    reads (zeros of ``unused_avals[z]`` stand in for it).
    """

    vjp_tree: PyTreeDef
    slots: tuple[Slot, ...]
    args_tree: PyTreeDef
    arg_leaf_avals: tuple[jax.ShapeDtypeStruct, ...]
    diff_leaves: tuple[int, ...]  # flat arg-leaf indices that are differentiated
    wrt: tuple[int, ...]  # argument positions in the gradient tuple
    out_tree: PyTreeDef
    out_avals: tuple[jax.ShapeDtypeStruct, ...]
    out_diff: tuple[int, ...]  # output leaves that take a cotangent
    single_grad: bool
    stored_avals: tuple[jax.ShapeDtypeStruct, ...]
    token: str  # names this plan in residual files (same process only)
    unused_avals: tuple[jax.ShapeDtypeStruct, ...] = ()

    @property
    def input_backed(self) -> tuple[int, ...]:
        """Flat arg-leaf indices that the backward reads straight from the inputs."""
        return tuple(k for kind, k in self.slots if kind == "input")

    @property
    def n_stored(self) -> int:
        """How many residuals the forward stores."""
        return len(self.stored_avals)


def trace_vjp(
    fn: Callable[..., Any], args: tuple[Any, ...], wrt: tuple[int, ...], single: bool, has_aux: bool
) -> tuple[Any, tuple[jax.Array, ...], Any, Plan]:
    """Run ``jax.vjp`` on ``fn(*args)`` and cut its result into forward outputs and a Plan.

    Call while tracing (inside jit or export): the identity test that finds
    input-backed residuals compares tracers. Returns ``(out, stored, aux, plan)``.
    """
    flat_args, args_tree = jax.tree_util.tree_flatten(args)
    wrt_set = set(wrt)
    leaf_owner: list[int] = []
    for pos, a in enumerate(args):
        leaf_owner += [pos] * len(jax.tree_util.tree_leaves(a))
    diff = tuple(
        i
        for i, (pos, leaf) in enumerate(zip(leaf_owner, flat_args))
        if pos in wrt_set and is_differentiable(jnp.result_type(leaf))
    )

    def f_diff(*diff_leaves: jax.Array) -> Any:
        leaves = list(flat_args)
        for i, v in zip(diff, diff_leaves):
            leaves[i] = v
        return fn(*jax.tree_util.tree_unflatten(args_tree, leaves))

    primals = [flat_args[i] for i in diff]
    # Only floating outputs take part in the vjp; integer and bool outputs ride
    # along as aux, so no float0 cotangent ever crosses a jit or export boundary.
    shape_of_out: dict[str, Any] = {}

    def f_split(*diff_leaves: jax.Array) -> tuple[list[Any], tuple[list[Any], Any]]:
        res = f_diff(*diff_leaves)
        if has_aux and not (isinstance(res, (tuple, list)) and len(res) == 2):
            got = (
                f"a {len(res)}-tuple"
                if isinstance(res, (tuple, list))
                else (format_shape(res.dtype, res.shape) if hasattr(res, "shape") else type(res).__name__)
            )
            raise VjpsplitError(f"has_aux is set, so {fn_name(fn)} must return a pair (out, aux); it returned {got}")
        out, aux = res if has_aux else (res, None)
        leaves, tree = jax.tree_util.tree_flatten(out)
        shape_of_out["tree"] = tree
        shape_of_out["mask"] = [is_differentiable(jnp.result_type(o)) for o in leaves]
        d = [o for o, m in zip(leaves, shape_of_out["mask"]) if m]
        nd = [o for o, m in zip(leaves, shape_of_out["mask"]) if not m]
        return d, (nd, aux)

    d_out, vjp_fn, (nd_out, aux) = jax.vjp(f_split, *primals, has_aux=True)
    mask = shape_of_out["mask"]
    d_it, nd_it = iter(d_out), iter(nd_out)
    out_leaves = [next(d_it) if m else next(nd_it) for m in mask]
    out_tree = shape_of_out["tree"]
    out = jax.tree_util.tree_unflatten(out_tree, out_leaves)

    vjp_leaves, vjp_tree = jax.tree_util.tree_flatten(vjp_fn)
    stored, slots = _slots(vjp_leaves, flat_args)
    stored, slots, unused = _drop_unused(vjp_tree, vjp_leaves, slots, stored, list(d_out))
    plan = Plan(
        vjp_tree=vjp_tree,
        slots=tuple(slots),
        args_tree=args_tree,
        arg_leaf_avals=tuple(struct_of(a) for a in flat_args),
        diff_leaves=diff,
        wrt=wrt,
        out_tree=out_tree,
        out_avals=tuple(struct_of(o) for o in out_leaves),
        out_diff=tuple(i for i, m in enumerate(mask) if m),
        single_grad=single,
        stored_avals=tuple(struct_of(v) for v in stored),
        token=uuid.uuid4().hex,
        unused_avals=tuple(unused),
    )
    return out, tuple(stored), aux, plan


def _slots(vjp_leaves: Sequence[jax.Array], flat_args: Sequence[jax.Array]) -> tuple[list[jax.Array], list[Slot]]:
    """The values to store, and where each vjp leaf comes from: an input (the caller's array) or a stored value."""
    by_id = {id(a): k for k, a in enumerate(flat_args)}
    stored: list[jax.Array] = []
    slots: list[Slot] = []
    seen: dict[int, int] = {}
    for leaf in vjp_leaves:
        k = by_id.get(id(leaf))
        if k is not None and flat_args[k] is leaf:
            slots.append(("input", k))
        elif id(leaf) in seen:  # one value kept twice by jax.vjp: store it once
            slots.append(("stored", seen[id(leaf)]))
        else:
            seen[id(leaf)] = len(stored)
            slots.append(("stored", len(stored)))
            stored.append(leaf)
    return stored, slots


# Call-like primitives whose body maps inputs and outputs one to one: liveness looks inside them.
_CALLS = ("jit", "pjit", "closed_call", "core_call", "checkpoint", "remat")


def _live_inputs(jaxpr: Jaxpr, live_out: Sequence[bool]) -> list[bool]:
    """Which inputs of ``jaxpr`` (a Jaxpr) the live outputs depend on; effects keep their inputs alive."""
    live = {v for v, keep in zip(jaxpr.outvars, live_out) if keep and not hasattr(v, "val")}
    for eqn in reversed(jaxpr.eqns):
        outs = [o in live for o in eqn.outvars]
        if not any(outs) and not eqn.effects:
            continue
        inner = eqn.params.get("jaxpr") if eqn.primitive.name in _CALLS else None
        inner = getattr(inner, "jaxpr", inner)
        if (
            inner is not None
            and not eqn.effects
            and len(inner.invars) == len(eqn.invars)
            and len(inner.outvars) == len(eqn.outvars)
        ):
            used = _live_inputs(inner, outs)
        else:
            used = [True] * len(eqn.invars)
        live.update(v for v, u in zip(eqn.invars, used) if u and not hasattr(v, "val"))
    return [v in live for v in jaxpr.invars]


def _drop_unused(
    vjp_tree: PyTreeDef,
    vjp_leaves: list[jax.Array],
    slots: list[Slot],
    stored: list[jax.Array],
    d_out: list[jax.Array],
) -> tuple[list[jax.Array], list[Slot], list[jax.ShapeDtypeStruct]]:
    """Stored residuals the backward never reads (jax.vjp keeps, e.g., the zeros of relu's select) are dropped.

    The forward would write them for nothing: 2 MiB of zeros per step in the
    MLP benchmark. The backward gets zeros in their place, which XLA removes.
    Returns the kept stored values, the renumbered slots and the dropped avals.
    """
    if not stored:
        return stored, slots, []
    avals = [struct_of(v) for v in vjp_leaves]
    cts = [struct_of(o) for o in d_out]
    try:
        closed = jax.make_jaxpr(lambda leaves, c: jax.tree_util.tree_unflatten(vjp_tree, leaves)(c))(avals, cts)
        used_leaf = _live_inputs(closed.jaxpr, [True] * len(closed.jaxpr.outvars))[: len(vjp_leaves)]
    except Exception:  # liveness is an optimisation: keep everything if the backward cannot be traced here
        return stored, slots, []
    used = [False] * len(stored)
    for (kind, k), u in zip(slots, used_leaf):
        if kind == "stored" and u:
            used[k] = True
    if all(used):
        return stored, slots, []
    renumber: dict[int, int] = {}
    kept: list[jax.Array] = []
    unused: list[jax.ShapeDtypeStruct] = []
    new_slots: list[Slot] = []
    for j, (v, u) in enumerate(zip(stored, used)):
        if u:
            renumber[j] = len(kept)
            kept.append(v)
    zero_of: dict[int, int] = {}
    for (kind, k), leaf in zip(slots, vjp_leaves):
        if kind != "stored":
            new_slots.append((kind, k))
        elif k in renumber:
            new_slots.append(("stored", renumber[k]))
        else:
            if k not in zero_of:
                zero_of[k] = len(unused)
                unused.append(struct_of(leaf))
            new_slots.append(("unused", zero_of[k]))
    return kept, new_slots, unused


def run_backward(
    plan: Plan, stored: Sequence[jax.Array], inputs: Sequence[jax.Array], cts: Sequence[jax.Array]
) -> tuple[jax.Array, ...]:
    """Gradients of the differentiated leaves, from residuals alone (no forward).

    ``inputs`` are the input-backed leaves in ``plan.input_backed`` order and
    ``cts`` one cotangent per floating output leaf (``plan.out_diff``).
    """
    from_input = dict(zip(plan.input_backed, inputs))
    zeros = [jnp.zeros(a.shape, a.dtype) for a in plan.unused_avals]
    pick: dict[str, Any] = {"stored": stored, "input": from_input, "unused": zeros}
    vjp_leaves = [pick[kind][k] for kind, k in plan.slots]
    vjp_fn = jax.tree_util.tree_unflatten(plan.vjp_tree, vjp_leaves)
    return tuple(vjp_fn(list(cts)))


def assemble_grads(plan: Plan, diff_grads: Sequence[Any]) -> Any:
    """Per-argument gradients with the arguments' structure; float0 zeros where not differentiated."""
    flat: list[Any] = [np.zeros(a.shape, float0) for a in plan.arg_leaf_avals]
    for i, g in zip(plan.diff_leaves, diff_grads):
        flat[i] = g
    per_arg = jax.tree_util.tree_unflatten(plan.args_tree, flat)
    grads = tuple(per_arg[p] for p in plan.wrt)
    return grads[0] if plan.single_grad else grads


def cotangent_leaves(plan: Plan, ct: Any) -> list[Any]:
    """The cotangents of the floating outputs, from a pytree shaped like the output.

    ``None`` means 1 for a single floating scalar output. Entries for integer or
    bool outputs are ignored (they take no cotangent).
    """
    if ct is None:
        if len(plan.out_avals) != 1 or plan.out_diff != (0,) or plan.out_avals[0].shape != ():
            raise VjpsplitError("a cotangent is required: the output is not a single floating-point scalar")
        return [jnp.ones((), plan.out_avals[0].dtype)]
    leaves, tree = jax.tree_util.tree_flatten(ct)
    if tree != plan.out_tree:
        raise VjpsplitError(f"cotangent structure {tree} does not match the output structure {plan.out_tree}")
    out: list[Any] = []
    for i in plan.out_diff:
        c, aval = leaves[i], plan.out_avals[i]
        if jnp.shape(c) != tuple(aval.shape) or jnp.result_type(c) != aval.dtype:
            raise VjpsplitError(
                f"cotangent leaf {i}: expected {format_shape(aval.dtype, aval.shape)}, "
                f"got {format_shape(jnp.result_type(c), jnp.shape(c))}"
            )
        out.append(c)
    return out


# Plans by token, so residuals saved to disk can find their backward again in
# this process. Plans are small (a treedef and a few tuples); they live as long
# as the process, like jit's own caches.
_PLANS: dict[str, Plan] = {}


def register_plan(plan: Plan) -> None:
    """Remember ``plan`` so that residual files it wrote load again in this process."""
    _PLANS[plan.token] = plan


def plan_for_token(token: str) -> Plan | None:
    """The Plan that wrote residuals with ``token`` in this process, if any."""
    return _PLANS.get(token)
