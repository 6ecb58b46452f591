"""A stage forward that blocks on demand: what the hang tests (timed, untimed, replicas, Ray) make stuck."""

from __future__ import annotations

import threading
import time

import jax

from vjpsplit_cli.pipeline.runtime.worker import StageWorker


def blocker(hold, release, linger=0.0):
    """A jitted identity through a ``jax.pure_callback`` that, once ``hold`` is set, waits for ``release`` (a host
    callback that does not return), then sleeps ``linger`` seconds; until then it passes its input through, so a
    first call compiles it."""

    def host(x):
        if hold.is_set():
            release.wait()
            time.sleep(linger)
        return x

    def through(x):
        like = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), x)
        return jax.pure_callback(host, like, x)

    return jax.jit(through)


def callback_blocks(monkeypatch, stage, mb, device=None, linger=0.0):
    """Stage ``stage``'s forward of microbatch ``mb`` (on ``device`` only, where given: one replica) reads its input
    through ``blocker``: once ``hold.set()`` is called, a host callback that waits for ``release``, then sleeps
    ``linger`` seconds. Until then it passes the input through, so a first step compiles it. XLA:CPU runs that
    cheap program inside its dispatch when its input is ready, else later on a thread of its own (the dispatch
    returns): a test that needs the dispatch itself held blocks the forward's Python call instead. Returns
    ``(hold, release)``."""
    hold, release = threading.Event(), threading.Event()
    through = blocker(hold, release, linger)
    real = StageWorker.forward

    def forward(self, m, x, side, worker=None, microbatches=None):
        if self.stage_index == stage and m == mb and (device is None or self.device == device):
            x = through(x)
        return real(self, m, x, side, worker=worker, microbatches=microbatches)

    monkeypatch.setattr(StageWorker, "forward", forward)
    return hold, release


def instance_blocks(st, mb):
    """``callback_blocks`` for one ``StageWorker`` object ``st`` (inside a Ray actor, where the test's monkeypatch
    does not reach), the forward's dispatch returning: its input of microbatch ``mb`` goes through a computation
    long enough for XLA:CPU to run it apart from the caller, then ``blocker``, so that the callback runs (and
    blocks) on XLA's threads once that input is ready, not inside the dispatch (which runs a cheap program with
    ready inputs, the callback alone, in the caller's thread). Returns ``(hold, release)``."""
    hold, release = threading.Event(), threading.Event()
    through = blocker(hold, release)
    big = jax.numpy.ones((1024, 1024), jax.numpy.float32)
    later = jax.jit(lambda x, b: jax.tree_util.tree_map(lambda a: a + (jax.numpy.sum(b @ b) * 0).astype(a.dtype), x))
    real = type(st).forward

    def forward(m, x, side, worker=None, microbatches=None):
        if m == mb:
            x = through(later(st.to_device(x), big))
        return real(st, m, x, side, worker=worker, microbatches=microbatches)

    st.forward = forward
    return hold, release
