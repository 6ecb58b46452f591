"""A Ray the user initialised with a runtime_env of their own: its env_vars reach the actors, but for the device
count, which is each actor's own."""

from __future__ import annotations

import os

import pytest
from test_local import what_actors_see

OTHER_FLAG = "--xla_cpu_multi_thread_eigen=false"
JOB_FLAGS = f"--xla_force_host_platform_device_count=2 {OTHER_FLAG}"


@pytest.fixture(scope="module")
def job_ray():
    """Ray initialised by the user (not by the runner) with XLA_FLAGS and PJRT_NPROC in its job runtime_env."""
    import ray

    env = {"env_vars": {"XLA_FLAGS": JOB_FLAGS, "PJRT_NPROC": "1"}}
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, runtime_env=env)
    yield ray
    ray.shutdown()


def test_ray_actors_keep_the_job_runtime_env_of_a_ray_the_user_started(job_ray, monkeypatch):
    import jax

    # The driver's own flags ask for 8 devices, the job's for 2: each 1-device actor keeps the job's other flag
    # (not the driver's flags) and its PJRT_NPROC, with a count of its own (a second device would only cost
    # XLA threads).
    def probe():
        return os.environ["XLA_FLAGS"], os.environ["PJRT_NPROC"], jax.local_device_count()

    seen = what_actors_see(job_ray, monkeypatch, probe)
    assert seen == [(f"{OTHER_FLAG} --xla_force_host_platform_device_count=1", "1", 1)] * 2
