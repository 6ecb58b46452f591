"""What both fixture scripts write beside an artifact: ``expected.npz``, the results a test checks.

Keys: ``params/<name>`` and ``x`` (the inputs), ``out`` (the loss), ``grad/params/<name>``
and ``grad/x`` (its gradients); metadata ``{"jax": the version that computed them}``.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np

import vjpsplit_cli as vs


def save_expected(path: Path, params: dict, x, value, g_params: dict, g_x) -> None:
    """Write the inputs, the loss and its gradients the way the fixture tests read them."""
    vs.save_arrays(
        path,
        {
            **{f"params/{k}": v for k, v in params.items()},
            "x": x,
            "out": np.asarray(value),
            **{f"grad/params/{k}": np.asarray(v) for k, v in g_params.items()},
            "grad/x": np.asarray(g_x),
        },
        {"jax": jax.__version__},
    )
