"""Artifacts outlive the jax that wrote them: files written by the oldest supported jax load here."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.export
import numpy as np
import pytest

import vjpsplit_cli as vs

FIXTURES = sorted((Path(__file__).parent / "fixtures").glob("jax-*"))


def test_there_is_a_fixture_from_the_oldest_supported_jax():
    assert [p.name for p in FIXTURES] == ["jax-0.6.2"]


@pytest.mark.parametrize("d", FIXTURES, ids=[p.name for p in FIXTURES])
def test_old_artifact_and_residuals_run_on_this_jax(d):
    art = vs.load(d / "mlp.vjps")
    m = art.manifest
    assert m.jax_version == d.name.removeprefix("jax-")
    assert m.calling_convention_version <= jax.export.maximum_supported_calling_convention_version
    expected, meta = vs.load_arrays(d / "expected.npz")
    params = {k: expected[f"params/{k}"] for k in ("w1", "b1", "w2")}
    # Residuals written by the old jax, backward run by this one.
    g_params, g_x = art.bwd(vs.load_residuals(d / "residuals.msgpack"))
    for k in params:
        np.testing.assert_allclose(g_params[k], expected[f"grad/params/{k}"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g_x, expected["grad/x"], rtol=1e-5, atol=1e-6)
    # The whole round trip on this jax, at the fixture's batch and at another one.
    out, res = art.fwd(params, expected["x"])
    np.testing.assert_allclose(out, expected["out"], rtol=1e-5)
    np.testing.assert_allclose(art.bwd(res)[1], expected["grad/x"], rtol=1e-5, atol=1e-6)
    out, res = art.fwd(params, np.concatenate([expected["x"]] * 3))
    np.testing.assert_allclose(out, expected["out"], rtol=1e-5)
