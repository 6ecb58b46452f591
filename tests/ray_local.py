"""A local Ray instance per test module: the ``ray_session`` fixture of the Ray and sharded suites."""

import pytest


@pytest.fixture(scope="module")
def ray_session():
    """A new local Ray instance with 4 CPUs for one module's tests (``address="local"``: never a cluster another
    test process started, such as the Ray suite's ``Cluster`` while the sharded suite runs), shut down after them."""
    import ray  # a test dependency (pip install -e '.[test]'): missing Ray is a failure, not a skip

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()
