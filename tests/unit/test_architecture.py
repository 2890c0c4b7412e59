"""The layout's rules, checked on the source (every import, lazy ones included):

* ``launcher/node/`` and ``pscontract/`` import only the standard library, the contract and the
  node package: they run on nodes where nothing else is installed;
* the trainer imports nothing of the launcher but the contract;
* the layers import downwards only: cli -> ui -> run -> backends, trackers -> runtime/transport -> spec;
  ``launcher.external`` (external commands) is below them all but ``launcher.errors`` (and
  imports nothing else of the launcher), though the spec, pure builders, runs no command;
  node and pscontract import nothing of them, and ``launcher.logs`` (the lowest floor, with
  pscontract) nothing of the launcher; no backend imports another (but the bases);
* no module of the launcher, nor of the trainer, imports another one in a cycle;
* only the backends name a backend in a comparison (everything else asks the backend's class);
* only ``launcher/node/__init__.py`` works out where the node programs are on disk.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Iterator, Optional

import pytest
from support.helpers import REPO

from launcher import backends

STDLIB = set(sys.stdlib_module_names)


def modules(package: str) -> dict[str, Path]:
    """``{"launcher.node.agent": path}`` for every module of ``package``."""
    root = REPO / package.replace(".", "/")
    out = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(REPO).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        out[".".join(parts)] = path
    return out


def imports(name: str, path: Path) -> Iterator[tuple[str, int]]:
    """Every module ``name`` imports, absolute (relative imports resolved), with its line."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if node.module is None or node.level:
                for a in node.names:  # "from . import x" may name a submodule
                    yield f"{target}.{a.name}", node.lineno
            yield target, node.lineno


ALL = {**modules("launcher"), **modules("pscontract"), **modules("trainer")}


def resolve(target: str) -> Optional[str]:
    """The project module ``target`` is (or is inside of), or None for anything else."""
    while target:
        if target in ALL:
            return target
        target = target.rpartition(".")[0]
    return None


def project_imports(name: str) -> set[str]:
    return {m for t, _ in imports(name, ALL[name]) if (m := resolve(t)) is not None and m != name}


# --- what may run on a node ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", [n for n in ALL if n.startswith(("launcher.node", "pscontract"))])
def test_node_programs_and_the_contract_import_only_the_standard_library(name: str) -> None:
    allowed_project = ("launcher.node", "pscontract", "launcher")  # ("launcher": its tiny __init__)
    for target, line in imports(name, ALL[name]):
        top = target.split(".")[0]
        if top in STDLIB or top == "__future__":
            continue
        if name == "launcher.node.mpirank" and top == "mpi4py":
            continue  # the user's MPI, imported only when mpirun gave no rank
        m = resolve(target)
        assert m is not None and m.startswith(allowed_project) and m in ("launcher",) + tuple(
            n for n in ALL if n.startswith(("launcher.node", "pscontract"))), f"{name}:{line} imports {target}"


def test_the_trainer_imports_only_the_contract_of_pslaunch() -> None:
    for name in (n for n in ALL if n.startswith("trainer")):
        for target, line in imports(name, ALL[name]):
            assert not target.startswith("launcher"), f"{name}:{line} imports {target}"


# --- layers ---------------------------------------------------------------------------------------


LAYERS = {  # a module of the key may not import a module of any value
    "launcher.spec": ("launcher.cli", "launcher.run", "launcher.ui", "launcher.backends", "launcher.runtime",
                      "launcher.transport", "launcher.trackers", "launcher.external",
                      "launcher.node.agent", "launcher.node.ssh_wrapper", "launcher.node.mpirank",
                      "launcher.node.task"),
    "launcher.runtime": ("launcher.cli", "launcher.run", "launcher.ui", "launcher.backends", "launcher.transport",
                         "launcher.trackers"),
    "launcher.transport": ("launcher.cli", "launcher.run", "launcher.ui", "launcher.backends", "launcher.runtime",
                           "launcher.trackers"),
    "launcher.backends": ("launcher.cli", "launcher.run", "launcher.ui", "launcher.trackers"),
    "launcher.trackers": ("launcher.cli", "launcher.run", "launcher.ui", "launcher.backends", "launcher.transport"),
    "launcher.ui": ("launcher.cli",),
    "launcher.run": ("launcher.cli", "launcher.ui"),
    "launcher.node": ("launcher.cli", "launcher.run", "launcher.ui", "launcher.backends", "launcher.runtime",
                      "launcher.transport", "launcher.trackers", "launcher.spec", "launcher.errors",
                      "launcher.external", "launcher.logs"),
    "launcher.external": ("launcher.cli", "launcher.run", "launcher.ui", "launcher.backends", "launcher.runtime",
                          "launcher.transport", "launcher.trackers", "launcher.spec", "launcher.node"),
    "pscontract": ("launcher",),
    "launcher.logs": ("launcher.cli", "launcher.run", "launcher.ui", "launcher.backends", "launcher.runtime",
                      "launcher.transport", "launcher.trackers", "launcher.spec", "launcher.node", "launcher.errors"),
}


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_layers_import_downwards_only(layer: str) -> None:
    for name in (n for n in ALL if n == layer or n.startswith(layer + ".")):
        for m in project_imports(name):
            bad = [f for f in LAYERS[layer] if m == f or m.startswith(f + ".")]
            assert not bad, f"{name} imports {m}"


def test_no_backend_imports_another() -> None:
    shared = {"launcher.backends", "launcher.backends.base", "launcher.backends.batch"}
    for name in (n for n in ALL if n.startswith("launcher.backends.") and n not in shared):
        mine = name.split(".")[2]
        for m in project_imports(name):
            if m.startswith("launcher.backends.") and m not in shared:
                assert m.split(".")[2] == mine, f"{name} imports {m}"


@pytest.mark.parametrize("project", [("launcher", "pscontract"), ("trainer",)], ids=["launcher", "trainer"])
def test_no_import_cycles(project: tuple[str, ...]) -> None:
    graph = {n: project_imports(n) for n in ALL if n.startswith(project)}
    # a package's __init__ is imported with any of its modules: an import of the package by its
    # own module is no cycle unless the __init__ imports that module back
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(n: str) -> None:
        state[n] = 1
        path.append(n)
        for m in graph.get(n, ()):
            if state.get(m) == 1:
                cycle = path[path.index(m):] + [m]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if m not in state:
                visit(m)
        path.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n)


# --- backend names and paths -----------------------------------------------------------------------


def _strings(node: ast.AST) -> Iterator[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        yield node.value
    elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        for e in node.elts:
            yield from _strings(e)


def test_only_the_backends_compare_backend_names() -> None:
    names = set(backends.available())
    for name, path in ALL.items():
        # (the node programs know no backend: "sge" there is the name of an index source)
        if name.startswith(("launcher.backends", "launcher.node")) or not name.startswith("launcher"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Compare):
                found = [s for part in (node.left, *node.comparators) for s in _strings(part) if s in names]
                assert not found, f"{name}:{node.lineno} compares with backend name(s) {found}: ask the backend's class"


def test_only_the_node_package_knows_where_node_programs_are() -> None:
    for name, path in ALL.items():
        if name in ("launcher.node", "launcher.node.ssh_loader") or not name.startswith("launcher"):
            continue
        text = path.read_text(encoding="utf-8")
        assert "__file__" not in text, f"{name} locates files by its own path: use launcher.node.path/source/bundle"


# --- frameworks ------------------------------------------------------------------------------------


FRAMEWORKS = ("torch", "xgboost", "mxnet", "tensorflow")
#: run as files with the user's Python (launcher.node.tracker_command): the only ones that may
TRACKER_CHILDREN = {"launcher.trackers.xgboost_child": "xgboost", "launcher.trackers.torch_store": "torch"}


def test_the_launcher_never_imports_a_framework() -> None:
    for name in (n for n in ALL if n.startswith("launcher")):
        for target, line in imports(name, ALL[name]):
            top = target.split(".")[0]
            if top in FRAMEWORKS:
                assert TRACKER_CHILDREN.get(name) == top, f"{name}:{line} imports {target}"


@pytest.mark.parametrize("name", sorted(TRACKER_CHILDREN))
def test_the_tracker_children_import_nothing_of_pslaunch(name: str) -> None:
    for target, line in imports(name, ALL[name]):
        top = target.split(".")[0]
        assert top in STDLIB or top == "__future__" or top == TRACKER_CHILDREN[name], f"{name}:{line} imports {target}"
