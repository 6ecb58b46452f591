"""Automatic schedules: plans built for measured F, B, W and send times under a memory limit.

``auto_schedule`` is list scheduling that simulates time as it builds, in the
family of the Zero Bubble paper's heuristic for ZB-1p/ZB-2p (Qi et al., *Zero
Bubble Pipeline Parallelism*, ICLR 2024, section 3): the worker whose clock is
earliest chooses next. It takes the B whose cotangent has arrived (the previous
stage waits for it), else an F whose activation has arrived and that memory
allows (the next stage waits for it), else a W if one fits before the next
input arrives, else it waits for that input. A forward that memory stops makes
a W run first, freeing a microbatch. Each operation is timed as the runners
play the lists: once its worker is free and its inputs exist.

A ``Policy`` sets how far forwards run ahead of their backwards, whether a ready
F goes before a ready B (or a B waits for the F 1F1B pairs it with), and how
much a W may delay an arriving input, or an F an arriving cotangent; ``policies``
is the family played, and the fastest plans win. The built-in ``gpipe``,
``1f1b`` and ``zbh1`` that fit the memory limit are a safety net: under the same
costs the result is never slower than any of them. Where the best of these is
above ``lower_bound`` (so possibly not optimal), ``refine``'s local search moves
single operations while that makes the plans end sooner, within a budget of
operations played (not of seconds: the plans are the same on every machine). Last,
each stage's W's are relabelled into microbatch order (what the stage sums its
gradients in: see ``_weights_in_order``).

The list scheduler and its ``Policy`` family are ``listscheduler``'s (named here
too, where their importers find them); this module owns ``auto_schedule``: its
arguments, the built-ins and ``refine`` around the search, and plans within a byte
limit with planned offload.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence, Sized

from ...errors import VjpsplitError
from .costs import Costs
from .modeled import lower_bound, memory_limits, memory_peaks, modeled_makespan
from .stepplans import check_plans
from .builtins import schedule
from .catalog import SPLIT_BACKWARD
from .offloading import OffloadPlans, choose_offload, offload_makespan
from .ops import Kind, Op
from .listscheduler import search
from .refine import refine

BUILT_INS = ("gpipe", "1f1b", "zbh1")  # the one-stage-per-worker schedules the result never loses to


def _stage_count(stages: object) -> int:
    if isinstance(stages, int) and not isinstance(stages, bool):
        n = stages
    elif isinstance(stages, Sized) and not isinstance(stages, (str, bytes)):
        n = len(stages)
    else:
        raise VjpsplitError(f"stages must be a count or the stages (a Stages, or artifacts), not {stages!r}")
    if n < 1:
        raise VjpsplitError(f"a pipeline needs at least one stage, not {n}")
    return n


def _split_stages(stages: object, costs: Mapping[str, object] | Costs, n: int) -> tuple[bool, ...]:
    """Whose backwards the plans split into I and W: every stage whose artifact has the split (all, for a count).

    Costs without ``W`` make every backward whole.
    """
    if not isinstance(costs, Costs) and isinstance(costs, Mapping) and "W" not in costs:
        return (False,) * n
    if not isinstance(stages, Iterable):
        return (True,) * n
    return tuple(bool(getattr(getattr(a, "manifest", None), "weights", True)) for a in stages)


def built_in_candidates(
    stages: int, microbatches: int, limits: Sequence[int], split: Sequence[bool] | None = None
) -> dict[str, list[list[Op]]]:
    """The built-in schedules (``BUILT_INS``) whose memory peak fits ``limits`` on every worker.

    ``split``: per stage, whether it has the split backward; where one lacks it, the schedules
    that need it (``SPLIT_BACKWARD``) are left out.
    """
    out = {}
    for name in BUILT_INS:
        if split is not None and not all(split) and name in SPLIT_BACKWARD:
            continue
        plans = schedule(name, stages, microbatches)
        if all(p <= lim for p, lim in zip(memory_peaks(plans), limits)):
            out[name] = plans
    return out


def auto_schedule(
    stages: object,
    microbatches: int,
    *,
    costs: Mapping[str, object] | Costs,
    memory_limit: int | Sequence[int] | None = None,
    memory_limit_bytes: int | Sequence[int] | None = None,
    microbatch_bytes: Sequence[int] | None = None,
) -> list[list[Op]]:
    """Plans for ``stages`` fastest under ``costs`` within ``memory_limit``.

    Checked, no slower under ``costs`` than any of ``gpipe``, ``1f1b`` and ``zbh1`` that fits, and a function of
    the arguments only (no clock, no randomness). Any runner takes them as ``Schedule(plans=...)``.

    Args:
        stages: The stage count, or a ``Stages`` or artifacts (which say which have the split backward).
        microbatches: The microbatches per step.
        costs: Per stage the times of F, B (the input part) and W, and ``comm``: a ``Costs`` or a dict (``Costs.of``).
        memory_limit: The most microbatches a worker holds at once (from F until its W, or B where whole): an int, one
            per worker, or ``None`` for no limit.
        memory_limit_bytes: Instead: bytes per worker, with ``microbatch_bytes``; residuals are offloaded where
            ``costs["transfer"]`` (bytes per second off the device and back) lets the plans end sooner.
        microbatch_bytes: Per stage, the bytes one microbatch in flight holds.

    Returns:
        One list of ``Op`` per worker (worker ``w`` holds stage ``w``); with ``memory_limit_bytes`` an ``OffloadPlans``.

    Raises:
        VjpsplitError: If an argument is malformed, or a byte limit is below one microbatch's (naming what fits).
    """
    S = _stage_count(stages)
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise VjpsplitError(f"microbatches must be an int >= 1, not {microbatches!r}")
    split = _split_stages(stages, costs, S)
    c = Costs.of(costs, S)
    if memory_limit_bytes is not None or microbatch_bytes is not None:
        if memory_limit is not None:
            raise VjpsplitError("give memory_limit (microbatches) or memory_limit_bytes, not both")
        return _within_bytes(c, microbatches, split, memory_limit_bytes, microbatch_bytes)
    return _plans(c, microbatches, memory_limits(memory_limit, S, microbatches), split)


def _plans(c: Costs, microbatches: int, limits: Sequence[int], split: Sequence[bool]) -> list[list[Op]]:
    S = c.num_stages
    plans, span, _ = search(c, microbatches, limits, split)
    for built in built_in_candidates(S, microbatches, limits, split).values():
        other = modeled_makespan(built, c)
        if other < span - 1e-9:
            plans, span = built, other
    if span > lower_bound(c, microbatches, limits) + 1e-9:  # at the bound the plans are already optimal
        plans, span = refine(plans, c, microbatches, limits)
    plans = [_weights_in_order(p) for p in plans]
    check_plans(plans, S, microbatches)
    return plans


def _weights_in_order(plan: list[Op]) -> list[Op]:
    """``plan`` with its W slots given the microbatches in the order of its I's (microbatch order).

    The search and ``refine`` may run a later microbatch's W first. Each stage adds W's gradient to
    the sum so far, and where XLA fuses that add into W's dot (jaxlib 0.6 on CPU does), another order
    rounds differently: relabelled, every plan sums a stage's gradients in microbatch order, so any
    two plans train bit for bit alike. The k-th W needs the k-th I, which some earlier W's I already
    ran past, so the plan stays valid; a W's time and the count it frees are those of any other W of
    the stage, so the makespan and the memory peaks stay the same.
    """
    order = {s: iter([op.mb for op in plan if op.kind == Kind.I and op.stage == s]) for s in {op.stage for op in plan}}
    return [Op(Kind.W, next(order[op.stage]), op.stage, op.overlap) if op.kind == Kind.W else op for op in plan]


def smallest_byte_limit(nbytes: Sequence[int]) -> list[int]:
    """Per worker, the smallest byte limit any plan fits: one microbatch's bytes of its stage (see ``offloading``)."""
    return [int(b) for b in nbytes]


def _within_bytes(
    c: Costs,
    m: int,
    split: Sequence[bool],
    limit: int | Sequence[int] | None,
    nbytes: Sequence[int] | None,
) -> OffloadPlans:
    """Plans within ``limit`` bytes per worker: for each count limit from what fits without offload up to ``m``
    (every worker's raised alike), the plans for it and the offload that brings them within the bytes; the
    soonest to end under ``c`` with the copies back charged (``offloading.offload_makespan``)."""
    S = c.num_stages
    if nbytes is None or limit is None:
        raise VjpsplitError("memory_limit_bytes and microbatch_bytes go together: give both")
    if len(nbytes) != S or any(isinstance(b, bool) or not isinstance(b, int) or b < 0 for b in nbytes):
        raise VjpsplitError(f"microbatch_bytes must be one int >= 0 per stage ({S}), not {nbytes!r}")
    raw = [limit] * S if isinstance(limit, int) and not isinstance(limit, bool) else list(limit)  # type: ignore[arg-type]
    if len(raw) != S or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in raw):
        raise VjpsplitError(f"memory_limit_bytes must be an int or one int per worker ({S}), not {limit!r}")
    need = smallest_byte_limit(nbytes)
    short = [w for w in range(S) if raw[w] < need[w]]
    if short:
        w = short[0]
        raise VjpsplitError(
            f"memory_limit_bytes={raw[w]} on worker {w}: no plan fits, with or without offload (a stage holds one "
            f"microbatch's residuals, {need[w]} bytes, at the end of its F); the smallest limit that fits every "
            f"worker is memory_limit_bytes={max(need)}; per worker, memory_limit_bytes={need} fits"
        )
    base = [m if b == 0 else max(1, min(m, lim // b)) for lim, b in zip(raw, nbytes)]
    best: tuple[float, list[list[Op]], frozenset[tuple[int, int]]] | None = None
    candidates = [_plans(c, m, base, split)]  # fits by its counts: no offload
    if c.transfer is not None:  # no transfer cost measured: no offload
        seen = {tuple(base)}
        for k in range(1, m):
            counts = tuple(min(m, x + k) for x in base)
            if counts in seen:
                break
            seen.add(counts)
            candidates.append(_plans(c, m, counts, split))
        # The built-ins too: GPipe's long wait from F to B is what offload serves best.
        candidates += list(built_in_candidates(S, m, (m,) * S, split).values())
    for i, plans in enumerate(candidates):
        chosen = frozenset() if i == 0 else choose_offload(plans, c, nbytes, raw, c.transfer)  # type: ignore[arg-type]
        if chosen is None:
            continue
        span = offload_makespan(plans, c, nbytes, chosen, c.transfer)
        if best is None or span < best[0] - 1e-9:
            best = (span, plans, chosen)
    assert best is not None  # k = 0 fits by its counts
    return OffloadPlans(best[1], best[2], _why_no_offload(c, m, base))


def _why_no_offload(c: Costs, m: int, base: Sequence[int]) -> str:
    """Why plans within a byte limit offload nothing (where the soonest to end offload nothing): ``base`` is what
    each worker holds within its bytes without offload."""
    if min(base) >= m:
        return f"every worker holds all {m} microbatches within its limit: nothing needs to leave the device"
    if c.transfer is None:
        return "no copy rate is known (the costs' 'transfer'): the copies off the device cannot be weighed"
    return (
        "no plan that offloads ends sooner: the copies off the device and back cost more than the waits the "
        "microbatches they let in flight remove"
    )
