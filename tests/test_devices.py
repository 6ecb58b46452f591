"""Every stage on a device of its own: tests/devices, run with 4 CPU devices in a pytest process of its own.

XLA fixes the CPU device count when JAX starts, so the 4-device suite cannot run
in this process (which tests everything else on one device).
"""

import pytest
from suites import run_own_process_suite


@pytest.mark.timeout(900)  # the whole 4-device suite, in one child process
def test_device_suite_passes_on_4_devices():
    run_own_process_suite("devices", "VJPSPLIT_DEVICES_SUITE", at_least=7, timeout=850)
