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
from typing import TYPE_CHECKING, Any

from ._version import __version__

# Every public name, and the module that defines it (None: the name is that module).
_EXPORTS = {
    "split": "tracing.split",
    "export": "artifact.lowering",
    "DEFAULT_PLATFORMS": "artifact.lowering",
    "load": "artifact.loading",
    "loads": "artifact.loading",
    "Artifact": "artifact.artifact",
    "Manifest": "artifact.manifest",
    "Leaf": "artifact.leaf",
    "FORMAT_VERSION": "artifact.manifest",
    "Residuals": "tracing.residuals",
    "SplitResiduals": "tracing.residuals",
    "Intermediates": "tracing.residuals",
    "save_residuals": "artifact.residual_files",
    "load_residuals": "artifact.residual_files",
    "save_intermediates": "artifact.residual_files",
    "load_intermediates": "artifact.residual_files",
    "save_arrays": "files",
    "load_arrays": "files",
    "file_arrays": "files.trees",
    "tree_from_file": "files.trees",
    "template": "artifact.templates",
    "save_template": "artifact.templates",
    "POLICIES": "tracing.policies",
    "PolicyCost": "tracing.policies",
    "plan_policies": "tracing.policies",
    "choose_policy": "tracing.choice",
    "choose_auto": "tracing.choice",
    "AutoChoice": "tracing.choice",
    "resolve_policy": "tracing.choice",
    "PolicyChoice": "tracing.choice",
    "VjpsplitError": "errors",
    "stage_boundary": "pipeline.stages.boundary",
    "export_stages": "pipeline.stages.exporting",
    "Stages": "pipeline.stages.directory",
    "load_stages": "pipeline.stages.directory",
    "pipeline": None,
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:  # a lazy name is any of the exports: a function, a class, a module
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


def __dir__() -> list[str]:
    return sorted(__all__)


if TYPE_CHECKING:  # for type checkers and IDEs: the eager spelling of the lazy names above
    from . import pipeline
    from .artifact.artifact import Artifact
    from .artifact.loading import load, loads
    from .artifact.lowering import DEFAULT_PLATFORMS, export
    from .artifact.leaf import Leaf
    from .artifact.manifest import FORMAT_VERSION, Manifest
    from .artifact.residual_files import load_intermediates, load_residuals, save_intermediates, save_residuals
    from .artifact.templates import save_template, template
    from .errors import VjpsplitError
    from .files import load_arrays, save_arrays
    from .files.trees import file_arrays, tree_from_file
    from .pipeline.stages.boundary import stage_boundary
    from .pipeline.stages.exporting import export_stages
    from .pipeline.stages.directory import Stages, load_stages
    from .tracing.choice import AutoChoice, PolicyChoice, choose_auto, choose_policy, resolve_policy
    from .tracing.policies import POLICIES, PolicyCost, plan_policies
    from .tracing.residuals import Intermediates, Residuals, SplitResiduals
    from .tracing.split import split
