"""Symbolic dims' text as manifests spell it, read: tokens, the parsed ``Node``, its names and its value.

Owns the grammar (ints, names, ``+ - * ^``, parentheses and jax.export's shape
functions), the bounds on what is read (``MAX_TEXT``, ``MAX_DEPTH``, ``MAX_POWER``)
and ``MAX_DIM``, and evaluating a parsed dim once its names are sized. Nothing is
evaluated by Python's ``eval``. Solving names from shapes is ``dims``'.
"""

from __future__ import annotations

import functools
import re
from typing import Mapping, Sequence, Union

MAX_TEXT = 400  # longer dim text is not read (a forged manifest's, not jax.export's)
MAX_DEPTH = 32  # parentheses and calls nested deeper are not read
MAX_POWER = 64  # b^k with k larger is not read: its value would dwarf any array
# No machine holds an array dim this long (a trillion elements); a larger one in a spec,
# an --at size, a file's recorded dims or a solved dim is a typo or corruption. (jax.export's
# int64 shape arithmetic would overflow only past 2**62.)
MAX_DIM = 2**40
FUNCS = frozenset({"floordiv", "mod", "max", "min", "non_negative"})  # jax.export's shape functions

_TOKEN = re.compile(r"\s*(?:([0-9]+)|([A-Za-z_][A-Za-z0-9_]*)|(\S))")
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


# A parsed dim: an int, a name, or (operator, operands...). Operators: "+" (sum of its
# operands), "*" (product), "neg", "^" (operand, int power), and the FUNCS.
Node = Union[int, str, tuple]


class _Unreadable(Exception):
    """Text this parser does not read; callers treat the dim as one it cannot evaluate."""


class _Parser:
    """A recursive-descent reader of one dim's text into a ``Node``; ``_Unreadable`` where it does not read it."""

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


def evaluate_node(node: Node, dims: Mapping[str, int]) -> int | None:
    """The value of a parsed dim with its names sized by ``dims``; None if some is unsized (or a division by 0)."""
    if isinstance(node, int):
        return node
    if isinstance(node, str):
        return dims.get(node)
    op, *args = node
    values = []
    for a in args:
        v = a if op == "^" and a is args[1] else evaluate_node(a, dims)
        if v is None:
            return None
        values.append(v)
    return _apply(op, values)


def evaluate(dim: int | str, dims: Mapping[str, int]) -> int | None:
    """The value of a manifest's dim with its names sized by ``dims``; None if some is unsized or unread."""
    if isinstance(dim, int):
        return dim
    node = parse(dim)
    return None if node is None else evaluate_node(node, dims)
