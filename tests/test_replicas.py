"""Data parallel x pipeline: tests/replicas, run with 8 CPU devices in a pytest process of its own.

XLA fixes the CPU device count when JAX starts, so the 8-device suite cannot run
in this process (which tests everything else on one device).
"""

import pytest
from suites import run_own_process_suite


@pytest.mark.timeout(900)  # the whole 8-device suite, in one child process
def test_data_parallel_suite_passes_on_8_devices():
    run_own_process_suite("replicas", "VJPSPLIT_REPLICAS_SUITE", at_least=8, timeout=850)
