"""The Ray runner: tests/ray_suite (a local Ray instance, then a 3-node cluster), in a pytest process of its own.

Ray's driver keeps threads and shared-memory channels in the process that called
``ray.init`` after ``ray.shutdown``, and ``ray.cluster_utils.Cluster`` forks its
node processes from it. In the main test process, after JAX had started its
threads, that crashed the whole pytest run with a SIGSEGV tests later (in CI,
and twice locally), with no Python stack: so every test that starts Ray runs in
a child process, where such a crash fails this one test with the child's output.
"""

import pytest
from suites import run_own_process_suite


@pytest.mark.timeout(2500)
def test_ray_suite_passes_in_its_own_process():
    run_own_process_suite("ray_suite", "VJPSPLIT_RAY_SUITE", at_least=22, timeout=2400)
