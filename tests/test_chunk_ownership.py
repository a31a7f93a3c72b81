"""Each field of the chunk manager is written by one of its modules (runtime/chunks/): the one that owns it. The parts
made objects (StepGrads, Gatherer, ...) own their fields by construction; this holds the mixins still over the
manager's fields, and the manager's construction, to it.

Read from the source with `ast` (nothing is imported): an assignment to `self.x` (or `self.x[...]`, augmented ones
too) or a mutating call (`self.x.add(...)`, `.pop`, ...) in a mixin's or the manager's methods writes `x`. Another
module reads `x` or asks its owner to change it (a method of the owner), never writes it.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

CHUNKS = Path(__file__).resolve().parent.parent / "protrain_fx" / "runtime" / "chunks"
MUTATORS = {
    "add",
    "update",
    "discard",
    "clear",
    "append",
    "remove",
    "pop",
    "popitem",
    "difference_update",
    "setdefault",
}
# no field is written by two modules: the plan's counts are the parts' (the persistent chunks' the storage's, the
# buffers' and the plan a pending manager waits for the placement's), each set by its own methods
SHARED: dict[str, set[str]] = {}


def _self_attr(node: ast.AST) -> str | None:
    """`x` of `self.x`, or of `self.x[...]`."""
    if isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return node.attr
    return None


def _written(cls: ast.ClassDef) -> set[str]:
    written = set()
    for node in ast.walk(cls):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = [
                t for target in node.targets for t in (target.elts if isinstance(target, ast.Tuple) else [target])
            ]
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            targets = [node.func.value]
        written.update(name for t in targets if (name := _self_attr(t)) is not None)
    return written


def writers() -> dict[str, set[str]]:
    """Field -> the modules of runtime/chunks whose mixins (or the manager's own methods) write it."""
    found: dict[str, set[str]] = defaultdict(set)
    for path in sorted(CHUNKS.glob("*.py")):
        for cls in ast.walk(ast.parse(path.read_text())):
            if isinstance(cls, ast.ClassDef) and (cls.name.endswith("Mixin") or cls.name == "ChunkManager"):
                for name in _written(cls):
                    found[name].add(path.name)
    return found


def test_the_reader_sees_every_kind_of_write():
    source = """
class AMixin:
    def f(self):
        self.a = 1
        self.b[0] = 2
        self.c += 3
        self.d.add(4)
        self.e, self.f = 5, 6
        self.g.x = 7  # (a field of what g holds: not g)
        self.h.copy_(8)  # (values, not the field)
"""
    assert _written(ast.parse(source).body[0]) == {"a", "b", "c", "d", "e", "f"}


def test_each_field_of_the_manager_is_written_by_one_module():
    found = writers()
    assert found, "no mixin found under runtime/chunks"
    shared = {name: modules for name, modules in found.items() if len(modules) > 1}
    assert shared == SHARED, {name: sorted(m) for name, m in shared.items()}
