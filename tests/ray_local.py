"""A local Ray instance for the modules that ask for one: the ``ray_session`` fixture of the Ray and sharded suites."""

import sys

import pytest

CPUS = 4
KEPT: dict[str, str] = {}  # "address": the GCS address of the local Ray ray_session started and keeps running


@pytest.fixture(scope="module")
def ray_session():
    """A local Ray instance with 4 CPUs for one module's tests (``address="local"``: never a cluster another
    test process started, such as the Ray suite's ``Cluster`` while the sharded suite runs).

    The instance it started for a module before is kept (a ``ray.init`` costs seconds) where that module ended
    with every CPU free (no actor of its tests left); else it is shut down after the module, and the next one
    starts a new one. A module that asks for none starts with none running (``no_kept_ray``)."""
    import ray  # a test dependency (pip install -e '.[test]'): missing Ray is a failure, not a skip

    if not ray.is_initialized() or ray.get_runtime_context().gcs_address != KEPT.get("address"):
        # A Ray running that it did not start: ray.init refuses it, as when every module started its own.
        ray.init(address="local", num_cpus=CPUS, include_dashboard=False, log_to_driver=False)
        KEPT["address"] = ray.get_runtime_context().gcs_address
    yield ray
    if ray.available_resources().get("CPU") != CPUS:
        ray.shutdown()


@pytest.fixture(scope="module", autouse=True)
def no_kept_ray(request):
    """A module none of whose tests asks for ``ray_session`` starts with no Ray running: a Ray one of them
    starts (or expects to start) is its own, not the one ``ray_session`` kept from a module before."""
    ray = sys.modules.get("ray")  # not imported: no Ray is running
    mine = (item for item in request.session.items if getattr(item, "module", None) is request.module)
    if ray is not None and not any("ray_session" in item.fixturenames for item in mine):
        ray.shutdown()
    yield
