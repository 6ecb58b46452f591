"""The sharded suite runs in its own pytest process (tests/test_sharded.py starts it) with 8 CPU devices.

XLA reads the device count once, when JAX first starts its CPU backend: the
flag must be in the environment before that, so this suite cannot share a
process with the single-device tests.
"""

import os
import sys
from pathlib import Path

flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
os.environ["XLA_FLAGS"] = " ".join([*flags, "--xla_force_host_platform_device_count=8"])

import jax  # noqa: E402

if jax.device_count() < 8:
    raise RuntimeError(
        "the sharded suite needs 8 devices: JAX started before tests/sharded/conftest.py set XLA_FLAGS; "
        "run it alone: python -m pytest tests/sharded"
    )

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "samples" / "sharded"))

from ray_local import no_kept_ray, ray_session  # noqa: E402, F401 - the suites' local Ray fixtures
