"""The house's floor plan (docs/architecture.md, "Floor plan"), read from the code: every import of every module of
the project's packages (an AST walk, imports inside functions included) goes to the same package or to a package on
a lower floor, and no two modules import each other, directly or round a longer circle."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from importlib import import_module
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# The allowed order, lowest floor first; a package may import its own modules and the packages of lower floors,
# never a package of its own floor or a higher one.
FLOORS: list[tuple[str, ...]] = [
    ("protos", "kernels"),  # the gRPC stubs; the kernels with their references (torch, Triton)
    ("spyglass",),  # the core library: models, attention, drafters, engine, context cache, client SDK
    ("services", "actors"),  # Ray Serve deployments; Ray actors and Ray Train jobs
    ("cli",),  # the command line, which composes all of them
]
# Entry points live in another package's directory but stand on the floor of what they start (nothing imports them).
ENTRY_POINTS = {"spyglass.__main__": "cli"}

FLOOR_OF = {pkg: i for i, floor in enumerate(FLOORS) for pkg in floor}


def project_modules(repo: Path = REPO) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the packages in FLOORS (a package is its __init__)."""
    modules = {}
    for pkg in FLOOR_OF:
        for path in sorted((repo / pkg).rglob("*.py")):
            parts = list(path.relative_to(repo).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int, bool]]:
    """(imported project module, line, type-checking only) for every import statement in the file, at any depth."""

    def resolve(name: str) -> str | None:  # the longest project module the dotted name starts with
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    is_package = path.name == "__init__.py"
    found = []

    def visit(node: ast.AST, typing_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            names: list[str] = []
            if isinstance(child, ast.Import):
                names = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    package = module.split(".") if is_package else module.split(".")[:-1]
                    package = package[: len(package) - (child.level - 1)]
                    base = ".".join(package + ([child.module] if child.module else []))
                # `from a import b` imports the module a.b when there is one, else a name of a.
                names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in child.names]
            for name in names:
                target = resolve(name)
                if target is not None and target != module and (target, child.lineno, typing_only) not in found:
                    found.append((target, child.lineno, typing_only))
            visit(child, typing_only or (isinstance(child, ast.If) and _type_checking_only(child)))

    visit(ast.parse(path.read_text(), filename=str(path)), False)
    return found


def floor(module: str) -> int:
    return FLOOR_OF[ENTRY_POINTS.get(module, module.split(".")[0])]


def package(module: str) -> str:
    return ENTRY_POINTS.get(module, module.split(".")[0])


def layering_violations(modules: dict[str, Path], repo: Path = REPO) -> list[str]:
    bad = []
    for module, path in modules.items():
        for target, line, _ in imports_of(module, path, modules):
            if package(target) != package(module) and floor(target) >= floor(module):
                where = "the same floor" if floor(target) == floor(module) else "a higher floor"
                bad.append(f"{path.relative_to(repo)}:{line}: {module} imports {target}, on {where}")
    return bad


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the project modules it imports when it runs (type-checking-only imports never run)."""
    return {
        module: {target for target, _, typing_only in imports_of(module, path, modules) if not typing_only}
        for module, path in modules.items()
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def test_every_package_is_on_a_floor():
    dirs = {p.parent.name for p in REPO.glob("*/__init__.py")} - {"tests", "bench"}
    assert dirs <= set(FLOOR_OF), f"packages on no floor: {sorted(dirs - set(FLOOR_OF))}"
    assert set(ENTRY_POINTS) <= set(project_modules())


def test_imports_only_go_down():
    assert layering_violations(project_modules()) == []


def test_no_module_imports_itself_round_a_circle():
    found = cycles(import_graph(project_modules()))
    assert found == [], "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def test_both_entry_points_run_the_top_floor_command_line():
    """`spyglass` (pyproject.toml's console script) and `python -m spyglass` start the same `main`, in cli/."""
    script = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]["spyglass"]
    module_name, _, attr = script.partition(":")
    assert package(module_name) == "cli"
    main = getattr(import_module(module_name), attr)
    assert import_module("spyglass.__main__").main is main
    proc = subprocess.run(
        [sys.executable, "-m", "spyglass", "--help"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and proc.stdout.startswith("usage: spyglass "), proc.stderr


def test_the_checks_catch_what_they_guard(tmp_path):
    """The walk on a small house of its own: an upward lazy import, a same-floor import, a relative import that
    closes a circle, a type-checking-only import (no circle), and an entry point on the top floor."""
    files = {
        "kernels/__init__.py": "",
        "kernels/k.py": "def f():\n    from spyglass import core  # lazy, and upward\n",
        "protos/__init__.py": "",
        "protos/p.py": "import kernels.k\n",
        "spyglass/__init__.py": "",
        "spyglass/core.py": "from .engine import run\n",
        "spyglass/engine.py": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from spyglass.typed import T\n"
            "def run():\n    from . import core\n"
        ),
        "spyglass/typed.py": "import spyglass.engine\n",
        "spyglass/__main__.py": "from cli.main import main\n",
        "cli/__init__.py": "",
        "cli/main.py": "import services.app\nimport spyglass.core\n",
        "services/__init__.py": "",
        "services/app.py": "from spyglass.engine import run\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    modules = project_modules(tmp_path)
    assert sorted(layering_violations(modules, tmp_path)) == [
        "kernels/k.py:2: kernels.k imports spyglass.core, on a higher floor",
        "protos/p.py:1: protos.p imports kernels.k, on the same floor",
    ]
    assert cycles(import_graph(modules)) == [["spyglass.core", "spyglass.engine"]]
