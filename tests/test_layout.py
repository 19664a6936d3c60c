"""The shape of the code, read from its imports with ``ast``: no import loop, ``prep/`` never imports
``train/``, and an import inside a function only for an optional or deliberately deferred dependency,
with its reason written beside it (issue 10)."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO_ROOT

PACKAGES = ("prep", "train")


def modules() -> dict[str, Path]:
    """Every module of the product by dotted name: prep.*, train.* and cli."""
    found = {"cli": REPO_ROOT / "cli.py"}
    for package in PACKAGES:
        for path in sorted((REPO_ROOT / package).glob("*.py")):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            found[name] = path
    return found


def imported_names(node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    return [base, *(f"{base}.{alias.name}" for alias in node.names)]


def project_imports(tree: ast.AST, known: set[str]) -> set[str]:
    """Project modules a module imports anywhere (module level, TYPE_CHECKING blocks and functions alike)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            out |= {name for name in imported_names(node) if name in known}
    return out


def function_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Imports that run inside a function body (where import ties hide)."""
    found = []
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            found += [n for n in ast.walk(fn) if isinstance(n, ast.Import | ast.ImportFrom)]
    return list({id(n): n for n in found}.values())


def has_reason(lines: list[str], node: ast.stmt) -> bool:
    """A comment on the import's own line, or above the block of imports it belongs to."""
    if "#" in lines[node.lineno - 1]:
        return True
    row = node.lineno - 2
    while row >= 0 and lines[row].strip().startswith(("import ", "from ")):
        if "#" in lines[row]:
            return True
        row -= 1
    return row >= 0 and lines[row].strip().startswith("#")


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: project_imports(ast.parse(path.read_text()), set(mods)) - {name} for name, path in mods.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every import loop, each as the path that closes it (depth-first search)."""
    found, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                found.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    return found


def test_the_import_graph_has_no_loop():
    loops = cycles(graph())
    assert not loops, "import loops: " + "; ".join(" → ".join(loop) for loop in loops)


def test_prep_never_imports_train():
    wrong = {name: sorted(t for t in targets if t.startswith("train")) for name, targets in graph().items()
             if name.startswith("prep")}
    assert not {k: v for k, v in wrong.items() if v}, f"prep/ imports train/: {wrong}"


def test_imports_inside_functions_say_why():
    """Only optional dependencies and heavy imports deferred on purpose, each with a one-line reason;
    never a project module outside the CLI (that is how import loops hide)."""
    unexplained, hidden_ties = [], []
    for name, path in modules().items():
        source = path.read_text()
        lines = source.splitlines()
        for node in function_imports(ast.parse(source)):
            where = f"{path.relative_to(REPO_ROOT)}:{node.lineno}"
            if not has_reason(lines, node):
                unexplained.append(where)
            if name != "cli" and any(n.split(".")[0] in PACKAGES for n in imported_names(node)):
                hidden_ties.append(where)
    assert not hidden_ties, f"project modules imported inside functions: {hidden_ties}"
    assert not unexplained, f"imports inside functions without a reason comment: {unexplained}"


def test_the_checker_finds_what_it_looks_for():
    """The helpers above catch a loop and an unexplained function-level import (they would pass vacuously else)."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    source = "def f():\n    import json\n    # optional\n    import yaml\n    import zlib  # deferred\n"
    tree = ast.parse(source)
    lines = source.splitlines()
    assert [has_reason(lines, n) for n in function_imports(tree)] == [False, True, True]
