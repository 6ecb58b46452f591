"""Checks run once per signature: a call like one before skips them, any other call gets every one.

An artifact remembers the signatures (tree structure, leaf types, shapes, dtypes, dims)
whose checks passed. Each test here warms an artifact with good calls, then makes a bad
one, and holds its error to the error a fresh artifact (same modules, nothing seen)
gives for the same call: the same refusal, word for word.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vjpsplit_cli as vs
from vjpsplit_cli.artifact import binding, checked_calls, runner


def loss(params, x):
    return jnp.mean(jnp.tanh(x @ params["w"] + params["b"]) ** 2)


def vector(w, x):
    return jnp.tanh(x @ w)


@pytest.fixture(scope="module")
def art():
    b = jax.export.symbolic_shape("b")[0]
    params = {"w": jax.ShapeDtypeStruct((4, 3), jnp.float32), "b": jax.ShapeDtypeStruct((3,), jnp.float32)}
    return vs.export(loss, params, jax.ShapeDtypeStruct((b, 4), jnp.float32), weights="params", platforms="cpu")


@pytest.fixture(scope="module")
def vec_art():
    return vs.export(
        vector, jax.ShapeDtypeStruct((4, 3), jnp.float32), jax.ShapeDtypeStruct((2, 4), jnp.float32), platforms="cpu"
    )


@pytest.fixture(scope="module")
def other_art():
    b = jax.export.symbolic_shape("b")[0]
    params = {"w": jax.ShapeDtypeStruct((4, 3), jnp.float32), "b": jax.ShapeDtypeStruct((3,), jnp.float32)}
    return vs.export(
        lambda p, x: jnp.sum(x @ p["w"] + p["b"]), params, jax.ShapeDtypeStruct((b, 4), jnp.float32), platforms="cpu"
    )


def fresh(art):
    """The same artifact with nothing seen: its own binding, runner and jitted calls."""
    return vs.Artifact(art.manifest, art.modules, art.exported, art.source)


def batch(seed, rows=5):
    rng = np.random.default_rng(seed)
    params = {"w": rng.normal(size=(4, 3)).astype(np.float32), "b": rng.normal(size=(3,)).astype(np.float32)}
    return params, rng.normal(size=(rows, 4)).astype(np.float32)


def warm(art, rounds=3):
    """Good calls of every form on ``art``, at two batch sizes, checked against jax."""
    for seed in range(rounds):
        for rows in (5, 2):
            params, x = batch(seed, rows)
            out, res = art.fwd(params, x)
            gp, gx = art.bwd(res)
            want = jax.grad(loss, argnums=(0, 1))(params, x)
            np.testing.assert_allclose(out, loss(params, x), rtol=1e-5)
            np.testing.assert_allclose(gx, want[1], rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(gp["w"], want[0]["w"], rtol=1e-5, atol=1e-6)
            g_in, inter = art.bwd_input(res)
            np.testing.assert_allclose(art.bwd_weight(inter)["params"]["b"], want[0]["b"], rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(g_in["x"], want[1], rtol=1e-5, atol=1e-6)
            flat = {"params/b": params["b"], "params/w": params["w"], "x": x}
            outputs, res2 = art.run_fwd_arrays(flat)
            assert set(art.run_bwd_arrays(res2)) == {"params/b", "params/w", "x"}


def same_error(art, call, warmed=True):
    """``call(artifact)``'s error on a fresh artifact and on ``art`` after good calls: both, as text."""
    with pytest.raises(vs.VjpsplitError) as first:
        call(fresh(art))
    if warmed:
        warm(art)
    with pytest.raises(vs.VjpsplitError) as later:
        call(art)
    assert str(later.value) == str(first.value)
    return str(later.value)


BAD_ARGS = {
    "another dtype": lambda p, x: (p, x.astype(np.int32)),
    "another shape": lambda p, x: (p, x[:, :3]),
    "another rank": lambda p, x: (p, x[None]),
    "a missing leaf": lambda p, x: ({"w": p["w"]}, x),
    "an extra leaf": lambda p, x: ({**p, "c": p["b"]}, x),
    "another tree type": lambda p, x: ([p["b"], p["w"]], x),
    "a weight of another dtype": lambda p, x: ({**p, "w": p["w"].astype(np.float16)}, x),
    "an array of the batch dtype made on device": lambda p, x: (p, jnp.asarray(x, jnp.bfloat16)),
    "a zero batch": lambda p, x: (p, x[:0]),
}


@pytest.mark.parametrize("case", sorted(BAD_ARGS))
def test_fwd_with_another_signature_gets_every_check(art, case):
    args = BAD_ARGS[case](*batch(7))
    message = same_error(art, lambda a: a.fwd(*args))
    assert message.startswith("args:")


@pytest.mark.parametrize("case", ["missing", "extra", "dtype", "shape"])
def test_fwd_arrays_with_another_signature_gets_every_check(art, case):
    params, x = batch(3)
    flat = {"params/b": params["b"], "params/w": params["w"], "x": x}
    if case == "missing":
        del flat["x"]
    elif case == "extra":
        flat["y"] = x
    elif case == "dtype":
        flat["x"] = x.astype(np.float64)
    else:
        flat["params/b"] = params["b"][:2]
    same_error(art, lambda a: a.run_fwd_arrays(flat))


def test_residuals_of_another_artifact_are_refused_after_good_calls(art, other_art):
    _, res = other_art.fwd(*batch(1))
    assert "another artifact" in same_error(art, lambda a: a.bwd(res))


def test_residuals_with_a_changed_array_are_refused_after_good_calls(art):
    _, res = art.fwd(*batch(1))
    key = next(iter(res.stored))
    for changed in (np.asarray(res.stored[key], np.float16), np.reshape(res.stored[key], (1, -1))):
        bad = res.replace(stored={**res.stored, key: changed})
        assert key in same_error(art, lambda a: a.bwd(bad))
        same_error(art, lambda a: a.bwd_input(bad))


def test_an_input_reshaped_in_place_after_the_forward_is_refused(art):
    """A NumPy input the residuals hold (not a copy) changed shape since the forward: checked again."""

    def call(a):
        params, x = batch(2)
        _, res = a.fwd(params, x)
        x.shape = (10, 2)
        a.bwd(res)

    assert "input 'x'" in same_error(art, call)


def test_split_residuals_are_refused_after_good_calls(art):
    fwd, _ = vs.split(loss)
    _, res = fwd(*batch(1))
    same_error(art, lambda a: a.bwd(res))


def test_intermediates_of_another_microbatch_are_refused_after_good_calls(art):
    _, res_a = art.fwd(*batch(1))
    _, res_b = art.fwd(*batch(2))
    _, inter_b = art.bwd_input(res_b)
    message = same_error(art, lambda a: a.bwd_weight(inter_b, res_a))
    assert "another forward run or microbatch" in message
    _, res_c = art.fwd(*batch(2, rows=3))
    _, inter_c = art.bwd_input(res_c)
    same_error(art, lambda a: a.bwd_weight(inter_c, res_a))  # and of another size


def test_intermediates_with_a_changed_array_are_refused_after_good_calls(art):
    _, res = art.fwd(*batch(1))
    _, inter = art.bwd_input(res)
    key = next(iter(inter.arrays))
    bad = inter.replace(arrays={**inter.arrays, key: np.asarray(inter.arrays[key], np.float16)})
    assert "intermediate" in same_error(art, lambda a: a.bwd_weight(bad))


@pytest.mark.parametrize("case", ["shape", "dtype", "missing", "void"])
def test_cotangents_with_another_signature_get_every_check(vec_art, case):
    w, x = np.ones((4, 3), np.float32), np.ones((2, 4), np.float32)
    good = np.ones((2, 3), np.float32)
    ct = {"shape": good[:1], "dtype": good.astype(np.int32), "missing": None, "void": good.view("V4")}[case]

    def call(a):
        _, res = a.fwd(w, x)
        a.bwd(res, good)  # a good cotangent first: its signature is seen
        a.bwd(res, ct)

    if case == "void":  # raw bytes of the right width (how numpy writes bfloat16) are viewed, on every call
        a = fresh(vec_art)
        _, res = a.fwd(w, x)
        for _ in range(2):
            np.testing.assert_allclose(a.bwd(res, ct)[0], a.bwd(res, good)[0])
        return
    same_error(vec_art, call, warmed=False)


def test_a_signature_seen_skips_the_checks_and_another_gets_them(art, monkeypatch):
    """The point of it all, counted: the second call of a signature checks no array, a new one checks all."""
    counts = {"check_array": 0, "check_outputs": 0}

    def counting(name, real):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return real(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(binding, "check_array", counting("check_array", binding.check_array))
    monkeypatch.setattr(runner, "check_outputs", counting("check_outputs", runner.check_outputs))
    a = fresh(art)
    params, x = batch(4)
    _, res = a.fwd(params, x)
    a.bwd(res)
    first = dict(counts)
    assert first["check_array"] == 3 and first["check_outputs"] == 2  # three inputs; fwd and bwd
    for seed in range(3):
        _, res = a.fwd(*batch(seed))  # the same signature, other values
        a.bwd(res)
    assert counts == first
    _, res = a.fwd(*batch(4, rows=3))  # another batch size: every check again
    a.bwd(res)
    assert counts["check_array"] == 2 * first["check_array"]
    assert counts["check_outputs"] == 2 * first["check_outputs"]
    res_loaded = res.replace(residuals_id="")  # not this fwd's own: checked, once per signature
    a.bwd(res_loaded)
    after = counts["check_array"]
    assert after > 2 * first["check_array"]
    a.bwd(res.replace(residuals_id=""))
    assert counts["check_array"] == after


def test_signatures_hold_no_object_ids(art):
    """Arrays made and dropped in turn (their ids reused by the next ones) never pass for one another."""
    a = fresh(art)
    params, _ = batch(0)
    for i in range(16):  # each gc.collect walks every object of a process that holds jax: ~1 s under xdist
        x = np.ones((3, 4), np.float32) if i % 2 else np.ones((3, 5), np.float32)
        if i % 2:
            out, res = a.fwd(params, x)
            a.bwd(res)
        else:
            with pytest.raises(vs.VjpsplitError, match="input 'x'"):
                a.fwd(params, x)
        del x
        gc.collect()


def test_threads_calling_one_artifact_each_get_their_own_checks(art):
    """The pipeline runners call artifacts from several threads: good calls right, bad calls refused."""
    a = fresh(art)
    errors: list[BaseException] = []

    def worker(seed):
        try:
            for i in range(12):
                params, x = batch(seed * 100 + i, rows=2 + (i + seed) % 3)
                if (i + seed) % 4 == 0:
                    with pytest.raises(vs.VjpsplitError, match="input 'x'"):
                        a.fwd(params, x.astype(np.int32))
                    continue
                out, res = a.fwd(params, x)
                gp, gx = a.bwd(res)
                want = jax.grad(loss, argnums=(0, 1))(params, x)
                np.testing.assert_allclose(gx, want[1], rtol=1e-5, atol=1e-6)
                np.testing.assert_allclose(gp["b"], want[0]["b"], rtol=1e-5, atol=1e-6)
        except BaseException as e:  # reported below, in the test's own thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_typed_keys_of_another_impl_are_refused_after_good_calls():
    def noisy(x, key):
        return jnp.sum(x * jax.random.normal(key, x.shape))

    key = jax.random.key(0)
    art = vs.export(noisy, jax.ShapeDtypeStruct((3,), jnp.float32), jax.eval_shape(lambda: key), platforms="cpu")
    x = np.ones(3, np.float32)
    for seed in range(3):
        out, res = art.fwd(x, jax.random.key(seed))
        np.testing.assert_allclose(out, noisy(x, jax.random.key(seed)), rtol=1e-6)
        np.testing.assert_allclose(art.bwd(res)[0], jax.grad(noisy)(x, jax.random.key(seed)), rtol=1e-6)
    rbg = jax.random.key(0, impl="rbg")
    with pytest.raises(vs.VjpsplitError) as first:
        fresh(art).fwd(x, rbg)
    with pytest.raises(vs.VjpsplitError) as later:
        art.fwd(x, rbg)
    assert str(later.value) == str(first.value)
    assert "key" in str(first.value)


def test_calls_under_a_callers_jit_keep_no_tracer(art):
    """The pipeline wraps artifact methods in jit: what a trace checked must not leak into later calls."""
    a = fresh(art)
    step = jax.jit(lambda p, x: a.bwd(a.fwd(p, x)[1]))
    for rows in (5, 3, 5):
        params, x = batch(rows, rows)
        for grads in (step(params, x), a.bwd(a.fwd(params, x)[1])):  # traced, then eager, alternately
            want = jax.grad(loss, argnums=(0, 1))(params, x)
            np.testing.assert_allclose(grads[1], want[1], rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(grads[0]["w"], want[0]["w"], rtol=1e-5, atol=1e-6)


def test_one_plan_per_signature_serves_fwd_and_bwd(art, monkeypatch):
    """fwd works out a plan once per signature and bwd lays the gradients out from it; new shapes get their own.

    Repeated calls of one signature make no new plan and rebuild no gradient tree the slow way
    (``grads_per_arg``); another batch size makes one more plan; a call of another dtype after
    them is still refused by name, word for word as on a fresh artifact, and makes no plan.
    """
    from vjpsplit_cli.artifact import artifact as artifact_module

    slow = {"grads_per_arg": 0}
    real = artifact_module.grads_per_arg

    def counting(*args, **kwargs):
        slow["grads_per_arg"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(artifact_module, "grads_per_arg", counting)
    a = fresh(art)
    made = binding.PLANS_MADE[0]
    for rows in (5, 5, 5, 2, 2, 5):
        for seed in range(3):
            params, x = batch(seed, rows)
            out, res = a.fwd(params, x)
            gp, gx = a.bwd(res)
            want = jax.grad(loss, argnums=(0, 1))(params, x)
            np.testing.assert_allclose(out, loss(params, x), rtol=1e-5)
            np.testing.assert_allclose(gx, want[1], rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(gp["w"], want[0]["w"], rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(gp["b"], want[0]["b"], rtol=1e-5, atol=1e-6)
            assert type(gp) is dict and set(gp) == {"w", "b"}  # the caller's own tree
    assert binding.PLANS_MADE[0] == made + 2  # batch sizes 5 and 2: one plan each
    assert slow["grads_per_arg"] == 0
    params, x = batch(0)
    with pytest.raises(vs.VjpsplitError) as first:
        fresh(art).fwd(params, x.astype(np.int32))
    made = binding.PLANS_MADE[0]
    with pytest.raises(vs.VjpsplitError) as later:
        a.fwd(params, x.astype(np.int32))
    assert str(later.value) == str(first.value)
    assert "input 'x'" in str(later.value) and "expected f32[b,4]" in str(later.value)
    assert binding.PLANS_MADE[0] == made
    _, res = a.fwd(params, x)
    a.bwd(res.replace(residuals_id=""))  # not this forward's own: checked, the gradients built the general way
    assert slow["grads_per_arg"] == 1


def test_residuals_of_one_artifact_take_no_shortcut_in_another(art):
    """Two artifacts of one manifest: residuals of one are checked by the other, never taken as its own."""
    a, b = fresh(art), fresh(art)
    params, x = batch(1)
    a.bwd(a.fwd(params, x)[1])
    _, res_b = b.fwd(params, x)
    gp, gx = a.bwd(res_b)  # same fingerprint, same shapes: accepted, but through a's checks
    np.testing.assert_allclose(gx, jax.grad(loss, argnums=1)(params, x), rtol=1e-5, atol=1e-6)
    assert a._binding.own_residuals(res_b) is None and b._binding.own_residuals(res_b) is not None


def test_signatures_read_off_jax_arrays_aval_equal_their_shape_and_dtype():
    """A jax array's signature comes from its aval straight: what ``shape`` and ``dtype`` say, for every kind."""
    arrays = [
        jnp.ones((2, 3), jnp.float32),
        jnp.ones((), jnp.bfloat16),
        jnp.ones((4,), jnp.int8),
        jnp.zeros((0, 5), jnp.bool_),
        jax.device_put(np.ones((3,), np.float32)),
        jax.random.key(0),  # a typed key: its own type, read by its attributes
        jax.random.split(jax.random.key(1), 3),
        np.ones((2,), np.float64),
    ]
    sig = checked_calls.leaves_signature(arrays)
    assert sig == tuple((type(a), a.shape, a.dtype) for a in arrays)
    assert checked_calls.reads_aval(type(arrays[0])) and not checked_calls.reads_aval(type(arrays[5]))
    assert not checked_calls.reads_aval(np.ndarray)
    flat = dict(zip("abcdefgh", arrays))
    assert checked_calls.mapping_signature(flat) == tuple((k, type(a), a.shape, a.dtype) for k, a in flat.items())


def test_run_ids_are_32_hex_digits_and_never_repeat_across_threads():
    got: list[list[str]] = [[] for _ in range(8)]

    def take(out):
        for _ in range(5000):
            out.append(checked_calls.new_run_id())

    threads = [threading.Thread(target=take, args=(out,)) for out in got]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ids = [i for out in got for i in out]
    assert len(set(ids)) == len(ids) == 40000
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids)


def test_bare_array_arguments_with_another_signature_get_every_check(vec_art):
    """Arguments that are each one array take the look-up without a tree: a bad one is refused word for word."""
    w, x = np.ones((4, 3), np.float32), np.ones((2, 4), np.float32)

    def good(a):
        for args in ((w, x), (jnp.asarray(w), jnp.asarray(x))):
            out, res = a.fwd(*args)
            np.testing.assert_allclose(out, vector(*args), rtol=1e-6)
            gw, gx = a.bwd(res, np.ones((2, 3), np.float32))
            np.testing.assert_allclose(gx, jax.grad(lambda x: jnp.sum(vector(w, x)))(x), rtol=1e-6)

    for bad in (
        (w, x.astype(np.int32)),
        (w, x[:, :3]),
        (w, x[None]),
        (jnp.asarray(w), jnp.asarray(x, jnp.bfloat16)),
        (w, 1.0),
        (x, w),
    ):
        with pytest.raises(vs.VjpsplitError) as first:
            fresh(vec_art).fwd(*bad)
        a = fresh(vec_art)
        good(a)
        with pytest.raises(vs.VjpsplitError) as later:
            a.fwd(*bad)
        assert str(later.value) == str(first.value) and str(first.value).startswith("args:")
    with pytest.raises(vs.VjpsplitError, match="fwd takes 2 arguments"):
        a.fwd(w)


def test_straight_calls_end_when_what_their_checks_depend_on_changes(art, monkeypatch, tmp_path):
    """A plan keeps each module's jitted call; kernel checks at call shapes, the executable cache
    and the CLI's signal guard set afterwards take every call back through the runner."""
    from vjpsplit_cli.safeio import signals

    a = fresh(art)
    params, x = batch(5)
    want = jax.grad(loss, argnums=(0, 1))(params, x)
    for _ in range(3):
        a.bwd(a.fwd(params, x)[1])
    runs: list[str] = []
    real_run = a._runner.run

    def run(module, *args, **kwargs):
        runs.append(module)
        return real_run(module, *args, **kwargs)

    monkeypatch.setattr(a._runner, "run", run)
    a.bwd(a.fwd(params, x)[1])
    assert runs == []  # straight: the plan's calls
    checked: list[str] = []
    monkeypatch.setattr(runner, "check_at_call", lambda source, module, *rest: checked.append(module))
    a.check_kernels_at_call(["fwd", "bwd"])
    for _ in range(2):
        gp, gx = a.bwd(a.fwd(params, x)[1])
        np.testing.assert_array_equal(gx, fresh(art).bwd(fresh(art).fwd(params, x)[1])[1])
        np.testing.assert_allclose(gx, want[1], rtol=1e-5, atol=1e-6)
    # Every call through the runner, which checks the kernels once per placed signature of its own.
    assert runs == ["fwd", "bwd"] * 2 and checked == ["fwd", "bwd"]
    a.check_kernels_at_call([])
    runs.clear()
    for _ in range(2):
        a.bwd(a.fwd(params, x)[1])
    assert runs == ["fwd", "bwd"]  # checked once more after the change, then straight again
    runs.clear()
    with signals.cleanup_on_signals():
        a.bwd(a.fwd(params, x)[1])
    assert runs == ["fwd", "bwd"]  # under the guard: through run, which sets the signals' defaults
    runs.clear()
    a.executable_cache = str(tmp_path)
    for _ in range(2):
        gp, gx = a.bwd(a.fwd(params, x)[1])
        np.testing.assert_allclose(gx, want[1], rtol=1e-5, atol=1e-6)
    assert runs == ["fwd", "bwd"] * 2  # a program read from the cache is checked on every call


def test_residuals_past_the_ones_remembered_are_checked_and_right(art):
    """More forwards outstanding than an artifact remembers: the oldest residuals take the checked path."""
    a = fresh(art)
    made = [a.fwd(*batch(seed % 4)) for seed in range(binding._MADE_KEPT + 20)]
    assert a._binding.own_residuals(made[0][1]) is None and a._binding.own_residuals(made[-1][1]) is not None
    for seed, (_, res) in enumerate(made[:3] + made[-3:]):
        params, x = batch(seed % 4) if seed < 3 else batch((binding._MADE_KEPT + 17 + seed - 3) % 4)
        gp, gx = a.bwd(res)
        want = jax.grad(loss, argnums=(0, 1))(params, x)
        np.testing.assert_allclose(gx, want[1], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(gp["w"], want[0]["w"], rtol=1e-5, atol=1e-6)


def _fields(res):
    """Every field of ``res`` but its run id, each with its type: what a backward or a file reads."""
    out = {}
    for name in type(res)._FIELDS:
        if name == "residuals_id":
            continue
        v = getattr(res, name)
        if isinstance(v, Mapping):
            v = (type(v), {k: (type(a), np.asarray(a).dtype, np.asarray(a).tolist()) for k, a in v.items()})
        else:
            v = (type(v), v)
        out[name] = v
    return out


@pytest.mark.parametrize("which", ["tree", "bare"])
def test_the_straight_forward_makes_the_residuals_the_checked_one_makes(art, vec_art, which, monkeypatch):
    # A seen signature's forward takes the straight path (no checks, the module straight): its residuals must
    # be, field for field and type for type, what the checked path's are.
    a = fresh(art if which == "tree" else vec_art)
    rng = np.random.default_rng(1)
    if which == "tree":
        params, x = batch(0)
        args = ({k: jnp.asarray(v) for k, v in params.items()}, jnp.asarray(x))
    else:
        args = (jnp.asarray(rng.normal(size=(4, 3)), jnp.float32), jnp.asarray(rng.normal(size=(2, 4)), jnp.float32))
    checked = []
    real = binding.Binding.arguments
    monkeypatch.setattr(binding.Binding, "arguments", lambda *a, **k: checked.append(1) or real(*a, **k))
    first = a.fwd(*args)[1]  # a signature not seen: every check
    a.fwd(*args)
    n = len(checked)
    straight = a.fwd(*args)[1]  # seen: the straight path
    assert n >= 1 and len(checked) == n, "the third call took the straight path, past the checks"
    assert _fields(straight) == _fields(first)
    assert straight.residuals_id != first.residuals_id
    ct = () if which == "tree" else (jnp.asarray(rng.normal(size=(2, 3)), jnp.float32),)
    for u, v in zip(jax.tree.leaves(a.bwd(first, *ct)), jax.tree.leaves(a.bwd(straight, *ct)), strict=True):
        np.testing.assert_array_equal(u, v)
