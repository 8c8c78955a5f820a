"""Imports inside engine/ point one way (STYLE.md: config/data/model at the bottom, parallel setup above them,
loops above that, bin/ on top). Read from each module's source, so deferred imports inside functions count too:
hiding a cycle in a function body does not remove it."""
from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parent.parent / "engine"


def module_names(root: Path = ENGINE, package: str = "engine") -> dict[Path, str]:
    """Every module under `root` (packages too, engine/export/ as well as engine/x.py) -> its dotted name."""
    out = {}
    for f in sorted(root.rglob("*.py")):
        parts = [package, *f.relative_to(root).with_suffix("").parts]
        out[f] = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    return out


def engine_imports(path: Path, package: str = "engine", root: Path | None = None) -> set[str]:
    """The engine modules that the module at `path` imports, anywhere in it: `from .x import y`, `from . import x`,
    `from engine.x import y`, `import engine.x`, `from ..x import y` inside a subpackage, at the top or inside a
    function. An imported name counts as the longest engine module it names (`from .export.read import X`:
    engine.export.read)."""
    root = root or path.parent
    names_of = module_names(root, package)
    known = set(names_of.values())
    me = names_of[path]
    here = me.split(".") if path.name == "__init__.py" else me.split(".")[:-1]  # the package `from .` means
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level > len(here):
                continue  # above the package: not engine's business
            base = ".".join(here[:len(here) - node.level + 1]) if node.level else ""
            base = ".".join(p for p in (base, node.module or "") if p)
            names = [base] + [f"{base}.{a.name}" for a in node.names]  # `from engine import x` imports engine.x
        else:
            continue
        for name in names:
            parts = name.split(".")
            hits = [".".join(parts[:i]) for i in range(len(parts), 1, -1) if ".".join(parts[:i]) in known]
            if hits:
                found.add(hits[0])
    found.discard(me)
    return found


def import_graph(root: Path = ENGINE) -> dict[str, set[str]]:
    return {name: engine_imports(f, root=root) for f, name in module_names(root).items() if name != "engine"}


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


def test_export_reads_below_the_loops():
    """engine/export/ (checkpoint reading, bin/zero_to_fp32) never reaches the training loops: GRPO and pretraining
    import it, not the other way (STYLE.md), and its layouts sit beneath its one interface."""
    graph = import_graph()
    export = {m for m in graph if m == "engine.export" or m.startswith("engine.export.")}
    assert {"engine.export.zero3", "engine.export.zero12", "engine.export.pipeline"} <= export, sorted(graph)
    reached, todo = set(), list(export)
    while todo:
        for dep in graph.get(todo.pop(), ()):
            if dep not in reached:
                reached.add(dep)
                todo.append(dep)
    assert not reached & {"engine.grpo", "engine.pretrain", "engine.decoder", "engine.rollout"}, sorted(reached)
    # the layouts do not know the writer or the interface above them
    for layout in ("engine.export.zero3", "engine.export.zero12", "engine.export.pipeline", "engine.export.plan",
                   "engine.export.read"):
        assert not graph[layout] & {"engine.export", "engine.export.write"}, (layout, graph[layout])


def test_a_wheel_of_the_project_carries_the_whole_engine(tmp_path):
    """`pip install .` (not only `pip install -e .`) gives a working engine: the wheel setup.py builds holds every
    module under engine/, its subpackages, the bundled data and the recipes (find_packages needs engine/__init__.py;
    without it the wheel held the bin/ scripts and no engine at all)."""
    import shutil
    import subprocess
    import sys
    import zipfile

    root = ENGINE.parent
    src = tmp_path / "src"  # a copy: the build writes build/ and egg-info beside setup.py
    src.mkdir()
    for name in ("setup.py", "README.md"):
        shutil.copy(root / name, src / name)
    for name in ("engine", "bin"):
        shutil.copytree(root / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp_path / "wheel")], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    names = set(zipfile.ZipFile(next((tmp_path / "wheel").glob("*.whl"))).namelist())
    want = {f.relative_to(root).as_posix() for f in ENGINE.rglob("*")
            if f.is_file() and "__pycache__" not in f.parts
            and (f.suffix == ".py" or f.parent.name in ("recipes", "tokenizer") or f.parent.name == "assets")}
    assert want and not want - names, sorted(want - names)[:10]
