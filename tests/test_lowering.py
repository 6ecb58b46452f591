"""A step's plans lowered to each worker's actions (``schedules.actions.lower``): computations with the sends and
receives between workers, as torch.distributed.pipelining lowers its schedules."""

from __future__ import annotations

import itertools

import pytest

from vjpsplit_cli.pipeline.schedules.actions import (
    Action,
    Comm,
    computations,
    hands_on_early,
    lower,
    sent_key,
)
from vjpsplit_cli.pipeline.schedules.builtins import schedule
from vjpsplit_cli.pipeline.schedules.catalog import SCHEDULES
from vjpsplit_cli.pipeline.schedules.layout import Layout
from vjpsplit_cli.pipeline.schedules.ops import Kind, Op, OpKey, dependencies

SENDS = (Comm.SEND_F, Comm.SEND_B)


def _cases():
    for name, splits in itertools.product(SCHEDULES, ("all", "none", "odd")):
        S = 8 if name == "interleaved1f1b" else 4
        yield pytest.param(name, S, 8, splits, id=f"{name}-{splits}")


def _lowered(name, S, M, which):
    plans = schedule(name, S, M)
    worker_of = Layout.of_schedule(name, S).worker_of()
    splits = {s: which == "all" or (which == "odd" and s % 2 == 1) for s in range(S)}
    if any(o.kind in (Kind.I, Kind.W) for ops in plans for o in ops):  # the schedule splits: every stage can
        splits = {s: True for s in range(S)}
    return plans, worker_of, splits, lower(plans, worker_of, splits, S)


@pytest.mark.parametrize("name,S,M,which", _cases())
def test_each_worker_computes_its_plan_with_early_handing_bs_split(name, S, M, which):
    plans, worker_of, splits, lists = _lowered(name, S, M, which)
    for ops, actions in zip(plans, lists):
        want = []
        for op in ops:
            split = hands_on_early(op, splits, worker_of)
            want += [Op(Kind.I, op.mb, op.stage), Op(Kind.W, op.mb, op.stage)] if split else [op]
        assert computations(actions) == want


@pytest.mark.parametrize("name,S,M,which", _cases())
def test_every_value_that_changes_worker_is_sent_once_and_received_once(name, S, M, which):
    plans, worker_of, splits, lists = _lowered(name, S, M, which)
    sends = {(w, a.peer, sent_key(a)) for w, acts in enumerate(lists) for a in acts if a.kind in SENDS}
    recvs = {
        (a.peer, w, sent_key(a)) for w, acts in enumerate(lists) for a in acts if not a.computes and a.kind not in SENDS
    }
    n_moves = sum(not a.computes for acts in lists for a in acts)
    assert sends == recvs and len(sends) + len(recvs) == n_moves  # each pair once, nothing unmatched
    # Exactly the values a computation reads from another worker's stage move.
    crossing = set()
    for w, ops in enumerate(plans):
        for op in ops:
            for d in dependencies(op, S):
                if d.stage != op.stage and worker_of[d.stage] != w:
                    crossing.add((worker_of[d.stage], w, d))
    assert sends == crossing
    for acts in lists:  # a SEND right after what it sends (after the I of a split B)
        for i, a in enumerate(acts):
            if a.kind in SENDS:
                made = acts[i - 1]
                assert made.computes and made.stage == a.stage and made.mb == a.mb
                assert made.kind == (Kind.F if a.kind == Comm.SEND_F else made.kind) and made.kind != Kind.W


@pytest.mark.parametrize("name,S,M,which", _cases())
def test_the_lowered_lists_run_to_the_end_with_blocking_receives(name, S, M, which):
    """Each worker runs its list in order, a RECV waiting until its SEND ran: every list ends (no deadlock), and each
    computation runs after every computation whose result it reads."""
    _, _, _, lists = _lowered(name, S, M, which)
    idx, sent, done = [0] * len(lists), set(), set()
    while any(i < len(acts) for i, acts in zip(idx, lists)):
        moved = False
        for w, acts in enumerate(lists):
            while idx[w] < len(acts):
                a = acts[idx[w]]
                if not a.computes and a.kind not in SENDS and (a.peer, sent_key(a)) not in sent:
                    break  # its value has not been sent yet
                if a.kind in SENDS:
                    sent.add((w, sent_key(a)))
                elif a.computes:
                    op = a.op
                    assert all(d in done for d in dependencies(op, S)), (w, a)
                    done.add(op.key if op.kind != Kind.W else OpKey(Kind.W, op.mb, op.stage))
                idx[w] += 1
                moved = True
        assert moved, f"deadlock at {[str(acts[i]) for i, acts in zip(idx, lists) if i < len(acts)]}"


def test_actions_read_as_torch_writes_them():
    lists = lower(
        [[Op(Kind.F, 0, 0), Op(Kind.B, 0, 0)], [Op(Kind.F, 0, 1), Op(Kind.B, 0, 1)]], {0: 0, 1: 1}, [True] * 2, 2
    )
    assert [[str(a) for a in acts] for acts in lists] == [
        ["0F0", "0SEND_F0", "0RECV_B0", "0B0"],
        ["1RECV_F0", "1F0", "1I0", "1SEND_B0", "1W0"],
    ]
    assert lists[0][1] == Action(0, Comm.SEND_F, 0, peer=1)
    with pytest.raises(ValueError, match="a move"):
        _ = lists[0][1].op
