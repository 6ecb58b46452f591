"""Sharded artifacts on 8 CPU devices: tests/sharded, run in a pytest process of its own.

XLA fixes the CPU device count when JAX starts, so the 8-device suite cannot
run in this process (which tests everything else on one device).
"""

import pytest
from suites import run_own_process_suite


@pytest.mark.timeout(1800)  # the whole 8-device suite, in one child process
def test_sharded_suite_passes_on_8_devices():
    run_own_process_suite("sharded", "VJPSPLIT_SHARDED_SUITE", at_least=42, timeout=1700)
