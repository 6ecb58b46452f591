"""Cutting one function's jaxpr into pipeline stages: at ``stage_boundary`` marks, or balanced by cost.

``trace`` makes the function's jaxpr over flat leaves (parameters first, then
the batch inputs; the user's own ``jit``s inlined so marks inside them count).
``cut`` splits its top-level equations at given positions and works out, for
each stage, the parameter leaves, batch leaves and constants it reads, the
values it receives from the stage before and the values it sends on. A value
made in stage i and read in stage j > i+1 is *carried*: it is in what every
stage between sends, so each stage talks only to its neighbours and the
runners' one-activation protocol holds. ``stage_function`` turns one stage
into a function of ``(params, x, batch)`` tuples for ``export``.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import TYPE_CHECKING, Callable, Sequence, TypeAlias

import jax
import numpy as np
from jax.extend import core as jcore

from ...errors import VjpsplitError
from ...tracing.jaxprs import iter_eqns, sub_jaxprs
from ...treetypes import PyTree
from .boundary import NAME, is_boundary

if TYPE_CHECKING:
    from jax.tree_util import PyTreeDef


@dataclasses.dataclass
class Traced:
    """A function's jaxpr over flat leaves: ``n_params`` parameter leaves, then the batch leaves."""

    closed: jcore.ClosedJaxpr
    n_params: int
    marks: list[int]  # positions of the top-level stage marks
    n_aux: int = 0  # the function's outputs after the loss: its aux leaves (``export_stages(has_aux=True)``)


@dataclasses.dataclass
class StageCut:
    """One stage: its equations and what it reads and sends (vars of the traced jaxpr)."""

    eqns: list[jcore.JaxprEqn]
    params: list[int]  # parameter leaf positions it reads
    batch: list[int]  # batch leaf positions it reads
    consts: list[int]  # positions of the jaxpr's constants it reads
    recv: list[jcore.Var]  # vars received from the stage before
    sent: list[jcore.Var]  # vars sent to the next stage (the loss and any aux leaves, for the last)


def trace_model(
    flat_fn: Callable[..., object],
    param_structs: Sequence[jax.ShapeDtypeStruct],
    batch_structs: Sequence[jax.ShapeDtypeStruct],
    has_aux: bool = False,
) -> Traced:
    """Trace ``flat_fn(*params, *batch)``; refuse a non-scalar loss and marks inside control flow.

    ``has_aux``: ``flat_fn`` returns ``(loss, *aux_leaves)``, the aux leaves after the loss.
    """
    closed = jax.make_jaxpr(flat_fn)(*param_structs, *batch_structs)
    if any(_inlinable(e) for e in closed.jaxpr.eqns):  # the user's jits inlined: a mark inside one counts
        closed = jax.make_jaxpr(lambda *a: _inline_eval(closed, a))(*param_structs, *batch_structs)
    outs = closed.jaxpr.outvars
    n_aux = len(outs) - 1 if has_aux else 0
    if len(outs) != 1 + n_aux or outs[0].aval.shape != () or not np.issubdtype(outs[0].aval.dtype, np.floating):
        got = ", ".join(f"{v.aval.dtype}[{','.join(map(str, v.aval.shape))}]" for v in outs[: len(outs) - n_aux])
        raise VjpsplitError(
            f"export_stages needs a function returning one float scalar loss (a mean over the batch)"
            f"{' and its aux' if n_aux else ''}; it returns {got}"
            + ("" if n_aux else " (a loss with metrics: return (loss, aux) and pass has_aux=True)")
        )
    marks = []
    for i, eqn in enumerate(closed.jaxpr.eqns):
        if is_boundary(eqn):
            marks.append(i)
        elif _has_mark(eqn):
            raise VjpsplitError(
                f"{NAME} inside a {eqn.primitive.name} body cannot end a stage; "
                "move it out of the scan/cond/while_loop/custom_vjp/checkpoint, between top-level computations"
            )
    return Traced(_read_marked(closed, marks), len(param_structs), marks, n_aux)


def _read_marked(closed: jcore.ClosedJaxpr, marks: Sequence[int]) -> jcore.ClosedJaxpr:
    """``closed`` with every read after a mark of a value it marks reading the mark's output instead.

    The two are one value; without this, a value both marked and read unmarked later (a skip
    around the boundary) would cross the cut twice.
    """
    if not marks:
        return closed
    jaxpr = closed.jaxpr
    alias: dict[jcore.Var, jcore.Var] = {}
    eqns = []
    for i, eqn in enumerate(jaxpr.eqns):
        if alias:
            eqn = eqn.replace(invars=[alias.get(a, a) if not isinstance(a, jcore.Literal) else a for a in eqn.invars])
        eqns.append(eqn)
        if i in marks:
            alias.update({a: o for a, o in zip(eqn.invars, eqn.outvars) if not isinstance(a, jcore.Literal)})
    outs = [alias.get(a, a) if not isinstance(a, jcore.Literal) else a for a in jaxpr.outvars]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        new = jcore.Jaxpr(jaxpr.constvars, jaxpr.invars, outs, eqns, jaxpr.effects)
    return jcore.ClosedJaxpr(new, closed.consts)


_CALLS = ("pjit", "jit", "closed_call", "core_call")
# A stage function's result: the values it sends on, or the loss (the last stage), or ``(loss, aux)``.
StageOut: TypeAlias = jax.Array | tuple[jax.Array, ...] | tuple[jax.Array, PyTree]


def _has_mark(eqn: jcore.JaxprEqn) -> bool:
    return any(is_boundary(e) for sub in sub_jaxprs(eqn) for e in iter_eqns(sub))


def _inlinable(eqn: jcore.JaxprEqn) -> bool:
    return eqn.primitive.name in _CALLS and _has_mark(eqn)


def _inline_eval(closed: jcore.ClosedJaxpr, args: Sequence[object]) -> list[object]:
    """Evaluate ``closed`` on ``args`` (under a trace), inlining the calls that contain a stage mark."""
    env: dict[jcore.Var, object] = dict(zip(closed.jaxpr.constvars, closed.consts))
    env.update(zip(closed.jaxpr.invars, args))

    def read(a: jcore.Var | jcore.Literal) -> object:
        return a.val if isinstance(a, jcore.Literal) else env[a]

    for eqn in closed.jaxpr.eqns:
        if _inlinable(eqn):
            inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
            if not hasattr(inner, "consts"):
                inner = jcore.ClosedJaxpr(inner, [])
            outs = _inline_eval(inner, [read(a) for a in eqn.invars])
        else:  # the equation alone, as a jaxpr: jax binds it as eval_jaxpr would
            ins = list(dict.fromkeys(_vars(eqn.invars)))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                one = jcore.Jaxpr([], ins, list(eqn.outvars), [eqn], eqn.effects)
            outs = jcore.jaxpr_as_fun(jcore.ClosedJaxpr(one, []))(*[env[v] for v in ins])
        env.update(zip(eqn.outvars, outs))
    return [read(a) for a in closed.jaxpr.outvars]


def _vars(atoms: Sequence[jcore.Var | jcore.Literal]) -> list[jcore.Var]:
    return [a for a in atoms if not isinstance(a, jcore.Literal)]


def cut(traced: Traced, ends: Sequence[int]) -> list[StageCut]:
    """The stages ending after equations ``ends`` (ascending; the last stage runs to the end)."""
    jaxpr = traced.closed.jaxpr
    eqns = jaxpr.eqns
    bounds = [0, *[e + 1 for e in ends], len(eqns)]
    groups = [eqns[a:b] for a, b in zip(bounds, bounds[1:])]
    for k, g in enumerate(groups):
        if all(is_boundary(e) for e in g):  # empty, or only a mark
            raise VjpsplitError(
                f"stage {k} computes nothing: two stage marks (or a mark and the function's end) with nothing "
                "between them; remove one"
            )
    made: dict[jcore.Var, int] = {}
    for k, g in enumerate(groups):
        for eqn in g:
            for v in eqn.outvars:
                made[v] = k
    param_pos = {v: i for i, v in enumerate(jaxpr.invars[: traced.n_params])}
    batch_pos = {v: i for i, v in enumerate(jaxpr.invars[traced.n_params :])}
    const_pos = {v: i for i, v in enumerate(jaxpr.constvars)}
    loss, aux = jaxpr.outvars[0], list(jaxpr.outvars[1:])  # aux leaves: made anywhere, carried to the last stage
    reads = []
    for k, g in enumerate(groups):
        read = {v: None for eqn in g for v in _vars(eqn.invars)}  # a dict keeps the order values are first read
        if k == len(groups) - 1:
            read.update((v, None) for v in _vars([loss, *aux]))
        reads.append(list(read))
    order = {v: i for i, v in enumerate(made)}
    sent = []
    for k in range(len(groups) - 1):
        later = {v for j in range(k + 1, len(groups)) for v in reads[j] if made.get(v, len(groups)) <= k}
        sent.append(sorted(later, key=order.__getitem__))
    if isinstance(loss, jcore.Literal) or made.get(loss) != len(groups) - 1:
        raise VjpsplitError("the loss is computed before the last stage mark; end the function after the last mark")
    stages = []
    for k, g in enumerate(groups):
        r = reads[k]
        stages.append(
            StageCut(
                eqns=g,
                params=sorted(param_pos[v] for v in r if v in param_pos),
                batch=sorted(batch_pos[v] for v in r if v in batch_pos),
                consts=sorted(const_pos[v] for v in r if v in const_pos),
                recv=sent[k - 1] if k else [],
                sent=sent[k] if k < len(groups) - 1 else [loss, *aux],
            )
        )
    return stages


def stage_function(
    traced: Traced, st: StageCut, first: bool, last: bool, aux_tree: PyTreeDef | None = None
) -> Callable[..., StageOut]:
    """Stage ``st`` as ``f(params, batch)`` (first), ``f(params, x)`` or ``f(params, x, batch)``; tuples in and out.

    It returns the tuple of values it sends on, or the scalar loss (last); the last stage of a function with
    aux (``traced.n_aux`` leaves) returns ``(loss, aux)``, ``aux`` rebuilt by ``aux_tree`` from its leaves.
    """
    jaxpr = traced.closed.jaxpr
    p_vars = [jaxpr.invars[i] for i in st.params]
    b_vars = [jaxpr.invars[traced.n_params + i] for i in st.batch]
    c_vars = [jaxpr.constvars[i] for i in st.consts]
    effects = set()
    for eqn in st.eqns:
        effects |= set(eqn.effects)
    with warnings.catch_warnings():  # a slice of a traced jaxpr has no DebugInfo of its own
        warnings.simplefilter("ignore", DeprecationWarning)
        sub = jcore.Jaxpr(c_vars, [*p_vars, *st.recv, *b_vars], list(st.sent), list(st.eqns), effects)
    run = jcore.jaxpr_as_fun(jcore.ClosedJaxpr(sub, [traced.closed.consts[i] for i in st.consts]))

    def call(params: Sequence[jax.Array], x: Sequence[jax.Array], batch: Sequence[jax.Array]) -> StageOut:
        outs = run(*params, *x, *batch)
        if last and aux_tree is not None:
            return outs[0], aux_tree.unflatten(outs[1:])
        return outs[0] if last else tuple(outs)

    if first:
        return lambda params, batch: call(params, (), batch)
    if st.batch:
        return lambda params, x, batch: call(params, x, batch)
    return lambda params, x: call(params, x, ())
