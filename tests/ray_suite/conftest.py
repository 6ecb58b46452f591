"""The Ray suite: its own pytest process (tests/test_pipeline_ray.py starts it)."""

import sys
from pathlib import Path

# test_pipeline's stage maker and tests/models.py, as in the main suite.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ray_local import no_kept_ray, ray_session  # noqa: E402, F401 - the suites' local Ray fixtures
