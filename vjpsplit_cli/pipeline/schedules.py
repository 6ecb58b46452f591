"""Pipeline schedules, pure: which worker runs which F, B and W operations, in what order.

GPipe, 1F1B and ZB-H1 put one stage on each worker; ZB-V puts two on each, in a
V. Nothing here runs a model: the lists are data, played by ``timeline.simulate``
and executed by the runners through ``dispatch.walk``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import VjpsplitError

SCHEDULES = ("gpipe", "1f1b", "zbh1", "zbv")
SPLIT_BACKWARD = ("zbh1", "zbv")  # schedules that run B and W as separate operations
LABELS = {"gpipe": "GPipe", "1f1b": "1F1B", "zbh1": "ZB-H1", "zbv": "ZB-V"}


@dataclass(frozen=True)
class Op:
    """One operation of a worker: ``kind`` F, B or W on microbatch ``mb`` of stage ``chunk``.

    ``chunk`` indexes the pipeline's stages (its artifacts). It equals the worker's
    index except in ZB-V, where each worker runs two stages.
    """

    kind: str
    mb: int
    chunk: int


def check_schedule(name: str, stages: int, microbatches: int = 1) -> None:
    """Refuse an unknown schedule, an empty pipeline, or ZB-V on an odd number of stages."""
    if name not in SCHEDULES:
        raise VjpsplitError(f"unknown schedule {name!r}; use one of {', '.join(SCHEDULES)}")
    if stages < 1 or microbatches < 1:
        raise VjpsplitError("a pipeline needs at least one stage and one microbatch")
    if name == "zbv" and stages % 2:
        raise VjpsplitError(f"ZB-V runs two stages per worker in a V: it needs an even number of stages, not {stages}")


def placement(name: str, stages: int) -> list[tuple[int, ...]]:
    """The stages each worker holds under schedule ``name``: ``(s,)`` each, or ZB-V's V ``(w, 2p-1-w)``."""
    check_schedule(name, stages)
    if name == "zbv":
        p = stages // 2
        return [(w, 2 * p - 1 - w) for w in range(p)]
    return [(s,) for s in range(stages)]


def dependencies(op: Op, stages: int, split: bool) -> list[tuple[str, int, int]]:
    """The ``(kind, mb, chunk)`` operations whose results ``op`` reads.

    F reads the previous stage's activation; B reads its own stage's residuals and
    the next stage's cotangent (the last stage starts from its loss); W (``split``
    schedules only) reads what its B left.
    """
    k, mb, c = op.kind, op.mb, op.chunk
    if k == "F":
        return [("F", mb, c - 1)] if c > 0 else []
    if k == "B":
        return [("F", mb, c)] + ([("B", mb, c + 1)] if c < stages - 1 else [])
    if not split:
        raise VjpsplitError("a W operation in a schedule without the split backward")
    return [("B", mb, c)]


def schedule(name: str, stages: int, microbatches: int) -> list[list[Op]]:
    """Per worker, the ordered operations of schedule ``name`` for ``stages`` stages and ``microbatches``.

    * ``gpipe``: every forward, then every backward.
    * ``1f1b``: worker ``s`` runs ``S-s-1`` forwards ahead, then alternates one
      forward and one (whole) backward; at most ``S-s`` microbatches in flight.
    * ``zbh1`` (Qi et al., *Zero Bubble Pipeline Parallelism*, ICLR 2024): 1F1B's
      order of F and B, B being only the input part; each W goes where the worker
      would otherwise wait, found by playing the schedule with F = B = W = 1. With
      those times the step takes 3m + (p-1) units against 1F1B's 3(m+p-1). A worker
      never holds more than ``S`` microbatches between F and W (1F1B's peak, on its
      first worker), nor more than 1F1B's ``S-s`` between F and B.
    * ``zbv`` (the same paper's V schedule, arXiv v2 section 6; PyTorch's
      ``ScheduleZBVZeroBubble``): ``S = 2p`` stages on ``p`` workers in a V. With
      F = B = W and at least ``2p-1`` microbatches no worker idles between its
      first and its last operation, at 1F1B's peak activation memory.

    Worker ``i``'s list is ``schedule(...)[i]``; ``placement`` says which stages it holds.
    """
    check_schedule(name, stages, microbatches)
    S, M = stages, microbatches
    if name == "gpipe":
        return [[Op("F", m, s) for m in range(M)] + [Op("B", m, s) for m in range(M)] for s in range(S)]
    if name == "zbv":
        return _zbv(S // 2, M)
    plans = []
    for s in range(S):
        warm = min(S - s - 1, M)
        ops = [Op("F", m, s) for m in range(warm)]
        f = warm
        for b in range(M):
            if f < M:
                ops.append(Op("F", f, s))
                f += 1
            ops.append(Op("B", b, s))
        plans.append(ops)
    return plans if name == "1f1b" else _place_weight_passes(plans, S)


def _place_weight_passes(fb: list[list[Op]], S: int) -> list[list[Op]]:
    """ZB-H1: insert W passes into 1F1B's F/B lists where a unit-time play shows the worker idle.

    A forward waits while the worker holds ``S`` microbatches between F and W: the
    first worker's 1F1B peak, which bounds every worker (the paper's memory rule:
    W holds less than B, so the first worker, which holds most, stays at 1F1B's
    peak). Bounding each worker by its *own* 1F1B count (``S-s``) instead forces
    W right behind B wherever a forward follows, and costs ``p-1`` more units.
    """
    done: dict[tuple, int] = {}
    nxt = [0] * S
    pending: list[list[int]] = [[] for _ in range(S)]
    out: list[list[Op]] = [[] for _ in range(S)]
    live = [0] * S
    t = 0
    while any(nxt[s] < len(fb[s]) or pending[s] for s in range(S)):
        for s in range(S):
            op = fb[s][nxt[s]] if nxt[s] < len(fb[s]) else None
            ready = op is not None and all(done.get(d, t + 1) <= t for d in dependencies(op, S, True))
            if ready and op.kind == "F" and live[s] >= S:
                ready = False
            if ready:
                out[s].append(op)
                done[(op.kind, op.mb, op.chunk)] = t + 1
                nxt[s] += 1
                if op.kind == "F":
                    live[s] += 1
                else:
                    pending[s].append(op.mb)
            elif pending[s]:
                mb = pending[s].pop(0)
                out[s].append(Op("W", mb, s))
                done[("W", mb, s)] = t + 1
                live[s] -= 1
        t += 1
    return out


def _zbv(p: int, M: int) -> list[list[Op]]:
    """ZB-V's lists: warm-up forwards down the V, then F-B-W pairs on both chunks, then the drain.

    The pattern needs ``2p-1`` microbatches to fill the V; with fewer, it is built
    for ``2p-1`` and the missing microbatches' operations are dropped, which keeps
    the order valid but leaves gaps.
    """
    n = max(2 * p - 1, M)
    plans = []
    for w in range(p):
        lo, hi = w, 2 * p - 1 - w
        count = {k: {lo: 0, hi: 0} for k in "FBW"}
        ops: list[Op] = []

        def add(kind, chunk):
            ops.append(Op(kind, count[kind][chunk], chunk))
            count[kind][chunk] += 1

        for _ in range(2 * (p - w) - 1):  # forwards of the first chunk, down the V
            add("F", lo)
        for _ in range(w):
            add("F", hi)
            add("F", lo)
        for _ in range(p - w):  # the second chunk's first backwards come back up
            add("F", hi)
            add("B", hi)
            add("W", hi)
        while count["F"][hi] < count["F"][lo] or count["F"][lo] < n:
            if count["F"][lo] < n:
                add("F", lo)
            add("B", lo)
            add("W", lo)
            add("F", hi)
            add("B", hi)
            add("W", hi)
        for _ in range(w):  # drain: input backwards first, weight passes fill the tail
            add("B", lo)
            add("B", hi)
        for _ in range(p - w):
            add("B", lo)
            add("W", lo)
        for chunk in (hi, lo):
            while count["W"][chunk] < count["B"][chunk]:
                add("W", chunk)
        plans.append([o for o in ops if o.mb < M])
    return plans


def layout(schedule_name: str) -> str:
    """How a schedule places stages on workers: ``"v"`` (two per worker, ZB-V) or ``"stage"`` (one each)."""
    check_schedule(schedule_name, 2)
    return "v" if schedule_name == "zbv" else "stage"
