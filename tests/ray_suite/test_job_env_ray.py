"""A Ray the user initialised with a runtime_env of their own: its env_vars reach the actors unchanged."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest
from models import assert_trees_close
from models import stages_whole as whole
from test_pipeline import make

from vjpsplit_cli import pipeline as P

JOB_FLAGS = "--xla_force_host_platform_device_count=1 --xla_cpu_multi_thread_eigen=false"


@pytest.fixture(scope="module")
def job_ray():
    """Ray initialised by the user (not by the runner) with XLA_FLAGS and PJRT_NPROC in its job runtime_env."""
    import ray

    env = {"env_vars": {"XLA_FLAGS": JOB_FLAGS, "PJRT_NPROC": "1"}}
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, runtime_env=env)
    yield ray
    ray.shutdown()


def test_ray_actors_keep_the_job_runtime_env_of_a_ray_the_user_started(job_ray, monkeypatch):
    # The driver's own flags ask for 8 devices: without reading the job's runtime_env the runner would
    # write its own XLA_FLAGS (a count of 1, nothing else) over the user's.
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    arts, params, x, labels = make(2)
    loss, grads = jax.value_and_grad(whole)(params, x, labels)
    with P.RayPipeline(arts, params) as rp:
        seen = job_ray.get(
            [a.__ray_call__.remote(lambda _: (os.environ["XLA_FLAGS"], os.environ["PJRT_NPROC"])) for a in rp.actors]
        )
        r = rp.run(x, [labels], microbatches=4, schedule_name="1f1b")
    assert seen == [(JOB_FLAGS, "1")] * 2
    np.testing.assert_allclose(r.loss, loss, rtol=1e-5)
    assert_trees_close(r.grads, grads, rtol=1e-5, atol=1e-6)
