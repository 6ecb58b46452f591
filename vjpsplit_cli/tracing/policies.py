"""Save versus recompute: the policies, applying one to a function, and what each costs.

A policy is a ``jax.checkpoint`` policy applied to the whole function:
``everything`` (what ``jax.vjp`` keeps), ``dots`` (matmul and convolution outputs),
``nothing`` (inputs only) and ``names:a,b`` (values tagged with
``jax.ad_checkpoint.checkpoint_name``). ``policy_cost`` traces, never runs, a
function under one and measures its stored residuals and its backward's work.
Choosing among them (under a memory budget, or ``policy="auto"``, which compiles and
times the fixed policies that fit) is module ``choice``; sizes and byte counts are
``files.sizes``.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import jax
import numpy as np

from ..errors import VjpsplitError, first_line
from ..files.shapes import is_symbolic_shape
from ..files.sizes import byte_terms_of_shape, evaluate_terms
from .jaxprs import iter_eqns, sub_jaxprs
from .specs import concrete_specs
from .traced import TracedVjp
from .signatures import Wrt, fn_wrt_positions
from .vjp import Plan

if TYPE_CHECKING:
    from jax.extend.core import ClosedJaxpr

# The fixed policies; ``names:a,b`` (any names) is the fourth form.
POLICIES = ("everything", "dots", "nothing")
AUTO = "auto"  # resolved to one of them by measuring (module choice)


def normalize_policy(policy: str | None) -> str:
    """The canonical policy string; None means ``everything``."""
    if policy is None or policy == "everything":
        return "everything"
    if policy in ("dots", "nothing"):
        return policy
    if policy.startswith("names:"):
        names = [n.strip() for n in policy[len("names:") :].split(",") if n.strip()]
        if not names:
            raise VjpsplitError("policy 'names:' needs at least one name, e.g. names:h1,h2")
        return "names:" + ",".join(names)
    if policy == AUTO:
        raise VjpsplitError("policy 'auto' is resolved by split or export (choose_auto) to a concrete policy first")
    raise VjpsplitError(f"unknown policy {policy!r}; use everything, dots, nothing, auto or names:a,b")


def apply_policy(fn: Callable[..., Any], policy: str | None) -> Callable[..., Any]:
    """``fn`` wrapped so that ``jax.vjp`` keeps what ``policy`` says and nothing more.

    ``everything`` is ``fn`` itself: note that ``jax.checkpoint(fn, policy=None)``
    would save *nothing*, the opposite.
    """
    policy = normalize_policy(policy)
    cp = jax.checkpoint_policies
    if policy == "everything":
        return fn
    if policy == "dots":
        saveable = cp.dots_saveable
    elif policy == "nothing":
        saveable = cp.nothing_saveable
    else:
        saveable = cp.save_only_these_names(*policy[len("names:") :].split(","))
    return PolicyFallback(fn, jax.checkpoint(fn, policy=saveable), policy)


class PolicyFallbackWarning(UserWarning):
    """A policy JAX cannot apply to a function that differentiates without it: the function ran as ``everything``."""


class PolicyFallback:
    """``jax.checkpoint(fn, policy)``, or ``fn`` itself where JAX fails to apply the policy but not to ``fn``.

    JAX's rematerialisation can fail on functions ``jax.vjp`` differentiates, e.g.
    a ``custom_jvp`` under ``vmap`` whose primal output is a constant (JAX's
    ``hard_stuff2`` case: ``broadcast_in_dim`` refuses the unbatched zeros). The
    error is raised while the checkpointed function is traced, so this falls back
    to ``fn`` in the same trace (every value kept, as ``everything`` keeps them),
    warns, and records it in ``fell_back``. If ``fn`` fails too, that error is raised.
    """

    def __init__(self, fn: Callable[..., Any], checkpointed: Callable[..., Any], policy: str) -> None:
        self.fn, self.checkpointed, self.policy = fn, checkpointed, policy
        self.fell_back = ""  # JAX's error, once the policy could not be applied
        functools.update_wrapper(self, fn, updated=())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.checkpointed(*args, **kwargs)
        except (TypeError, ValueError, NotImplementedError) as e:
            out = self.fn(*args, **kwargs)  # the function's own error, if it fails without the policy too
            self.fell_back = first_line(e)
            warnings.warn(
                f"policy {self.policy!r} cannot be applied to {getattr(self.fn, '__name__', 'the function')} "
                f"(JAX's checkpoint fails on it: {self.fell_back[:160]}); it keeps every residual instead, "
                "as policy 'everything'",
                PolicyFallbackWarning,
                stacklevel=2,
            )
            return out


# Cheapest recompute first: a budget takes the first of these that fits.
BUDGET_ORDER = ("everything", "dots", "nothing")


def candidate(
    fn: Callable[..., Any], policy: str | None, wrt_pos: tuple[int, ...], single: bool, has_aux: bool
) -> TracedVjp:
    """``fn`` under ``policy`` as a traceable forward and backward: what a policy is measured on."""
    return TracedVjp(apply_policy(fn, policy), wrt_pos, single, has_aux)


def _nbytes(structs: Sequence[jax.ShapeDtypeStruct]) -> int:
    return sum(int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize for s in structs)


def _count_ops(jaxpr: ClosedJaxpr) -> tuple[int, int]:
    """(all primitive applications, matmuls and convolutions) in a jaxpr and its sub-jaxprs."""
    # A call-like wrapper (jit, remat, custom_vjp) is not an op: what it runs is counted.
    prims = [e.primitive.name for e in iter_eqns(jaxpr) if not sub_jaxprs(e)]
    return len(prims), sum(p in ("dot_general", "conv_general_dilated") for p in prims)


@dataclass(frozen=True)
class PolicyCost:
    """What one policy costs: residual bytes the forward stores, and the backward's work.

    Attributes:
        policy: The policy's name.
        stored_arrays: How many arrays the forward stores.
        stored_bytes: Their bytes; ``None`` when symbolic dims are unbound.
        stored_terms: Their bytes as ``{symbolic factor: coefficient}``.
        input_backed: How many residuals are references to input arrays.
        backward_ops: Primitive applications in the backward.
        backward_dots: Of which matmuls and convolutions.
        backward_flops: The backward's flops by XLA's cost analysis, with concrete
            sizes only; ``None`` otherwise or where the backend offers none.
    """

    policy: str
    stored_arrays: int
    stored_bytes: int | None  # None when symbolic dims are unbound
    stored_terms: dict[str, int] = field(default_factory=dict)  # bytes as {symbolic factor: coefficient}
    input_backed: int = 0
    backward_ops: int = 0  # primitive applications in the backward
    backward_dots: int = 0  # of which matmuls / convolutions
    backward_flops: float | None = None  # XLA's cost analysis, with concrete sizes only

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict.

        Returns:
            The fields by name.
        """
        return {
            "policy": self.policy,
            "stored_arrays": self.stored_arrays,
            "stored_bytes": self.stored_bytes,
            "stored_terms": self.stored_terms,
            "input_backed": self.input_backed,
            "backward_ops": self.backward_ops,
            "backward_dots": self.backward_dots,
            "backward_flops": self.backward_flops,
        }


def policy_cost(
    fn: Callable[..., Any],
    *specs: Any,
    policy: str | None = None,
    wrt: Wrt = None,
    has_aux: bool = False,
    at: Mapping[str, int] | None = None,
    flops: bool = True,
) -> PolicyCost:
    """Trace (never run) ``fn`` under ``policy`` and measure its residuals and backward."""
    policy = normalize_policy(policy)
    at = dict(at or {})
    symbolic = any(is_symbolic_shape(s.shape) for s in jax.tree_util.tree_leaves(specs))
    wrt_pos, single = fn_wrt_positions(fn, wrt, len(specs))

    def traced(
        specs_: tuple[Any, ...],
    ) -> tuple[list[Any], Plan, Callable[..., tuple[Any, ...]], list[Any], list[Any]]:
        cand = candidate(fn, policy, wrt_pos, single, has_aux)
        stored_ = jax.eval_shape(lambda *a: cand.forward(*a)[1], *specs_)
        stored_, inputs_, cts_ = cand.backward_args(jax.tree_util.tree_leaves(specs_), stored_)
        return stored_, cand.plan, cand.backward, inputs_, cts_

    # Counted on the symbolic trace, as export lowers it (at concrete sizes JAX folds values
    # such as 1/b into constants, so an artifact would store more than such a count says).
    stored, plan, bwd, inputs, cts = traced(specs)
    ops, dots = _count_ops(jax.make_jaxpr(bwd)(stored, inputs, cts))
    n_stored, n_input_backed = len(stored), len(plan.input_backed)
    terms: dict[str, int] = {}
    for s in stored:
        for k, v in byte_terms_of_shape(s.dtype, [d if isinstance(d, int) else str(d) for d in s.shape]).items():
            terms[k] = terms.get(k, 0) + v
    total = evaluate_terms(terms, at) if symbolic else _nbytes(stored)
    if symbolic and at:
        stored, plan, bwd, inputs, cts = traced(concrete_specs(specs, at))
        if total is None:  # a dim expression evaluate_terms does not read: the concrete trace's bytes
            total = _nbytes(stored)
        symbolic = False
    fl = None
    if flops and not symbolic:
        try:
            analysis = jax.jit(bwd).lower(stored, inputs, cts).compile().cost_analysis()
            if isinstance(analysis, list):  # older jax: one dict per computation
                analysis = analysis[0] if analysis else {}
            fl = float(analysis.get("flops", 0.0)) if analysis else None
        except Exception:  # cost analysis is best effort: not every backend offers it
            fl = None
    return PolicyCost(policy, n_stored, total, terms, n_input_backed, ops, dots, fl)


def plan_policies(
    fn: Callable[..., Any],
    *specs: Any,
    wrt: Wrt = None,
    has_aux: bool = False,
    at: Mapping[str, int] | None = None,
    policies: Sequence[str] = BUDGET_ORDER,
    flops: bool = True,
) -> list[PolicyCost]:
    """``policy_cost`` for each policy, cheapest recompute first.

    Each policy is traced, never run.

    Args:
        fn: The function, as ``split`` takes it.
        *specs: Its arguments' shapes and dtypes (``jax.ShapeDtypeStruct`` pytrees; symbolic dims allowed).
        wrt: The argument positions or names to differentiate; ``None`` means all.
        has_aux: Whether ``fn`` returns ``(out, aux)``.
        at: Values of symbolic dims to count bytes and flops at; ``None`` leaves them symbolic.
        policies: The policies to measure, in the order given (by default
            ``everything``, ``dots``, ``nothing``).
        flops: Whether to compile the backward for XLA's flop count (concrete sizes only).

    Returns:
        One ``PolicyCost`` per policy, in the order of ``policies``.

    Raises:
        VjpsplitError: If a policy is unknown, ``auto``, or ``names:`` without names.
    """
    return [policy_cost(fn, *specs, policy=p, wrt=wrt, has_aux=has_aux, at=at, flops=flops) for p in policies]
