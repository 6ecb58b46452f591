"""The optimizer as a portable program: optax's init and update exported per stage, run without optax."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from vjpsplit_cli.errors import VjpsplitError
from vjpsplit_cli.files import load_arrays, save_arrays
from vjpsplit_cli.files.trees import flatten_with_keys
from vjpsplit_cli.pipeline.training.optimizer import export_optimizer, load_optimizer

ROOT = Path(__file__).resolve().parents[1]


def _params(seed=0):
    rng = np.random.default_rng(seed)
    return {"w": rng.normal(size=(4, 3)).astype(np.float32), "b": rng.normal(size=3).astype(np.float32)}


def _grads(step):
    rng = np.random.default_rng(100 + step)
    return {"w": rng.normal(size=(4, 3)).astype(np.float32), "b": rng.normal(size=3).astype(np.float32)}


def _specs(p):
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in p.items()}


OPTIMIZERS = {
    "adamw+schedule": lambda: optax.adamw(optax.linear_schedule(1e-2, 1e-3, 5), weight_decay=0.1),
    "sgd+momentum": lambda: optax.sgd(0.1, momentum=0.9, nesterov=True),
    "lion": lambda: optax.lion(1e-3),
    "adafactor": lambda: optax.adafactor(1e-2),
}


def _optax_steps(tx, p, steps, scale=1.0):
    state = tx.init(p)
    for i in range(steps):
        g = jax.tree_util.tree_map(lambda x: x * np.float32(scale), _grads(i))
        u, state = tx.update(g, state, p)
        p = optax.apply_updates(p, u)
    return p, state


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_program_steps_equal_optax(name):
    tx, p = OPTIMIZERS[name](), _params()
    prog = load_optimizer(export_optimizer(tx, _specs(p), platforms="cpu").to_bytes())
    state, mine = prog.init(p), dict(p)
    for i in range(4):
        mine, state = prog.update(mine, state, _grads(i), 0.5)
    ref_p, ref_state = _optax_steps(tx, p, 4, scale=0.5)
    for k in p:
        np.testing.assert_allclose(mine[k], ref_p[k], rtol=1e-6, atol=1e-7)
    ref_flat = dict(flatten_with_keys("", ref_state))
    assert prog.state_keys == list(ref_flat)  # the state's structure, recorded as its keys
    for k, v in ref_flat.items():
        np.testing.assert_allclose(np.asarray(state[k]), np.asarray(v), rtol=1e-6, atol=1e-7)


def test_program_takes_any_pytree_of_specs_and_typed_key_state():
    tx = optax.noisy_sgd(0.1, key=jax.random.key(3))
    p = {"layers": [_params(1), _params(2)]}
    specs = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), p)
    prog = load_optimizer(export_optimizer(tx, specs, platforms="cpu").to_bytes())
    assert prog.param_keys == [k for k, _ in flatten_with_keys("", p)]
    flat = dict(flatten_with_keys("", p))
    state = prog.init(flat)
    assert jax.dtypes.issubdtype(state["0/rng_key"].dtype, jax.dtypes.prng_key)
    g = {k: np.ones_like(v) for k, v in flat.items()}
    new, state = prog.update(flat, state, g)
    u, _ = tx.update(jax.tree_util.tree_map(np.ones_like, p), tx.init(p), p)
    ref = dict(flatten_with_keys("", optax.apply_updates(p, u)))
    for k in flat:
        np.testing.assert_allclose(new[k], ref[k], rtol=1e-5, atol=1e-6)


_CHILD = """
import sys
sys.modules["optax"] = None  # importing optax now fails: the worker has no optax
sys.modules["flax"] = None
import numpy as np
from vjpsplit_cli.files import load_arrays, save_arrays
from vjpsplit_cli.pipeline.training.optimizer import load_optimizer
try:
    import optax  # noqa: F401
    raise SystemExit("optax importable")
except ImportError:
    pass
d = sys.argv[1]
prog = load_optimizer(open(d + "/opt.bin", "rb").read(), source="shipped")
arrays, _ = load_arrays(d + "/in.npz")
p = {k[2:]: v for k, v in arrays.items() if k.startswith("p/")}
state = prog.init(p)
for i in range(3):
    g = {k[len(f"g{i}/"):]: v for k, v in arrays.items() if k.startswith(f"g{i}/")}
    p, state = prog.update(p, state, g, 1.0)
save_arrays(d + "/out.npz", {**{"p/" + k: np.asarray(v) for k, v in p.items()},
                             **{"s/" + k: np.asarray(v) for k, v in state.items()}})
assert "optax" not in [m for m, v in sys.modules.items() if v is not None]
"""


def test_program_runs_where_optax_cannot_be_imported(tmp_path):
    tx, p = optax.adamw(optax.cosine_decay_schedule(1e-2, 10)), _params()
    (tmp_path / "opt.bin").write_bytes(export_optimizer(tx, _specs(p), platforms="cpu").to_bytes())
    inputs = {f"p/{k}": v for k, v in p.items()}
    for i in range(3):
        inputs.update({f"g{i}/{k}": v for k, v in _grads(i).items()})
    save_arrays(tmp_path / "in.npz", inputs)
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"}
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_CHILD), str(tmp_path)], env=env, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr[-2000:]
    out, _ = load_arrays(tmp_path / "out.npz")
    ref_p, ref_state = _optax_steps(tx, p, 3)
    for k in p:
        np.testing.assert_allclose(out[f"p/{k}"], ref_p[k], rtol=1e-6, atol=1e-7)
    for k, v in flatten_with_keys("", ref_state):
        np.testing.assert_allclose(out[f"s/{k}"], np.asarray(v), rtol=1e-6, atol=1e-7)


def _callback_tx():
    def update(g, state, params=None):
        return jax.tree_util.tree_map(
            lambda x: jax.pure_callback(np.negative, jax.ShapeDtypeStruct(x.shape, x.dtype), x), g
        ), state

    return optax.GradientTransformation(lambda p: optax.EmptyState(), update)


def _string_state_tx():
    return optax.GradientTransformation(lambda p: {"tag": "not an array"}, lambda g, s, p=None: (g, s))


def test_unexportable_transformations_are_one_error_naming_them():
    specs = _specs(_params())
    with pytest.raises(VjpsplitError, match=r"optimizer '_callback_tx'.*update"):
        export_optimizer(_callback_tx(), specs, platforms="cpu")
    with pytest.raises(VjpsplitError, match=r"optimizer '_string_state_tx'.*pytree of arrays"):
        export_optimizer(_string_state_tx(), specs, platforms="cpu")
    with pytest.raises(VjpsplitError, match="not an optax GradientTransformation"):
        export_optimizer(lambda g: g, specs, platforms="cpu")


def test_wrong_inputs_and_damaged_bytes_are_refused():
    p = _params()
    prog = export_optimizer(optax.sgd(0.1), _specs(p), platforms="cpu")
    state = prog.init(p)
    with pytest.raises(VjpsplitError, match="gradients lack 'w'"):
        prog.update(p, state, {"b": p["b"]})
    with pytest.raises(VjpsplitError, match=r"gradients 'w' is float32\[3, 4\]"):
        prog.update(p, state, {"w": p["w"].T.copy(), "b": p["b"]})
    with pytest.raises(VjpsplitError, match="not a vjpsplit optimizer program"):
        load_optimizer(b"\x93NUMPY" + bytes(20))
    data = prog.to_bytes()
    with pytest.raises(VjpsplitError, match="optimizer"):
        load_optimizer(data[: len(data) // 2])


def test_serialized_form_is_data_not_pickle():
    import msgpack

    prog = export_optimizer(optax.adam(1e-3), _specs(_params()), platforms="cpu")
    top = msgpack.unpackb(prog.to_bytes(), raw=False)
    assert [s["key"] for s in top["state"]] == prog.state_keys
    json.dumps({k: v for k, v in top.items() if k != "modules"})  # everything but the modules is JSON
    assert set(top["modules"]) == {"init", "update"}


def test_bfloat16_parameters():
    p = {k: jnp.asarray(v, jnp.bfloat16) for k, v in _params().items()}
    tx = optax.adam(1e-2)
    prog = export_optimizer(tx, _specs(p), platforms="cpu")
    g = {k: jnp.asarray(v, jnp.bfloat16) for k, v in _grads(0).items()}
    new, _ = prog.update(p, prog.init(p), g)
    u, _ = tx.update(g, tx.init(p), p)
    ref = optax.apply_updates(p, u)
    for k in p:
        assert new[k].dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(new[k], np.float32), np.asarray(ref[k], np.float32))


def test_a_program_exported_over_an_abstract_mesh_runs_once_loaded_onto_devices():
    # What the driver of a data-parallel Ray run exports: no devices at export, the actor's at load.
    from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

    mesh = AbstractMesh((1,), ("replicas",))
    specs = {"w": jax.ShapeDtypeStruct((4, 2), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec("replicas")))}
    prog = export_optimizer(optax.adam(0.1), specs, platforms="cpu")
    w = {"w": np.arange(8, dtype=np.float32).reshape(4, 2)}
    with pytest.raises(VjpsplitError, match=r"exported over an abstract mesh of \{'replicas': 1\}, it has no devices"):
        prog.init(w)
    placed = load_optimizer(prog.to_bytes(), devices=jax.devices()[:1])
    tx = optax.adam(0.1)
    g = {"w": np.ones((4, 2), np.float32)}
    new, _ = placed.update(w, placed.init(w), g)
    u, _ = tx.update(g, tx.init(w), w)
    np.testing.assert_allclose(np.asarray(new["w"]), np.asarray(optax.apply_updates(w, u)["w"]), rtol=1e-6)
