"""dtree's modules import one another in one direction: no import cycle between its
files, counting every import (module level, inside a function, and the annotation-only
ones under ``TYPE_CHECKING``): a cycle that only type checkers see still ties two
modules into one."""

from __future__ import annotations

import ast
import pathlib

import dtree

ROOT = pathlib.Path(dtree.__file__).parent


def _module_file(module: str) -> pathlib.Path | None:
    path = ROOT.parent.joinpath(*module.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def _imports(path: pathlib.Path) -> set[pathlib.Path]:
    """The dtree files ``path`` imports anywhere in its body; ``from pkg import name``
    points at ``pkg/name.py`` when that is a module, else at ``pkg``."""
    package = list(path.relative_to(ROOT.parent).parent.parts)
    found: set[pathlib.Path] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            targets = [_module_file(f"{module}.{a.name}") or _module_file(module) for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [_module_file(a.name) for a in node.names]
        else:
            continue
        found.update(t for t in targets if t is not None and t != path)
    return found


def _cycles(graph: dict[pathlib.Path, set[pathlib.Path]]) -> list[list[str]]:
    """The strongly connected components of more than one file (Tarjan)."""
    index: dict = {}
    low: dict = {}
    stack: list = []
    out: list[list[str]] = []

    def visit(v) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(str(w.relative_to(ROOT.parent)))
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_import_graph_reads_imports():
    """The graph sees what the code imports (else the test below could not fail)."""
    graph = {p: _imports(p) for p in ROOT.rglob("*.py")}
    assert ROOT / "losses" / "reduction.py" in graph[ROOT / "losses" / "token_loss.py"]
    assert ROOT / "models" / "layer_list.py" in graph[ROOT / "models" / "checkpointing.py"]
    assert _cycles({ROOT / "a.py": {ROOT / "b.py"}, ROOT / "b.py": {ROOT / "a.py"}}) == [["dtree/a.py", "dtree/b.py"]]


def test_no_import_cycle():
    graph = {p: _imports(p) for p in ROOT.rglob("*.py")}
    assert _cycles(graph) == [], "import cycles between these dtree files (break them with a lower module)"


def _package(path: pathlib.Path) -> str:
    """The top-level part of dtree a file belongs to: ``engine``, ``plan``, ``ops``, ... or
    the root module's name (``config``)."""
    parts = path.relative_to(ROOT).parts
    return parts[0] if len(parts) > 1 else path.stem


def test_packages_stand_in_floors():
    """The packages (README's architecture) import one another in one direction too: no
    cycle between dtree/engine, plan, stacks, losses, forest, ops, models, device, ... (a
    package's own __init__ re-exports are inside it; dtree/__init__.py is the top)."""
    graph: dict[pathlib.Path, set[pathlib.Path]] = {}
    for path in ROOT.rglob("*.py"):
        if path.parent == ROOT and path.name in ("__init__.py", "__main__.py"):
            continue
        for target in _imports(path):
            if target.parent == ROOT and target.name == "__init__.py":
                continue
            a, b = _package(path), _package(target)
            if a != b:
                graph.setdefault(ROOT / a, set()).add(ROOT / b)
    assert ROOT / "plan" in graph[ROOT / "engine"] and ROOT / "stacks" in graph[ROOT / "plan"]
    assert _cycles(graph) == [], "import cycles between these dtree packages (move the shared piece lower)"


MAX_FILE_LINES = 450
MAX_FUNCTION_LINES = 80


def _is_kernel(node: ast.FunctionDef) -> bool:
    """A Triton kernel body (``@triton.jit``): kernels are exempt from the function size."""
    return any("jit" in ast.unparse(d) for d in node.decorator_list)


def test_files_and_functions_stay_small():
    """No file of dtree/ over 450 lines and no function over 80, Triton kernel bodies aside:
    a reader takes in one room, or one function, at a time."""
    too_long = []
    for path in sorted(ROOT.rglob("*.py")):
        text = path.read_text()
        if text.count("\n") > MAX_FILE_LINES:
            too_long.append(f"{path.relative_to(ROOT.parent)}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_kernel(node):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    too_long.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} {node.name}: {lines} lines")
    assert not too_long, too_long
