"""Pipeline schedules, pure: which worker runs which F, B and W operations, in what order.

GPipe, 1F1B and ZB-H1 put one stage on each worker; ZB-V and DualPipeV put two on
each, in a V; interleaved 1F1B puts ``v`` on each, round robin. Nothing here runs
a model: the lists are data, played by ``timeline.simulate`` and executed by the
runners through ``dispatch.walk``. A B whose microbatch has a W in the lists is
the input part of the backward; one without is the whole backward (DualPipeV
mixes both).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import VjpsplitError

SCHEDULES = ("gpipe", "1f1b", "zbh1", "zbv", "interleaved1f1b", "dualpipev")
SPLIT_BACKWARD = ("zbh1", "zbv", "dualpipev")  # schedules that run (some) B and W as separate operations
LABELS = {
    "gpipe": "GPipe",
    "1f1b": "1F1B",
    "zbh1": "ZB-H1",
    "zbv": "ZB-V",
    "interleaved1f1b": "Interleaved 1F1B",
    "dualpipev": "DualPipeV",
    "custom": "Custom schedule",
}
V_SHAPED = ("zbv", "dualpipev")  # worker w holds stages w and 2p-1-w
CHUNKS = 2  # interleaved 1F1B's stages per worker when only a name is given (Megatron-LM's usual choice)


@dataclass(frozen=True)
class Op:
    """One operation of a worker: ``kind`` F, B or W on microbatch ``mb`` of stage ``chunk``.

    ``chunk`` indexes the pipeline's stages (its artifacts). It equals the worker's
    index except where a worker runs several stages (ZB-V, DualPipeV, interleaved).
    ``overlap`` marks the first of two operations that torch's runtime runs as one
    ``OVERLAP_F_B`` action (DualPipeV); vjpsplit runs them one after the other.
    """

    kind: str
    mb: int
    chunk: int
    overlap: bool = False


def check_schedule(name: str, stages: int, microbatches: int | None = None, chunks: int = CHUNKS) -> None:
    """Refuse an unknown schedule, an empty pipeline, or stages and microbatches the schedule cannot run.

    ``microbatches=None`` checks only what the stages decide.
    """
    if name not in SCHEDULES:
        raise VjpsplitError(f"unknown schedule {name!r}; use one of {', '.join(SCHEDULES)}")
    if stages < 1 or (microbatches is not None and microbatches < 1):
        raise VjpsplitError("a pipeline needs at least one stage and one microbatch")
    if name in V_SHAPED and stages % 2:
        raise VjpsplitError(
            f"{LABELS[name]} runs two stages per worker in a V: it needs an even number of stages, not {stages}"
        )
    if name == "interleaved1f1b":
        if chunks < 1 or stages % chunks:
            raise VjpsplitError(
                f"interleaved 1F1B with {chunks} stages per worker needs a multiple of {chunks} stages, not "
                f"{stages}; for another count pass schedule=schedule('interleaved1f1b', S, m, chunks=v)"
            )
        p = stages // chunks
        if microbatches is not None and microbatches % p:
            raise VjpsplitError(
                f"interleaved 1F1B on {p} workers needs a multiple of {p} microbatches, not {microbatches}"
            )
    if name == "dualpipev" and microbatches is not None and microbatches < stages:
        raise VjpsplitError(
            f"DualPipeV on {stages // 2} workers needs at least {stages} microbatches (2 per worker), not {microbatches}"
        )


def placement(name: str, stages: int, chunks: int = CHUNKS) -> list[tuple[int, ...]]:
    """The stages each worker holds under schedule ``name``.

    ``(s,)`` each; the V ``(w, 2p-1-w)`` for ZB-V and DualPipeV; ``(w, w+p, ...)``
    (``chunks`` of them) for interleaved 1F1B.
    """
    check_schedule(name, stages, chunks=chunks)
    if name in V_SHAPED:
        p = stages // 2
        return [(w, 2 * p - 1 - w) for w in range(p)]
    if name == "interleaved1f1b":
        p = stages // chunks
        return [tuple(range(w, stages, p)) for w in range(p)]
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


def schedule(name: str, stages: int, microbatches: int, chunks: int = CHUNKS) -> list[list[Op]]:
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
    * ``interleaved1f1b`` (Narayanan et al., *Efficient Large-Scale Language Model
      Training on GPU Clusters Using Megatron-LM*, SC 2021, section 2.2.2; PyTorch's
      ``ScheduleInterleaved1F1B``): ``chunks`` stages per worker (stage ``s`` on
      worker ``s mod p``, ``p = S/chunks``), Megatron-LM's order; ``m`` a multiple of ``p``.
    * ``dualpipev`` (DeepSeek's ``dualpipev.py``; PyTorch's ``ScheduleDualPipeV``):
      ``S = 2p`` stages in ZB-V's V, its eight phases, ``m >= 2p``.

    Worker ``i``'s list is ``schedule(...)[i]``; ``placement`` says which stages it holds.
    """
    check_schedule(name, stages, microbatches, chunks)
    S, M = stages, microbatches
    if name == "gpipe":
        return [[Op("F", m, s) for m in range(M)] + [Op("B", m, s) for m in range(M)] for s in range(S)]
    if name == "zbv":
        return _zbv(S // 2, M)
    if name == "interleaved1f1b":
        return [_interleaved_rank(r, S // chunks, chunks, M) for r in range(S // chunks)]
    if name == "dualpipev":
        return [_dualpipev_rank(r, S // 2, M) for r in range(S // 2)]
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
            if op is not None and ready and op.kind == "F" and live[s] >= S:
                ready = False
            if op is not None and ready:
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


def _interleaved_rank(r: int, p: int, v: int, M: int) -> list[Op]:
    """Megatron-LM's interleaved 1F1B on worker ``r``: warm-up forwards, then one F and one B, then the drain.

    The ``k``-th forward of the worker runs chunk ``(k // p) % v`` on microbatch
    ``(k // (p v)) p + k % p``: ``p`` microbatches through one chunk, then the next
    chunk; backwards walk the chunks in reverse.
    """
    total = M * v
    warm = min(2 * (p - r - 1) + (v - 1) * p, total)

    def op(kind: str, k: int) -> Op:
        c = (k // p) % v
        return Op(kind, (k // (p * v)) * p + k % p, (c if kind == "F" else v - 1 - c) * p + r)

    ops = [op("F", k) for k in range(warm)]
    for i in range(total - warm):
        ops += [op("F", warm + i), op("B", i)]
    return ops + [op("B", i) for i in range(total - warm, total)]


def _dualpipev_rank(r: int, p: int, M: int) -> list[Op]:
    """DualPipeV's eight phases on worker ``r``, which holds stage ``r`` (chunk 0) and ``2p-1-r`` (chunk 1).

    A B is the whole backward, or its input part ("I") with the W queued; each W
    phase runs the oldest queued one. Paired F and B are one overlapped action.
    """
    lo, hi = r, 2 * p - 1 - r
    nxt = {("F", lo): 0, ("F", hi): 0, ("B", lo): 0, ("B", hi): 0}
    queued: list[Op] = []
    ops: list[Op] = []

    def f(c, overlap=False):
        ops.append(Op("F", nxt["F", c], c, overlap))
        nxt["F", c] += 1

    def b(c, split=False):
        ops.append(Op("B", nxt["B", c], c))
        if split:
            queued.append(Op("W", nxt["B", c], c))
        nxt["B", c] += 1

    def w():
        if queued:
            ops.append(queued.pop(0))

    for _ in range(2 * (p - r - 1)):  # 1: forwards of chunk 0
        f(lo)
    for _ in range(r + 1):  # 2: F0 F1
        f(lo)
        f(hi)
    for _ in range(p - r - 1):  # 3: I1 W F1, zero bubble
        b(hi, split=True)
        w()
        f(hi)
    for i in range(M - 2 * p + r + 1):  # 4, the main phase: F0 with B1, F1 with B0
        f(lo, overlap=not (i == 0 and r == p - 1))  # the last worker's first pair is not overlapped
        b(hi)
        f(hi, overlap=True)
        b(lo)
    for _ in range(p - r - 1):  # 5: B1, F1 with B0
        b(hi)
        f(hi, overlap=True)
        b(lo)
    split = False
    for i in range(r + 1):  # 6: B1 B0, the second half split
        split = split or (i == (r + 1) // 2 and r % 2 == 1)
        b(hi, split)
        split = split or (i == (r + 1) // 2 and r % 2 == 0)
        b(lo, split)
    for _ in range(p - r - 1):  # 7: W, I0
        w()
        b(lo, split=True)
    for _ in range(r + 1):  # 8: the remaining W
        w()
    return ops


def layout(schedule_name: str) -> str:
    """How a schedule places stages on workers: ``"v"`` (two per worker, ZB-V, DualPipeV),
    ``"interleaved"`` (``CHUNKS`` per worker, round robin) or ``"stage"`` (one each)."""
    check_schedule(schedule_name, 2)
    if schedule_name in V_SHAPED:
        return "v"
    return "interleaved" if schedule_name == "interleaved1f1b" else "stage"
