"""Run a folder of tests in a pytest process of its own, and fail with its output's tail if it fails.

Some suites cannot share the main test process: the 8-device suite needs XLA_FLAGS set
before JAX starts, and the Ray suite starts Ray drivers and clusters, whose threads and
forked node processes can crash (SIGSEGV) the process they run in long after the test
that started them, far from its cause.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_own_process_suite(folder: str, env_var: str, at_least: int, timeout: float) -> None:
    """Run ``tests/<folder>`` with ``<env_var>=1`` in a child pytest; assert it ran ``at_least`` tests, all passing."""
    env = {**os.environ, env_var: "1"}
    r = subprocess.run(
        # -X faulthandler: a crash in the child names its Python stack in the output we show.
        [
            sys.executable,
            "-X",
            "faulthandler",
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            # One process: the suite is one test of the run that started it, which may spread over cores.
            "-n",
            "0",
            str(ROOT / "tests" / folder),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    tail = (r.stdout + r.stderr)[-8000:]
    assert r.returncode == 0, f"tests/{folder} exited with {r.returncode}:\n{tail}"
    # Only pytest's own summary line (its last) counts: a warning's printed source may say "failed" too.
    summary = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
    m = re.search(r"(\d+) passed", summary)
    assert m and int(m.group(1)) >= at_least, tail  # the suite ran, not an empty collection
    assert not re.search(r"\d+ (failed|errors?)\b", summary), tail
