"""A traced program with its calls inlined, one equation at a time: what ``leaf_labels`` labels and evaluates.

``InlinedGraph`` flattens a closed jaxpr (``pjit``, ``custom_jvp_call`` and the
other calls inlined; a ``cond`` named in ``inline`` taken apart into its branches
and a ``select_n`` of their outputs, ``SELECT``) into numbered nodes, each
equation evaluated alone as ``eval_jaxpr`` would (``run_equation``);
``made_at`` says where user code made an equation, for messages.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Sequence, TypeAlias

import jax
from jax.extend import core as jcore
from jax.typing import ArrayLike

if TYPE_CHECKING:
    from jax.core import AbstractValue

_CALLS = ("pjit", "jit", "closed_call", "core_call")
_CUSTOM = ("custom_jvp_call", "custom_vjp_call")


class Select:
    """A ``lax.select_n`` over a cond's branches' outputs: how a cond whose operands span leaves is inlined."""

    class primitive:  # noqa: N801 - read as an equation's ``primitive.name``
        name = "select_n"


SELECT = Select()
Equation: TypeAlias = "jcore.JaxprEqn | Select"  # an equation of an ``InlinedGraph``


class InlinedGraph:
    """A jaxpr with its calls inlined: nodes are ints, each equation evaluated alone as ``eval_jaxpr`` would.

    A ``cond`` named in ``inline`` becomes its branches, each inlined, and a ``select_n`` of their outputs
    by its index: the same values (the branches have no effects), each leaf's part of them apart."""

    def __init__(self, inline: set[int] = frozenset()) -> None:  # type: ignore[assignment]
        self.inline = inline
        self.values: dict[int, ArrayLike] = {}  # literal and constant nodes
        self.avals: dict[int, AbstractValue] = {}
        # eqn, its invars, their nodes, out nodes
        self.eqns: list[tuple[Equation, list[jcore.Var], list[int], list[int]]] = []
        self.count = 0

    def node(self, aval: AbstractValue) -> int:
        """A new node of abstract value ``aval``; its number."""
        self.count += 1
        self.avals[self.count] = aval
        return self.count

    def const(self, value: ArrayLike) -> int:
        """A new node holding the constant ``value``; its number."""
        n = self.node(jax.typeof(value))
        self.values[n] = value
        return n

    def flatten(self, closed: jcore.ClosedJaxpr, ins: Sequence[int]) -> list[int]:
        """``closed``'s equations added as nodes over the input nodes ``ins``, its calls inlined; its output nodes."""
        env: dict[jcore.Var, int] = {v: self.const(c) for v, c in zip(closed.jaxpr.constvars, closed.consts)}
        env.update(zip(closed.jaxpr.invars, ins))

        def read(a: jcore.Var | jcore.Literal) -> int:
            if isinstance(a, jcore.Literal):
                return self.const(a.val)
            return env[a]

        for eqn in closed.jaxpr.eqns:
            name = eqn.primitive.name
            inner = (
                eqn.params.get("jaxpr") if name in _CALLS else eqn.params.get("call_jaxpr") if name in _CUSTOM else None
            )
            if inner is not None:
                if not hasattr(inner, "consts"):
                    inner = jcore.ClosedJaxpr(inner, [])
                outs = self.flatten(inner, [read(a) for a in eqn.invars])
            elif name == "cond" and id(eqn) in self.inline:
                index, ops = read(eqn.invars[0]), [read(a) for a in eqn.invars[1:]]
                cases = [self.flatten(b, ops) for b in eqn.params["branches"]]
                outs = []
                for j, v in enumerate(eqn.outvars):
                    outs.append(self.node(v.aval))
                    self.eqns.append((SELECT, [], [index, *[c[j] for c in cases]], [outs[-1]]))
            else:
                invars = list(dict.fromkeys(a for a in eqn.invars if not isinstance(a, jcore.Literal)))
                outs = [self.node(v.aval) for v in eqn.outvars]
                self.eqns.append((eqn, invars, [env[v] for v in invars], outs))
            env.update((v, o) for v, o in zip(eqn.outvars, outs) if not _dropped(v))
        return [read(a) for a in closed.jaxpr.outvars]


def _dropped(v: jcore.Var) -> bool:
    """Whether ``v`` is an equation's unused output (``DropVar``): named by its type, since ``jax.extend.core``
    has no ``DropVar`` before jax 0.7 and the oldest supported jax is 0.6.2."""
    return type(v).__name__ == "DropVar"


def made_at(eqn: Equation) -> str:
    """`` (file:line)`` of the code that made ``eqn``, for messages; empty where JAX does not say."""
    if isinstance(eqn, Select):
        return ""  # an inlined cond's select: made by this module, not by user code
    try:
        frame = jax.extend.source_info_util.user_frame(eqn.source_info)  # type: ignore[attr-defined]
        return "" if frame is None else f" ({frame.file_name.rsplit('/', 1)[-1]}:{frame.start_line})"
    except Exception:  # noqa: BLE001 - where, in words, is a nicety
        return ""


def run_equation(eqn: Equation, invars: Sequence[jcore.Var], vals: Sequence[ArrayLike]) -> list[jax.Array | None]:
    """Evaluate one equation of the inlined graph on ``vals``: its outputs (None for an output it drops)."""
    if isinstance(eqn, Select):
        return [jax.lax.select_n(vals[0], *vals[1:])]
    outs = [v for v in eqn.outvars if not _dropped(v)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        one = jcore.Jaxpr([], list(invars), outs, [eqn], eqn.effects)
    got = iter(jcore.jaxpr_as_fun(jcore.ClosedJaxpr(one, []))(*vals))
    return [None if _dropped(v) else next(got) for v in eqn.outvars]
