"""Functions stay small: none in the package is over MAX_LINES lines, docstring included (read with `ast`, nothing
imported). A function that grows past it is split where its steps part."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "protrain_fx"
MAX_LINES = 80


def long_functions(source: str, max_lines: int = MAX_LINES) -> list[tuple[str, int]]:
    """(name, lines) of every function or method in `source` over `max_lines` lines."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            if lines > max_lines:
                found.append((node.name, lines))
    return found


def test_the_count_sees_methods_and_nested_functions():
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_LINES))
    source = f"class A:\n    def f(self):\n{body}\n\n\ndef g():\n    def h():\n        pass\n"
    assert long_functions(source) == [("f", MAX_LINES + 1)]
    assert long_functions(source, max_lines=MAX_LINES + 1) == []


def test_no_function_is_over_the_limit():
    over = {
        f"{path.relative_to(PACKAGE.parent)}:{name}": lines
        for path in sorted(PACKAGE.rglob("*.py"))
        for name, lines in long_functions(path.read_text())
    }
    assert not over, f"functions over {MAX_LINES} lines: {over}"
