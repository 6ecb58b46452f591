"""Zero-bubble backward: cut the backward into an input part (B) and a weight part (W).

Pipeline schedules such as ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism",
ICLR 2024) run B as soon as the next stage's cotangent arrives, since the previous
stage waits for it, and push W, the weight-gradient matmuls, into idle slots.

The cut is made on the backward's jaxpr (``jax.extend.core``, JAX's public
extension API) by data dependence: B holds every equation the non-weight
gradients need; W holds the remaining equations the weight gradients need. W
reads the residuals directly and, from B, only the values B computed that it
uses (the intermediate cotangents), plus any output cotangent it uses itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from jax.extend import core as jcore


@dataclass(frozen=True)
class Partition:
    """The two halves of a backward jaxpr.

    ``input_part``: original inputs -> (non-weight outputs..., boundary...).
    ``weight_part``: (original inputs except the cotangents..., boundary...) -> weight outputs.
    """

    input_part: jcore.ClosedJaxpr
    weight_part: jcore.ClosedJaxpr
    n_boundary: int


def _vars(atoms) -> list:
    return [a for a in atoms if isinstance(a, jcore.Var)]


def partition(closed: jcore.ClosedJaxpr, weight_outs: Sequence[int], ct_invars: Sequence[int]) -> Partition:
    """Cut ``closed`` so the outputs at ``weight_outs`` come from a separate weight part.

    ``ct_invars`` are the positions of the cotangent inputs: the weight part does not
    take them, so any it needs are passed through the boundary instead.
    """
    jaxpr = closed.jaxpr
    weight_outs = set(weight_outs)
    in_outvars = [v for i, v in enumerate(jaxpr.outvars) if i not in weight_outs]
    w_outvars = [v for i, v in enumerate(jaxpr.outvars) if i in weight_outs]

    def backward_slice(roots, exclude):
        need = set(_vars(roots))
        picked = []
        for idx in range(len(jaxpr.eqns) - 1, -1, -1):
            eqn = jaxpr.eqns[idx]
            if idx in exclude:
                continue
            if any(v in need for v in eqn.outvars if isinstance(v, jcore.Var)):
                picked.append(idx)
                need.update(_vars(eqn.invars))
        return set(picked), need

    a_idx, _ = backward_slice(in_outvars, exclude=set())
    b_idx, b_need = backward_slice(w_outvars, exclude=a_idx)
    defined_by_a = {v for i in a_idx for v in jaxpr.eqns[i].outvars if isinstance(v, jcore.Var)}
    ct_vars = [jaxpr.invars[i] for i in ct_invars]
    boundary = []
    seen = set()
    # Deterministic order: as the values appear in the jaxpr.
    for v in ct_vars + [v for i in sorted(a_idx) for v in jaxpr.eqns[i].outvars if isinstance(v, jcore.Var)]:
        if v in b_need and v not in seen and (v in defined_by_a or v in ct_vars):
            boundary.append(v)
            seen.add(v)
    kept_invars = [v for i, v in enumerate(jaxpr.invars) if i not in set(ct_invars)]
    a_eqns = [jaxpr.eqns[i] for i in sorted(a_idx)]
    b_eqns = [jaxpr.eqns[i] for i in sorted(b_idx)]
    input_part = jcore.Jaxpr(jaxpr.constvars, jaxpr.invars, in_outvars + boundary, a_eqns, _effects(a_eqns),
                             _debug_info(jaxpr, "input part", len(jaxpr.invars), len(in_outvars) + len(boundary)))
    weight_part = jcore.Jaxpr(jaxpr.constvars, kept_invars + boundary, w_outvars, b_eqns, _effects(b_eqns),
                              _debug_info(jaxpr, "weight part", len(kept_invars) + len(boundary), len(w_outvars)))
    return Partition(jcore.ClosedJaxpr(input_part, closed.consts), jcore.ClosedJaxpr(weight_part, closed.consts),
                     len(boundary))


def _debug_info(jaxpr: jcore.Jaxpr, what: str, n_in: int, n_out: int):
    # jax.extend.core exports DebugInfo only from jax 0.10: take the type from the
    # backward's own debug_info (a NamedTuple in every jax since 0.5) instead.
    return jaxpr.debug_info._replace(traced_for="vjpsplit", func_src_info=f"zero-bubble {what} of the backward",
                                     arg_names=(None,) * n_in, result_paths=(None,) * n_out)


def _effects(eqns):
    effects = set()
    for e in eqns:
        effects |= set(e.effects)
    return frozenset(effects)
