"""The Ray actor of one pipeline worker, and the actor options a sharded stage needs.

The actor imports no user code: it loads its stages' artifacts from bytes. Its
``__init__`` does nothing, so the time an actor takes to become ready is the time
Ray takes to place and start it (which the driver bounds); ``load`` does the work.
"""

from __future__ import annotations

import os
import time

import numpy as np

from ...schedules.builtins import Op
from ..worker import StageWorker, run_op


class StageActor:
    """The Ray actor around one worker's StageWorkers (one, or ZB-V's two).

    An operation that fails records its error and returns None; operations that get
    None in place of an activation or cotangent skip, so ``state`` reports the first
    error and nothing downstream runs on garbage.
    """

    def __init__(self):
        self.stages: dict[int, StageWorker] = {}
        self.worker = -1
        self.error: BaseException | None = None

    def ready(self) -> str:
        """This actor's Ray node id (answered as soon as the actor runs)."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def clock(self) -> float:
        """This process's ``time.monotonic()``, for the driver's clock offset."""
        return time.monotonic()

    def load(self, chunks, stages: int, worker: int | None = None) -> None:
        """Load ``(stage index, artifact bytes, params)`` for each stage this worker holds (worker ``worker``)."""
        from ....artifact.loading import loads

        self.stages = {
            c: StageWorker(loads(data, source=f"stage {c}"), params, c, stages) for c, data, params in chunks
        }
        self.worker = min(self.stages) if worker is None else worker  # the built-in layouts: its first stage

    def reset(self) -> None:
        """Forget the last step's residuals, gradients, timings and error."""
        for st in self.stages.values():
            st.reset()
        self.error = None

    def op(self, kind: str, chunk: int, mb: int, data, side, microbatches: int, split: bool, after=None):
        """Run one scheduled operation (see ``stage.run_op``); None when skipped or failed.

        ``after`` is ignored: a compiled graph passes the worker's previous result to order its calls.
        """
        st = self.stages[chunk]
        needed = data is not None or (kind == "B" and chunk == st.stages - 1) or (kind == "W" and mb in st.inter)
        if self.error is not None or not needed:
            return None
        try:
            out = run_op(st, Op(kind, mb, chunk), data, side, microbatches, split, self.worker)
            import jax

            # An activation may be a tuple of arrays (stages from one function).
            return None if out is None else jax.tree_util.tree_map(np.asarray, out)
        except BaseException as e:  # noqa: BLE001 - handed to the driver by state()
            self.error = picklable(e)
            return None

    def state(self) -> dict:
        """Gradients, losses, timings (this process's clock) and the first error of the step."""
        import jax

        return {
            "grads": {c: jax.tree_util.tree_map(np.asarray, st.grads) for c, st in self.stages.items()},
            "device_count": jax.device_count(),
            "devices": {c: [d.id for d in st.art.devices] for c, st in self.stages.items()},
            "events": [e for st in self.stages.values() for e in st.events],
            "losses": {m: v for st in self.stages.values() for m, v in st.losses.items()},
            "error": self.error,
        }

    def collect(self, after) -> dict:
        """``state``, then ``reset``: the end of a compiled step (``after``: the worker's last result)."""
        out = self.state()
        self.reset()
        return out


def picklable(e: BaseException) -> BaseException:
    """``e`` itself if it survives Ray's serialization, else a RuntimeError with its text."""
    import pickle

    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001 - some runtime errors do not survive pickling; keep their text
        return RuntimeError(f"{type(e).__name__}: {e}")


def devices_for(opts: dict, n: int) -> None:
    """Let an actor that drives an ``n``-device sharded stage see ``n`` devices.

    Accelerators come from the actor options (``num_gpus``, ``resources``); on
    CPU, XLA makes ``n`` host devices when the actor's process starts with
    ``XLA_FLAGS=--xla_force_host_platform_device_count=n`` (added unless the
    options set XLA_FLAGS themselves). It only affects JAX's CPU platform.
    """
    if n <= 1:
        return
    env = dict(opts.get("runtime_env") or {})
    env_vars = dict(env.get("env_vars") or {})
    if "XLA_FLAGS" not in env_vars:
        flags = [
            f
            for f in os.environ.get("XLA_FLAGS", "").split()
            if not f.startswith("--xla_force_host_platform_device_count")
        ]
        env_vars["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={n}"])
    env["env_vars"] = env_vars
    opts["runtime_env"] = env
