"""``split``: a jit-able forward that returns residuals and a backward that consumes them, in memory.

The mechanics (one ``jax.vjp`` trace cut in two) are in ``vjp``; this module
wraps them in two jitted functions that retrace per signature, as ``jax.jit`` does.
"""

from __future__ import annotations

from typing import Any, Callable

import jax

from ..errors import VjpsplitError
from ..files import keys
from .choice import resolve_policy
from .policies import AUTO, apply_policy
from .residuals import Residuals, SplitResiduals
from .traced import TracedVjp
from .signatures import Wrt, fn_wrt_positions
from .vjp import Plan, assemble_grads, cotangent_leaves, register_plan, struct_of


class _Static:
    """A childless pytree node: carries a Plan out of a jitted function as static data."""

    __slots__ = ("value",)

    def __init__(self, value: Plan) -> None:
        self.value = value


jax.tree_util.register_pytree_node(_Static, lambda s: ((), s.value), lambda v, _: _Static(v))


def _forward_impl(
    fn: Callable[..., Any],
    wrt: Wrt,
    has_aux: bool,
    policy: str | None,
    memory_budget: int | str | None,
    traces: list[int],
) -> Callable[..., tuple[Any, tuple[jax.Array, ...], Any, _Static]]:
    """The function ``split``'s forward jits: trace ``fn`` under its policy (chosen per signature with ``"auto"``
    or a budget), returning its output, stored residuals, aux and plan, and counting each trace in ``traces``."""
    per_signature = policy == AUTO or memory_budget is not None  # chosen for each signature, as jit compiles
    inner = fn if per_signature else apply_policy(fn, policy)

    def _fwd_impl(*args: Any) -> tuple[Any, tuple[jax.Array, ...], Any, _Static]:
        wrt_pos, single = fn_wrt_positions(fn, wrt, len(args))
        body = inner
        specs = jax.tree_util.tree_map(struct_of, args)
        if per_signature:
            chosen = resolve_policy(
                fn, *specs, policy=policy, memory_budget=memory_budget, wrt=wrt_pos, has_aux=has_aux
            )
            body = apply_policy(fn, chosen.policy)
        traced = TracedVjp(body, wrt_pos, single, has_aux)
        out, stored, aux = traced.forward(*args)
        register_plan(traced.plan)
        traces[0] += 1
        return out, stored, aux, _Static(traced.plan)

    return _fwd_impl


def _backward_impl() -> Callable[[SplitResiduals, list[Any]], tuple[jax.Array, ...]]:
    """The function ``split``'s backward jits (a new one per split, so each has its own jit cache): the plan's
    backward over the stored residuals, the input-backed ones and the cotangent's leaves."""

    def _bwd_impl(res: SplitResiduals, ct_leaves: list[Any]) -> tuple[jax.Array, ...]:
        plan = res.plan
        stored = [res.stored[keys.stored(i)] for i in range(plan.n_stored)]
        inputs = [res.inputs[str(k)] for k in plan.input_backed]
        return TracedVjp.of_plan(plan).backward(stored, inputs, ct_leaves)

    return _bwd_impl


def _split_residuals(args: tuple[Any, ...], stored: tuple[jax.Array, ...], plan: Plan) -> SplitResiduals:
    """The residuals a forward returns: its stored values, and references to the input arrays it reads."""
    flat = jax.tree_util.tree_leaves(args)
    return SplitResiduals(
        {keys.stored(i): v for i, v in enumerate(stored)},
        {str(k): flat[k] for k in plan.input_backed},
        plan=plan,
        bound_inputs={str(i): v for i, v in enumerate(flat)},
    )


def _refuse_foreign(res: Residuals) -> SplitResiduals:
    """``res`` as this split's residuals, or the error that says whose they are."""
    if not isinstance(res, SplitResiduals):
        what = "an artifact's residuals" if isinstance(res, Residuals) else type(res).__name__
        raise VjpsplitError(
            f"bwd takes the residuals returned by this split's fwd, got {what}; "
            "run an artifact's residuals with art.bwd"
        )
    return res


def split(
    fn: Callable[..., Any],
    wrt: Wrt = None,
    has_aux: bool = False,
    policy: str | None = None,
    memory_budget: int | str | None = None,
) -> tuple[Callable[..., tuple[Any, ...]], Callable[..., Any]]:
    """Split ``fn`` into a forward that returns residuals and a backward that consumes them.

    Both are jitted, jit-able and retrace per signature; ``bwd`` never evaluates the forward again under the default
    policy, and ``res`` holds references to input arrays instead of copies.

    Args:
        fn: The function to differentiate; its arguments are pytrees of arrays.
        wrt: The argument positions or names to differentiate; ``None`` (the default) means every argument.
        has_aux: Whether ``fn`` returns ``(out, aux)``; ``aux`` passes through the forward, not differentiated.
        policy: A name in ``POLICIES``, or ``"auto"`` (fastest measured per signature); ``None`` keeps every residual.
        memory_budget: Bytes (or ``"64MiB"``) for the stored residuals: per signature, the policy that recomputes least
            and fits; ``None`` sets no budget.

    Returns:
        ``(fwd, bwd)``: ``fwd(*args)`` gives ``(out, res)`` (``(out, res, aux)``), ``res`` a ``SplitResiduals``;
        ``bwd(res, ct=None)`` the gradients (one for a single int or name, else a tuple), and raises ``VjpsplitError``
        when ``res`` is not a ``SplitResiduals``.

    Raises:
        VjpsplitError: If ``memory_budget`` is given with a policy other than ``"everything"`` or ``"auto"``.
    """
    if memory_budget is not None and policy not in (None, "everything", AUTO):
        raise VjpsplitError("give either a policy or a memory budget (or both with policy auto), not both")
    traces = [0]
    jit_fwd = jax.jit(_forward_impl(fn, wrt, has_aux, policy, memory_budget, traces))
    jit_bwd = jax.jit(_backward_impl())

    def fwd(*args: Any) -> tuple[Any, ...]:
        """Forward pass: ``(out, res)``, or ``(out, res, aux)`` when ``has_aux``."""
        out, stored, aux, static = jit_fwd(*args)
        res = _split_residuals(args, stored, static.value)
        return (out, res, aux) if has_aux else (out, res)

    def bwd(res: Residuals, ct: Any = None) -> Any:
        """Backward pass from residuals alone: gradients with respect to ``wrt``."""
        mine = _refuse_foreign(res)
        diff = jit_bwd(mine, cotangent_leaves(mine.plan, ct))
        return assemble_grads(mine.plan, diff)

    fwd.__name__ = f"fwd_{getattr(fn, '__name__', 'fn')}"
    bwd.__name__ = f"bwd_{getattr(fn, '__name__', 'fn')}"
    fwd.trace_count = lambda: traces[0]  # type: ignore[attr-defined]
    return fwd, bwd
