"""Fuzzing: codecs round-trip anything JAX can hold; mutated files give clean errors or correct results."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from jax import export as jexport

import vjpsplit_cli as vs
from vjpsplit_cli import load_arrays, save_arrays
from vjpsplit_cli.files.dtypes import _ALLOWED, dtype_from_name

DTYPES = sorted(_ALLOWED)
# Bounded so CI stays fast; raise locally with HYPOTHESIS_PROFILE-style edits when hunting.
EXAMPLES = 60


@st.composite
def arrays(draw):
    """Any allowed dtype, 0-d to 3-d (empty dims included), any bit pattern, maybe strided or big-endian."""
    dt = dtype_from_name(draw(st.sampled_from(DTYPES)))
    shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
    n = int(np.prod(shape, dtype=np.int64))
    raw = draw(st.binary(min_size=n * dt.itemsize, max_size=n * dt.itemsize))
    a = np.frombuffer(raw, np.uint8).view(dt).reshape(shape) if n else np.zeros(shape, dt)
    if dt == np.bool_:
        a = a.view(np.uint8) % 2 == 1  # only 0/1 bytes are valid bools
    layout = draw(st.sampled_from(["plain", "strided", "transposed", "big-endian"]))
    if layout == "strided" and a.ndim:
        a = np.repeat(a, 2, axis=-1)[..., ::2]
    elif layout == "transposed":
        a = a.T
    elif layout == "big-endian" and dt.kind in "iufc" and dt.itemsize > 1 and dt.isbuiltin:
        a = a.astype(dt.newbyteorder(">"))
    return a


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    data=st.dictionaries(
        st.from_regex(r"[a-z][a-z0-9_]{0,6}(/[a-z0-9_]{1,4}){0,2}", fullmatch=True), arrays(), max_size=4
    ),
    fmt=st.sampled_from(["npz", "msgpack"]),
)
def test_every_dtype_and_shape_round_trips(tmp_path, data, fmt):
    # Keys must form a pytree: no key may be a prefix path of another.
    keys = sorted(data)
    assume(not any(b.startswith(a + "/") for a in keys for b in keys))  # counted as skipped, not as passed
    path = tmp_path / f"f.{fmt}"
    save_arrays(path, data)
    back, _ = load_arrays(path)
    assert list(back) == list(data)
    for k, a in data.items():
        b = back[k]
        assert b.shape == a.shape and b.dtype == a.dtype.newbyteorder("=")
        assert b.tobytes() == a.astype(b.dtype).tobytes()


# ---------------------------------------------------------------- mutation fuzzer


def _mutants(data: bytes, count: int, seed: int):
    """Bit flips, truncations and splices of ``data``, deterministic per seed."""
    rng = np.random.default_rng(seed)
    for i in range(count):
        kind = i % 3
        b = bytearray(data)
        if kind == 0:
            for _ in range(int(rng.integers(1, 9))):
                pos = int(rng.integers(0, len(b)))
                b[pos] ^= 1 << int(rng.integers(0, 8))
        elif kind == 1:
            b = b[: int(rng.integers(0, len(b)))]
        else:
            a0, a1 = sorted(int(x) for x in rng.integers(0, len(b), 2))
            at = int(rng.integers(0, len(b)))
            b = b[:at] + b[a0:a1] + b[at:]
        yield f"{['flip', 'truncate', 'splice'][kind]}-{i}", bytes(b)


ARTIFACT_MUTANTS = 300


@pytest.fixture(scope="module")
def fuzz_artifact(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    (b,) = jexport.symbolic_shape("b")

    def f(w, x):
        return jnp.sum(jnp.tanh(x @ w) ** 2)

    vs.export(
        f, jax.ShapeDtypeStruct((3, 2), jnp.float32), jax.ShapeDtypeStruct((b, 3), jnp.float32), platforms="cpu"
    ).save(d / "a.vjps")
    w = np.arange(6, dtype=np.float32).reshape(3, 2) / 6
    x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3)
    art = vs.load(d / "a.vjps")
    out, res = art.fwd(w, x)
    return d, (w, x), out, art.bwd(res)


def test_mutated_artifacts_fail_cleanly_or_work(fuzz_artifact, tmp_path):
    d, args, out, grads = fuzz_artifact
    data = (d / "a.vjps").read_bytes()
    outcomes = {"error": 0, "same": 0}
    for name, mutant in _mutants(data, ARTIFACT_MUTANTS, seed=1):
        p = tmp_path / "m.vjps"
        p.write_bytes(mutant)
        try:
            art = vs.load(p)
            o, res = art.fwd(*args)
            g = art.bwd(res)
        except vs.VjpsplitError as e:
            assert str(p) in str(e) and "\n" not in str(e), (name, e)
            outcomes["error"] += 1
            continue
        # Still valid bytes (e.g. a flip in msgpack framing that decodes the same): results must be right,
        # leaf for leaf: zip() alone would pass a mutant that returns fewer gradients, or none.
        np.testing.assert_allclose(o, out, err_msg=name)
        assert jax.tree_util.tree_structure(g) == jax.tree_util.tree_structure(grads), name
        for a, b_ in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(grads), strict=True):
            np.testing.assert_allclose(a, b_, err_msg=name)
        outcomes["same"] += 1
    # Most mutants must be caught: a loader that accepted everything and ran it would fail here.
    assert outcomes["error"] >= ARTIFACT_MUTANTS * 9 // 10, outcomes


RESIDUAL_MUTANTS = 200


@pytest.mark.parametrize("ext", ["npz", "msgpack"])
def test_mutated_residual_files_fail_cleanly_or_give_the_same_gradients(fuzz_artifact, tmp_path, ext):
    d, args, _, grads = fuzz_artifact
    art = vs.load(d / "a.vjps")
    _, res = art.fwd(*args)
    src = tmp_path / f"r.{ext}"
    vs.save_residuals(src, res)
    outcomes = {"error": 0, "same": 0}
    for name, mutant in _mutants(src.read_bytes(), RESIDUAL_MUTANTS, seed=2):
        p = tmp_path / f"m.{ext}"
        p.write_bytes(mutant)
        try:
            g = art.bwd(vs.load_residuals(p, inputs=args, artifact=art))
        except vs.VjpsplitError as e:
            assert p.name in str(e) and "\n" not in str(e), (name, e)
            outcomes["error"] += 1
            continue
        # The checksums make any change to the data an error, so a file that still
        # loads must give exactly the original gradients, every one of them.
        assert jax.tree_util.tree_structure(g) == jax.tree_util.tree_structure(grads), name
        for a, b_ in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(grads), strict=True):
            np.testing.assert_array_equal(a, b_, err_msg=name)
        outcomes["same"] += 1
    assert outcomes["error"] > RESIDUAL_MUTANTS // 2, outcomes
