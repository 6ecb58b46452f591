"""The environment a Ray actor's process starts with, without Ray: its own device count whatever the driver's or
the job's ``XLA_FLAGS`` say (their other flags kept), its share of the host's XLA CPU threads on a local Ray, and
an actor's own ``runtime_env`` first."""

from __future__ import annotations

import os

import pytest

from vjpsplit_cli.pipeline.runtime.ray.actor import cpu_environment, xla_threads

COUNT = "--xla_force_host_platform_device_count"


def env_vars(opts):
    return opts.get("runtime_env", {}).get("env_vars", {})


@pytest.mark.parametrize("n", [1, 2, 4])
def test_an_actor_counts_its_own_devices_not_the_drivers(monkeypatch, n):
    monkeypatch.setenv("XLA_FLAGS", f"--xla_cpu_multi_thread_eigen=false {COUNT}=8")
    opts = {"num_cpus": 0}
    cpu_environment(opts, n, 1)
    # The driver's other flags travel; its device count does not (8 devices for a 1-device actor).
    assert env_vars(opts) == {"XLA_FLAGS": f"--xla_cpu_multi_thread_eigen=false {COUNT}={n}", "PJRT_NPROC": "1"}
    assert opts["num_cpus"] == 0


def test_a_one_device_actor_of_a_driver_without_a_count_keeps_its_flags(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")
    opts: dict = {}
    cpu_environment(opts, 1, None)
    assert opts == {}  # nothing to change: a cluster's actors keep their own node's flags and threads
    monkeypatch.delenv("XLA_FLAGS")
    cpu_environment(opts, 2, None)
    assert env_vars(opts) == {"XLA_FLAGS": f"{COUNT}=2"}


def test_an_actors_own_runtime_env_wins(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", f"{COUNT}=8")
    mine = {"XLA_FLAGS": f"{COUNT}=3", "PJRT_NPROC": "5", "OTHER": "x"}
    opts = {"runtime_env": {"env_vars": dict(mine), "pip": ["y"]}}
    cpu_environment(opts, 2, 1, {"XLA_FLAGS": f"{COUNT}=4", "PJRT_NPROC": "6"})
    assert env_vars(opts) == mine
    assert opts["runtime_env"]["pip"] == ["y"]


def test_the_jobs_flags_reach_the_actor_with_its_own_device_count(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", f"{COUNT}=8 --driver_only_flag")
    job = {"XLA_FLAGS": f"{COUNT}=3 --xla_cpu_multi_thread_eigen=false", "PJRT_NPROC": "5", "OTHER": "x"}
    for n in (1, 2):
        opts: dict = {}
        cpu_environment(opts, n, 1, job)
        # The job's flags, not the driver's, with the count this actor drives; the job's PJRT_NPROC stands.
        assert env_vars(opts) == {"XLA_FLAGS": f"--xla_cpu_multi_thread_eigen=false {COUNT}={n}"}
    opts = {}
    cpu_environment(opts, 1, None, {"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false"})
    assert opts == {}  # one device and no count anywhere in the job's flags: they reach the actor as they are


def test_a_local_rays_actors_share_the_hosts_cores():
    cores = len(os.sched_getaffinity(0))
    assert xla_threads(1) == cores
    assert xla_threads(2) == max(1, cores // 2)
    assert xla_threads(10 * cores) == 1  # never none
    assert xla_threads(None) is None  # a cluster: which actors share a node is Ray's choice
