"""Sharded artifacts on 8 CPU devices: tests/sharded, run in a pytest process of its own.

XLA fixes the CPU device count when JAX starts, so the 8-device suite cannot
run in this process (which tests everything else on one device).
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(1800)  # the whole 8-device suite, in one child process
def test_sharded_suite_passes_on_8_devices():
    env = {**os.environ, "VJPSPLIT_SHARDED_SUITE": "1"}
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "tests" / "sharded")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    tail = (r.stdout + r.stderr)[-6000:]
    assert r.returncode == 0, tail
    m = re.search(r"(\d+) passed", r.stdout)
    assert m and int(m.group(1)) >= 10, tail  # the suite ran, not an empty collection
    assert " failed" not in r.stdout and " error" not in r.stdout, tail
