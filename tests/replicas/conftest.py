"""The data-parallel suite runs in its own pytest process (tests/test_replicas.py starts it) with 8 CPU devices.

XLA reads the device count once, when JAX starts its CPU backend, so the flag is set
here before JAX is imported; XLA also writes every program it compiles, optimized, as
HLO text to ``HLO_DUMP`` (what the test counting collectives reads).
"""

import os
import sys
import tempfile
from pathlib import Path

HLO_DUMP = tempfile.mkdtemp(prefix="vjpsplit-hlo-")
flags = [
    f
    for f in os.environ.get("XLA_FLAGS", "").split()
    if "xla_force_host_platform_device_count" not in f and "xla_dump" not in f
]
os.environ["XLA_FLAGS"] = " ".join(
    [*flags, "--xla_force_host_platform_device_count=8", f"--xla_dump_to={HLO_DUMP}", "--xla_dump_hlo_as_text"]
)

import jax  # noqa: E402
import pytest  # noqa: E402

if jax.device_count() != 8:
    raise RuntimeError(
        "the data-parallel suite needs 8 devices: JAX started before tests/replicas/conftest.py set XLA_FLAGS; "
        "run it alone: python -m pytest tests/replicas"
    )

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/models.py, tests/stage_models.py


@pytest.fixture()
def hlo_dump() -> Path:
    """Where XLA writes the HLO text of every program this process compiles."""
    return Path(HLO_DUMP)
