"""A sharded artifact written by the newest jax (calling convention 9) runs on 8 devices under every supported jax.

jax <= 0.7 reads the device count from a field jax >= 0.9.1 no longer writes,
and sees 0 devices: the manifest's ``nr_devices`` must win, not a silent
one-device run. CI runs this file under jax 0.6.2 too (scripts/compat).
"""

import dataclasses
from pathlib import Path

import jax
import msgpack
import numpy as np
import pytest
from jax import export as jexport

import vjpsplit_cli as vs
from vjpsplit_cli.artifact.artifact_file import deserialize_module
from vjpsplit_cli.artifact.manifest import MAGIC, Manifest

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "sharded-cc9"


def _run(art):
    expected, _ = vs.load_arrays(FIXTURE / "expected.npz")
    params = {k[len("params/") :]: v for k, v in expected.items() if k.startswith("params/")}
    out, res = art.fwd(params, expected["x"])
    assert len(res.stored["r/0"].sharding.device_set) == 8
    g_params, g_x = art.bwd(res)
    np.testing.assert_allclose(out, expected["out"], rtol=1e-5)
    np.testing.assert_allclose(g_x, expected["grad/x"], rtol=1e-5, atol=1e-6)
    for k, v in g_params.items():
        np.testing.assert_allclose(v, expected[f"grad/params/{k}"], rtol=1e-5, atol=1e-6)
        assert len(v.sharding.device_set) == 8


SHARDY = tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 7)  # the partitioner the fixture's jax used


def test_fixture_runs_on_8_devices_here():
    if not SHARDY:  # jax 0.6 reads the file, but not the Shardy dialect of its sharded modules: one clear refusal
        with pytest.raises(
            vs.VjpsplitError,
            match=r"cannot read the fwd module .*Shardy partitioner.*jax 0\.10\.2 or newer, or re-export it with this jax",
        ):
            vs.load(FIXTURE / "mlp.vjps")
        return
    art = vs.load(FIXTURE / "mlp.vjps")
    assert art.manifest.nr_devices == 8 and art.manifest.calling_convention_version == 9
    _run(art)


def _file():
    top = msgpack.unpackb((FIXTURE / "mlp.vjps").read_bytes()[len(MAGIC) :], raw=False)
    return top, Manifest.from_json(top["manifest"], "fixture")


def test_a_module_read_with_0_devices_runs_on_the_manifests_count(monkeypatch):
    """What jax <= 0.7 sees in this file: the device count field reads 0."""
    real = jexport.deserialize
    top, manifest = _file()
    assert real(bytearray(top["fwd"])).nr_devices == (8 if SHARDY else 0)  # jax 0.6 reads 0 here, truly
    if SHARDY:  # this jax reads the count: make it read what jax <= 0.7 reads
        monkeypatch.setattr(jexport, "deserialize", lambda data: dataclasses.replace(real(data), nr_devices=0))
    for module in ("fwd", "bwd"):
        assert deserialize_module(top[module], "fixture", manifest, module).nr_devices == 8
    if SHARDY:
        art = vs.load(FIXTURE / "mlp.vjps")
        assert all(e.nr_devices == 8 for e in art.exported.values())
        _run(art)


def test_a_module_whose_device_count_disagrees_with_the_manifest_is_refused(monkeypatch):
    real = jexport.deserialize
    monkeypatch.setattr(jexport, "deserialize", lambda data: dataclasses.replace(real(data), nr_devices=4))
    with pytest.raises(vs.VjpsplitError, match="module runs on 4 devices, the manifest says 8"):
        vs.load(FIXTURE / "mlp.vjps")
