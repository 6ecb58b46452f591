import os
import signal
import sys
import tempfile
from pathlib import Path

import pytest

# tests/models.py is a plain helper module, not an installed package.
sys.path.insert(0, str(Path(__file__).parent))

# CLI runs in tests (and their subprocesses) keep their compilation cache out of ~/.cache.
os.environ.setdefault("VJPSPLIT_CACHE_DIR", tempfile.mkdtemp(prefix="vjpsplit-test-cache-"))

# tests/sharded needs 8 CPU devices, which XLA fixes when JAX starts: it runs in its own
# process (tests/test_sharded.py starts it with VJPSPLIT_SHARDED_SUITE=1).
collect_ignore = [] if os.environ.get("VJPSPLIT_SHARDED_SUITE") == "1" else ["sharded"]
# tests/ray_suite starts Ray (a local instance, then a multi-node cluster whose processes fork):
# its threads and forks can crash the whole pytest process tests later, so it runs in one of
# its own (tests/test_pipeline_ray.py starts it with VJPSPLIT_RAY_SUITE=1).
if os.environ.get("VJPSPLIT_RAY_SUITE") != "1":
    collect_ignore.append("ray_suite")
# tests/devices needs 4 CPU devices (every stage on its own): its own process too (tests/test_devices.py).
if os.environ.get("VJPSPLIT_DEVICES_SUITE") != "1":
    collect_ignore.append("devices")
# tests/replicas needs 8 CPU devices (data parallel x pipeline): its own process too (tests/test_replicas.py).
if os.environ.get("VJPSPLIT_REPLICAS_SUITE") != "1":
    collect_ignore.append("replicas")


# The suites run in their own processes take minutes each: handed out first, they run beside the rest when
# pytest-xdist spreads the tests over the cores, instead of alone at the end.
_LONG_FIRST = ("tests/test_pipeline_ray.py", "tests/test_sharded.py")


def pytest_collection_modifyitems(config, items):
    """Each long suite at the head of one worker's share: ``--dist worksteal`` (pyproject's addopts) first hands
    each of the N workers one contiguous part of the tests, then has an idle worker take half of the tests
    another has not started; the head of a part is never taken, so two long suites in one part would run one
    after the other on one core."""
    long = [item for item in items if item.nodeid.startswith(_LONG_FIRST)]
    rest = [item for item in items if not item.nodeid.startswith(_LONG_FIRST)]
    workers = max(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")), 1)
    left, ordered = len(items), []
    for w in range(workers):
        size = left // (workers - w)  # worksteal's first share of the tests left, worker by worker
        left -= size
        head = long[w::workers]
        take = max(size - len(head), 0)
        ordered += head + rest[:take]
        rest = rest[take:]
    items[:] = ordered + rest


@pytest.fixture()
def sigint_default():
    """Python's default SIGINT handler for one test, however the run was started (a background job ignores SIGINT)."""
    from sighelp import set_default_sigint

    previous = set_default_sigint()
    yield
    signal.signal(signal.SIGINT, previous)
