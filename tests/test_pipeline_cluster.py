"""Pipelines on a local multi-node Ray cluster: tests/cluster, run in a pytest process of its own.

``ray.cluster_utils.Cluster`` forks its node processes from the test process; after
the rest of the suite has started JAX's threads there, a fork can crash that whole
process, so the cluster tests get a fresh one (where Ray starts before JAX runs).
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(1200)
def test_cluster_suite_passes_in_its_own_process():
    env = {**os.environ, "VJPSPLIT_CLUSTER_SUITE": "1"}
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "tests" / "cluster")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1100,
    )
    tail = (r.stdout + r.stderr)[-6000:]
    assert r.returncode == 0, tail
    m = re.search(r"(\d+) passed", r.stdout)
    assert m and int(m.group(1)) >= 2, tail  # the suite ran, not an empty collection
