"""The optimizer program on a sharded stage: state sharded as the parameters, results equal optax, on a device group."""

from __future__ import annotations

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from vjpsplit_cli.pipeline.training.optimizer import export_optimizer, load_optimizer


def test_sharded_program_keeps_state_sharded_and_equals_optax():
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    rng = np.random.default_rng(0)
    p = {"w": rng.normal(size=(8, 4)).astype(np.float32), "b": rng.normal(size=4).astype(np.float32)}
    sh = {"w": NamedSharding(mesh, P("data", "model")), "b": NamedSharding(mesh, P())}
    specs = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sh[k]) for k, v in p.items()}
    tx = optax.adamw(1e-2)
    prog = export_optimizer(tx, specs, platforms="cpu")
    # The second device group (devices 4..7), as stage_devices gives a second stage.
    prog = load_optimizer(prog.to_bytes(), devices=jax.devices()[4:8])
    state = prog.init(p)
    assert state["0/mu/w"].sharding.spec == P("data", "model")
    assert {d.id for d in state["0/mu/w"].sharding.device_set} == {4, 5, 6, 7}
    mine, ref, ref_state = dict(p), dict(p), tx.init(p)
    for _ in range(3):
        g = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in p.items()}
        mine, state = prog.update(mine, state, g)
        u, ref_state = tx.update(g, ref_state, ref)
        ref = optax.apply_updates(ref, u)
    assert mine["w"].sharding.spec == P("data", "model")
    for k in p:
        np.testing.assert_allclose(np.asarray(mine[k]), ref[k], rtol=1e-6, atol=1e-7)
