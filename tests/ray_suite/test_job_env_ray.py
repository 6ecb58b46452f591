"""A Ray the user initialised with a runtime_env of their own: its env_vars reach the actors unchanged."""

from __future__ import annotations

import os

import pytest
from test_local import what_actors_see

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
    seen = what_actors_see(job_ray, monkeypatch, lambda: (os.environ["XLA_FLAGS"], os.environ["PJRT_NPROC"]))
    assert seen == [(JOB_FLAGS, "1")] * 2
