"""The plans as Ray's untimed lists run them (``runtime.ray.lists.action_lists``): what a Ray step's lower bound models.

On Ray, a B whose cotangent goes to another actor, on a stage with the split
backward, runs as its input part, the send, then its weight part. Under unit
costs (F = I = W = 1, a whole B = 2, no send time) 1F1B as scheduled ends at
``3 (m + S - 1)``; as listed, each of the last microbatch's ``S - 1`` hops back
leaves one W earlier, so it ends at ``3 m + 2 (S - 1)``.
"""

from __future__ import annotations

import pytest

from vjpsplit_cli.pipeline.runtime.ray.lists import action_lists
from vjpsplit_cli.pipeline.schedules.actions import hands_on_early
from vjpsplit_cli.pipeline.schedules.builtins import schedule
from vjpsplit_cli.pipeline.schedules.modeled import modeled_makespan
from vjpsplit_cli.pipeline.schedules.ops import Kind, Op


def _unit(S: int) -> dict:
    return {"F": [1.0] * S, "B": [1.0] * S, "W": [1.0] * S, "comm": 0.0}


@pytest.mark.parametrize("S", [2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 5, 8])
def test_1f1b_in_action_lists_ends_one_weight_part_earlier_per_hop_back(S, m):
    plans = schedule("1f1b", S, m)
    apart = {s: s for s in range(S)}
    assert modeled_makespan(plans, _unit(S)) == 3 * (m + S - 1)
    assert modeled_makespan(action_lists(plans, [True] * S, apart), _unit(S)) == 3 * m + 2 * (S - 1)


def test_only_a_b_sent_to_another_worker_from_a_split_stage_runs_as_i_then_w():
    plans = schedule("1f1b", 2, 2)
    listed = action_lists(plans, [True, True], {0: 0, 1: 1})
    assert listed[1] == [Op(Kind(k), mb, 1) for mb in (0, 1) for k in "FIW"]
    assert listed[0] == list(plans[0])  # stage 0's B sends nothing: whole
    # A stage without the split backward, or both stages on one worker: every B whole.
    assert action_lists(plans, [True, False], {0: 0, 1: 1}) == [list(p) for p in plans]
    assert action_lists(plans, [True, True], {0: 0, 1: 0}) == [list(p) for p in plans]
    assert not hands_on_early(Op(Kind.I, 0, 1), [True, True], {0: 0, 1: 1})  # already split: unchanged


def test_zero_bubble_action_lists_are_the_plans_as_scheduled():
    plans = schedule("zbh1", 3, 6)
    assert action_lists(plans, [True] * 3, {0: 0, 1: 1, 2: 2}) == [list(p) for p in plans]
