"""Sharded artifacts on a 2 x 4 mesh: export with shardings, run from sharded arrays, numpy and the CLI.

Every gradient is checked against ``jax.grad`` on the same inputs, and its
sharding against the one ``jit(grad)`` gives with the same input shardings.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import block
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export as jexport
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import vjpsplit_cli as vs

SAMPLE = Path(block.__file__)
CASES = {"mlp": (block.mlp, block.mlp_params), "attention": (block.attention, block.attention_params)}


def _close(a, b, tol=2e-5):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


def _placed(specs, arrays):
    return jax.tree_util.tree_map(lambda s, a: jax.device_put(a, s.sharding), specs, arrays)


def _reference(fn, specs, args):
    """``jit(value_and_grad)`` with the same input shardings: values and gradients (with their shardings)."""
    shardings = tuple(jax.tree_util.tree_map(lambda s: s.sharding, sp) for sp in specs)
    f = jax.jit(jax.value_and_grad(fn, argnums=(0, 1)), in_shardings=shardings)
    return f(*_placed(specs, args))


def _per_device_bytes(arrays) -> int:
    """The most bytes any one device holds of ``arrays``."""
    held: dict = {}
    for a in arrays:
        for shard in a.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return max(held.values())


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request):
    fn, make_params = CASES[request.param]
    specs = (make_params(), block.batch())
    art = vs.export(fn, *specs, platforms="cpu", weights="params")
    args = (block.init(specs[0], 1), block.init(specs[1], 2, b=8))
    return request.param, fn, specs, art, args


def test_manifest_records_mesh_and_every_leafs_sharding(case):
    _, _, specs, art, _ = case
    m = art.manifest
    assert m.nr_devices == 8 and m.mesh == (("data", 2), ("model", 4)) and m.format_version == 4
    by_key = {leaf.key: leaf for leaf in m.inputs}
    assert by_key["params/w1"].sharding == (None, "model") and by_key["x"].sharding == ("data",)
    for leaf in m.all_leaves:
        assert leaf.sharding is not None, leaf.key
    # Residuals the forward computes from the batch stay split over 'data' (a causal mask
    # broadcast from constants is XLA's to place, and it replicates it).
    batch_residuals = [r for r in m.stored_residuals if r.shape and r.shape[0] == "b" and r.dtype == "float32"]
    assert batch_residuals and all(r.sharding[:1] == ("data",) for r in batch_residuals)
    again = vs.loads(art.to_bytes())
    assert again.manifest == m


@pytest.mark.parametrize("source", ["sharded", "numpy"])
def test_gradients_equal_jax_grad_with_its_shardings(case, source):
    _, fn, specs, art, args = case
    (ref_loss, (ref_gp, ref_gx)) = _reference(fn, specs, args)
    call_args = _placed(specs, args) if source == "sharded" else args
    out, res = art.fwd(*call_args)
    _close(out, ref_loss)
    gp, gx = art.bwd(res)
    for got, want in zip(jax.tree_util.tree_leaves((gp, gx)), jax.tree_util.tree_leaves((ref_gp, ref_gx))):
        _close(got, want)
        assert got.sharding.is_equivalent_to(want.sharding, got.ndim), (got.sharding, want.sharding)
    gi, inter = art.bwd_input(res)
    gw = art.bwd_weight(inter)
    _close(gi["x"], ref_gx)
    jax.tree_util.tree_map(_close, gw["params"], ref_gp)


def test_backward_gathers_no_residual_and_holds_what_the_forward_left(case):
    _, _, specs, art, args = case
    _, res = art.fwd(*_placed(specs, args))
    stored = list(res.stored.values())
    bwd = jexport.deserialize(bytearray(art.modules["bwd"]))
    cts = [jnp.ones((), jnp.float32)]
    dims_arg = jax.device_put(np.zeros((0, 8), bool), NamedSharding(art.mesh, P()))
    compiled = jax.jit(bwd.call).lower(stored, list(res.inputs.values()), cts, dims_arg).compile()
    hlo = compiled.as_text()
    params = {int(i): name for name, i in re.findall(r"(%?[\w.\-]+) = \S+ parameter\((\d+)\)", hlo)}
    gathered = re.findall(r"all-gather[\w.\-]* = \S+ all-gather\(([^)]*)\)", hlo)
    # No all-gather reads a residual parameter of the backward (nor anything derived only by copies of one).
    residual_params = {params[i] for i in range(len(stored)) if i in params}
    assert not any(op.split()[-1] in residual_params for op in gathered), gathered
    if case[0] == "mlp":
        assert "all-gather" not in hlo  # the TP x DP MLP's backward needs none at all
    # Per device, the backward takes exactly the residual bytes the forward left there.
    in_shardings = jax.tree_util.tree_leaves(compiled.input_shardings[0][0])
    taken = {}
    for a, sh in zip(stored, in_shardings):
        for d, idx in sh.devices_indices_map(a.shape).items():
            n = int(np.prod([len(range(*s.indices(dim))) for s, dim in zip(idx, a.shape)])) * a.dtype.itemsize
            taken[d] = taken.get(d, 0) + n
    assert max(taken.values()) == _per_device_bytes(stored)
    assert _per_device_bytes(stored) * 4 <= sum(a.nbytes for a in stored)  # sharded, not replicated


def test_residual_file_round_trip_places_again(case, tmp_path):
    _, fn, specs, art, args = case
    path = tmp_path / "a.vjps"
    art.save(path)
    loaded = vs.load(path)
    _, res = loaded.fwd(*args)
    vs.save_residuals(tmp_path / "r.msgpack", res)
    back = vs.load_residuals(tmp_path / "r.msgpack", inputs=args, artifact=loaded)
    assert all(isinstance(v, np.ndarray) for v in back.stored.values())  # full arrays in the file
    _, (ref_gp, ref_gx) = _reference(fn, specs, args)
    gp, gx = loaded.bwd(back)
    _close(gx, ref_gx)
    assert gx.sharding.is_equivalent_to(ref_gx.sharding, gx.ndim)
    jax.tree_util.tree_map(_close, gp, ref_gp)


def test_split_keeps_residuals_sharded():
    specs = (block.mlp_params(), block.batch())
    args = _placed(
        (
            specs[0],
            jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct((8, 8, 16), s.dtype, sharding=s.sharding), specs[1]),
        ),
        (block.init(specs[0], 1), block.init(specs[1], 2)),
    )
    fwd, bwd = vs.split(block.mlp)
    out, res = jax.jit(fwd)(*args)
    assert any(
        len(a.sharding.device_set) == 8 and not a.sharding.is_fully_replicated for a in jax.tree_util.tree_leaves(res)
    )
    gp, gx = jax.jit(bwd)(res, jnp.float32(1))
    _, (ref_gp, ref_gx) = jax.value_and_grad(block.mlp, argnums=(0, 1))(*args)
    _close(gx, ref_gx)
    jax.tree_util.tree_map(_close, gp, ref_gp)


# -- errors -----------------------------------------------------------------------------------


def _mesh():
    return Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))


def test_symbolic_dim_not_known_divisible_says_which_constraint_to_add():
    (b,) = jexport.symbolic_shape("b")
    x = jax.ShapeDtypeStruct((b, 16), jnp.float32, sharding=NamedSharding(_mesh(), P("data", None)))
    w = jax.ShapeDtypeStruct((16, 4), jnp.float32)
    with pytest.raises(vs.VjpsplitError) as e:
        vs.export(lambda w, x: jnp.sum(x @ w), w, x, platforms="cpu")
    msg = str(e.value)
    assert "'x' dim 0 (b) is split 2 ways by mesh axis data" in msg and "mod(b, 2) == 0" in msg
    assert "\n" not in msg


def test_concrete_dim_a_mesh_axis_does_not_divide():
    x = jax.ShapeDtypeStruct((6, 16), jnp.float32, sharding=NamedSharding(_mesh(), P("model", None)))
    with pytest.raises(
        vs.VjpsplitError,
        match=r"'x' dim 0 \(6\) is split 4 ways by mesh axis model, but 6 is not a "
        r"multiple of 4",
    ):
        vs.export(lambda x: jnp.sum(x**2), x, platforms="cpu")


def test_two_meshes_are_refused():
    other = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
    a = jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=NamedSharding(_mesh(), P("data")))
    b = jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=NamedSharding(other, P("data")))
    with pytest.raises(vs.VjpsplitError, match="two meshes"):
        vs.export(lambda a, b: jnp.sum(a * b), a, b, platforms="cpu")


def test_device_group_of_the_wrong_size_is_refused(case):
    art = case[3]
    with pytest.raises(vs.VjpsplitError, match="runs on 8 devices, 4 were given"):
        art.on_devices(jax.devices()[:4])


# -- the CLI, from numpy files, in processes of its own ------------------------------------------


def _cli(*args, devices=8, cwd=None):
    env = {**os.environ}
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])
    return subprocess.run(
        [sys.executable, "-m", "vjpsplit_cli", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=600,
    )


@pytest.fixture(scope="module", params=sorted(CASES))
def cli_artifact(request, tmp_path_factory):
    """The block exported by the CLI (as ``mlp.vjps``, whichever block), and an inputs file of batch 6."""
    root = tmp_path_factory.mktemp("cli")
    name = request.param
    r = _cli(
        "export",
        f"{SAMPLE}:{name}",
        "--shapes",
        f"params=@{SAMPLE}:{name}_params",
        "--shapes",
        f"x=@{SAMPLE}:batch",
        "--platforms",
        "cpu",
        "--weights",
        "params",
        "-o",
        root / "mlp.vjps",
    )
    assert r.returncode == 0, r.stderr
    specs = (CASES[name][1](), block.batch())
    params, x = block.init(specs[0], 3), block.init(specs[1], 4, b=6)
    np.savez(root / "in.npz", **{f"params/{k}": v for k, v in params.items()}, x=x)
    return root, specs, (params, x), CASES[name][0]


@pytest.mark.parametrize("fmt", ["npz", "msgpack"])
def test_cli_runs_a_sharded_artifact_from_array_files(cli_artifact, fmt):
    root, specs, args, fn = cli_artifact
    art = root / "mlp.vjps"
    r = _cli(
        "run-fwd",
        art,
        "--inputs",
        root / "in.npz",
        "--residuals",
        root / f"res.{fmt}",
        "--outputs",
        root / f"out.{fmt}",
    )
    assert r.returncode == 0, r.stderr
    r = _cli(
        "run-bwd", art, "--inputs", root / "in.npz", "--residuals", root / f"res.{fmt}", "--grads", root / f"g.{fmt}"
    )
    assert r.returncode == 0, r.stderr
    grads, _ = vs.load_arrays(root / f"g.{fmt}")
    loss, (gp, gx) = _reference(fn, specs, args)
    outs, _ = vs.load_arrays(root / f"out.{fmt}")
    _close(outs["out"], loss)
    _close(grads["x"], gx)
    for k, v in gp.items():
        _close(grads[f"params/{k}"], v)
    # B then W through files, as a pipeline stage on another host would.
    r = _cli(
        "run-bwd",
        art,
        "--inputs",
        root / "in.npz",
        "--residuals",
        root / f"res.{fmt}",
        "--part",
        "input",
        "--grads",
        root / f"gi.{fmt}",
        "--intermediates",
        root / f"inter.{fmt}",
    )
    assert r.returncode == 0, r.stderr
    r = _cli(
        "run-bwd",
        art,
        "--inputs",
        root / "in.npz",
        "--intermediates",
        root / f"inter.{fmt}",
        "--part",
        "weight",
        "--grads",
        root / f"gw.{fmt}",
    )
    assert r.returncode == 0, r.stderr
    gw, _ = vs.load_arrays(root / f"gw.{fmt}")
    for k, v in gp.items():
        _close(gw[f"params/{k}"], v)


def test_cli_inspect_json_carries_devices_and_shardings(cli_artifact):
    root = cli_artifact[0]
    r = _cli("inspect", root / "mlp.vjps", "--json", devices=1)  # inspecting needs no devices
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["nr_devices"] == 8 and d["mesh"] == {"data": 2, "model": 4}
    for section in ("inputs", "outputs", "residuals", "grads", "intermediates"):
        assert all("sharding" in leaf for leaf in d[section]), section
    assert {leaf["key"]: leaf["sharding"] for leaf in d["inputs"]}["params/w1"] == [None, "model"]
    assert {leaf["key"]: leaf["sharding"] for leaf in d["grads"]}["x"] == ["data"]
    table = _cli("inspect", root / "mlp.vjps", devices=1).stdout
    assert "devices      8 (mesh data=2, model=4" in table and "P(None, 'model')" in table


def test_cli_host_with_too_few_devices_is_one_clear_line(cli_artifact):
    root = cli_artifact[0]
    out = root / "few.npz"
    r = _cli("run-fwd", root / "mlp.vjps", "--inputs", root / "in.npz", "--residuals", out, devices=4)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "exported for 8 devices" in lines[0] and "this host has 4" in lines[0], r.stderr
    assert "xla_force_host_platform_device_count=8" in lines[0]
    assert not out.exists()


def test_cli_residuals_from_another_sharding_are_refused_by_name(cli_artifact):
    root, specs, _, fn = cli_artifact
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    # The same function with the batch replicated and the model split the other way.
    other = (
        {k: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(mesh, P())) for k, s in specs[0].items()},
        jax.ShapeDtypeStruct(specs[1].shape, specs[1].dtype, sharding=NamedSharding(mesh, P(None, None, "model"))),
    )
    vs.export(fn, *other, platforms="cpu").save(root / "other.vjps")
    assert (
        _cli("run-fwd", root / "other.vjps", "--inputs", root / "in.npz", "--residuals", root / "other.npz").returncode
        == 0
    )
    r = _cli(
        "run-bwd",
        root / "mlp.vjps",
        "--inputs",
        root / "in.npz",
        "--residuals",
        root / "other.npz",
        "--grads",
        root / "bad.npz",
    )
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "other.npz" in lines[0] and "was saved with sharding" in lines[0], r.stderr
    assert not (root / "bad.npz").exists()
