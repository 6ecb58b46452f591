"""vjpsplit: run a JAX function's forward now, keep its residuals, run the backward later.

``split`` gives a jit-able forward/backward pair in memory; ``export`` writes both
as ``jax.export`` modules into one portable artifact; residuals and other arrays
travel in ``.npz``/``.msgpack`` files. See SPEC.md for the contract.
"""

from ._version import __version__
from .arrays import load_arrays, save_arrays
from .artifact import FORMAT_VERSION, Artifact, ArtifactResiduals, Manifest, export, load
from .core import Residuals, split
from .errors import VjpsplitError
from .policies import POLICIES
from .residuals import load_residuals, save_residuals

__all__ = [
    "__version__",
    "split",
    "export",
    "load",
    "Artifact",
    "ArtifactResiduals",
    "Manifest",
    "Residuals",
    "save_residuals",
    "load_residuals",
    "save_arrays",
    "load_arrays",
    "VjpsplitError",
    "FORMAT_VERSION",
    "POLICIES",
]
