"""vjpsplit: run a JAX function's forward now, keep its residuals, run the backward later.

``split`` gives a jit-able forward/backward pair in memory; ``export`` writes both
as ``jax.export`` modules into one portable artifact; residuals and other arrays
travel in ``.npz``/``.msgpack`` files. See SPEC.md for the contract.

Names are imported on first use, so ``vjpsplit --help`` and the array-file
helpers do not pay for importing JAX.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ._version import __version__

_EXPORTS = {
    "split": "core", "Residuals": "core",
    "export": "artifact", "load": "artifact", "loads": "artifact", "Artifact": "artifact", "ArtifactResiduals": "artifact",
    "Manifest": "artifact", "FORMAT_VERSION": "artifact",
    "save_residuals": "residuals", "load_residuals": "residuals",
    "save_intermediates": "residuals", "load_intermediates": "residuals", "Intermediates": "artifact",
    "save_arrays": "arrays", "load_arrays": "arrays",
    "file_arrays": "trees", "tree_from_file": "trees",
    "plan_policies": "economy", "choose_policy": "economy",
    "VjpsplitError": "errors",
    "POLICIES": "policies",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'vjpsplit_cli' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(__all__)


if TYPE_CHECKING:  # for type checkers and IDEs: the eager spelling of the lazy names above
    from .arrays import load_arrays, save_arrays
    from .artifact import FORMAT_VERSION, Artifact, ArtifactResiduals, Intermediates, Manifest, export, load, loads
    from .core import Residuals, split
    from .economy import choose_policy, plan_policies
    from .errors import VjpsplitError
    from .policies import POLICIES
    from .trees import file_arrays, tree_from_file
    from .residuals import load_intermediates, load_residuals, save_intermediates, save_residuals
