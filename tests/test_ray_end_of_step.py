"""The end of a Ray step as each actor runs it (``TrainActor._finish``), with its exchanges stubbed: a worker
whose peer's step failed updates nothing, even where no tied sum, norm or reduction goes between them."""

from __future__ import annotations

import pytest

from vjpsplit_cli.pipeline.training.ray_backend import EndOfStep, TrainActor


class _Stage:
    """What ``_finish`` asks of a stage's trainer, with the updates it was asked for noted."""

    def __init__(self) -> None:
        self.applied: list[float] = []

    def tied_grads(self) -> dict:
        return {}

    def prepare(self, contributions: dict) -> float:
        return 1.0

    def shares(self, r, scale, value, reduced) -> list:
        return []

    def apply(self, scale, value, reduced) -> None:
        self.applied.append(scale)


def _actor(worker: int, peer_ok: bool, own_error: Exception | None = None):
    actor = object.__new__(TrainActor)  # its state only: no Ray, no stages
    actor.end = EndOfStep(holders=({}, {}))  # nothing tied, no reductions over leaves, an update without the loss
    actor.worker, actor.num_stages = worker, 2
    actor.trainers = {worker: _Stage()}
    actor.worker_of = {0: 0, 1: 1}
    actor.error, actor.phases = own_error, []
    sent: list[tuple[str, dict]] = []

    def exchange(step, tag, parts, peers):
        sent.append((tag, dict(parts)))
        return {w: (True if peer_ok else None) for w in peers}  # a failed peer sends None for each part

    actor._exchange = exchange
    return actor, sent


@pytest.mark.parametrize("peer_ok", [True, False])
def test_a_worker_updates_only_when_every_other_workers_step_went_well(peer_ok):
    actor, sent = _actor(0, peer_ok)
    actor._finish(step=1, microbatches=2, clip=None)
    assert actor.trainers[0].applied == ([1.0] if peer_ok else [])
    assert [tag for tag, _ in sent] == ["ok"] and sent[0][1] == {1: True}


def test_a_worker_whose_own_step_failed_says_so_and_updates_nothing():
    actor, sent = _actor(1, True, own_error=RuntimeError("an operation failed"))
    actor._finish(step=1, microbatches=2, clip=None)
    assert actor.trainers[1].applied == [] and sent == [("ok", {0: None})]


def test_with_clipping_the_norms_are_the_agreement():
    actor, sent = _actor(0, False)
    actor._finish(step=1, microbatches=2, clip=1.0)
    assert actor.trainers[0].applied == [] and [tag for tag, _ in sent] == ["norms"]
