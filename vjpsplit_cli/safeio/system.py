"""Facts about this host that bound what a file may ask for."""

from __future__ import annotations

import functools
import os


@functools.cache
def host_memory() -> int:
    """Physical memory in bytes (2**63 where the platform does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 2**63


def current_platform() -> str:
    """The platform JAX runs on here, named as jax.export names it (``cpu``, ``cuda``, ``rocm``, ``tpu``)."""
    import jax

    d = jax.devices()[0]
    if d.platform == "gpu":
        return "rocm" if "rocm" in getattr(d.client, "platform_version", "").lower() else "cuda"
    return d.platform
