"""The Ray runner on a local 3-node cluster: stages pinned to nodes, placement groups, unschedulable stages."""

from __future__ import annotations

import time

import jax
import numpy as np
import pytest
from models import assert_trees_close
from models import stages_whole as whole
from test_pipeline import make

import vjpsplit_cli as vs
from vjpsplit_cli import pipeline as P
from vjpsplit_cli.pipeline.runtime.ray.setup import placement_group_options


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    c.add_node(num_cpus=1, resources={"node_a": 1, "slot": 1})
    c.add_node(num_cpus=1, resources={"node_b": 1, "slot": 1})
    c.wait_for_nodes()
    ray.init(address=c.address, include_dashboard=False, log_to_driver=False)
    ids = {
        name: n["NodeID"] for n in ray.nodes() if n["Alive"] for name in ("node_a", "node_b") if name in n["Resources"]
    }
    yield ray, ids
    ray.shutdown()
    c.shutdown()


def _check(r, params, x, labels):
    loss, grads = jax.value_and_grad(whole)(params, x, labels)
    np.testing.assert_allclose(r.loss, loss, rtol=1e-5)
    assert_trees_close(r.grads, grads, rtol=1e-5, atol=1e-6)


def test_stages_pinned_to_named_nodes(cluster):
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ray, ids = cluster
    arts, params, x, labels = make(2, seed=5)
    pins = [
        {"resources": {"node_a": 0.5}},
        {"scheduling_strategy": NodeAffinitySchedulingStrategy(ids["node_b"], soft=False)},
    ]
    with P.RayPipeline(arts, params, actor_options=pins) as rp:
        assert rp.nodes == [ids["node_a"], ids["node_b"]]
        for name in ("1f1b", "zbh1"):
            r = rp.run(x, [labels], microbatches=4, schedule=name)
            _check(r, params, x, labels)
    arts, params, x, labels = make(4, seed=6)
    opts = placement_group_options(2, {"CPU": 1}, strategy="STRICT_SPREAD")
    try:
        with P.RayPipeline(arts, params, layout="v", actor_options=opts) as rp:
            assert len(set(rp.nodes)) == 2  # one worker per node
            _check(rp.run(x, [labels], microbatches=4, schedule="zbv"), params, x, labels)
    finally:
        ray.util.remove_placement_group(opts[0]["scheduling_strategy"].placement_group)


def test_more_stages_than_resources_is_one_clear_error(cluster):
    arts, params, x, labels = make(3)
    with pytest.raises(
        vs.VjpsplitError,
        match=r"stage \d: Ray did not place its actor within 20 s: missing slot "
        r"\(asks 1, 0 free of 2 in the cluster\)",
    ):
        P.RayPipeline(arts, params, actor_options=[{"resources": {"slot": 1}}] * 3, schedule_timeout=20)
    # The actors that were placed are gone again: both slots come free (Ray frees them asynchronously).
    ray = cluster[0]
    for _ in range(60):
        if ray.available_resources().get("slot") == 2:
            break
        time.sleep(0.5)
    assert ray.available_resources().get("slot") == 2
