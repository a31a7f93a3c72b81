"""The package's imports point one way, along the flow: capture → profiler → planner → passes → runtime → backend.

Read from the source with `ast` (nothing is imported), every import counts: at the top, inside functions and
under TYPE_CHECKING, absolute or relative. Every module has one place in PLACES and imports only from its own
place or earlier ones, with no exception:

    shared    what several stages read (SHARED: distributed.py, host.py, cache_dir.py, ...); no stage
    capture, profiler, planner
    options   config.py: ProTrainConfig, whose forced plan fields planner/plan.py checks; the passes, the runtime
              and the backend read it
    passes, runtime
    debug     the backend's dumps (debug/dump.py), a dumped graph planned again (debug/from_dump.py)
    backend
    public    __init__.py, explain.py (which compiles with the backend in explain mode), metrics.py, amp.py, optim.py,
              whatif.py (a profile planned for another machine)

The passes insert the runtime's custom ops (`torch.ops.protrain.*`, registered by runtime/ops.py) by name and
call the objects the backend hands them in the PassContext (the ChunkManager, the SwapSpace): neither is an
import, and the passes import nothing of the runtime. A package's modules never import the package itself: its
`__init__.py` is built from them.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "protrain_fx"
PLACES = ("shared", "capture", "profiler", "planner", "options", "passes", "runtime", "debug", "backend", "public")
SHARED = ("cache_dir", "distributed", "real_tensors", "host", "host_queue", "progress", "shapes")
OPTIONS = ("config",)
PUBLIC = ("", "explain", "metrics", "amp", "optim", "whatif")  # "": the package's __init__.py


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported(source: str, name: str, is_package: bool, known: set[str]) -> set[str]:
    """The protrain_fx modules that module `name` (a package's __init__ where `is_package`) imports anywhere in
    `source`; `from a import b` counts a.b where that is a module of `known`, else a."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            found.update(f"{target}.{a.name}" if f"{target}.{a.name}" in known else target for a in node.names)
    return {m for m in found if m == "protrain_fx" or m.startswith("protrain_fx.")}


def import_graph() -> dict[str, set[str]]:
    found = modules()
    known = set(found)
    return {
        name: imported(path.read_text(), name, path.name == "__init__.py", known) - {name}
        for name, path in found.items()
    }


def place(module: str) -> str:
    """Where a module sits in PLACES."""
    rest = module.removeprefix("protrain_fx").removeprefix(".")
    top = rest.split(".")[0]
    if top in OPTIONS:
        return "options"
    if top in PLACES:
        return top
    if top in SHARED:
        return "shared"
    assert top in PUBLIC, f"{module} has no place: add it to PLACES, SHARED, OPTIONS or PUBLIC"
    return "public"


def test_the_parser_sees_every_kind_of_import():
    known = {"protrain_fx.runtime", "protrain_fx.runtime.ops", "protrain_fx.backend", "protrain_fx.planner.plan"}
    known |= {"protrain_fx.profiler.chunking"}
    source = (
        "import torch\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from ..backend import GraphRecord\n"
        "def f():\n    from ..runtime import ops\n    import protrain_fx.planner.plan\n"
        "from . import chunking\n"
    )
    got = imported(source, "protrain_fx.profiler.mod", False, known)
    assert got == {
        "protrain_fx.backend",
        "protrain_fx.runtime.ops",
        "protrain_fx.planner.plan",
        "protrain_fx.profiler.chunking",
    }
    assert imported("from .chunks import ChunkManager\n", "protrain_fx.runtime", True, set()) == {
        "protrain_fx.runtime.chunks"
    }
    graph = import_graph()
    assert "protrain_fx.planner.inputs" in graph["protrain_fx.backend.planning"]
    assert "protrain_fx.runtime.ops" in graph["protrain_fx.runtime.chunks"]  # (`from protrain_fx.runtime import ops`)


def test_every_module_has_a_place():
    for name in modules():
        place(name)


def test_imports_follow_the_flow():
    order = {p: i for i, p in enumerate(PLACES)}
    wrong = [
        f"{name} ({place(name)}) imports {other} ({place(other)})"
        for name, imports in import_graph().items()
        for other in sorted(imports)
        if order[place(other)] > order[place(name)]
    ]
    assert not wrong, "imports against the flow:\n" + "\n".join(wrong)


def test_no_module_imports_its_own_package():
    found = modules()
    wrong = [
        f"{name} imports {other}"
        for name, imports in import_graph().items()
        if found[name].name != "__init__.py"
        for other in sorted(imports)
        if name.startswith(other + ".")
    ]
    assert not wrong, "a package's modules importing the package they make up:\n" + "\n".join(wrong)
