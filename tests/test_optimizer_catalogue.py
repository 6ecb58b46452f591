"""Every optimizer of optax's own test catalogue trains in the pipeline as in one process, or is refused by name.

The lists are read from the installed optax's own test modules (``optax/_src/alias_test.py``'s
``_OPTIMIZERS_UNDER_TEST``, ``optax/contrib/_common_test.py``'s ``_MAIN_OPTIMIZERS_UNDER_TEST`` and
its ``mechanize`` wrappers of ``_BASE_OPTIMIZERS``) with ``ast.literal_eval`` (the modules themselves
import scikit-learn), plus the combinators users write. Each runs 3 steps of a 2-stage model whose
embedding is tied (read by both stages) against ``jax.value_and_grad`` and optax in one process
(``value=loss`` passed, as a one-process loop passes it): the losses, parameters and ``state()``
equal within float noise, or the Trainer refuses it at construction with one error naming it.
"""

from __future__ import annotations

import ast
import functools
import os

import jax

import numpy as np
import optax
import pytest

from optimizer_models import MICROBATCHES, assert_as_one_process, batches, one_process, params_, stages

from vjpsplit_cli import pipeline as P
from vjpsplit_cli.errors import VjpsplitError


def _literal(path: str, name: str) -> list:
    """``name``'s literal value in the module at ``path`` (with the ``+=`` of literals that follow it)."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    out: list | None = None
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            if out is None:  # the first assignment: later ones re-wrap it (tuple(...))
                out = list(ast.literal_eval(node.value))
        elif isinstance(node, ast.AugAssign) and getattr(node.target, "id", None) == name and out is not None:
            if isinstance(node.value, (ast.List, ast.Tuple)):
                out += list(ast.literal_eval(node.value))
    assert out, f"{path} defines no literal {name}"
    return out


def _catalogue() -> list[tuple[str, object]]:
    root = os.path.dirname(optax.__file__)
    alias, common = os.path.join(root, "_src", "alias_test.py"), os.path.join(root, "contrib", "_common_test.py")
    for f in (alias, common):
        assert os.path.exists(f), f"optax {optax.__version__} does not ship {f}; this test reads its lists"
    out: list[tuple[str, object]] = []
    for e in _literal(alias, "_OPTIMIZERS_UNDER_TEST"):
        out.append(
            (f"{e['opt_name']}{e['opt_kwargs']}", functools.partial(getattr(optax, e["opt_name"]), **e["opt_kwargs"]))
        )
    entries = _literal(common, "_MAIN_OPTIMIZERS_UNDER_TEST")
    # _OTHER_OPTIMIZERS_UNDER_TEST: mechanize(weight_decay=0.0) around each of _BASE_OPTIMIZERS (a comprehension).
    entries += [
        {**b, "wrapper_name": "mechanize", "wrapper_kwargs": {"weight_decay": 0.0}}
        for b in _literal(common, "_BASE_OPTIMIZERS")
    ]
    for e in entries:
        name, kw, wrap, wkw = e["opt_name"], e["opt_kwargs"], e.get("wrapper_name"), e.get("wrapper_kwargs") or {}
        factory = getattr(optax.contrib, name, None) or getattr(optax, name)
        if wrap is None:
            out.append((f"contrib.{name}{kw}", functools.partial(factory, **kw)))
        elif wrap == "reduce_on_plateau":  # as _common_test's _wrap_opt builds it
            out.append(
                (
                    f"{name}{kw}+reduce_on_plateau",
                    lambda f=factory, k=kw, w=wkw: optax.chain(f(**k), optax.contrib.reduce_on_plateau(**w)),
                )
            )
        else:
            out.append(
                (f"{wrap}({name}{kw})", lambda f=factory, k=kw, w=wrap, a=wkw: getattr(optax.contrib, w)(f(**k), **a))
            )
    out += [
        (
            "chain(clip_by_global_norm(0.05), adamw)",
            lambda: optax.chain(optax.clip_by_global_norm(0.05), optax.adamw(1e-2)),
        ),
        ("chain(clip(0.01), sgd)", lambda: optax.chain(optax.clip(0.01), optax.sgd(0.1))),
        ("masked(adamw)", lambda: optax.masked(optax.adamw(1e-2), lambda p: jax.tree.map(lambda x: x.ndim > 1, p))),
        ("inject_hyperparams(adam)", lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)),
        ("MultiSteps(adam, 2)", lambda: optax.MultiSteps(optax.adam(1e-2), 2).gradient_transformation()),
        ("apply_if_finite(adam)", lambda: optax.apply_if_finite(optax.adam(1e-2), 3)),
        ("lookahead(sgd)", lambda: optax.lookahead(optax.sgd(0.1), 2, 0.5)),
        ("lbfgs", lambda: optax.lbfgs()),
    ]
    return out


CATALOGUE = _catalogue()

# What the Trainer refuses, and the words its error must say (the rest must train exactly).
REFUSED = {
    "lbfgs": "needs value_fn and grad",
    "contrib.sophia{'learning_rate': 0.01}": "obj_fn",
    "lookahead(sgd)": "LookaheadParams",
}


@pytest.mark.parametrize("name,make", CATALOGUE, ids=[n for n, _ in CATALOGUE])
def test_catalogue_optimizer_trains_as_one_process_or_is_refused_by_name(name, make):
    tx, data = make(), batches()
    if name in REFUSED:
        with pytest.raises(VjpsplitError) as e:
            P.Trainer(stages(), params_(), optimizer=tx, microbatches=MICROBATCHES)
        msg = str(e.value)
        assert REFUSED[name] in msg and "\n" not in msg, msg
        assert "host callbacks" not in msg and "vjpsplit bug" not in msg, msg
        return
    with P.Trainer(stages(), params_(), optimizer=tx, microbatches=MICROBATCHES) as tr:
        losses = [tr.step(b) for b in data]
        params, state = tr.state()
    assert_as_one_process(name, losses, params, state, one_process(tx, data))


def test_the_catalogue_is_optax_own_lists():
    names = [n for n, _ in CATALOGUE]
    assert len(names) > 70  # alias_test's 35, _common_test's 21 and 19 mechanize wrappers, our combinators
    for must in (
        "noisy_sgd",
        "contrib.dowg",
        "contrib.prodigy",
        "contrib.dadapt_adamw",
        "polyak_sgd",
        "reduce_on_plateau",
    ):
        assert any(must in n for n in names), must


def _ravelled_tx():
    """An update over all leaves ravelled into one vector (as ``jax.flatten_util`` users write): no stage holds it."""
    from jax.flatten_util import ravel_pytree

    def update(g, state, params=None):
        flat, unravel = ravel_pytree(g)
        return unravel(-0.1 * flat / (1.0 + jax.numpy.std(flat))), state

    return optax.GradientTransformation(lambda p: optax.EmptyState(), update)


def test_an_update_that_mixes_leaves_otherwise_than_by_sums_is_refused_naming_what_spans():
    with pytest.raises(VjpsplitError) as e:
        P.Trainer(stages(), params_(), optimizer=_ravelled_tx(), microbatches=MICROBATCHES)
    msg = str(e.value)
    assert msg.startswith("optimizer '_ravelled_tx': its update of parameter 'params/") and "\n" not in msg
    assert "concatenate of leaves" in msg and "no stage holds both" in msg and "Use an optimizer" in msg


def test_the_same_update_for_one_stage_holding_every_leaf_exports_and_equals_optax():
    """export_optimizer alone (no stages): the whole model is its one stage, its reductions its own."""
    from vjpsplit_cli.pipeline.training.optimizer import export_optimizer

    for tx in (_ravelled_tx(), optax.contrib.dowg(), optax.noisy_sgd(1e-2, eta=1e-2, key=0)):
        p = {k: np.asarray(v) for k, v in params_().items()}
        g = jax.tree_util.tree_map(lambda x: np.full_like(x, 0.5), p)
        prog = export_optimizer(tx, p, platforms="cpu")
        assert prog.reductions == [] and prog.rounds == 0
        state = prog.init(p)
        new_p, _ = prog.update(p, state, g)
        u, _ = tx.update(g, tx.init(p), p)
        want = optax.apply_updates(p, u)
        for k in p:
            np.testing.assert_allclose(new_p[k], want[k], rtol=1e-6, atol=1e-7)


def test_apply_if_finite_skips_every_stage_when_one_stage_has_a_non_finite_gradient():
    """Its check stacks one flag per leaf and reduces them with ``all``: the reduction spans the stages, so a NaN
    on stage 1 alone stops stage 0's update too, as in one process (each stage's own check would not)."""
    from vjpsplit_cli.pipeline.training.optimizer import export_optimizer
    from vjpsplit_cli.pipeline.training.separable import WholeOptimizer, combine
    from vjpsplit_cli.pipeline.training.optax_state import StateMap

    tx = optax.apply_if_finite(optax.sgd(0.1), 3)
    p = {"a": np.ones(3, np.float32), "b": np.ones(2, np.float32)}
    names, keys = [["a"], ["b"]], {"a": "a", "b": "b"}
    smap = StateMap(tx, p, keys, names)
    where: dict = {}
    for j, at in enumerate(smap.whole):
        where.setdefault(at, []).append(j)
    index = [[where[at] for at in ats] for _, ats in smap.stages]
    whole = WholeOptimizer(tx, p, keys, names, "apply_if_finite", [at.key for at in smap.whole], smap.entries, index)
    assert [r.op for r in whole.roots()] == ["and"]
    progs = [export_optimizer(tx, {k: p[k]}, platforms="cpu", whole=whole, stage=s) for s, k in enumerate("ab")]
    g = {"a": np.full(3, 0.5, np.float32), "b": np.array([np.nan, 0.5], np.float32)}
    own = [{k: p[k]} for k in "ab"]
    states = [prog.init(x) for prog, x in zip(progs, own)]
    grads = [{k: g[k]} for k in "ab"]
    unknown = [np.zeros((), np.bool_)]  # round 0 reads no reduction yet
    parts = [prog.shares(0, x, st, gr, 1.0, 0.0, unknown) for prog, x, st, gr in zip(progs, own, states, grads)]
    reduced = [combine("and", np.bool_, [part[0] for part in parts])]
    new = [prog.update(x, st, gr, 1.0, 0.0, reduced)[0] for prog, x, st, gr in zip(progs, own, states, grads)]
    u, _ = tx.update(g, tx.init(p), p)
    want = optax.apply_updates(p, u)
    np.testing.assert_array_equal(new[0]["a"], want["a"])
    np.testing.assert_array_equal(new[0]["a"], p["a"])  # skipped: stage 1's gradient is not finite
