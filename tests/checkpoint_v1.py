"""Checkpoints as vjpsplit wrote them before they were keyed by the model (layout 1: one file per stage)."""

from __future__ import annotations

import numpy as np

from vjpsplit_cli.files.prng import impl_name, is_key, to_data
from vjpsplit_cli.pipeline.training.checkpoint import KIND, write_directory


def write_per_stage_checkpoint(directory, snapshots, step, meta):
    """``snapshots``: per stage, ``(params, optimizer state)`` flat by key, as ``trainer.backend.snapshots()``."""
    files, entries = {}, []
    for i, (params, state) in enumerate(snapshots):
        name = f"stage-{i}.npz"
        files[name] = {
            **{f"params/{k}": np.asarray(v) for k, v in params.items()},
            **{f"state/{k}": np.asarray(to_data(v)) for k, v in state.items()},
        }
        impls = {k: impl_name(v) for k, v in state.items() if is_key(v)}
        entries.append({"file": name, "params": list(params), "state": list(state), "prng_impls": impls})
    write_directory(directory, files, {"kind": KIND, "format": 1, "step": int(step), "stages": entries, "meta": meta})
