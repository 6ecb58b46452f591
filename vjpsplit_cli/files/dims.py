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
the equations. Nothing is evaluated by Python's ``eval``: the text is parsed here,
and text this module does not read (longer than ``MAX_TEXT``, nested deeper than
``MAX_DEPTH``, another syntax) is a dim it leaves to jax.export's own shape checks.
No JAX here.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Mapping, Sequence, Union

from ..errors import VjpsplitError

MAX_TEXT = 400  # longer dim text is not read (a forged manifest's, not jax.export's)
MAX_DEPTH = 32  # parentheses and calls nested deeper are not read
MAX_POWER = 64  # b^k with k larger is not read: its value would dwarf any array
# No machine holds an array dim this long (a trillion elements); a larger one in a spec,
# an --at size, a file's recorded dims or a solved dim is a typo or corruption. (jax.export's
# int64 shape arithmetic would overflow only past 2**62.)
MAX_DIM = 2**40
FUNCS = frozenset({"floordiv", "mod", "max", "min", "non_negative"})  # jax.export's shape functions

_TOKEN = re.compile(r"\s*(?:([0-9]+)|([A-Za-z_][A-Za-z0-9_]*)|(\S))")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


# A parsed dim: an int, a name, or (operator, operands...). Operators: "+" (sum of its
# operands), "*" (product), "neg", "^" (operand, int power), and the FUNCS.
Node = Union[int, str, tuple]


class _Unreadable(Exception):
    """Text this parser does not read; callers treat the dim as one it cannot evaluate."""


class _Parser:
    def __init__(self, text: str) -> None:
        self.tokens: list[tuple[str, str]] = []
        pos = 0
        while pos < len(text):
            m = _TOKEN.match(text, pos)
            if m is None:  # only trailing blanks are left
                break
            pos = m.end()
            if m.group(1):
                self.tokens.append(("int", m.group(1)))
            elif m.group(2):
                self.tokens.append(("name", m.group(2)))
            elif m.group(3):
                self.tokens.append(("op", m.group(3)))
        self.i = 0

    def peek(self) -> tuple[str, str]:
        return self.tokens[self.i] if self.i < len(self.tokens) else ("end", "")

    def take(self, op: str) -> bool:
        if self.peek() == ("op", op):
            self.i += 1
            return True
        return False

    def parse(self) -> Node:
        node = self.expr(0)
        if self.peek()[0] != "end":
            raise _Unreadable
        return node

    def expr(self, depth: int) -> Node:
        if depth > MAX_DEPTH:
            raise _Unreadable
        terms = [("neg", self.term(depth)) if self.take("-") else self.term(depth)]
        while True:
            if self.take("+"):
                terms.append(self.term(depth))
            elif self.take("-"):
                terms.append(("neg", self.term(depth)))
            else:
                return terms[0] if len(terms) == 1 else ("+", *terms)

    def term(self, depth: int) -> Node:
        factors = [self.factor(depth)]
        while self.take("*"):
            factors.append(self.factor(depth))
        return factors[0] if len(factors) == 1 else ("*", *factors)

    def factor(self, depth: int) -> Node:
        base = self.atom(depth)
        if self.take("^"):
            kind, text = self.peek()
            if kind != "int" or int(text) > MAX_POWER:
                raise _Unreadable
            self.i += 1
            return ("^", base, int(text))
        return base

    def atom(self, depth: int) -> Node:
        kind, text = self.peek()
        self.i += 1
        if kind == "int":
            return int(text)
        if kind == "name":
            if text not in FUNCS:
                return text
            if not self.take("("):
                raise _Unreadable
            args = [self.expr(depth + 1)]
            while self.take(","):
                args.append(self.expr(depth + 1))
            if not self.take(")") or len(args) != (1 if text == "non_negative" else 2):
                raise _Unreadable
            return (text, *args)
        if (kind, text) == ("op", "("):
            node = self.expr(depth + 1)
            if not self.take(")"):
                raise _Unreadable
            return node
        if (kind, text) == ("op", "-"):
            return ("neg", self.atom(depth + 1))
        raise _Unreadable


@functools.lru_cache(maxsize=4096)  # manifests repeat the same few dims on every call
def parse(dim: int | str) -> Node | None:
    """``dim`` parsed; None for text this module does not read (see the module docstring)."""
    if isinstance(dim, int):
        return dim
    if not isinstance(dim, str) or len(dim) > MAX_TEXT:
        return None
    try:
        return _Parser(dim).parse()
    except (_Unreadable, IndexError):
        return None


def names(node: Node | None) -> tuple[str, ...]:
    """The symbolic names in a parsed dim, in first-seen order."""
    out: list[str] = []
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, str):
            if n not in out:
                out.append(n)
        elif isinstance(n, tuple):
            stack.extend(reversed(n[1:]))
    return tuple(out)


def _apply(op: str, values: Sequence[int]) -> int | None:
    if op == "+":
        return sum(values)
    if op == "*":
        out = 1
        for v in values:
            out *= v
        return out
    if op == "neg":
        return -values[0]
    if op == "^":
        return values[0] ** values[1]
    if op == "non_negative":
        return max(values[0], 0)
    if op == "max":
        return max(values)
    if op == "min":
        return min(values)
    if values[1] == 0:  # floordiv or mod by zero: no value (jax.export never prints one)
        return None
    # jax.export's floordiv and mod round toward minus infinity, as Python's do.
    return values[0] // values[1] if op == "floordiv" else values[0] % values[1]


def _evaluate(node: Node, dims: Mapping[str, int]) -> int | None:
    if isinstance(node, int):
        return node
    if isinstance(node, str):
        return dims.get(node)
    op, *args = node
    values = []
    for a in args:
        v = a if op == "^" and a is args[1] else _evaluate(a, dims)
        if v is None:
            return None
        values.append(v)
    return _apply(op, values)


def evaluate(dim: int | str, dims: Mapping[str, int]) -> int | None:
    """The value of a manifest's dim with its names sized by ``dims``; None if some is unsized or unread."""
    if isinstance(dim, int):
        return dim
    node = parse(dim)
    return None if node is None else _evaluate(node, dims)


# ---------------------------------------------------------------------------------- solving

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
        value = _evaluate(("*", *others), known) if others else 1
        if value is not None:
            return coeff * value, {}
        if len(others) == 1 and isinstance(others[0], str):
            return 0, {others[0]: coeff} if coeff else {}
        return None
    value = _evaluate(node, known)  # a power or a function: linear only once every name in it is known
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
                if _NAME.match(d):
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
            if isinstance(dim, str) and (int(size) >= 1 or not _NAME.match(dim)):
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
    plain = list(dict.fromkeys(d for _, shape in shapes for d in shape if isinstance(d, str) and _NAME.match(d)))
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
