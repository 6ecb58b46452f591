"""Schedules, checked by an independent model: completeness, order, deadlock freedom under random op times,
peak memory, and unit-time makespans against the paper's formulas.

p is the number of workers (devices), m the number of microbatches. GPipe, 1F1B
and ZB-H1 run p stages; ZB-V runs 2p stages, two per worker. Time unit: one
stage's forward. GPipe's and 1F1B's whole backward costs 2 (B + W), the split
schedules' B and W cost 1 each, and a ZB-V stage (half a worker's layers) costs
half of that. Memory unit: what one stage keeps for one microbatch between F and
B (all its residuals; half for a ZB-V stage); between B and W it keeps only W's
part, a share ``w`` of that.
"""

from __future__ import annotations

import random
from collections import defaultdict

import pytest

import vjpsplit_cli as vs
from vjpsplit_cli import pipeline as P

GRID = [(p, m) for p in range(2, 7) for m in range(p, 4 * p + 1)]


def n_stages(name, p):
    return 2 * p if name == "zbv" else p


def deps(kind, mb, c, S):
    """What an operation reads, written out here rather than taken from the module under test."""
    if kind == "F":
        return [("F", mb, c - 1)] if c > 0 else []
    if kind == "B":
        return [("F", mb, c)] + ([("B", mb, c + 1)] if c + 1 < S else [])
    return [("B", mb, c)]


def play(plans, S, duration):
    """Start and end of every op: a longest path over the DAG of list order plus data edges (Kahn's algorithm).

    Returns None if the graph has a cycle, i.e. the lists deadlock.
    """
    preds = defaultdict(list)
    worker = {}
    for w, ops in enumerate(plans):
        for i, o in enumerate(ops):
            key = (o.kind, o.mb, o.chunk)
            worker[key] = w
            preds[key] += deps(*key, S)
            if i:
                prev = ops[i - 1]
                preds[key].append((prev.kind, prev.mb, prev.chunk))
    succs = defaultdict(list)
    indeg = {k: len(v) for k, v in preds.items()}
    for k, v in preds.items():
        for d in v:
            succs[d].append(k)
    ready = [k for k, n in indeg.items() if n == 0]
    start, end = {}, {}
    while ready:
        k = ready.pop()
        start[k] = max((end[d] for d in preds[k]), default=0.0)
        end[k] = start[k] + duration(k)
        for s in succs[k]:
            indeg[s] -= 1
            if indeg[s] == 0:
                ready.append(s)
    if len(end) != len(preds):
        return None
    return start, end, worker


def unit_time(name):
    split = name in P.SPLIT_BACKWARD
    scale = 0.5 if name == "zbv" else 1.0

    def duration(key):
        return scale * (2.0 if key[0] == "B" and not split else 1.0)

    return duration


def memory_trace(ops, name, w):
    """Memory of one worker after each op, in stage units."""
    size = 0.5 if name == "zbv" else 1.0
    split = name in P.SPLIT_BACKWARD
    held, trace = 0.0, []
    for o in ops:
        if o.kind == "F":
            held += size
        elif o.kind == "B":
            held -= size * (1 - w) if split else size
        else:
            held -= size * w
        trace.append(held)
    return trace


@pytest.mark.parametrize("name", P.SCHEDULES)
def test_every_op_once_on_its_worker_in_order(name):
    for p, m in GRID:
        S = n_stages(name, p)
        plans = P.schedule(name, S, m)
        assert len(plans) == p
        kinds = "FBW" if name in P.SPLIT_BACKWARD else "FB"
        every = sorted((o.kind, o.mb, o.chunk) for ops in plans for o in ops)
        assert every == sorted((k, mb, c) for k in kinds for mb in range(m) for c in range(S)), (p, m)
        for w, ops in enumerate(plans):
            assert {o.chunk for o in ops} == set(P.placement(name, S)[w])
            pos = {(o.kind, o.mb, o.chunk): i for i, o in enumerate(ops)}
            for o in ops:
                for d in deps(o.kind, o.mb, o.chunk, S):
                    if d in pos:  # a dependency on this worker must come earlier in its list
                        assert pos[d] < pos[(o.kind, o.mb, o.chunk)], (p, m, w, o, d)


def test_zbv_places_two_stages_per_worker_in_a_v():
    assert P.placement("zbv", 8) == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert P.placement("1f1b", 3) == [(0,), (1,), (2,)]


@pytest.mark.parametrize("name", P.SCHEDULES)
def test_no_deadlock_under_random_op_times(name):
    rng = random.Random(13)
    for p, m in GRID:
        S = n_stages(name, p)
        plans = P.schedule(name, S, m)
        for _ in range(3):
            times = defaultdict(lambda: rng.uniform(0.05, 3.0))
            played = play(plans, S, lambda k: times[k])
            assert played is not None, (p, m)
            start, end, _ = played
            for k in start:
                assert all(start[k] >= end[d] for d in deps(*k, S))
            # The module's own replay agrees with this independent model.
            events = P.simulate(plans, S, lambda o: times[(o.kind, o.mb, o.chunk)])
            assert len(events) == len(start)
            for e in events:
                k = (e.kind, e.mb, e.chunk)
                assert (e.start, e.end) == pytest.approx((start[k], end[k])), (p, m, k)


def makespan(name, p, m):
    S = n_stages(name, p)
    start, end, worker = play(P.schedule(name, S, m), S, unit_time(name))
    return max(end.values()), start, end, worker


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_take_3_m_plus_p_minus_1(name):
    for p, m in GRID:
        assert makespan(name, p, m)[0] == 3 * (m + p - 1), (p, m)


def test_zbh1_takes_3m_plus_p_minus_1():
    # The paper's ZB-H1: bubble (p-1)(T_F + T_B - T_W) = p-1, a third of 1F1B's 3(p-1).
    for p, m in GRID:
        assert makespan("zbh1", p, m)[0] == 3 * m + (p - 1), (p, m)


def test_zbv_has_no_bubble_once_the_v_is_full():
    # The paper's ZB-V with T_F = T_B = T_W: no worker idles between its first and its last op, so each
    # worker's span is its work, 3m. Worker w starts when the first microbatch reaches it, after w
    # half-stage forwards; the step's makespan is therefore 3m + (p-1)/2. The V fills with 2p-1
    # microbatches; with fewer, the dropped operations leave gaps (p-1 units more at m = p).
    for p, m in GRID:
        span, start, end, worker = makespan("zbv", p, m)
        if m >= 2 * p - 1:
            assert span == 3 * m + (p - 1) / 2, (p, m)
            for w in range(p):
                mine = [k for k in start if worker[k] == w]
                assert max(end[k] for k in mine) - min(start[k] for k in mine) == 3 * m, (p, m, w)
        else:
            assert span == 3 * m + max(p - 1, 2 * (2 * p - 1 - m)) / 2, (p, m)
        assert span <= makespan("zbh1", p, m)[0]


@pytest.mark.parametrize("name", P.SCHEDULES)
def test_peak_memory(name):
    for p, m in GRID:
        plans = P.schedule(name, n_stages(name, p), m)
        for s, ops in enumerate(plans):
            peak = max(memory_trace(ops, name, w=1.0))  # w = 1: W keeps everything, the worst case
            fb_peak = max(memory_trace(ops, name, w=0.0))  # only what F..B holds
            if name == "gpipe":
                assert peak == m
            elif name == "1f1b":
                assert peak == min(p - s, m)
            elif name == "zbh1":
                # As many microbatches between F and B as 1F1B, and never more in memory than 1F1B's
                # peak (its first worker's, p), even if W kept everything. Worker 0 reaches it.
                assert fb_peak == min(p - s, m), (p, m, s)
                assert peak <= p and (s > 0 or peak == p), (p, m, s)
            else:
                # ZB-V: 1F1B's peak activation memory, p stage units, even if W kept everything.
                assert peak <= p, (p, m, s)


def test_bad_schedules_are_refused():
    with pytest.raises(vs.VjpsplitError, match="unknown schedule"):
        P.schedule("interleaved", 2, 2)
    with pytest.raises(vs.VjpsplitError, match="even number of stages"):
        P.schedule("zbv", 3, 4)
    with pytest.raises(vs.VjpsplitError, match="at least one stage"):
        P.schedule("1f1b", 2, 0)


def test_one_worker_schedules_run():
    for name in P.SCHEDULES:
        S = n_stages(name, 1)
        for m in (1, 2, 5):
            assert play(P.schedule(name, S, m), S, unit_time(name)) is not None
