"""Imports inside engine/ point one way (STYLE.md: config/data/model at the bottom, parallel setup above them,
loops above that, bin/ on top). Read from each module's source, so deferred imports inside functions count too:
hiding a cycle in a function body does not remove it."""
from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parent.parent / "engine"


def engine_imports(path: Path, package: str = "engine") -> set[str]:
    """The engine modules that the module at `path` imports, anywhere in it: `from .x import y`, `from . import x`,
    `from engine.x import y`, `import engine.x`, at the top or inside a function."""
    modules = {p.stem for p in path.parent.glob("*.py")}
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level > 1:
                continue  # above the package: not engine's business
            base = node.module or ""
            if node.level == 1:
                base = f"{package}.{base}" if base else package
            # `from engine import x` / `from . import x` imports the module engine.x when there is one
            names = [base] + ([f"{base}.{a.name}" for a in node.names] if base == package else [])
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == package and len(parts) > 1 and parts[1] in modules:
                found.add(f"{package}.{parts[1]}")
    found.discard(f"{package}.{path.stem}")
    return found


def import_graph(root: Path = ENGINE) -> dict[str, set[str]]:
    return {f"engine.{f.stem}": engine_imports(f) for f in sorted(root.glob("*.py")) if f.stem != "__init__"}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path that ends where it starts (['engine.a', 'engine.b', 'engine.a']), or None."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" once every path from it is clean
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = "open"
        path.append(m)
        for dep in sorted(graph.get(m, ())):
            if state.get(dep) == "open":
                return path[path.index(dep):] + [dep]
            if dep not in state:
                found = visit(dep)
                if found:
                    return found
        path.pop()
        state[m] = "done"
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_the_walker_sees_every_kind_of_import(tmp_path):
    pkg = tmp_path / "engine"
    pkg.mkdir()
    for name in ("a", "b", "c", "d", "e", "f"):
        (pkg / f"{name}.py").write_text("")
    (pkg / "a.py").write_text("from .b import x\nimport os\n")
    (pkg / "b.py").write_text("def f():\n    from . import c\n")
    (pkg / "c.py").write_text("import engine.d\n")
    (pkg / "d.py").write_text("from engine.e import y\n")
    (pkg / "e.py").write_text("from engine import f as g\n")
    (pkg / "f.py").write_text("class K:\n    def m(self):\n        from .a import z\n")
    graph = import_graph(pkg)
    assert graph == {"engine.a": {"engine.b"}, "engine.b": {"engine.c"}, "engine.c": {"engine.d"},
                     "engine.d": {"engine.e"}, "engine.e": {"engine.f"}, "engine.f": {"engine.a"}}
    assert find_cycle(graph) == ["engine.a", "engine.b", "engine.c", "engine.d", "engine.e", "engine.f", "engine.a"]


def test_engine_imports_have_no_cycle():
    graph = import_graph()
    assert len(graph) > 10 and graph["engine.pretrain"], graph  # the walk found the modules and their imports
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle in engine/: " + " -> ".join(cycle)
