"""The Ray runner with a local Ray instance in this (the Ray suite's own) process: gradients, errors, clocks."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest
from models import assert_trees_close
from models import stages_whole as whole
from test_pipeline import make

import vjpsplit_cli as vs
from vjpsplit_cli import pipeline as P
from vjpsplit_cli.pipeline.schedules.catalog import SCHEDULES
from vjpsplit_cli.pipeline.schedules.layout import layout_kind


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_ray_gradients_equal_value_and_grad(ray_session, stages):
    arts, params, x, labels = make(stages, seed=stages)
    loss, grads = jax.value_and_grad(whole)(params, x, labels)
    layouts = ["stage", "v", "interleaved"] if stages % 2 == 0 else ["stage"]
    for lay in layouts:
        with P.RayPipeline(arts, params, layout=lay, compiled=None) as rp:
            for name in [n for n in SCHEDULES if layout_kind(n) == lay]:
                r = rp.run(x, [labels], microbatches=4, schedule=name)
                assert r.runner == "ray" and r.extra["compiled"]  # compiled=None: a Compiled Graph where Ray can
                np.testing.assert_allclose(r.loss, loss, rtol=1e-5)
                assert_trees_close(r.grads, grads, rtol=1e-5, atol=1e-6)
                assert {e.stage for e in r.events} == set(range(stages))
                assert {e.worker for e in r.events} == set(range(r.num_workers))


@pytest.mark.parametrize("compiled", [False, True])
def test_ray_driver_fetches_only_gradients_and_timings(ray_session, monkeypatch, compiled):
    arts, params, x, labels = make(4)
    with P.RayPipeline(arts, params, layout="v", compiled=compiled) as rp:
        rp.run(x, [labels], microbatches=4, schedule="zbv")  # compiles the step's graph (which gets refs)
        fetched = []
        real_get = ray_session.get

        def counting_get(refs, *a, **k):  # ray.get is Ray's own too (its graph teardown gets single refs)
            if isinstance(refs, list):
                fetched.append(len(refs))
            return real_get(refs, *a, **k)

        monkeypatch.setattr(rp.ray, "get", counting_get)
        with pytest.raises(vs.VjpsplitError, match="needs RayPipeline"):
            rp.run(x, [labels], microbatches=4, schedule="zbh1")
        r = rp.run(x, [labels], microbatches=4, schedule="zbv")
        # Each actor's list: one get of the lists (None each) with the actors' final states; a compiled step:
        # one get of the actors' states. No activation or cotangent reaches the driver.
        assert fetched == ([2] if compiled else [4]) and r.extra["compiled"] is compiled
        assert len(r.events) == sum(len(p) for p in P.schedule("zbv", 4, 4))


def test_ray_stage_error_reaches_the_driver(ray_session):
    arts, params, x, labels = make(3)
    bad = [params[0], {"w": params[1]["w"][:, :3], "b": params[1]["b"]}, params[2]]
    with P.RayPipeline(arts, bad) as rp:
        for _ in range(2):  # the step fails on the driver, not in a hang, and the next one too
            with pytest.raises(vs.VjpsplitError, match="params"):
                rp.run(x, [labels], microbatches=4, schedule="zbh1")


def test_ray_events_are_on_the_drivers_clock(ray_session):
    import time

    arts, params, x, labels = make(2)
    with P.RayPipeline(arts, params) as rp:
        warm = rp.run(x, [labels], microbatches=2, schedule="1f1b", progress=True)  # warm-up: compiles
        assert len(warm.events) == sum(len(p) for p in P.schedule("1f1b", 2, 2))
        t0 = time.monotonic()
        r = rp.run(x, [labels], microbatches=2, schedule="1f1b")
        t1 = time.monotonic()
        rp.step_timeout = 1e-6  # a step that is not back in time is an error, not a hang
        with pytest.raises(vs.VjpsplitError, match="did not finish within step_timeout=1e-06 s"):
            rp.run(x, [labels], microbatches=2, schedule="1f1b")
    # Every actor's events, moved by its measured offset, fall inside the step as the driver saw it.
    assert t0 <= min(e.start for e in r.events) and max(e.end for e in r.events) <= t1
    assert all(e.start <= e.end for e in r.events) and len(rp.clock_offsets) == 2


def test_ray_settings_a_running_ray_would_ignore_are_refused(ray_session):
    arts, params, x, labels = make(2)
    with pytest.raises(vs.VjpsplitError, match="already initialised, connected to .*address='10.9.9.9:6379'"):
        P.RayPipeline(arts, params, address="10.9.9.9:6379")
    with pytest.raises(vs.VjpsplitError, match="already initialised with another runtime_env"):
        P.RayPipeline(arts, params, runtime_env={"env_vars": {"VJPSPLIT_TEST": "1"}})
    with pytest.raises(vs.VjpsplitError, match="actor_options has 1 entries for 2 workers"):
        P.RayPipeline(arts, params, actor_options=[{}])


@pytest.mark.parametrize("compiled", [False, True])
def test_ray_dead_actor_is_named_and_a_new_pipeline_runs(ray_session, compiled):
    arts, params, x, labels = make(2)
    loss, grads = jax.value_and_grad(whole)(params, x, labels)
    with P.RayPipeline(arts, params, compiled=compiled) as rp:
        rp.run(x, [labels], microbatches=2, schedule="zbh1")
        ray_session.kill(rp.actors[1])
        with pytest.raises(vs.VjpsplitError, match="stage 1: its Ray actor died.*build a new RayPipeline"):
            rp.run(x, [labels], microbatches=2, schedule="zbh1")
    with P.RayPipeline(arts, params) as rp:
        r = rp.run(x, [labels], microbatches=2, schedule="zbh1")
        assert_trees_close(r.grads, grads, rtol=1e-5, atol=1e-6)


def test_ray_falls_back_to_actor_calls_without_compiled_graphs(ray_session, monkeypatch):
    import ray.dag

    class NoGraphs:
        def __init__(self, *a, **k):
            raise NotImplementedError("no Compiled Graphs on this Ray")

    monkeypatch.setattr(ray.dag, "InputNode", NoGraphs)
    arts, params, x, labels = make(2)
    loss, grads = jax.value_and_grad(whole)(params, x, labels)
    with P.RayPipeline(arts, params, compiled=None) as rp:
        r = rp.run(x, [labels], microbatches=2, schedule="zbh1")
        assert r.extra["compiled"] is False
        assert_trees_close(r.grads, grads, rtol=1e-5, atol=1e-6)
    with P.RayPipeline(arts, params, compiled=True) as rp:  # asked for explicitly: an error, not a fallback
        with pytest.raises(vs.VjpsplitError, match="could not compile the step's graph.*no Compiled Graphs"):
            rp.run(x, [labels], microbatches=2, schedule="zbh1")


def test_ray_runs_plans_read_from_csv(ray_session, tmp_path):
    # Worker 0 holds the last stage: a placement no built-in layout has; stage 1's backward whole, stage 0's split.
    arts, params, x, labels = make(2)
    loss, grads = jax.value_and_grad(whole)(params, x, labels)
    (tmp_path / "hand.csv").write_text("1F0,1F1,1B0,,1B1\n0F0,0F1,0I0,0I1,0W1,0W0\n")
    plans = P.read_schedule(tmp_path / "hand.csv")
    with P.RayPipeline(arts, params) as rp:
        with pytest.raises(vs.VjpsplitError, match=r"needs RayPipeline\(layout=\[\(1,\), \(0,\)\]\)"):
            rp.run(x, [labels], microbatches=2, schedule=P.Schedule(plans=plans))
    with P.RayPipeline(arts, params, layout=[(1,), (0,)], compiled=None) as rp:
        for _ in range(2):  # compiled where Ray can, then the same graph again
            r = rp.run(x, [labels], microbatches=2, schedule=P.Schedule(plans=plans))
            np.testing.assert_allclose(r.loss, loss, rtol=1e-5)
            assert_trees_close(r.grads, grads, rtol=1e-5, atol=1e-6)
            for w, ops in enumerate(plans):  # each actor ran its own list, under its own worker index
                mine = sorted((e for e in r.events if e.worker == w), key=lambda e: e.start)
                assert [(e.kind, e.mb, e.stage) for e in mine] == [(o.kind, o.mb, o.stage) for o in ops]
    # Interleaved 1F1B with 3 chunks per worker, via pipeline.run: the layout comes from the plans.
    arts, params, x, labels = make(6)
    loss, grads = jax.value_and_grad(whole)(params, x, labels)
    P.write_schedule(tmp_path / "i3.csv", P.schedule("interleaved1f1b", 6, 4, chunks=3))
    r = P.run(
        arts,
        params,
        x,
        [labels],
        microbatches=4,
        runner="ray",
        schedule=P.Schedule(plans=P.read_schedule(tmp_path / "i3.csv")),
    )
    np.testing.assert_allclose(r.loss, loss, rtol=1e-5)
    assert_trees_close(r.grads, grads, rtol=1e-5, atol=1e-6)
    assert r.num_workers == 2 and {e.worker for e in r.events} == {0, 1}


@pytest.mark.parametrize("transport", ["socket", "ray"])
def test_ray_both_transports_equal_value_and_grad(ray_session, monkeypatch, transport):
    """Values actor to actor down the sockets (the default) or as Ray calls (VJPSPLIT_RAY_TRANSPORT=ray)."""
    monkeypatch.setenv("VJPSPLIT_RAY_TRANSPORT", transport)
    arts, params, x, labels = make(3, seed=1)
    loss, grads = jax.value_and_grad(whole)(params, x, labels)
    with P.RayPipeline(arts, params, compiled=False) as rp:
        assert rp.transport == transport
        for name in ["1f1b", "zbh1"]:
            r = rp.run(x, [labels], microbatches=4, schedule=name)
            np.testing.assert_allclose(r.loss, loss, rtol=1e-5)
            assert_trees_close(r.grads, grads, rtol=1e-5, atol=1e-6)


def what_actors_see(ray, monkeypatch, probe):
    """``probe()`` run in each actor of a 2-stage RayPipeline started under a driver whose XLA_FLAGS ask for 8
    devices (as a sharded test's do), checked to still train equal to ``value_and_grad``; one result per actor."""
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    arts, params, x, labels = make(2)
    loss, grads = jax.value_and_grad(whole)(params, x, labels)
    with P.RayPipeline(arts, params) as rp:
        seen = ray.get([a.__ray_call__.remote(lambda _: probe()) for a in rp.actors])
        r = rp.run(x, [labels], microbatches=4, schedule="1f1b")
    np.testing.assert_allclose(r.loss, loss, rtol=1e-5)
    assert_trees_close(r.grads, grads, rtol=1e-5, atol=1e-6)
    return seen


def test_ray_actors_start_with_their_own_devices_and_a_share_of_the_cores(ray_session, monkeypatch):
    # Each 1-device actor still gets 1 device, and an XLA CPU pool of its share of this host's cores,
    # not a pool each as wide as the host (oversubscribed).
    seen = what_actors_see(ray_session, monkeypatch, lambda: (jax.local_device_count(), os.environ["PJRT_NPROC"]))
    assert seen == [(1, str(max(1, len(os.sched_getaffinity(0)) // 2)))] * 2
