"""Symbolic dims as manifests spell them: parsed, evaluated, and solved from the shapes of actual arrays.

A manifest records each dim as an int or as the text jax.export prints for a
symbolic one (``b``, ``2*b + 4``, ``floordiv(b, 2)``, ``b^2``). ``evaluate`` gives
such a dim's value once its names are sized; ``solve`` works the names out from the
sizes arrays actually have, as jax.export does when an exported function is called
(``jax/_src/export/shape_poly.py``, ``solve_dim_vars``): an equation ``dim = size``
in which exactly one name is still unknown, and appears in it only as an integer
times that name (``2*b1 = 8``, ``b + 4 = 9``, ``2*c + b = 7`` once ``b`` is known),
gives that name; the names it gives are used in the other equations, until none
gives more. Equations whose names are all known are left to the caller's shape
check (``b*c = 12`` once ``b`` and ``c`` are). A name no equation gives, an answer that is
not a whole number, or one below 1 is one ``VjpsplitError`` that names the dim and
the equations. Nothing is evaluated by Python's ``eval``: the text is parsed by
``dimtext`` (whose ``parse``, ``names``, ``evaluate`` and limits this module names too),
and text it does not read (longer than ``MAX_TEXT``, nested deeper than
``MAX_DEPTH``, another syntax) is a dim left to jax.export's own shape checks.
Owns the solving. No JAX here.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Mapping, Sequence

from ..errors import VjpsplitError

# Reading a dim's text is ``dimtext``'s; its names are here too, where their importers have always found them.
from .dimtext import MAX_DIM
from .dimtext import NAME, evaluate_node
from .dimtext import Node
from .dimtext import evaluate
from .dimtext import names
from .dimtext import parse


_Linear = tuple[int, dict[str, int]]  # constant + sum of coefficient * unknown name


def _linear(node: Node, known: Mapping[str, int]) -> _Linear | None:
    """``node`` as a constant plus a linear sum of the names not in ``known``; None if it is not one."""
    if isinstance(node, int):
        return node, {}
    if isinstance(node, str):
        return (known[node], {}) if node in known else (0, {node: 1})
    op, *args = node
    coeffs: dict[str, int] = {}
    if op in ("+", "neg"):
        const = 0
        for a in args:
            part = _linear(a, known)
            if part is None:
                return None
            const += part[0]
            for n, k in part[1].items():
                coeffs[n] = coeffs.get(n, 0) + k
        if op == "neg":
            const, coeffs = -const, {n: -k for n, k in coeffs.items()}
        return const, {n: k for n, k in coeffs.items() if k}
    if op == "*":
        # As jax.export solves: a term gives its name only as (integer) * name; a product
        # with another name in it (b*c, even with b known) is used once all its names are.
        coeff, others = 1, []
        for a in args:
            if isinstance(a, int):
                coeff *= a
            else:
                others.append(a)
        value = evaluate_node(("*", *others), known) if others else 1
        if value is not None:
            return coeff * value, {}
        if len(others) == 1 and isinstance(others[0], str):
            return 0, {others[0]: coeff} if coeff else {}
        return None
    value = evaluate_node(node, known)  # a power or a function: linear only once every name in it is known
    return None if value is None else (value, {})


@dataclass(frozen=True)
class Equation:
    """One symbolic dim of an expected shape against the size an actual array has there.

    ``what`` names it in messages: ``"inputs: input 'x' dim 1"``.
    """

    what: str
    dim: str
    size: int


class _Unsolved(Exception):
    """Equations left that give no name alone: the names they hold, and the equations."""

    def __init__(self, unsolved: list[str], pending: list[Equation]) -> None:
        super().__init__(unsolved)
        self.unsolved, self.pending = unsolved, pending

    def message(self, equations: str) -> str:
        n = self.unsolved
        return (
            f"symbolic dim{'s' if len(n) > 1 else ''} {', '.join(repr(x) for x in n)} cannot be worked out from "
            f"the shapes, as {equations} leave{'s' if len(self.pending) == 1 else ''} {'it' if len(n) == 1 else 'them'} "
            f"open (no equation gives one name alone); give some input a plain dim {n[0]!r} (or one that gives it "
            f"alone, like 2*{n[0]} or {n[0]} + 1)"
        )


def _solve_one(eq: Equation, node: Node, dims: dict[str, int]) -> bool:
    """Solve ``eq`` for its one unknown name into ``dims``; False if it has no single linear unknown."""
    lin = _linear(node, dims)
    if lin is None or len(lin[1]) != 1:
        return False
    ((name, k),) = lin[1].items()
    value, rest = divmod(eq.size - lin[0], k)
    if rest:
        raise VjpsplitError(
            f"{eq.what} is {eq.size}, but the shape gives it as {eq.dim}: no whole number {name!r} "
            f"solves {eq.dim} = {eq.size}; pass an array of a size that fits {eq.dim}"
        )
    if not 1 <= value <= MAX_DIM:
        limit = "at most 2**40" if value > 1 else ">= 1"
        raise VjpsplitError(
            f"{eq.what} is {eq.size}, but the shape gives it as {eq.dim}, so symbolic dim {name!r} "
            f"would be {value}; symbolic dims are {limit}: pass an array of a size that fits {eq.dim}"
        )
    dims[name] = value
    return True


def refuse_size(what: str, dim: str, size: int) -> None:
    """Refuse ``size`` where dim ``dim`` has one symbolic name and no whole value >= 1 of it gives ``size``
    (``2*b`` against 3), in ``solve``'s words; a dim with several names, or not linear in its one, is left
    to the shape check of the call that takes it.

    Raises:
        VjpsplitError: naming ``what``, the dim and the size.
    """
    node = parse(dim)
    if node is not None and len(names(node)) == 1:
        _solve_one(Equation(what, dim, size), node, {})


def _solve(equations: Sequence[Equation], known: Mapping[str, int] | None) -> dict[str, int]:
    dims = dict(known or {})
    pending = []
    for eq in equations:
        node = parse(eq.dim)
        if node is not None and names(node):
            pending.append((eq, node))
    while pending:
        left = [(eq, node) for eq, node in pending if not _solve_one(eq, node, dims)]
        left = [(eq, node) for eq, node in left if any(n not in dims for n in names(node))]
        if len(left) == len(pending):
            unsolved = list(dict.fromkeys(n for _, node in left for n in names(node) if n not in dims))
            raise _Unsolved(unsolved, [eq for eq, _ in left])
        pending = left
    return dims


def solve(equations: Sequence[Equation], known: Mapping[str, int] | None = None) -> dict[str, int]:
    """The symbolic names the ``equations`` give (with ``known`` ones kept), solved as jax.export does.

    A plain name takes the first size it is given; an equation whose names are all
    known is left for the caller's shape check, which names the leaf. Raises a
    ``VjpsplitError`` naming the dim and the equations when some name cannot be worked
    out from them (none gives it alone and linearly, so they admit several sizes), or
    when an equation admits no size (not a whole number, below 1).
    """
    try:
        return _solve(equations, known)
    except _Unsolved as e:
        raise VjpsplitError(e.message(", ".join(f"{q.dim} = {q.size} ({q.what})" for q in e.pending))) from None


@functools.lru_cache(maxsize=256)  # asked on every call that checks its arrays: once per manifest
def needs_solving(shapes: tuple[tuple[int | str, ...], ...]) -> bool:
    """Whether some symbolic name in ``shapes`` appears only inside expressions, never as a dim of its own."""
    plain: set[str] = set()
    used: set[str] = set()
    for shape in shapes:
        for d in shape:
            if isinstance(d, str):
                if NAME.match(d):
                    plain.add(d)
                else:
                    used.update(names(parse(d)))
    return not used <= plain


def solve_shapes(entries: Sequence[tuple[str, Sequence[int | str], Sequence[int]]]) -> dict[str, int]:
    """The dims ``(what, expected shape, actual shape)`` entries give, where some name appears only in expressions.

    ``{}`` when every name is some shape's plain dim: callers bind those one shape at
    a time, as they always have. Otherwise every name, solved by ``solve`` (``2*b1``
    against a size of 8 gives ``b1 = 4``). An entry whose rank differs, and a plain
    dim below 1, are left to the caller's shape check, which names the leaf.
    """
    if not needs_solving(tuple(tuple(want) for _, want, _ in entries)):
        return {}
    equations = []
    for what, want, shape in entries:
        if len(shape) != len(want):
            continue
        for i, (dim, size) in enumerate(zip(want, shape)):
            if isinstance(dim, str) and (int(size) >= 1 or not NAME.match(dim)):
                equations.append(Equation(f"{what} dim {i}", dim, int(size)))
    return solve(equations)


def solvable(shapes: Sequence[tuple[str, Sequence[int | str]]]) -> tuple[str, ...]:
    """Every symbolic name in ``(what, shape)`` pairs; refused where ``solve`` could not give it.

    The names that are some dim of their own come first, in first-seen order (the
    order artifacts have always listed them in), then those only inside expressions.

    The check at export, before anything is traced: ``solve`` runs on stand-in sizes
    that fit every equation exactly, so only names no equation gives are refused,
    whatever sizes a call brings.
    """
    order: list[str] = []
    for what, shape in shapes:
        for d in shape:
            if isinstance(d, str):
                node = parse(d)
                if node is None:
                    raise VjpsplitError(
                        f"{what}: symbolic dim {d!r} is not one vjpsplit reads; write it with names, integers, "
                        "+ - * ^ and floordiv, mod, max, min"
                    )
                order += [n for n in names(node) if n not in order]
    plain = list(dict.fromkeys(d for _, shape in shapes for d in shape if isinstance(d, str) and NAME.match(d)))
    order = plain + [n for n in order if n not in plain]
    stand_in = {n: 1009 + 2 * i for i, n in enumerate(order)}  # odd and distinct: no coefficient cancels by chance
    equations = []
    for what, shape in shapes:
        for i, d in enumerate(shape):
            if isinstance(d, str):
                size = evaluate(d, stand_in)
                if size is not None:  # None: a floordiv or mod by zero, which jax.export itself refuses
                    equations.append(Equation(f"{what} dim {i}", d, size))
    try:
        _solve(equations, None)
    except _Unsolved as e:
        raise VjpsplitError(e.message(", ".join(f"{q.dim} ({q.what})" for q in e.pending))) from None
    return tuple(order)
