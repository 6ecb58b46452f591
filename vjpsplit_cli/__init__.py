"""vjpsplit: run a JAX function's forward now, keep its residuals, run the backward later.

``split`` gives a jit-able forward/backward pair in memory; ``export`` writes both
as ``jax.export`` modules into one portable artifact; residuals and other arrays
travel in ``.npz``/``.msgpack`` files; ``pipeline`` runs pipeline-parallel
schedules over artifacts. ``docs/`` in the repository states the contract.

Names are imported on first use, so ``vjpsplit --help`` and the array-file
helpers do not pay for importing JAX.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ._version import __version__

# Every public name, and the module that defines it (None: the name is that module).
_EXPORTS = {
    "split": "core",
    "export": "lowering",
    "DEFAULT_PLATFORMS": "lowering",
    "load": "loading",
    "loads": "loading",
    "Artifact": "artifact",
    "Manifest": "manifest",
    "Leaf": "manifest",
    "FORMAT_VERSION": "manifest",
    "Residuals": "residuals",
    "SplitResiduals": "residuals",
    "Intermediates": "residuals",
    "save_residuals": "residual_files",
    "load_residuals": "residual_files",
    "save_intermediates": "residual_files",
    "load_intermediates": "residual_files",
    "save_arrays": "files",
    "load_arrays": "files",
    "file_arrays": "trees",
    "tree_from_file": "trees",
    "template": "templates",
    "save_template": "templates",
    "POLICIES": "policies",
    "PolicyCost": "policies",
    "plan_policies": "policies",
    "choose_policy": "policies",
    "choose_auto": "choice",
    "AutoChoice": "choice",
    "resolve_policy": "choice",
    "PolicyChoice": "choice",
    "VjpsplitError": "errors",
    "stage_boundary": "pipeline.boundary",
    "export_stages": "pipeline.exporting",
    "Stages": "pipeline.stagedir",
    "load_stages": "pipeline.stagedir",
    "pipeline": None,
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'vjpsplit_cli' has no attribute {name!r}")
    module = _EXPORTS[name]
    value = (
        importlib.import_module(f".{name}", __name__)
        if module is None
        else getattr(importlib.import_module(f".{module}", __name__), name)
    )
    globals()[name] = value
    return value


def __dir__():
    return sorted(__all__)


if TYPE_CHECKING:  # for type checkers and IDEs: the eager spelling of the lazy names above
    from . import pipeline
    from .artifact import Artifact
    from .loading import load, loads
    from .core import split
    from .errors import VjpsplitError
    from .lowering import DEFAULT_PLATFORMS, export
    from .files import load_arrays, save_arrays
    from .manifest import FORMAT_VERSION, Leaf, Manifest
    from .choice import AutoChoice, PolicyChoice, choose_auto, resolve_policy
    from .policies import POLICIES, PolicyCost, choose_policy, plan_policies
    from .residual_files import load_intermediates, load_residuals, save_intermediates, save_residuals
    from .residuals import Intermediates, Residuals, SplitResiduals
    from .templates import save_template, template
    from .trees import file_arrays, tree_from_file
    from .pipeline.boundary import stage_boundary
    from .pipeline.exporting import export_stages
    from .pipeline.stagedir import Stages, load_stages
