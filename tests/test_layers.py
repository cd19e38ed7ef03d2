"""Packages import only downward, and no files import each other in a loop.

:data:`LAYERS` is the package structure, bottom first (docs/design.md, "Layers"): a module may import its own
package and the packages of lower layers, never a package of its own layer or a higher one.  Every import counts,
also one inside a function or under ``TYPE_CHECKING``: each is a dependency a reader must follow.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

#: Bottom first.  ``mpifl`` is the package's face (its version); ``algorithms.core`` is the machinery the methods
#: (``algorithms``) stand on.
LAYERS = (
    ("mpifl", "errors"),
    ("dirlock",),
    ("process",),
    ("data", "models"),
    ("transport",),
    ("plan",),
    ("algorithms.core",),
    ("algorithms",),
    ("privacy",),
    ("session", "rundir", "presets"),
    ("client", "server"),
    ("job",),
    ("run", "report", "analysis", "bench"),
)


def module_of(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit_of(module: str) -> str:
    """The layered unit a module belongs to: ``mpifl.algorithms.core.base`` -> ``algorithms.core``."""
    parts = module.split(".")[1:]
    if not parts:
        return "mpifl"
    if parts[:2] == ["algorithms", "core"]:
        return "algorithms.core"
    return parts[0]


def imports(root: Path) -> dict[str, list[tuple[str, int]]]:
    """Every module of ``root/mpifl`` and the project modules it imports, with the line."""
    found = {}
    for path in sorted((root / "mpifl").rglob("*.py")):
        module = module_of(path, root)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets = []
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets += [(a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "mpifl"]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if target.split(".")[0] != "mpifl":
                    continue
                for alias in node.names:  # `from package import module` depends on the module
                    sub = f"{target}.{alias.name}"
                    is_module = (root / Path(*sub.split("."))).with_suffix(".py").is_file() or \
                        (root / Path(*sub.split("."))).is_dir()
                    targets.append((sub if is_module else target, node.lineno))
        found[module] = targets
    return found


def upward_imports(graph: dict[str, list[tuple[str, int]]], layers=LAYERS) -> list[str]:
    level = {unit: i for i, layer in enumerate(layers) for unit in layer}
    wrong = []
    for module, targets in graph.items():
        here = unit_of(module)
        assert here in level, f"{module}: package {here} has no layer; add it to LAYERS"
        for target, line in sorted(set(targets)):
            there = unit_of(target)
            if there != here and level[there] >= level[here]:
                kind = "a package of the same layer" if level[there] == level[here] else "a higher layer"
                wrong.append(f"{module} (line {line}) imports {target}, {kind} ({here} is on layer {level[here]}, "
                             f"{there} on {level[there]})")
    return wrong


def cycles(graph: dict[str, list[tuple[str, int]]]) -> list[list[str]]:
    """Modules that import each other in a loop (strongly connected components of more than one module, or a
    module importing itself), by Tarjan's algorithm."""
    edges = {m: sorted({t for t, _ in targets if t in graph and t != m} | ({m} if any(t == m for t, _ in targets)
                                                                              else set()))
             for m, targets in graph.items()}
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in edges[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in edges[node]:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_every_package_imports_only_downward():
    wrong = upward_imports(imports(REPO))
    assert not wrong, "upward or sideways imports (move the shared piece down to a lower layer):\n" + "\n".join(wrong)


def test_no_files_import_each_other_in_a_loop():
    loops = cycles(imports(REPO))
    assert not loops, f"import cycles: {loops}"


def test_the_check_finds_an_upward_import_a_sideways_one_and_a_cycle(tmp_path):
    """The checks above on a small tree with each fault: they are not checks that cannot fail."""
    for name, text in {"mpifl/__init__.py": "", "mpifl/errors.py": "",
                       "mpifl/plan/__init__.py": "", "mpifl/plan/config.py": "from ..client.host import Host\n",
                       "mpifl/client/__init__.py": "", "mpifl/client/host.py": "from . import data\n",
                       "mpifl/client/data.py": "def f():\n    from .host import Host\n",
                       "mpifl/server/__init__.py": "", "mpifl/server/serve.py": "from mpifl.client import host\n"
                       }.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = imports(tmp_path)
    wrong = upward_imports(graph)
    assert len(wrong) == 2
    assert wrong[0].startswith("mpifl.plan.config (line 1) imports mpifl.client.host, a higher layer")
    assert wrong[1].startswith("mpifl.server.serve (line 1) imports mpifl.client.host, a package of the same layer")
    assert cycles(graph) == [["mpifl.client.data", "mpifl.client.host"]]
