"""The built-in schedules as pure lists: which worker runs which F, B, I and W operations, in what order.

GPipe, 1F1B and ZB-H1 put one stage on each worker; ZB-V and DualPipeV put two on
each, in a V; interleaved 1F1B puts ``v`` on each, round robin. Nothing here runs
a model: the lists are data, played by ``play`` and executed by the runners. Each
backward is a whole ``B``, or an ``I`` (its input part) with its ``W`` later:
GPipe, 1F1B and interleaved 1F1B run whole ones, ZB-H1 and ZB-V split every one,
DualPipeV mixes both.
"""

from __future__ import annotations

import functools

from .catalog import CHUNKS, check_schedule
from .ops import Kind, Op
from .play import play


def schedule(name: str, num_stages: int, microbatches: int, chunks: int = CHUNKS) -> list[list[Op]]:
    """Per worker, the ordered operations of schedule ``name`` for ``num_stages`` stages and ``microbatches``.

    ``gpipe`` (every F, then every B); ``1f1b``; ``zbh1`` and ``zbv`` (Qi et al., *Zero Bubble Pipeline
    Parallelism*, ICLR 2024: each W where the worker would otherwise wait; ``zbv`` ``S = 2p`` stages in a V);
    ``interleaved1f1b`` (Megatron-LM's order, ``chunks`` stages per worker, ``m`` a multiple of ``p``); ``dualpipev``
    (DeepSeek's, ``S = 2p``, ``m >= 2p``). docs/explanations/schedules.md says each.

    Args:
        name: The schedule, one of ``SCHEDULES``.
        num_stages: The pipeline's stage count.
        microbatches: The microbatches per step.
        chunks: Interleaved 1F1B's stages per worker (by default 2); ignored by the others.

    Returns:
        One list of ``Op`` per worker (``worker_stages`` says which stages it holds), in the order it runs them.

    Raises:
        VjpsplitError: If the schedule is unknown, or cannot run these stages and microbatches (an odd stage count
            for a V, counts not multiples as interleaved 1F1B needs, fewer microbatches than stages for DualPipeV).
    """
    check_schedule(name, num_stages, microbatches, chunks)
    return [list(ops) for ops in _built(name, num_stages, microbatches, chunks)]


@functools.lru_cache(maxsize=64)
def _built(name: str, S: int, M: int, chunks: int) -> tuple[tuple[Op, ...], ...]:
    """The lists, built once per arguments: every runner asks for its step's, each step (``Op`` is frozen)."""
    return tuple(tuple(ops) for ops in _lists(name, S, M, chunks))


def _lists(name: str, S: int, M: int, chunks: int) -> list[list[Op]]:
    if name == "gpipe":
        return [[Op(Kind.F, m, s) for m in range(M)] + [Op(Kind.B, m, s) for m in range(M)] for s in range(S)]
    if name == "zbv":
        return _zbv(S // 2, M)
    if name == "interleaved1f1b":
        return [_interleaved_rank(r, S // chunks, chunks, M) for r in range(S // chunks)]
    if name == "dualpipev":
        return [_dualpipev_rank(r, S // 2, M) for r in range(S // 2)]
    back = Kind.B if name == "1f1b" else Kind.I  # ZB-H1: 1F1B's order, each backward's input part
    plans = []
    for s in range(S):
        warm = min(S - s - 1, M)
        ops = [Op(Kind.F, m, s) for m in range(warm)]
        f = warm
        for b in range(M):
            if f < M:
                ops.append(Op(Kind.F, f, s))
                f += 1
            ops.append(Op(back, b, s))
        plans.append(ops)
    return plans if name == "1f1b" else _place_weight_passes(plans, S)


class _WeightPasses:
    """ZB-H1's rule for W: run the oldest pending W where the worker would wait, or where a forward
    would make it hold ``limit`` microbatches between F and W.

    ``limit`` is the first worker's 1F1B peak, ``S``, which bounds every worker (the paper's
    memory rule: W holds less than B, so the first worker, which holds most, stays at 1F1B's
    peak). Bounding each worker by its *own* 1F1B count (``S-s``) instead forces W right
    behind B wherever a forward follows, and costs ``p-1`` more units.
    """

    def __init__(self, num_workers: int, limit: int):
        self.limit = limit
        self.live = [0] * num_workers  # microbatches between F and W
        self.pending: list[list[Op]] = [[] for _ in range(num_workers)]

    def insert(self, worker: int, next_op: Op | None, free: float, ready: float) -> Op | None:
        """The oldest pending W when the worker would otherwise wait (or its list is done)."""
        pending = self.pending[worker]
        if not pending:
            return None
        held = next_op is not None and next_op.kind == Kind.F and self.live[worker] >= self.limit
        return pending.pop(0) if next_op is None or free < ready or held else None

    def ran(self, worker: int, op: Op) -> None:
        """Count what ``op`` holds or frees; an I queues its W."""
        if op.kind == Kind.F:
            self.live[worker] += 1
        elif op.kind == Kind.I:
            self.pending[worker].append(Op(Kind.W, op.mb, op.stage))
        else:
            self.live[worker] -= 1


def _place_weight_passes(fb: list[list[Op]], S: int) -> list[list[Op]]:
    """ZB-H1: 1F1B's F/I lists with each W inserted where a unit-time play shows the worker idle."""
    return play(fb, S, lambda op: 1.0, fill=_WeightPasses(len(fb), S)).plans


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
        count = {k: {lo: 0, hi: 0} for k in "FIW"}  # every backward split: I, its W later
        ops: list[Op] = []

        def add(kind: str, stage: int) -> None:
            ops.append(Op(Kind(kind), count[kind][stage], stage))
            count[kind][stage] += 1

        for _ in range(2 * (p - w) - 1):  # forwards of the first chunk, down the V
            add("F", lo)
        for _ in range(w):
            add("F", hi)
            add("F", lo)
        for _ in range(p - w):  # the second chunk's first backwards come back up
            add("F", hi)
            add("I", hi)
            add("W", hi)
        while count["F"][hi] < count["F"][lo] or count["F"][lo] < n:
            if count["F"][lo] < n:
                add("F", lo)
            add("I", lo)
            add("W", lo)
            add("F", hi)
            add("I", hi)
            add("W", hi)
        for _ in range(w):  # drain: input backwards first, weight passes fill the tail
            add("I", lo)
            add("I", hi)
        for _ in range(p - w):
            add("I", lo)
            add("W", lo)
        for stage in (hi, lo):
            while count["W"][stage] < count["I"][stage]:
                add("W", stage)
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

    def op(kind: Kind, k: int) -> Op:
        c = (k // p) % v
        return Op(kind, (k // (p * v)) * p + k % p, (c if kind == Kind.F else v - 1 - c) * p + r)

    ops = [op(Kind.F, k) for k in range(warm)]
    for i in range(total - warm):
        ops += [op(Kind.F, warm + i), op(Kind.B, i)]
    return ops + [op(Kind.B, i) for i in range(total - warm, total)]


def _dualpipev_rank(r: int, p: int, M: int) -> list[Op]:
    """DualPipeV's eight phases on worker ``r``, which holds stage ``r`` (chunk 0) and ``2p-1-r`` (chunk 1).

    A backward is a whole B, or its input part I with the W queued; each W phase
    runs the oldest queued one. Paired F and B are one overlapped action.
    """
    lo, hi = r, 2 * p - 1 - r
    nxt = {("F", lo): 0, ("F", hi): 0, ("B", lo): 0, ("B", hi): 0}
    queued: list[Op] = []
    ops: list[Op] = []

    def f(c: int, overlap: bool = False) -> None:
        ops.append(Op(Kind.F, nxt["F", c], c, overlap))
        nxt["F", c] += 1

    def b(c: int, split: bool = False) -> None:
        ops.append(Op(Kind.I if split else Kind.B, nxt["B", c], c))
        if split:
            queued.append(Op(Kind.W, nxt["B", c], c))
        nxt["B", c] += 1

    def w() -> None:
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
