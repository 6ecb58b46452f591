"""One trace-and-run of a function's vjp: the forward that records its Plan, and that plan's backward.

``split`` (its jitted forward and backward), the policy candidates (``policies``,
``choice``) and ``export`` (``artifact.lowering``) all trace ``fn`` through
``trace_vjp`` and run the backward through ``run_backward``; ``TracedVjp`` is that
pair, written once. Call ``forward`` while tracing (under ``jit``, ``jax.export`` or
``eval_shape``): the plan it records is what ``backward`` runs.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax

from .vjp import Plan, run_backward, trace_vjp


def _as_given(aval: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    return aval


class TracedVjp:
    """``fn``'s vjp as a traceable forward ``(out, stored, aux)`` and the backward of its last trace.

    The backward's plan comes from the forward's trace, so trace (or lower) the
    forward first, or build one from a known plan with ``of_plan``.
    """

    def __init__(
        self,
        fn: Callable[..., Any] | None,
        wrt: tuple[int, ...],
        single: bool,
        has_aux: bool,
        plan: Plan | None = None,
    ) -> None:
        self.fn, self.wrt, self.single, self.has_aux = fn, wrt, single, has_aux
        self._plan = plan

    @classmethod
    def of_plan(cls, plan: Plan) -> "TracedVjp":
        """The backward of a plan some forward traced before (residuals carry theirs); it has no forward."""
        return cls(None, plan.wrt, plan.single_grad, False, plan)

    @property
    def plan(self) -> Plan:
        """What the forward's trace learned (trace or lower ``forward`` first)."""
        if self._plan is None:
            raise AssertionError("TracedVjp.plan is known once forward has been traced")
        return self._plan

    def forward(self, *args: Any) -> tuple[Any, tuple[jax.Array, ...], Any]:
        """``(out, stored residuals, aux)`` of ``fn(*args)``; records the plan for ``backward``."""
        if self.fn is None:
            raise AssertionError("a TracedVjp made from a plan has no forward")
        out, stored, aux, self._plan = trace_vjp(self.fn, tuple(args), self.wrt, self.single, self.has_aux)
        return out, stored, aux

    def backward(
        self, stored: Sequence[jax.Array], inputs: Sequence[jax.Array], cts: Sequence[jax.Array]
    ) -> tuple[jax.Array, ...]:
        """Gradients of the differentiated leaves from the stored and input-backed residuals and cotangents."""
        return run_backward(self.plan, stored, inputs, cts)

    def backward_args(
        self,
        flat_args: Sequence[Any],
        stored: Sequence[Any],
        cotangent: Callable[[jax.ShapeDtypeStruct], Any] = _as_given,
    ) -> tuple[list[Any], list[Any], list[Any]]:
        """``(stored, input-backed leaves of flat_args, cotangent(aval) per floating output)`` for ``backward``."""
        plan = self.plan
        return (
            list(stored),
            [flat_args[k] for k in plan.input_backed],
            [cotangent(plan.out_avals[i]) for i in plan.out_diff],
        )
