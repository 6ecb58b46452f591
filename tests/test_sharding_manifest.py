"""Sharding metadata on one device: PartitionSpecs as JSON, the manifest's checks, messages.

Running sharded artifacts needs 8 devices: tests/sharded (started by test_sharded.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import msgpack
import pytest
from jax import export as jexport
from jax.sharding import PartitionSpec as P

import vjpsplit_cli as vs
from vjpsplit_cli.artifact.manifest import MAGIC, Manifest
from vjpsplit_cli.artifact.sharding import divisibility_problem, format_spec, host_mesh, spec_from_json, spec_to_json


@pytest.mark.parametrize(
    "spec,json_",
    [
        (P(), ()),
        (P("data"), ("data",)),
        (P(None, "model"), (None, "model")),
        (P("data", None), ("data",)),
        (P(("data", "model"), None), (("data", "model"),)),
        (P(None, ("x",)), (None, "x")),
    ],
)
def test_partition_specs_round_trip_as_json(spec, json_):
    assert spec_to_json(spec) == json_
    assert spec_from_json([list(e) if isinstance(e, tuple) else e for e in json_]) == json_


@pytest.mark.parametrize("bad", ["data", [1], [["data", 2]], [[]], {"a": 1}])
def test_malformed_specs_are_refused(bad):
    with pytest.raises(ValueError):
        spec_from_json(bad)


def test_format_spec():
    assert format_spec(None) == "-" and format_spec(()) == "P()"
    assert format_spec((None, "model")) == "P(None, 'model')" and format_spec((("a", "b"),)) == "P(('a', 'b'))"


def test_divisibility_problems_name_the_dim_and_the_fix():
    sizes = {"data": 2, "model": 4}
    assert divisibility_problem("input 'x'", (8, 16), ("data", "model"), sizes) is None
    assert "6 is not a multiple of 4" in divisibility_problem("input 'x'", (6,), ("model",), sizes)
    (b,) = jexport.symbolic_shape("b")
    msg = divisibility_problem("input 'x'", (b, 16), (("data", "model"),), sizes)
    assert "split 8 ways by mesh axis data/model" in msg and "mod(b, 8) == 0" in msg
    (c,) = jexport.symbolic_shape("c", constraints=("mod(c, 2) == 0",))
    assert divisibility_problem("input 'x'", (c, 16), ("data",), sizes) is None


def test_host_with_too_few_devices_names_both_counts():
    with pytest.raises(
        vs.VjpsplitError,
        match=r"exported for 8 devices \(mesh data=2, model=4\), but this host has "
        rf"{jax.device_count()};.*device_count=8",
    ):
        host_mesh((("data", 2), ("model", 4)))


def _unsharded(tmp_path):
    vs.export(lambda x: jnp.sum(jnp.sin(x)), jax.ShapeDtypeStruct((4,), jnp.float32), platforms="cpu").save(
        tmp_path / "a.vjps"
    )
    top = msgpack.unpackb((tmp_path / "a.vjps").read_bytes()[len(MAGIC) :], raw=False)
    return top


@pytest.mark.parametrize(
    "mutate,why",
    [
        (lambda m: m.update(nr_devices=8), "without a mesh"),
        (lambda m: m.update(nr_devices=8, mesh=[["data", 4]]), "mesh's 4 devices"),
        (
            lambda m: m.update(nr_devices=2, mesh=[["data", 2]], inputs=[{**m["inputs"][0], "sharding": ["model"]}]),
            "not the mesh's",
        ),
        (
            lambda m: m.update(nr_devices=2, mesh=[["data", 2]], inputs=[{**m["inputs"][0], "sharding": [1]}]),
            "sharding entry",
        ),
        (
            lambda m: m.update(
                nr_devices=2, mesh=[["data", 2]], inputs=[{**m["inputs"][0], "sharding": ["data", None]}]
            ),
            "more entries than its shape",
        ),
    ],
)
def test_forged_sharding_metadata_is_one_clear_error(tmp_path, mutate, why):
    top = _unsharded(tmp_path)
    mutate(top["manifest"])
    with pytest.raises(vs.VjpsplitError) as e:
        Manifest.from_json(top["manifest"], "forged.vjps")
    assert "malformed artifact manifest" in str(e.value) and "\n" not in str(e.value)
    assert why in str(e.value)


def test_unsharded_artifact_says_one_device_and_no_mesh(tmp_path):
    art = vs.export(lambda x: jnp.sum(jnp.sin(x)), jax.ShapeDtypeStruct((4,), jnp.float32), platforms="cpu")
    m = art.manifest
    assert m.nr_devices == 1 and m.mesh == () and not m.sharded and art.mesh is None
    assert all(leaf.sharding is None for leaf in m.all_leaves)
    body = m.to_json()
    # Written only when set: an unsharded manifest has no sharding fields at all.
    assert "nr_devices" not in body and "mesh" not in body
    assert all("sharding" not in leaf for leaf in body["inputs"] + body["residuals"])
    assert art.on_devices(jax.devices()[:1]) is art
