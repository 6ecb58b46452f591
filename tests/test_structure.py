"""The package's shape: modules that depend one way, no private cross-imports, one documented API."""

from __future__ import annotations

import ast
import importlib
import inspect
import sys
from pathlib import Path


import vjpsplit_cli as vs

PKG = Path(vs.__file__).parent
README = Path(__file__).resolve().parents[1] / "README.md"


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = p.relative_to(PKG).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def _private_module(name: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in name.split("."))


def _imports() -> tuple[dict[str, set[str]], list[tuple[str, str, str]]]:
    """Every relative import (top level or inside functions): module -> modules, and private names taken."""
    mods = _modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    private = []
    for name, path in mods.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        package = [p for p in package if p]
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.level):
                continue
            base = package[: len(package) - (node.level - 1)]
            target = ".".join([*base, *(node.module.split(".") if node.module else [])])
            for alias in node.names:
                full = f"{target}.{alias.name}".strip(".")
                dep = full if full in mods else target
                if dep in mods and dep != name:
                    edges[name].add(dep)
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        private.append((name, dep, alias.name))
                    elif _private_module(dep) and dep != "_version":
                        private.append((name, dep, alias.name))  # a private module is private as a whole
    return edges, private


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle a depth-first walk of ``edges`` closes, as the modules along it."""
    state: dict[str, int] = {}
    cycles = []

    def visit(m, path):
        state[m] = 1
        for d in sorted(edges[m]):
            if state.get(d) == 1:
                cycles.append(path[path.index(d) :] + [d])
            elif d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    return cycles


def test_no_import_cycles():
    edges, _ = _imports()
    cycles = _cycles(edges)
    assert not cycles, f"import cycles: {cycles}"


def test_the_cycle_check_can_fail():
    edges, _ = _imports()
    assert "tracing.policies" in edges["tracing.split"], "split uses policies; the check below relies on it"
    # split -> policies -> vjp; adding vjp -> split must be reported, by the very function the test above uses.
    edges["tracing.vjp"].add("tracing.split")
    assert any("tracing.vjp" in c and "tracing.split" in c for c in _cycles(edges))


def test_no_module_imports_another_modules_private_names():
    _, private = _imports()
    assert not private, private


def test_the_private_import_check_sees_private_modules(tmp_path, monkeypatch):
    """A module importing from a private module (``from ._io import x``) is reported."""
    fake = tmp_path / "vjpsplit_cli"
    fake.mkdir()
    (fake / "__init__.py").write_text('"""x"""\n')
    (fake / "_hidden.py").write_text("def helper():\n    pass\n")
    (fake / "user.py").write_text("from ._hidden import helper\n")
    monkeypatch.setattr(sys.modules[__name__], "PKG", fake)
    _, private = _imports()
    assert private == [("user", "_hidden", "helper")]


def test_every_public_name_is_importable_documented_and_in_the_api_table():
    # The table of everything public was README's until README became a front page.
    text = (
        (README.parent / "docs" / "api" / "index.md").read_text().split("## At a glance\n", 1)[1].split("\n## ", 1)[0]
    )
    for name in vs.__all__:
        if name == "__version__":
            continue
        obj = getattr(vs, name)
        if inspect.isfunction(obj) or inspect.isclass(obj) or inspect.ismodule(obj):
            assert (obj.__doc__ or "").strip(), f"{name} has no docstring"
        assert f"`{name}" in text or f"vs.{name}" in text, f"docs/api/index.md's table does not mention {name}"
    assert sorted(vs.__all__) == sorted(set(vs.__all__))
    assert sorted(dir(vs)) == sorted(vs.__all__)


def test_returned_types_are_public():
    import jax
    import numpy as np

    def f(w, x):
        return (x @ w).sum()

    w, x = np.ones((3, 2), np.float32), np.ones((4, 3), np.float32)
    art = vs.export(f, w, x, platforms="cpu", weights="w")
    out, res = art.fwd(w, x)
    _, inter = art.bwd_input(res)
    fwd, _ = vs.split(f)
    _, res2 = fwd(w, x)
    for value in (
        art,
        art.manifest,
        art.manifest.inputs[0],
        res,
        res2,
        inter,
        vs.plan_policies(f, jax.ShapeDtypeStruct((3, 2), np.float32), jax.ShapeDtypeStruct((4, 3), np.float32))[0],
    ):
        assert getattr(vs, type(value).__name__) is type(value), type(value)


def test_public_modules_have_docstrings():
    for name in _modules():
        if name.split(".")[-1] == "__main__":  # importing it runs the CLI
            continue
        mod = importlib.import_module(f"vjpsplit_cli.{name}" if name else "vjpsplit_cli")
        assert (mod.__doc__ or "").strip(), f"module {name or 'vjpsplit_cli'} has no docstring"


# The subpackages are the architecture. Each may import only those before it in this order (and the
# top-level modules in BASE); docs/explanations/architecture.md draws the same picture.
LAYERS = ["safeio", "files", "tracing", "trust", "artifact", "pipeline", "cli"]
BASE = {"errors", "config", "terminal", "_version", "treetypes"}


def _layer_violations(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    rank = {name: i for i, name in enumerate(LAYERS)}
    bad = []
    for mod, deps in edges.items():
        top = mod.split(".")[0]
        if top in BASE:
            bad += [(mod, d) for d in deps if d.split(".")[0] not in BASE]
            continue
        if top not in rank:
            continue  # the package's own __init__ and __main__ sit above everything
        for d in deps:
            dtop = d.split(".")[0]
            if dtop in BASE or dtop == top:
                continue
            if dtop not in rank or rank[dtop] > rank[top]:
                bad.append((mod, d))
    return bad


def test_subpackages_import_only_the_layers_below_them():
    edges, _ = _imports()
    assert set(LAYERS) <= set(_modules()), "every layer is a subpackage"
    assert not _layer_violations(edges)


def test_the_layer_check_can_fail():
    edges, _ = _imports()
    edges["files.trees"].add("artifact.manifest")  # files reaching up into artifact
    edges["errors"].add("safeio.outputs")  # the base reaching into a subpackage
    assert _layer_violations(edges) == [("errors", "safeio.outputs"), ("files.trees", "artifact.manifest")] or set(
        _layer_violations(edges)
    ) == {("errors", "safeio.outputs"), ("files.trees", "artifact.manifest")}


def test_every_subpackage_says_what_it_owns():
    for name in LAYERS:
        doc = importlib.import_module(f"vjpsplit_cli.{name}").__doc__ or ""
        assert doc.strip(), name


def test_environment_variables_are_read_in_config_only():
    """Every ``os.environ``/``getenv`` read of a VJPSPLIT_ variable is in config.py, nowhere else."""
    offenders = []
    for name, path in _modules().items():
        if name == "config":
            continue
        text = path.read_text()
        if "VJPSPLIT_" in text and ("os.environ" in text or "getenv" in text):
            for line in text.splitlines():
                if ("environ" in line or "getenv" in line) and "VJPSPLIT_" in line:
                    offenders.append(f"{name}: {line.strip()}")
    assert not offenders, offenders


def test_architecture_doc_names_every_module():
    """docs/explanations/architecture.md's table lists every module of the package, so it cannot drift from the folders."""
    text = (README.parent / "docs" / "explanations" / "architecture.md").read_text()
    missing = [
        name
        for name in _modules()
        if name
        and name.split(".")[-1] != "__main__"
        and f"`{name.split('.')[-1]}`" not in text
        and f"`{name}/`" not in text  # a subpackage
        and f"`{name.split('.')[-1]}/`" not in text  # a layer inside a subpackage (`pipeline`'s `schedules/`)
    ]
    assert not missing, missing


# The pipeline's layers, in their dependency order: a module may import modules of its own layer and of the
# layers before it, never one after. Inside runtime, ray/ sits above the in-process modules; training's `runners`
# (`run`, which picks one) above both; `launch` (N local processes of a jax.distributed job) above all.
# docs/explanations/architecture.md draws the same picture.
PIPELINE_LAYERS = ["schedules", "stages", "runtime", "runtime.ray", "training", "launch"]


def _pipeline_layer(mod: str) -> int | None:
    """The rank of ``mod``'s layer (the longest layer prefix it falls under); None outside the layers."""
    if not mod.startswith("pipeline."):
        return None
    inner = mod[len("pipeline.") :]
    best = None
    for i, layer in enumerate(PIPELINE_LAYERS):
        if (inner == layer or inner.startswith(layer + ".")) and (
            best is None or len(layer) > len(PIPELINE_LAYERS[best])
        ):
            best = i
    return best


def _pipeline_layer_violations(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    bad = []
    for mod, deps in edges.items():
        rank = _pipeline_layer(mod)
        if rank is None:
            continue
        bad += [
            (mod, d) for d in deps if (_pipeline_layer(d) is not None and _pipeline_layer(d) > rank) or d == "pipeline"
        ]
    return sorted(bad)


def test_pipeline_layers_import_only_the_layers_before_them():
    edges, _ = _imports()
    modules = {m for m in _modules() if m.startswith("pipeline.")}
    assert all(_pipeline_layer(m) is not None for m in modules), "every pipeline module lives in a layer"
    assert not _pipeline_layer_violations(edges)


def test_the_pipeline_layer_check_can_fail():
    edges, _ = _imports()
    edges["pipeline.schedules.ops"].add("pipeline.runtime.worker")  # schedules reaching into the runtime
    edges["pipeline.runtime.inprocess"].add("pipeline.runtime.ray.pipeline")  # the in-process runner needing Ray
    edges["pipeline.stages.cut"].add("pipeline")  # a layer reaching up to the package's surface
    assert _pipeline_layer_violations(edges) == [
        ("pipeline.runtime.inprocess", "pipeline.runtime.ray.pipeline"),
        ("pipeline.schedules.ops", "pipeline.runtime.worker"),
        ("pipeline.stages.cut", "pipeline"),
    ]


def test_every_pipeline_layer_says_what_it_owns():
    for layer in ["pipeline", *(f"pipeline.{r}" for r in PIPELINE_LAYERS)]:
        doc = importlib.import_module(f"vjpsplit_cli.{layer}").__doc__ or ""
        assert doc.strip(), layer


def test_allowed_imports_live_in_this_table_only():
    """No module docstring restates what it may import: the tables above (``LAYERS``, ``PIPELINE_LAYERS``) hold it."""
    restating = [
        name
        for name, path in _modules().items()
        if "may import" in (ast.get_docstring(ast.parse(path.read_text())) or "").lower()
    ]
    assert not restating, restating


DOCSTRING_LINES = 20  # issue 71: a summary line and Args:/Returns:/Raises:; the docs pages hold the rest


def _public_docstrings() -> dict[str, str]:
    """Every docstring the API reference renders: the public names, their constructors and their public methods."""
    from vjpsplit_cli import pipeline as P

    out: dict[str, str] = {}
    names = [(f"vjpsplit_cli.{n}", getattr(vs, n)) for n in vs.__all__ if n not in ("__version__", "pipeline")]
    names += [(f"vjpsplit_cli.pipeline.{n}", getattr(P, n)) for n in P.__all__]
    for name, obj in names:
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        out[name] = inspect.getdoc(obj) or ""
        if inspect.isclass(obj):
            for attr, value in vars(obj).items():
                fn = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
                fn = fn.fget if isinstance(fn, property) else fn
                if (attr == "__init__" or not attr.startswith("_")) and inspect.isfunction(fn) and fn.__doc__:
                    out[f"{name}.{attr}"] = inspect.getdoc(fn) or ""
    return out


def test_public_docstrings_are_at_most_20_lines():
    """Each public docstring is a summary and its sections (tests/test_api_reference.py holds Args:/Returns:)."""
    long = {name: len(doc.splitlines()) for name, doc in _public_docstrings().items()}
    assert {name: n for name, n in long.items() if n > DOCSTRING_LINES} == {}
    assert "vjpsplit_cli.pipeline.Trainer.__init__" in long and "vjpsplit_cli.Manifest" in long  # the check reads them


def test_the_pipeline_surface_is_curated_and_documented():
    """``pipeline.__all__`` holds what users call, each documented; the runners' internals stay in their layers."""
    from vjpsplit_cli import pipeline as P

    for name in P.__all__:
        obj = getattr(P, name)
        if inspect.isfunction(obj) or inspect.isclass(obj):
            assert (obj.__doc__ or "").strip(), f"pipeline.{name} has no docstring"
    internal = {"run_op", "walk", "progress_bar", "StageActor", "stage_devices", "dependencies"}
    assert not internal & set(P.__all__)
    assert len(P.__all__) <= 30, "issue 71: the rest lives in its submodule"
    init = PKG / "pipeline" / "__init__.py"
    body = [n for n in ast.parse(init.read_text()).body if not isinstance(n, (ast.Import, ast.ImportFrom, ast.Expr))]
    kinds = [(type(n).__name__, getattr(n, "name", None)) for n in body]
    assert kinds == [("Assign", None)], kinds  # no logic of its own, and no old name kept: the export list


def test_the_package_warns_of_no_deprecation():
    """Issue 71: one spelling per concept, no old name kept behind a ``DeprecationWarning`` (jax's own deprecations,
    silenced around a jaxpr built by hand, are jax's)."""
    raised = []
    for path in PKG.rglob("*.py"):
        for line in path.read_text().splitlines():
            if "DeprecationWarning" in line and 'simplefilter("ignore", DeprecationWarning)' not in line:
                raised.append(f"{path.relative_to(PKG)}: {line.strip()}")
    assert raised == []


def _pipeline_names() -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """Module file names and public top-level function/class names in ``pipeline/``, each with where it is."""
    modules: dict[str, list[str]] = {}
    names: dict[str, list[str]] = {}
    for p in sorted((PKG / "pipeline").rglob("*.py")):
        where = str(p.relative_to(PKG / "pipeline"))
        if p.name != "__init__.py":
            modules.setdefault(p.stem, []).append(where)
        for n in ast.parse(p.read_text()).body:
            if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and not n.name.startswith("_"):
                names.setdefault(n.name, []).append(where)
    return modules, names


def test_no_module_or_public_name_repeats_in_pipeline():
    """Each name once, saying its job: two ``inprocess.py`` or two ``trace`` send a reader to the wrong file."""
    modules, names = _pipeline_names()
    assert {k: v for k, v in modules.items() if len(v) > 1} == {}
    assert {k: v for k, v in names.items() if len(v) > 1} == {}


def test_operations_say_what_they_are_and_nothing_asks_the_plans():
    """Issue 44: an Op's kind says whether it is a whole backward (B) or its input part (I). No code works
    that out from the rest of the plans (the former ``ops.split_ops``), and no ``split`` flag travels from
    the plans to the worker, the threads, the Ray lists or the compiled graph."""
    from vjpsplit_cli.pipeline.runtime import stageops, timed, untimed
    from vjpsplit_cli.pipeline.runtime.ray import actor, compiled, lists, pipeline
    from vjpsplit_cli.pipeline.schedules import ops

    assert not hasattr(ops, "split_ops")
    for path in PKG.rglob("*.py"):
        assert "split_ops" not in path.read_text(), f"{path.relative_to(PKG)} still asks the plans (split_ops)"
    takers = [
        stageops.run_op,
        timed.run_timed,
        untimed.dispatch,
        lists.run_list,
        lists.submit_lists,
        compiled.compile_step,
        actor.StageActor.op,
        actor.StageActor.run_step,
        pipeline.RayPipeline.start_step,
        pipeline.RayPipeline._graph,
    ]
    for fn in takers:
        assert "split" not in inspect.signature(fn).parameters, fn.__qualname__
    assert [k.value for k in ops.Kind] == ["F", "B", "I", "W"]  # torch's letters, one kind each


def _type_checking_imports_that_do_not_resolve() -> list[tuple[str, str, str]]:
    bad = []
    for name, path in _modules().items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)):
                continue
            for imp in (n for n in ast.walk(node) if isinstance(n, ast.ImportFrom)):
                target = "." * imp.level + (imp.module or "")
                try:
                    module = importlib.import_module(
                        target, f"vjpsplit_cli.{package}".rstrip(".") if imp.level else None
                    )
                except ImportError:
                    bad.append((name, target, "*"))
                    continue
                for alias in imp.names:
                    if not hasattr(module, alias.name):
                        try:
                            importlib.import_module(f"{module.__name__}.{alias.name}")
                        except ImportError:
                            bad.append((name, target, alias.name))
    return bad


def test_every_type_checking_import_resolves():
    """mypy's ``ignore_missing_imports`` reads a mistyped ``if TYPE_CHECKING:`` import as ``Any`` and passes."""
    assert _type_checking_imports_that_do_not_resolve() == []


def _split_bases(modules: dict[str, Path]) -> list[tuple[str, str]]:
    """``(base, subclass)`` for every class of the package whose one subclass is its only use: a base cut off a
    class to keep a module short (issue 71), not an abstraction of its own (never named but as that base)."""
    trees = {name: ast.parse(path.read_text()) for name, path in modules.items()}
    defined = {n.name for t in trees.values() for n in ast.walk(t) if isinstance(n, ast.ClassDef)}
    subclasses: dict[str, list[str]] = {}
    as_base: set[int] = set()  # the ast nodes that name a class as a base
    for t in trees.values():
        for n in ast.walk(t):
            if isinstance(n, ast.ClassDef):
                for b in n.bases:
                    name = b.id if isinstance(b, ast.Name) else getattr(b, "attr", None)
                    if name in defined:
                        subclasses.setdefault(name, []).append(n.name)
                        as_base.add(id(b))
    named = {
        n.id if isinstance(n, ast.Name) else n.attr
        for t in trees.values()
        for n in ast.walk(t)
        if isinstance(n, (ast.Name, ast.Attribute)) and id(n) not in as_base
    }
    return sorted((base, subs[0]) for base, subs in subclasses.items() if len(subs) == 1 and base not in named)


def test_no_class_is_split_into_bases():
    """Issue 71: one object, one module. A base with one subclass is named on its own somewhere (run alone, as
    ``StageActor`` is by ``RayPipeline``, or a type), else its methods belong in the subclass."""
    assert _split_bases(_modules()) == []


def test_the_split_base_check_can_fail(tmp_path):
    (tmp_path / "parts.py").write_text("class Measures:\n    pass\n")
    (tmp_path / "whole.py").write_text("from .parts import Measures\n\n\nclass Trainer(Measures):\n    pass\n")
    (tmp_path / "real.py").write_text("class Base:\n    pass\n\n\nclass Sub(Base):\n    pass\n\n\nmade = Base()\n")
    modules = {p.stem: p for p in tmp_path.glob("*.py")}
    assert _split_bases(modules) == [("Measures", "Trainer")]
