"""The package's import graph: layers that import only downward, no cycles, no hidden imports.

Walks every module of ``batchmax_tp`` with ``ast`` (nothing is imported) and collects the package modules each
one imports at run time (imports under ``if TYPE_CHECKING:`` only name types and are left out). Layers, lowest
first; a module may import its own layer and the ones below:

    embedded  <  core/  <  parallel  <  parted  <  models  <  plan/  <  config/  <  eval/  <  bench/  <  harness
    <  job  <  cli  (<  __init__)

``embedded`` holds only the embedded model's name (``config`` and ``models`` share it without importing each other);
``parted`` fetches and checks the models for accuracy (and names the cache root ``models`` uses);
``bench/`` holds the benchmark libraries of ``launch/bench_*.py``.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "batchmax_tp"
ROOT = PACKAGE.parent
LAYERS = [
    "embedded",
    "core",
    "parallel",
    "parted",
    "models",
    "plan",
    "config",
    "api",
    "eval",
    "bench",
    "harness",
    "job",
    "cli",
    "__init__",
]
#: The deferred imports the package allows (module, function): the CLI loads the job (torch, transformers) only
#: once a configuration is valid, and the package's ``__getattr__`` the torch-bound part of the public API.
DEFERRED = {("batchmax_tp.cli", "main"), ("batchmax_tp", "__getattr__")}


def _name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> list[str]:
    """The package modules an ``from X import a, b`` names (``a`` may itself be a module)."""
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - node.level + 1]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if not target.startswith("batchmax_tp"):
        return []
    out = []
    for alias in node.names:
        sub = f"{target}.{alias.name}"
        out.append(sub if sub in MODULES else target)
    return out


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def _scan(path: Path) -> tuple[set[str], list[str], list[str]]:
    """(package modules imported at run time, deferred imports as 'function: module', importlib uses)."""
    module, is_package = _name(path), path.name == "__init__.py"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    imports: set[str] = set()
    deferred: list[str] = []
    importlib_uses: list[str] = []

    def visit(node: ast.AST, function: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                continue
            name = function
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = child.name if function is None else function
            targets: list[str] = []
            if isinstance(child, ast.ImportFrom):
                targets = _resolve(module, is_package, child)
            elif isinstance(child, ast.Import):
                targets = [a.name for a in child.names if a.name.startswith("batchmax_tp")]
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                if any(a.name == "importlib" or a.name.startswith("importlib.") for a in child.names) or (
                    isinstance(child, ast.ImportFrom) and (child.module or "").startswith("importlib")
                ):
                    importlib_uses.append(f"{module}: line {child.lineno}")
                imports.update(targets)
                if function is not None and targets:
                    deferred.append(f"{function}: {', '.join(targets)}")
            visit(child, name)

    visit(tree, None)
    return imports - {module}, deferred, importlib_uses


MODULES = {_name(p) for p in PACKAGE.rglob("*.py")}
SCANS = {_name(p): _scan(p) for p in PACKAGE.rglob("*.py")}


def _layer(module: str) -> int:
    parts = module.split(".")
    key = "__init__" if len(parts) == 1 else parts[1]
    return LAYERS.index(key)


def test_every_module_has_a_layer():
    assert {m.split(".")[1] if "." in m else "__init__" for m in MODULES} <= set(LAYERS)


def test_imports_only_go_down():
    upward = [
        f"{m} imports {t}" for m, (imports, _, _) in SCANS.items() for t in sorted(imports) if _layer(t) > _layer(m)
    ]
    assert upward == []


def test_core_imports_nothing_else_from_the_package():
    outside = [
        f"{m} imports {t}"
        for m, (imports, _, _) in SCANS.items()
        if m.startswith("batchmax_tp.core")
        for t in sorted(imports)
        if not t.startswith("batchmax_tp.core")
    ]
    assert outside == []


def test_the_attention_sits_below_the_hf_drop_in_and_the_engine():
    """The engine's attention imports only what a pass needs (the description, the pool and its storage helpers, the
    probe, snap and workspace arithmetic): the HF drop-in (``hf_cache``) is on top of it, as are the pass loop and the
    engine."""
    lower = ("method", "rules", "schedule", "step", "slots", "bounded", "probe", "snap", "workspace")
    below = {f"batchmax_tp.core.{m}" for m in lower}
    assert SCANS["batchmax_tp.core.attention"][0] <= below, SCANS["batchmax_tp.core.attention"][0] - below
    assert "batchmax_tp.core.attention" in SCANS["batchmax_tp.core.hf_cache"][0]


def test_no_import_cycle():
    graph = {m: {t for t in imports if t in MODULES} for m, (imports, _, _) in SCANS.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def walk(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(path[path.index(nxt) :] + [nxt]) if nxt in path else f"{node} -> {nxt}")
            elif nxt not in state:
                walk(nxt, [*path, nxt])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            walk(module, [module])
    assert cycles == []


def test_no_deferred_imports_and_no_importlib_indirection():
    deferred = [f"{m}.{d}" for m, (_, found, _) in SCANS.items() for d in found if (m, d.split(":")[0]) not in DEFERRED]
    assert deferred == []
    assert [
        use for _, (_, _, uses) in SCANS.items() for use in uses if not use.startswith("batchmax_tp.models:")
    ] == []  # models finds the embedded package's files


def test_the_walker_sees_what_it_must_refuse(tmp_path):
    """The checks above can fail: an upward import, a cycle and a deferred import written into scratch modules
    are each found."""
    global MODULES
    fake = tmp_path / "batchmax_tp"
    (fake / "core").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "core" / "__init__.py").write_text("")
    (fake / "core" / "a.py").write_text("from ..config import X\nfrom . import b\n")
    (fake / "core" / "b.py").write_text("from .a import Y\n\ndef f():\n    from . import a\n")
    (fake / "config.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .job import J\n")
    saved = (PACKAGE, MODULES)
    try:
        globals()["PACKAGE"] = fake
        MODULES = {_name(p) for p in fake.rglob("*.py")}
        scans = {_name(p): _scan(p) for p in fake.rglob("*.py")}
    finally:
        globals()["PACKAGE"], MODULES = saved
    assert scans["batchmax_tp.core.a"][0] == {"batchmax_tp.config", "batchmax_tp.core.b"}
    assert scans["batchmax_tp.core.b"][0] == {"batchmax_tp.core.a"} and scans["batchmax_tp.core.b"][1] == [
        "f: batchmax_tp.core.a"
    ]
    assert scans["batchmax_tp.config"][0] == set()  # a TYPE_CHECKING import is not a run-time import


@pytest.mark.parametrize(
    "module, heavy",
    [
        ("batchmax_tp.config", ("torch", "transformers")),
        ("batchmax_tp.plan.planner", ("torch", "transformers")),
        ("batchmax_tp", ("torch", "transformers")),
        # (the package's __init__ brings the public API, plan/ included; nothing above plan/ is loaded)
        (
            "batchmax_tp.core.engine",
            ("batchmax_tp.eval", "batchmax_tp.config", "batchmax_tp.models", "batchmax_tp.job"),
        ),
    ],
)
def test_cheap_imports_stay_cheap(module, heavy):
    """Validation and planning import no torch (a configuration error is reported before it loads); core loads
    nothing from the layers above it."""
    child = [sys.executable, os.path.join(os.path.dirname(__file__), "loaded.py"), module, *heavy]
    out = subprocess.run(child, capture_output=True, text=True, check=True).stdout.strip()
    assert out == ""


def test_every_name_the_docs_give_exists():
    """Every `batchmax_tp.<module>[.<attribute>]` the README and docs/ name resolves (no stale names after a
    rename or a removal)."""
    import importlib
    import re

    names = set()
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        names |= set(re.findall(r"`(batchmax_tp(?:\.\w+)+)", path.read_text(encoding="utf-8")))
    missing = []
    for name in sorted(names):
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):  # the longest importable module, then attributes
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            try:
                for attr in parts[cut:]:
                    obj = getattr(obj, attr)
            except AttributeError:
                missing.append(name)
            break
        else:
            missing.append(name)
    assert names and not missing, missing


def test_the_public_api_gives_each_name_from_its_module():
    """``from batchmax_tp import Engine, Request, Sampling, ...``: every name of ``__all__`` resolves, to the object
    its module defines (the torch-bound ones on first use); an unknown name raises AttributeError."""
    import batchmax_tp
    from batchmax_tp.api import run_prompts
    from batchmax_tp.bench import padded
    from batchmax_tp.core import engine, hf_cache, requests

    want = {
        "Engine": engine.Engine,
        "generate": padded.generate,
        "BatchMaxCache": hf_cache.BatchMaxCache,
        "Batching": requests.Batching,
        "Record": requests.Record,
        "Request": requests.Request,
        "Sampling": requests.Sampling,
        "run_prompts": run_prompts,
        "Method": batchmax_tp.core.method.Method,
        "plan": batchmax_tp.plan,
    }
    assert sorted(batchmax_tp.__all__) == sorted(want)
    assert all(getattr(batchmax_tp, name) is obj for name, obj in want.items())
    with pytest.raises(AttributeError, match="no attribute 'Pool'"):
        batchmax_tp.Pool  # noqa: B018
