"""A stage forward that blocks on demand: what the hang tests (timed, untimed, replicas) make stuck."""

from __future__ import annotations

import threading
import time

import jax

from vjpsplit_cli.pipeline.runtime.worker import StageWorker


def callback_blocks(monkeypatch, stage, mb, device=None, linger=0.0):
    """Stage ``stage``'s forward of microbatch ``mb`` (on ``device`` only, where given: one replica) reads its input
    through a jitted ``jax.pure_callback`` that, once ``hold.set()`` is called, waits for ``release`` (a host
    callback that never returns), then sleeps ``linger`` seconds. Until then it passes the input through, so a
    first step compiles it. Returns ``(hold, release)``."""
    hold, release = threading.Event(), threading.Event()

    def host(x):
        if hold.is_set():
            release.wait()
            time.sleep(linger)
        return x

    def through(x):
        like = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), x)
        return jax.pure_callback(host, like, x)

    blocker = jax.jit(through)
    real = StageWorker.forward

    def forward(self, m, x, side, worker=None):
        if self.stage_index == stage and m == mb and (device is None or self.device == device):
            x = blocker(x)
        return real(self, m, x, side, worker=worker)

    monkeypatch.setattr(StageWorker, "forward", forward)
    return hold, release
