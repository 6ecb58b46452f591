"""The zero-bubble cut inside ``scan``, ``remat``/``checkpoint`` and nested ``jit`` bodies.

``zerobubble.partition`` cuts a backward jaxpr by data dependence, equation by
equation. An equation that carries a body (a scan, a remat, a nested jit) is one
equation to it, so a backward whose layers sit under ``lax.scan`` (scan over
layers, flax ``nn.scan``, RNNs over time) would leave every weight-gradient matmul
inside B's loop. ``cut_inside`` rewrites the backward, before the cut, into an
equivalent one where those matmuls are plain equations outside every body:

- a nested ``jit``/``pjit``/``closed_call`` (without sharding annotations) and a
  ``remat``/``checkpoint`` body are inlined (the recompute a remat asks for happens
  in the backward either way);
- the transpose of a ``scan`` is split by loop fission. Its body's outputs that B
  does not need (the weight-gradient accumulators of shared weights, ``c' = c + d``,
  and the per-iteration weight gradients of stacked weights, its ``ys``) become the
  W part. B keeps a reverse scan carrying only the other carries (the cotangent
  that flows back through the layers or time steps) and emits, per iteration, the
  values the W part reads that are neither residuals nor constants (stacked like
  ``ys``). W is then evaluated outside the loop over those stacks: a stacked
  weight's gradient batched over the iteration axis (one slice per layer), a
  shared weight's gradient as a sum over iterations pushed into the contraction
  (``sum_t a_t^T b_t`` is one ``dot_general`` that also contracts the iteration
  axis), so W does the same FLOPs as the loop did.

A scan is left whole when its W part has no contraction (nothing to defer) or when
the stacks B would emit could be larger than the stacked residuals the scan
already reads (W must not hold more between B and W than the fused backward
reads). ``custom_vjp`` backwards, effectful bodies and jits with shardings stay
whole too.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

# An equation's operand: a variable or a literal constant.
Atom = Union[jcore.Var, jcore.Literal]
# jax types a variable's aval as AbstractValue, which declares no shape or dtype; in these
# backward jaxprs of arrays every one is a ShapedArray (or a key array's), which has both.
Aval = Any

_CALLS = ("pjit", "jit", "closed_call", "core_call")
_REMATS = ("remat2", "checkpoint", "remat")
CONTRACTIONS = ("dot_general", "conv_general_dilated")
# Primitives f with sum_t f(x_t) == f(sum_t x_t) when x is their only iteration-dependent operand.
_LINEAR = (
    "transpose",
    "reshape",
    "neg",
    "reduce_sum",
    "copy",
    "copy_p",
    "squeeze",
    "expand_dims",
    "broadcast_in_dim",
    "mul",
    "dot_general",
)


def _body(eqn: jcore.JaxprEqn) -> tuple[jcore.Jaxpr, Sequence[Any]] | None:
    """The body (jaxpr, consts) an equation carries, or None."""
    p = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    if p is None:
        return None
    return (p.jaxpr, p.consts) if hasattr(p, "consts") else (p, ())


def _unsharded(eqn: jcore.JaxprEqn) -> bool:
    shardings = tuple(eqn.params.get("in_shardings", ())) + tuple(eqn.params.get("out_shardings", ()))
    return all(type(s).__name__ == "UnspecifiedValue" for s in shardings)


def _inlinable(eqn: jcore.JaxprEqn) -> bool:
    name = eqn.primitive.name
    return not eqn.effects and _body(eqn) is not None and (name in _REMATS or (name in _CALLS and _unsharded(eqn)))


def _has_work(jaxpr: jcore.Jaxpr) -> bool:
    """Does ``jaxpr`` hold a scan, or a body that cut_inside would inline?"""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan" or _inlinable(eqn):
            return True
    return False


def _bind(eqn: jcore.JaxprEqn, invals: Sequence[Any], **changes: Any) -> list[Any]:
    # jax < 0.7 returns (subfuns, params), later jax the params alone.
    got = eqn.primitive.get_bind_params({**eqn.params, **changes})
    subfuns, params = ((), got) if isinstance(got, dict) else got
    out = eqn.primitive.bind(*subfuns, *invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _needed_vars(jaxpr: jcore.Jaxpr, out_positions: Iterable[int]) -> set[jcore.Var]:
    """The variables the outputs at ``out_positions`` depend on (themselves included)."""
    need = {v for v in (jaxpr.outvars[i] for i in out_positions) if isinstance(v, jcore.Var)}
    for eqn in reversed(jaxpr.eqns):
        if any(v in need for v in eqn.outvars):
            need.update(v for v in eqn.invars if isinstance(v, jcore.Var))
    return need


def _struct(aval: Aval) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=getattr(aval, "weak_type", False))


def cut_inside(closed: jcore.ClosedJaxpr, needed_outs: Sequence[int], merge: bool = True) -> jcore.ClosedJaxpr:
    """``closed`` rewritten so that what only the outputs outside ``needed_outs`` need sits outside every body.

    ``needed_outs`` are the positions of the outputs on B's side (the non-weight
    gradients). ``merge``: W may merge the iteration axis with the contraction beside it
    (one GEMM on XLA:CPU); False for sharded stages, where a merged axis whose minor part
    is sharded would be gathered. Returns ``closed`` itself when there is nothing to rewrite.
    """
    if not _has_work(closed.jaxpr):
        return closed
    needed = tuple(needed_outs)
    return jax.make_jaxpr(lambda *args: _interpret(closed.jaxpr, closed.consts, args, needed, merge))(
        *[_struct(v.aval) for v in closed.jaxpr.invars]
    )


def _interpret(
    jaxpr: jcore.Jaxpr, consts: Sequence[Any], args: Sequence[Any], needed: Sequence[int], merge: bool
) -> list[Any]:
    """Evaluate ``jaxpr`` on tracers, inlining bodies and cutting scans for outputs outside ``needed``."""
    env: dict[jcore.Var, Any] = {}

    def read(a: Atom) -> Any:
        return a.val if isinstance(a, jcore.Literal) else env[a]

    for v, x in zip(jaxpr.constvars, consts):
        env[v] = x
    for v, x in zip(jaxpr.invars, args):
        env[v] = x
    need = _needed_vars(jaxpr, needed)
    for eqn in jaxpr.eqns:
        invals = [read(a) for a in eqn.invars]
        out_needed = [i for i, v in enumerate(eqn.outvars) if v in need]
        if eqn.primitive.name == "scan" and not eqn.effects:
            outs = _cut_scan(eqn, invals, out_needed, merge)
        elif _inlinable(eqn):
            inner = _body(eqn)
            assert inner is not None  # _inlinable found the body
            body, body_consts = inner
            outs = _interpret(body, body_consts, invals, out_needed, merge)
        else:
            outs = _bind(eqn, invals)
        env.update(zip(eqn.outvars, outs))  # a dropped output too: nothing reads it
    return [read(v) for v in jaxpr.outvars]


def _accumulators(jaxpr: jcore.Jaxpr, nc: int, nk: int, skip: Sequence[int]) -> dict[int, tuple[jcore.JaxprEqn, Atom]]:
    """Carries ``c' = c + d`` whose ``c`` nothing else reads: carry position -> (add equation, d)."""
    uses: dict[jcore.Var, int] = {}
    for eqn in jaxpr.eqns:
        for v in eqn.invars:
            if isinstance(v, jcore.Var):
                uses[v] = uses.get(v, 0) + 1
    for v in jaxpr.outvars:
        if isinstance(v, jcore.Var):
            uses[v] = uses.get(v, 0) + 1
    producer = {v: e for e in jaxpr.eqns for v in e.outvars}
    found: dict[int, tuple[jcore.JaxprEqn, Atom]] = {}
    for i in range(nk):
        c_in, c_out = jaxpr.invars[nc + i], jaxpr.outvars[i]
        if i in skip or not isinstance(c_out, jcore.Var) or uses.get(c_in) != 1 or uses.get(c_out) != 1:
            continue
        add = producer.get(c_out)
        if add is None or add.primitive.name not in ("add_any", "add") or len(add.invars) != 2:
            continue
        a, b = add.invars
        if a is c_in and b is not c_in:
            found[i] = (add, b)
        elif b is c_in:
            found[i] = (add, a)
    return found


def _nbytes(avals: Sequence[Aval], length: Any = 1) -> Any:  # length and the result: ints or symbolic dims
    total = 0
    for a in avals:
        # a.dtype.itemsize: PRNG key dtypes (dropout keys scanned over) have one; np.dtype() refuses them
        total = total + length * int(a.dtype.itemsize) * np.prod(a.shape, dtype=object)
    return total


def _fits(emitted: Sequence[Aval], xs_avals: Sequence[Aval], length: Any) -> bool:
    """Are the stacks B would emit no larger than the stacked residuals the scan reads?

    Sizes JAX cannot compare mean no.
    """
    try:
        return bool(_nbytes(emitted, length) <= _nbytes(xs_avals, length))
    except jcore.InconclusiveDimensionOperation:
        return False


def _cut_scan(eqn: jcore.JaxprEqn, invals: Sequence[Any], out_needed: Sequence[int], merge: bool) -> list[Any]:
    """The scan ``eqn`` on ``invals``, fissioned into a B scan and a W part outside it when that pays."""
    p = eqn.params
    nc, nk, length = p["num_consts"], p["num_carry"], p["length"]
    body = p["jaxpr"]
    consts, init, xs = invals[:nc], invals[nc : nc + nk], invals[nc + nk :]
    n_ys = len(body.jaxpr.outvars) - nk
    acc = _accumulators(body.jaxpr, nc, nk, out_needed)
    w_ys = [j for j in range(n_ys) if nk + j not in out_needed]
    if not acc and not w_ys:
        return _bind(eqn, invals)
    kept = [i for i in range(nk) if i not in acc] + [nk + j for j in range(n_ys) if j not in w_ys]
    # Inline the body's own bodies (and cut its inner scans) before slicing it.
    flat = jax.make_jaxpr(lambda *a: _interpret(body.jaxpr, body.consts, a, kept, merge))(
        *[_struct(v.aval) for v in body.jaxpr.invars]
    )
    bj = flat.jaxpr
    acc = {i: a for i, a in _accumulators(bj, nc, nk, out_needed).items() if i in acc}
    kept = [i for i in range(nk) if i not in acc] + [nk + j for j in range(n_ys) if j not in w_ys]
    w_outs = [d for _, d in acc.values()] + [bj.outvars[nk + j] for j in w_ys]
    if bj.effects or any(isinstance(v, jcore.Literal) for v in w_outs):
        return _bind(eqn, invals)
    b_need = _needed_vars(bj, kept)
    b_eqns = [e for e in bj.eqns if any(v in b_need for v in e.outvars)]
    w_need = {v for v in w_outs if isinstance(v, jcore.Var)}
    w_eqns: list[jcore.JaxprEqn] = []
    for e in reversed(bj.eqns):
        if any(v in w_need for v in e.outvars) and not any(v in b_need for v in e.outvars):
            w_eqns.append(e)
            w_need.update(v for v in e.invars if isinstance(v, jcore.Var))
    w_eqns.reverse()
    if not any(e.primitive.name in CONTRACTIONS for e in w_eqns):
        return _bind(eqn, invals)
    c_vars, k_vars, x_vars = bj.invars[:nc], bj.invars[nc : nc + nk], bj.invars[nc + nk :]
    w_defined = {v for e in w_eqns for v in e.outvars}
    outer = {**dict(zip(bj.constvars, flat.consts)), **dict(zip(c_vars, consts))}
    stacked_in = dict(zip(x_vars, xs))
    emitted: list[jcore.Var] = []
    for v in [v for e in w_eqns for v in e.invars] + w_outs:
        if (
            isinstance(v, jcore.Var)
            and v not in w_defined
            and v not in outer
            and v not in stacked_in
            and v not in emitted
        ):
            emitted.append(v)
    if not _fits([v.aval for v in emitted], [v.aval for v in x_vars], length):
        return _bind(eqn, invals)

    keep_k = [i for i in range(nk) if i not in acc]
    b_ys = [nk + j for j in range(n_ys) if j not in w_ys]

    def step(carry: list[Any], x: list[Any]) -> tuple[list[Any], list[Any]]:
        env = {**outer, **dict(zip(x_vars, x)), **{k_vars[i]: c for i, c in zip(keep_k, carry)}}
        read = lambda a: a.val if isinstance(a, jcore.Literal) else env[a]  # noqa: E731
        for e in b_eqns:
            for v, val in zip(e.outvars, _bind(e, [read(a) for a in e.invars])):
                env[v] = val
        return [read(bj.outvars[i]) for i in keep_k], [read(bj.outvars[i]) for i in b_ys] + [read(v) for v in emitted]

    carry_out, ys = jax.lax.scan(
        step, [init[i] for i in keep_k], list(xs), length=length, reverse=p["reverse"], unroll=p["unroll"]
    )
    stacks = dict(zip(emitted, ys[len(b_ys) :]))
    w = _Batched(w_eqns, {**stacked_in, **stacks}, outer, length, merge)
    outs: list[Any] = [None] * (nk + n_ys)
    for i, c in zip(keep_k, carry_out):
        outs[i] = c
    for i, (add, d) in acc.items():
        (outs[i],) = _bind(add, [init[i], w.summed(d)] if add.invars[1] is d else [w.summed(d), init[i]])
    for i, y in zip(b_ys, ys[: len(b_ys)]):
        outs[i] = y
    for j in w_ys:
        outs[nk + j] = w.stacked(bj.outvars[nk + j])
    return outs


class _Batched:
    """The W part of a scan body evaluated over all iterations at once.

    ``stacked_in`` maps body variables to arrays with a leading iteration axis;
    ``outer`` maps variables that do not change across iterations to their values;
    ``merge``: see ``cut_inside``.
    """

    def __init__(
        self,
        eqns: Sequence[jcore.JaxprEqn],
        stacked_in: dict[jcore.Var, Any],
        outer: dict[jcore.Var, Any],
        length: int,
        merge: bool,
    ) -> None:
        self.producer = {v: e for e in eqns for v in e.outvars}
        self.length = length
        self.merge = merge
        self.vals = {v: (True, x) for v, x in stacked_in.items()}
        self.vals.update({v: (False, x) for v, x in outer.items()})
        self.sums: dict[Atom, Any] = {}
        self.dep = {v for v in stacked_in}
        for e in eqns:
            if any(isinstance(v, jcore.Var) and v in self.dep for v in e.invars):
                self.dep.update(e.outvars)

    def _value(self, v: Atom) -> tuple[bool, Any]:
        """(has an iteration axis, value)."""
        if isinstance(v, jcore.Literal):
            return False, v.val
        if v not in self.vals:
            eqn = self.producer[v]
            args = [self._value(a) for a in eqn.invars]
            if not any(s for s, _ in args):
                outs = _bind(eqn, [x for _, x in args])
            else:

                def one(*sliced: Any, eqn: jcore.JaxprEqn = eqn, args: list[tuple[bool, Any]] = args) -> list[Any]:
                    it = iter(sliced)
                    return _bind(eqn, [next(it) if s else x for s, x in args])

                outs = jax.vmap(one)(*[x for s, x in args if s])
            for o, val in zip(eqn.outvars, outs):
                self.vals[o] = (any(s for s, _ in args), val)
        return self.vals[v]

    def stacked(self, v: Atom) -> Any:
        """``v`` for every iteration, stacked on a leading axis."""
        s, x = self._value(v)
        return x if s else jnp.broadcast_to(x, (self.length, *jnp.shape(x)))

    def summed(self, v: Atom) -> Any:
        """``sum_t v_t``, the sum pushed through linear equations into their contractions."""
        if isinstance(v, jcore.Literal) or v not in self.dep:
            return jnp.sum(self.stacked(v), axis=0)
        if v in self.sums:
            return self.sums[v]
        eqn = self.producer.get(v)
        out = None
        if eqn is not None and len(eqn.outvars) == 1:
            dep = [isinstance(a, jcore.Var) and a in self.dep for a in eqn.invars]
            name = eqn.primitive.name
            if name == "dot_general" and all(dep):
                (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
                shift = lambda ds: tuple(d + 1 for d in ds)  # noqa: E731
                lc, rc, lb, rb = (0,) + shift(lc), (0,) + shift(rc), shift(lb), shift(rb)  # iteration axis outermost
                a, b = (self.stacked(x) for x in eqn.invars)
                k = len(lc)
                if self.merge and k > 1 and not lb and lc == rc == tuple(range(k)):
                    # The iteration axis and the contraction beside it (an RNN's batch) lead both
                    # operands: merged into one axis (a free reshape), XLA:CPU runs one GEMM, where
                    # for two contracted axes it transposes an operand first and takes a slower
                    # dot (W 1.5x slower on the GRU of benchmarks/zbscan.py).
                    a = jnp.reshape(a, (math.prod(a.shape[:k]), *a.shape[k:]))
                    b = jnp.reshape(b, (math.prod(b.shape[:k]), *b.shape[k:]))
                    lc = rc = (0,)
                (out,) = _bind(eqn, [a, b], dimension_numbers=((lc, rc), (lb, rb)))
            elif name in _LINEAR and sum(dep) == 1:
                (out,) = _bind(eqn, [self.summed(a) if d else self._value(a)[1] for a, d in zip(eqn.invars, dep)])
            elif name in ("add_any", "add", "sub") and all(dep):
                (out,) = _bind(eqn, [self.summed(a) for a in eqn.invars])
        if out is None:
            out = jnp.sum(self.stacked(v), axis=0)
        self.sums[v] = out
        return out
