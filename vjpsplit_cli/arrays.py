"""Array files (``.npz``/``.msgpack``): kept so existing imports work; the code is in :mod:`vjpsplit_cli.files`."""

from . import load_arrays, save_arrays

__all__ = ["save_arrays", "load_arrays"]
