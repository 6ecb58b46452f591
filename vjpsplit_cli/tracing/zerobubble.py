"""Zero-bubble backward: cut the backward into an input part (I) and a weight part (W).

Pipeline schedules such as ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism",
ICLR 2024) run B as soon as the next stage's cotangent arrives, since the previous
stage waits for it, and push W, the weight-gradient matmuls, into idle slots.

The cut is made on the backward's jaxpr (``jax.extend.core``, JAX's public
extension API) by data dependence: B holds every equation the non-weight
gradients need, and the cotangent chain that runs back through the stage's
layers (every equation on the cotangent's path that feeds a later contraction);
W holds the rest of what the weight gradients need, the weight-gradient
contractions and what follows them. W reads the residuals directly and, from B,
only the values B computed that it uses (the intermediate cotangents), plus any
output cotangent it uses itself.

The chain rule matters for a stage whose input gradient nobody needs (a
pipeline's first stage): B then still walks the cotangent back through the
layers, as in the paper, instead of leaving the whole backward to W.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from jax.extend import core as jcore

from .fission import CONTRACTIONS, Atom, cut_inside


@dataclass(frozen=True)
class Partition:
    """The two halves of a backward jaxpr.

    ``input_part``: original inputs -> (non-weight outputs..., boundary...).
    ``weight_part``: (original inputs except the cotangents..., boundary...) -> weight outputs.
    """

    input_part: jcore.ClosedJaxpr
    weight_part: jcore.ClosedJaxpr
    n_boundary: int
    weight_reads: tuple[int, ...] = ()  # positions of the weight part's inputs that it actually reads


def _vars(atoms: Iterable[Atom]) -> list[jcore.Var]:
    return [a for a in atoms if isinstance(a, jcore.Var)]


def partition(
    closed: jcore.ClosedJaxpr, weight_outs: Sequence[int], ct_invars: Sequence[int], merge: bool = True
) -> Partition:
    """Cut ``closed`` so the outputs at ``weight_outs`` come from a separate weight part.

    ``ct_invars`` are the positions of the cotangent inputs: the weight part does not
    take them, so any it needs are passed through the boundary instead. Scans,
    remat and nested jit bodies are cut too (``fission.cut_inside``, which ``merge`` is passed to).
    """
    weights = set(weight_outs)
    closed = cut_inside(closed, [i for i in range(len(closed.jaxpr.outvars)) if i not in weights], merge)
    jaxpr = closed.jaxpr
    in_outvars = [v for i, v in enumerate(jaxpr.outvars) if i not in weights]
    w_outvars = [v for i, v in enumerate(jaxpr.outvars) if i in weights]
    # B (the input part) computes the input gradients; W what only the weight gradients need.
    b_input, _ = _backward_slice(jaxpr, in_outvars, exclude=set())
    weight_only, _ = _backward_slice(jaxpr, w_outvars, exclude=b_input)
    chain = _cotangent_chain(jaxpr, ct_invars, weight_only)
    if chain:
        more, _ = _backward_slice(jaxpr, [v for e in chain for v in _outs(e)], exclude=set())
        b_input |= more
    b_weight, weight_needs = _backward_slice(jaxpr, w_outvars, exclude=b_input)
    ct_vars = [jaxpr.invars[i] for i in ct_invars]
    boundary = _boundary(jaxpr, b_input, weight_needs, ct_vars)
    kept_invars = [v for i, v in enumerate(jaxpr.invars) if i not in set(ct_invars)]
    input_eqns = [jaxpr.eqns[i] for i in sorted(b_input)]
    weight_eqns = [jaxpr.eqns[i] for i in sorted(b_weight)]
    input_part = jcore.Jaxpr(
        jaxpr.constvars,
        jaxpr.invars,
        in_outvars + boundary,
        input_eqns,
        _effects(input_eqns),
        _debug_info(jaxpr, "input part", len(jaxpr.invars), len(in_outvars) + len(boundary)),
    )
    weight_part = jcore.Jaxpr(
        jaxpr.constvars,
        kept_invars + boundary,
        w_outvars,
        weight_eqns,
        _effects(weight_eqns),
        _debug_info(jaxpr, "weight part", len(kept_invars) + len(boundary), len(w_outvars)),
    )
    used = set(_vars(w_outvars)) | {v for e in weight_eqns for v in _vars(e.invars)}
    reads = tuple(i for i, v in enumerate(weight_part.invars) if v in used)
    return Partition(
        jcore.ClosedJaxpr(input_part, closed.consts),
        jcore.ClosedJaxpr(weight_part, closed.consts),
        len(boundary),
        reads,
    )


def _outs(eqn: jcore.JaxprEqn) -> list[jcore.Var]:
    return [v for v in eqn.outvars if isinstance(v, jcore.Var)]


def _backward_slice(jaxpr: jcore.Jaxpr, roots: Iterable[Atom], exclude: set[int]) -> tuple[set[int], set[jcore.Var]]:
    """The equations (indices) that ``roots`` depend on, less ``exclude``; and every variable they read."""
    need = set(_vars(roots))
    picked: set[int] = set()
    for idx in range(len(jaxpr.eqns) - 1, -1, -1):
        eqn = jaxpr.eqns[idx]
        if idx in exclude:
            continue
        if any(v in need for v in _outs(eqn)):
            picked.add(idx)
            need.update(_vars(eqn.invars))
    return picked, need


def _cotangent_chain(jaxpr: jcore.Jaxpr, ct_invars: Sequence[int], weight_only: set[int]) -> list[jcore.JaxprEqn]:
    """Equations of the weight-only slice that depend on a cotangent and feed a later contraction there.

    They (and what they read) join B: otherwise W would walk the cotangent back through the
    layers itself, and B's consumer would wait for work that is W's only by accident.
    """
    ct_dep = {jaxpr.invars[i] for i in ct_invars}
    for eqn in jaxpr.eqns:
        if any(v in ct_dep for v in _vars(eqn.invars)):
            ct_dep.update(_outs(eqn))
    feeds: set[jcore.Var] = set()  # values that reach a contraction of the weight-only slice
    for idx in sorted(weight_only, reverse=True):
        eqn = jaxpr.eqns[idx]
        if eqn.primitive.name in CONTRACTIONS or any(v in feeds for v in _outs(eqn)):
            feeds.update(_vars(eqn.invars))
    return [jaxpr.eqns[i] for i in sorted(weight_only) if any(v in feeds and v in ct_dep for v in _outs(jaxpr.eqns[i]))]


def _boundary(
    jaxpr: jcore.Jaxpr, b_input: set[int], weight_needs: set[jcore.Var], ct_vars: list[jcore.Var]
) -> list[jcore.Var]:
    """What B hands W: the cotangents and B's values that W reads, in the order they appear in the jaxpr."""
    defined_by_b = {v for i in b_input for v in _outs(jaxpr.eqns[i])}
    boundary: list[jcore.Var] = []
    seen: set[jcore.Var] = set()
    for v in ct_vars + [v for i in sorted(b_input) for v in _outs(jaxpr.eqns[i])]:
        if v in weight_needs and v not in seen and (v in defined_by_b or v in ct_vars):
            boundary.append(v)
            seen.add(v)
    return boundary


def _debug_info(jaxpr: jcore.Jaxpr, what: str, n_in: int, n_out: int) -> jcore.DebugInfo:
    # jax.extend.core exports DebugInfo only from jax 0.10: take the type from the
    # backward's own debug_info (a NamedTuple in every jax since 0.5) instead.
    return jaxpr.debug_info._replace(
        traced_for="vjpsplit",
        func_src_info=f"zero-bubble {what} of the backward",
        arg_names=(None,) * n_in,  # type: ignore[arg-type]  # jax's own jaxprs hold None for unnamed leaves
        result_paths=(None,) * n_out,  # type: ignore[arg-type]
    )


def _effects(eqns: Iterable[jcore.JaxprEqn]) -> frozenset[jcore.Effect]:
    effects: set[jcore.Effect] = set()
    for e in eqns:
        effects |= set(e.effects)
    return frozenset(effects)


def keep_inputs(closed: jcore.ClosedJaxpr, keep: Sequence[int]) -> jcore.ClosedJaxpr:
    """``closed`` taking only the inputs at positions ``keep``: the others must be unread.

    Lets the weight part be lowered over just the residuals it reads, so a stage
    can free the rest once the input part has run.
    """
    jaxpr = closed.jaxpr
    used = {v for e in jaxpr.eqns for v in _vars(e.invars)} | set(_vars(jaxpr.outvars))
    dropped = [v for i, v in enumerate(jaxpr.invars) if i not in set(keep)]
    if any(v in used for v in dropped):
        raise ValueError("keep_inputs would drop an input the jaxpr reads")
    invars = [jaxpr.invars[i] for i in keep]
    pruned = jcore.Jaxpr(
        jaxpr.constvars,
        invars,
        jaxpr.outvars,
        jaxpr.eqns,
        jaxpr.effects,
        _debug_info(jaxpr, "weight part", len(invars), len(jaxpr.outvars)),
    )
    return jcore.ClosedJaxpr(pruned, closed.consts)
