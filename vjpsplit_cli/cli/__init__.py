"""The ``vjpsplit`` command line: a thin layer over the library (``main`` is the console script)."""

from . import artifacts, functions, running  # noqa: F401 - each registers its commands on main
from .app import main

__all__ = ["main"]
