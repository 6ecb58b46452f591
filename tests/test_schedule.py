"""Schedules, checked by an independent model: completeness, order, deadlock freedom under random op times,
peak memory, and unit-time makespans against the paper's formulas.

p is the number of workers (devices), m the number of microbatches. GPipe, 1F1B
and ZB-H1 run p stages; ZB-V runs 2p stages, two per worker. Time unit: one
stage's forward. GPipe's and 1F1B's whole backward, B, costs 2, the split
schedules' I (input part) and W cost 1 each, and a ZB-V stage (half a worker's layers) costs
half of that. Each operation's kind says which it is: nothing here looks at the rest
of the plans to tell a whole backward from an input part. Memory unit: what one stage keeps for one microbatch between F and
B (all its residuals; half for a ZB-V stage); between B and W it keeps only W's
part, a share ``w`` of that.
"""

from __future__ import annotations

import hashlib
import random
from collections import defaultdict

import pytest

import vjpsplit_cli as vs
from vjpsplit_cli import pipeline as P
from vjpsplit_cli.pipeline.schedules.catalog import SCHEDULES, SPLIT_BACKWARD
from vjpsplit_cli.pipeline.schedules.layout import worker_stages

GRID = [(p, m) for p in range(2, 7) for m in range(p, 4 * p + 1)]
CLASSIC = ("gpipe", "1f1b", "zbh1", "zbv")  # the schedules that run any m >= 1 (new ones: below)


def n_stages(name, p):
    return 2 * p if name == "zbv" else p


def deps(kind, mb, c, S):
    """What an operation reads, written out here rather than taken from the module under test (``"b"``: the
    backward that hands on the cotangent, a whole B or an I)."""
    if kind == "F":
        return [("F", mb, c - 1)] if c > 0 else []
    if kind in "BI":
        return [("F", mb, c)] + ([("b", mb, c + 1)] if c + 1 < S else [])
    return [("b", mb, c)]


def slot(o):
    """An operation as ``deps`` names it: a B or an I is its microbatch's ``"b"`` on its stage."""
    return ("b" if o.kind in "BI" else str(o.kind), o.mb, o.stage)


def play(plans, S, duration, comm=0.0):
    """Start and end of every op: a longest path over the DAG of list order plus data edges (Kahn's algorithm).

    A result read on another worker arrives ``comm`` after it ends. ``duration`` takes ``(kind, mb, stage)``;
    the times come back keyed the same way. Returns None if the graph has a cycle, i.e. the lists deadlock.
    """
    preds = defaultdict(list)
    worker, real = {}, {}
    for w, ops in enumerate(plans):
        for i, o in enumerate(ops):
            key = slot(o)
            worker[key], real[key] = w, (str(o.kind), o.mb, o.stage)
            preds[key] += deps(str(o.kind), o.mb, o.stage, S)
            if i:
                preds[key].append(slot(ops[i - 1]))
    succs = defaultdict(list)
    indeg = {k: len(v) for k, v in preds.items()}
    for k, v in preds.items():
        for d in v:
            succs[d].append(k)
    ready = [k for k, n in indeg.items() if n == 0]
    start, end = {}, {}
    while ready:
        k = ready.pop()
        start[k] = max((end[d] + (comm if worker[d] != worker[k] else 0.0) for d in preds[k]), default=0.0)
        end[k] = start[k] + duration(real[k])
        for s in succs[k]:
            indeg[s] -= 1
            if indeg[s] == 0:
                ready.append(s)
    if len(end) != len(preds):
        return None
    return (
        {real[k]: v for k, v in start.items()},
        {real[k]: v for k, v in end.items()},
        {real[k]: w for k, w in worker.items()},
    )


def unit_time(name):
    scale = 0.5 if name == "zbv" else 1.0

    def duration(key):
        return scale * (2.0 if key[0] == "B" else 1.0)  # a whole backward; I and W are 1 each

    return duration


def memory_trace(ops, name, w):
    """Memory of one worker after each op, in stage units."""
    size = 0.5 if name == "zbv" else 1.0
    held, trace = 0.0, []
    for o in ops:
        if o.kind == "F":
            held += size
        elif o.kind == "B":
            held -= size
        elif o.kind == "I":
            held -= size * (1 - w)
        else:
            held -= size * w
        trace.append(held)
    return trace


@pytest.mark.parametrize("name", CLASSIC)
def test_every_op_once_on_its_worker_in_order(name):
    for p, m in GRID:
        S = n_stages(name, p)
        plans = P.schedule(name, S, m)
        assert len(plans) == p
        kinds = "FIW" if name in SPLIT_BACKWARD else "FB"  # split schedules say I for every input part
        every = sorted((o.kind, o.mb, o.stage) for ops in plans for o in ops)
        assert every == sorted((k, mb, c) for k in kinds for mb in range(m) for c in range(S)), (p, m)
        for w, ops in enumerate(plans):
            assert {o.stage for o in ops} == set(worker_stages(name, S)[w])
            pos = {slot(o): i for i, o in enumerate(ops)}
            for o in ops:
                for d in deps(o.kind, o.mb, o.stage, S):
                    if d in pos:  # a dependency on this worker must come earlier in its list
                        assert pos[d] < pos[slot(o)], (p, m, w, o, d)


def test_zbv_places_two_stages_per_worker_in_a_v():
    assert worker_stages("zbv", 8) == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert worker_stages("1f1b", 3) == [(0,), (1,), (2,)]


@pytest.mark.parametrize("name", CLASSIC)
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
            real = {slot(o): (o.kind, o.mb, o.stage) for ops in plans for o in ops}
            for k in start:
                assert all(start[k] >= end[real[d]] for d in deps(*k, S))
            # The module's own replay agrees with this independent model.
            events = P.simulate(plans, S, lambda o: times[(o.kind, o.mb, o.stage)])
            assert len(events) == len(start)
            for e in events:
                k = (e.kind, e.mb, e.stage)
                assert (e.start, e.end) == pytest.approx((start[k], end[k])), (p, m, k)


@pytest.mark.parametrize("name", SCHEDULES)
def test_simulate_takes_per_stage_costs_and_a_send_delay(name):
    """Costs per stage and kind (a whole backward costs B + W) and a delay per send between workers, as an
    automatic scheduler evaluates plans, against the independent model."""
    rng = random.Random(7)
    for p in (2, 3, 4):
        S = p if name in ("gpipe", "1f1b", "zbh1") else 2 * p
        for m in (2 * p, 3 * p):
            plans = P.schedule(name, S, m)
            costs = {k: [rng.uniform(0.1, 2.0) for _ in range(S)] for k in "FBW"}
            comm = rng.uniform(0.05, 0.5)

            def duration(key, costs=costs):
                kind, mb, s = key  # the costs' "B" is the input part's time: an I's, and a whole B's less W
                return {"F": costs["F"][s], "I": costs["B"][s], "B": costs["B"][s] + costs["W"][s], "W": costs["W"][s]}[
                    kind
                ]

            start, end, worker = play(plans, S, duration, comm)
            events = P.simulate(plans, S, {**costs, "comm": comm})
            assert len(events) == len(start)
            for e in events:
                k = (e.kind, e.mb, e.stage)
                assert e.worker == worker[k]
                assert (e.start, e.end) == pytest.approx((start[k], end[k])), (p, m, k)
            # A delay given beside the costs replaces theirs; no delay at all is the model without it.
            assert P.simulate(plans, S, costs, comm=comm) == events
            start0, end0, _ = play(plans, S, duration)
            assert max(e.end for e in P.simulate(plans, S, costs)) == pytest.approx(max(end0.values()))
            assert max(e.end for e in events) > max(end0.values())  # the sends cost something


def test_costs_are_checked():
    plans = P.schedule("1f1b", 2, 2)
    with pytest.raises(vs.VjpsplitError, match=r"costs\['F'\] must be one time per stage \(2\)"):
        P.simulate(plans, 2, {"F": [1, 1, 1], "B": [1, 1]})
    with pytest.raises(vs.VjpsplitError, match="costs has no 'B'"):
        P.simulate(plans, 2, {"F": [1, 1]})
    with pytest.raises(vs.VjpsplitError, match=r"costs\['comm'\]"):
        P.simulate(plans, 2, {"F": 1.0, "B": 1.0, "comm": -1})
    # One number serves every stage; W defaults to 0: 1F1B's whole backward costs B + W = 1.
    assert max(e.end for e in P.simulate(plans, 2, {"F": 1, "B": 1})) == 2 * (2 + 2 - 1)


def test_walk_and_simulate_name_the_deadlock():
    """The dispatcher and the simulator play plans as the check does: the same error names the rank and action."""
    F, B = (lambda mb, c, k=k: P.Op(k, mb, c) for k in "FB")
    plans = [[F(0, 0), B(0, 0), F(1, 0), B(1, 0)], [F(0, 1), F(1, 1), B(0, 1), B(1, 1)]]
    match = r"deadlocks: rank 0's action 0B0 waits for 1B0"
    with pytest.raises(vs.VjpsplitError, match=match):
        P.simulate(plans, 2, lambda o: 1.0)
    from vjpsplit_cli.pipeline.runtime.dispatch import walk

    submitted = []
    with pytest.raises(vs.VjpsplitError, match=match):
        walk(plans, 2, [(0, []), (1, [])], lambda w, op, data, side: submitted.append(op))
    assert submitted == [F(0, 0), F(0, 1)]  # what can run before the cycle, nothing after


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


@pytest.mark.parametrize("name", CLASSIC)
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
    with pytest.raises(vs.VjpsplitError, match="multiple of 3 microbatches, not 4"):
        P.schedule("interleaved1f1b", 6, 4)
    with pytest.raises(vs.VjpsplitError, match="multiple of 3 stages, not 4"):
        P.schedule("interleaved1f1b", 4, 4, chunks=3)
    with pytest.raises(vs.VjpsplitError, match="at least 6 microbatches"):
        P.schedule("dualpipev", 6, 5)
    with pytest.raises(vs.VjpsplitError, match="even number of stages"):
        P.schedule("zbv", 3, 4)
    with pytest.raises(vs.VjpsplitError, match="at least one stage"):
        P.schedule("1f1b", 2, 0)


def test_one_worker_schedules_run():
    for name in CLASSIC:
        S = n_stages(name, 1)
        for m in (1, 2, 5):
            assert play(P.schedule(name, S, m), S, unit_time(name)) is not None


# Interleaved 1F1B and DualPipeV. Interleaved: v chunks per worker, a chunk's F costs 1/v and its
# whole B 2/v. DualPipeV: 2 chunks per worker, F = I = W = 1/2 per chunk; a B is the whole
# backward, I + W = 1. Memory in chunk activations: an F adds one; a whole B, or the W of a split
# one, frees it (W keeping everything: the worst case).

INTERLEAVED = [(p, v, m) for p in range(2, 7) for v in (2, 3) for m in range(p, 4 * p + 1)]
DUALPIPEV = [(p, m) for p in range(2, 7) for m in range(p, 4 * p + 1)]
# torch's test/distributed/pipelining/artifacts/dualpipev_4rank_10mb.csv, its text with \n line ends
TORCH_DUALPIPEV_4RANK_10MB = "16ce4a29936e4c5ad774098add32489b4937942e3f5ab0108f17d2826b184529"


def split_pairs(plans):
    """The (stage, microbatch) pairs whose backward the plans split: those with an I."""
    return {(o.stage, o.mb) for ops in plans for o in ops if o.kind == "I"}


def chunk_time(v):
    def duration(key):
        return (2.0 if key[0] == "B" else 1.0) / v  # a whole backward; F, I and W 1/v each

    return duration


def chunk_memory(ops):
    held, peak = 0, 0
    for o in ops:
        if o.kind == "F":
            held += 1
        elif o.kind in "BW":
            held -= 1
        peak = max(peak, held)
    return peak, held


def check_complete(plans, S, m, placement):
    split = split_pairs(plans)
    every = sorted((o.kind, o.mb, o.stage) for ops in plans for o in ops)
    want = sorted(
        [("F", mb, c) for mb in range(m) for c in range(S)]
        + [(k, mb, c) for mb in range(m) for c in range(S) for k in (("I", "W") if (c, mb) in split else ("B",))]
    )
    assert every == want
    for w, ops in enumerate(plans):
        assert {o.stage for o in ops} == set(placement[w])
        pos = {slot(o): i for i, o in enumerate(ops)}
        for o in ops:
            for d in deps(o.kind, o.mb, o.stage, S):
                if d in pos:
                    assert pos[d] < pos[slot(o)], (w, o, d)


def test_interleaved_1f1b_makespan_memory_and_order():
    for p, v, m in INTERLEAVED:
        S = v * p
        if m % p:
            with pytest.raises(vs.VjpsplitError, match=f"multiple of {p} microbatches"):
                P.schedule("interleaved1f1b", S, m, chunks=v)
            continue
        plans = P.schedule("interleaved1f1b", S, m, chunks=v)
        placement = worker_stages("interleaved1f1b", S, chunks=v)
        assert placement == [tuple(range(r, S, p)) for r in range(p)]  # stage s on worker s mod p
        check_complete(plans, S, m, placement)
        start, end, _ = play(plans, S, chunk_time(v))
        # Megatron-LM (SC 2021) section 2.2.2: bubble (p-1)(t_f + t_b)/v on top of the work, 3m.
        assert max(end.values()) == pytest.approx(3 * m + 3 * (p - 1) / v), (p, v, m)
        for r, ops in enumerate(plans):
            peak, held = chunk_memory(ops)
            assert held == 0 and peak == min(2 * (p - 1 - r) + (v - 1) * p + 1, m * v), (p, v, m, r)
            # Megatron-LM's warm-up forwards, then (while forwards remain) one more F before the first B.
            warm = min(2 * (p - r - 1) + (v - 1) * p, m * v)
            first_b = next(i for i, o in enumerate(ops) if o.kind == "B")
            assert first_b == warm + (1 if warm < m * v else 0), (p, v, m, r)


def test_interleaved_1f1b_by_name_has_two_chunks():
    assert P.schedule("interleaved1f1b", 6, 6) == P.schedule("interleaved1f1b", 6, 6, chunks=2)
    assert worker_stages("interleaved1f1b", 6) == [(0, 3), (1, 4), (2, 5)]


def test_dualpipev_makespan_memory_and_order():
    for p, m in DUALPIPEV:
        S = 2 * p
        if m < 2 * p:
            with pytest.raises(vs.VjpsplitError, match=f"at least {S} microbatches"):
                P.schedule("dualpipev", S, m)
            continue
        plans = P.schedule("dualpipev", S, m)
        assert worker_stages("dualpipev", S) == [(w, S - 1 - w) for w in range(p)]
        check_complete(plans, S, m, worker_stages("dualpipev", S))
        split = split_pairs(plans)
        assert split and len(split) < S * m  # split into I and W for some microbatches, a whole B for others
        start, end, worker = play(plans, S, chunk_time(2))
        assert max(end.values()) == pytest.approx(3 * m + (p - 1) / 2), (p, m)
        for w, ops in enumerate(plans):
            peak, held = chunk_memory(ops)
            assert held == 0 and peak <= 2 * p + 1, (p, m, w, peak)  # DualPipe's README: PP+1, PP = 2p
            mine = [k for k in start if worker[k] == w]
            span = max(end[k] for k in mine) - min(start[k] for k in mine)
            assert span == pytest.approx(3 * m + (p - 1 - w) / 2), (p, m, w)  # its work, 3m, and its idle


def test_dualpipev_equals_torchs_artifact(tmp_path):
    plans = P.schedule("dualpipev", 8, 10)
    path = tmp_path / "dualpipev_4rank_10mb.csv"
    P.write_schedule(path, plans)
    text = path.read_bytes()
    assert hashlib.sha256(text).hexdigest() == TORCH_DUALPIPEV_4RANK_10MB
    assert P.read_schedule(path) == plans
    # torch's csv module ends lines with \r\n: read the same.
    crlf = tmp_path / "crlf.csv"
    crlf.write_bytes(text.replace(b"\n", b"\r\n"))
    assert P.read_schedule(crlf) == plans
    first = text.decode().splitlines()[0].split(",")
    assert first[:3] == ["0F0", "0F1", "0F2"] and "(0F7;7B3)OVERLAP_F_B" in first and first[-1] == "0W9"


@pytest.mark.parametrize("name", SCHEDULES)
def test_write_then_read_gives_the_same_plans(name, tmp_path):
    for p in (1, 2, 3):
        S = 2 * p if name in ("zbv", "dualpipev", "interleaved1f1b") else p
        for m in (2 * p, 3 * p):
            plans = P.schedule(name, S, m)
            path = tmp_path / f"{name}_{p}_{m}.csv"
            P.write_schedule(path, plans)
            assert P.read_schedule(path) == plans, (p, m)
            lines = path.read_text().splitlines()
            assert len(lines) == len(plans) and all("," in ln or len(ops) == 1 for ln, ops in zip(lines, plans))


def test_csv_idle_steps_are_dropped(tmp_path):
    path = tmp_path / "s.csv"
    path.write_text("0F0,,0F1,0B0,0B1\n,1F0,1B0,1F1,,1B1\n")
    plans = P.read_schedule(path)
    assert plans == [
        [P.Op("F", 0, 0), P.Op("F", 1, 0), P.Op("B", 0, 0), P.Op("B", 1, 0)],
        [P.Op("F", 0, 1), P.Op("B", 0, 1), P.Op("F", 1, 1), P.Op("B", 1, 1)],
    ]
    assert P.check_plans(plans, 2, 2) == [(0,), (1,)]


@pytest.mark.parametrize(
    "text,match",
    [
        ("0F0,0X0\n", r"rank 0, step 1: '0X0' is not a compute action"),
        ("0F0,0SEND_F0\n", r"rank 0, step 1: '0SEND_F0' is not a compute action"),
        ("0F0,0I0\n", r"rank 0: stage 0 microbatch 0: 0I0 is the backward's input part, but no 0W0 runs"),
        ("0F0,0B0,0W0\n", r"rank 0: stage 0 microbatch 0: 0B0 is the whole backward, yet 0W0 is its weight part; "),
        ("0F0,0W0\n", r"rank 0: stage 0 microbatch 0: 0W0 is the backward's weight part, but no 0I0"),
        ("0F0,0I0,0B0,0W0\n", r"rank 0: stage 0 microbatch 0: 0B0 \(the whole backward\) and 0I0"),
    ],
)
def test_bad_csv_is_one_error_naming_rank_and_action(tmp_path, text, match):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(vs.VjpsplitError, match=match):
        P.read_schedule(path)


def test_bad_plans_are_one_error_naming_rank_and_action():
    F, B, I, W = (lambda mb, c, k=k: P.Op(k, mb, c) for k in "FBIW")  # noqa: E741
    good = [[F(0, 0), F(1, 0), B(0, 0), B(1, 0)], [F(0, 1), B(0, 1), F(1, 1), B(1, 1)]]
    assert P.check_plans(good, 2, 2) == [(0,), (1,)]
    cases = [
        ([[F(0, 0), F(1, 0), B(0, 0)], good[1]], r"rank 0: action 0B1 is missing"),
        (
            [[F(0, 0), F(1, 0), B(0, 0), B(1, 0), F(0, 1)], good[1]],
            r"rank 1: action 1F0 runs stage 1, which rank 0 holds",
        ),
        ([good[0] + [B(1, 0)], good[1]], r"rank 0: action 0B1 appears twice"),
        ([good[0], good[1] + [F(2, 1)]], r"rank 1: action 1F2 is outside the 2 stages and 2 microbatches"),
        (
            [[F(0, 0), B(0, 0), F(1, 0), B(1, 0)], [F(0, 1), F(1, 1), B(0, 1), B(1, 1)]],
            r"deadlocks: rank 0's action 0B0 waits for 1B0",
        ),
        ([good[0], [F(0, 1), B(0, 1), W(1, 1), F(1, 1), I(1, 1)]], r"rank 1's action 1W1 waits for 1I1"),
        # A B with a W: what a B meant before Kind.I existed (its input part). Refused, naming the fix.
        (
            [good[0], [F(0, 1), B(0, 1), F(1, 1), B(1, 1), W(1, 1)]],
            r"^rank 1: stage 1 microbatch 1: 1B1 is the whole backward, yet 1W1 is its weight part; "
            r"with a W, use I \(1I1\) for the input part, or drop the W$",
        ),
        ([good[0], [F(0, 1), B(0, 1), F(1, 1), I(1, 1)]], r"^rank 1: stage 1 microbatch 1: 1I1 is the backward's"),
        ([good[0], [F(0, 1), B(0, 1), F(1, 1), W(1, 1)]], r"^rank 1: stage 1 microbatch 1: 1W1 is the backward's"),
        ([good[0], good[1] + [I(1, 1), W(1, 1)]], r"^rank 1: stage 1 microbatch 1: 1B1 \(the whole backward\)"),
        ([good[0]], r"no rank: action 1F0 is missing"),
    ]
    for plans, match in cases:
        with pytest.raises(vs.VjpsplitError, match=match):
            P.check_plans(plans, 2, 2)


def test_an_op_of_an_unknown_kind_is_refused():
    with pytest.raises(vs.VjpsplitError, match=r"Op kind 'X': use 'F', 'B' \(whole backward\), 'I' \(its input"):
        P.Op("X", 0, 0)
    assert P.Op("F", 0, 1) == P.Op(P.Kind.F, 0, 1) and P.Op("W", 2, 0).kind == "W"
    assert P.Op("I", 2, 0).kind == P.Kind.I != P.Kind.B  # the input part says so itself


def test_replay_gives_a_b_that_ran_as_its_parts_both_their_times():
    """A Ray worker's B that hands its cotangent on early runs as I then W: the modeled timeline gives that B the
    sum of their times, as it gives a B that ran whole its own."""
    from vjpsplit_cli.pipeline.schedules.play import replay
    from vjpsplit_cli.pipeline.schedules.timeline import Event

    plans = P.schedule("1f1b", 2, 2)
    whole, parts = [], []
    for w, ops in enumerate(plans):
        t = 0.0
        for o in ops:
            d = 1.0 if o.kind == "F" else 2.0
            whole.append(Event(w, o.kind, o.mb, t, t + d, o.stage))
            if o.kind == "B" and o.stage == 1:
                parts += [Event(w, "I", o.mb, t, t + 0.5, o.stage), Event(w, "W", o.mb, t + 0.5, t + d, o.stage)]
            else:
                parts.append(whole[-1])
            t += d
    spans = lambda evs: sorted((e.kind, e.mb, e.stage, e.end - e.start) for e in evs)  # noqa: E731
    assert spans(replay(parts, plans, 2)) == spans(replay(whole, plans, 2))
    assert ("B", 0, 1, 2.0) in spans(replay(parts, plans, 2))
