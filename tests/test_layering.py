"""The package's imports point one way: capture → profiler → planner → passes → runtime → backend.

Read from the source with `ast` (nothing is imported), every import counts: at the top, inside functions and
under TYPE_CHECKING, absolute or relative. Besides the stages:
- shared modules (config.py, distributed.py, real_tensors.py, host.py, host_queue.py, progress.py, shapes.py) hold what several
  stages read; they reach no stage above the planner. config.py checks the forced plan fields with
  planner/plan.py, and distributed.py names the chunk layout as a type: so a profiler module that reads the
  cache directory from config.py reaches the plan's records, and no code that plans;
- debug/ sits between the runtime and the backend: the backend writes its dumps with debug/dump.py, and
  debug/from_dump.py plans a dumped graph again with the planner (and reads runtime/monitor.py's report);
- the public modules (__init__.py, explain.py, metrics.py, amp.py, optim.py) sit on top; explain.py compiles with
  the backend in explain mode, so it imports backend/ as __init__.py does.
The passes insert the runtime's custom ops (`torch.ops.protrain.*`, registered by runtime/ops.py) by name and
call the objects the backend hands them in the PassContext (the ChunkManager, the SwapSpace): neither is an
import, and the passes import nothing of runtime/.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "protrain_fx"
STAGES = ("capture", "profiler", "planner", "passes", "runtime", "debug", "backend")
SHARED = ("config", "distributed", "real_tensors", "host", "host_queue", "progress", "shapes")
PUBLIC = ("", "explain", "metrics", "amp", "optim")  # "": the package's __init__.py
LOWER = ("capture", "profiler", "planner")  # never reach runtime/, passes/, backend/ or debug/


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
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names if f"{target}.{alias.name}" in known)
    return {m for m in found if m == "protrain_fx" or m.startswith("protrain_fx.")}


def import_graph() -> dict[str, set[str]]:
    found = modules()
    known = set(found)
    return {
        name: imported(path.read_text(), name, path.name == "__init__.py", known) - {name}
        for name, path in found.items()
    }


def place(module: str) -> str:
    """The stage, "shared" or "public" a module belongs to."""
    rest = module.removeprefix("protrain_fx").removeprefix(".")
    top = rest.split(".")[0]
    if top in STAGES:
        return top
    if top in SHARED:
        return "shared"
    assert top in PUBLIC, f"{module} belongs to no stage: add it to STAGES, SHARED or PUBLIC"
    return "public"


def entries(graph: dict[str, set[str]], start: str, forbidden: tuple[str, ...]) -> list[str]:
    """Each chain of imports by which `start` first reaches a module placed in `forbidden`, directly or through
    other modules (one chain a module)."""
    chains, todo, found = {start: [start]}, [start], []
    while todo:
        here = todo.pop()
        for there in sorted(graph.get(here, ())):
            if there in chains:
                continue
            chains[there] = [*chains[here], there]
            if place(there) in forbidden:
                found.append(" -> ".join(chains[there]))
            else:
                todo.append(there)
    return found


def test_the_parser_sees_every_kind_of_import():
    known = {"protrain_fx.runtime", "protrain_fx.runtime.ops", "protrain_fx.backend", "protrain_fx.planner.plan"}
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
        "protrain_fx.runtime",
        "protrain_fx.runtime.ops",
        "protrain_fx.planner.plan",
        "protrain_fx.profiler",
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


def test_stages_import_only_their_own_and_earlier_ones():
    wrong = [
        f"{name} imports {other}"
        for name, imports in import_graph().items()
        if place(name) in STAGES
        for other in sorted(imports)
        if place(other) in STAGES and STAGES.index(place(other)) > STAGES.index(place(name))
    ]
    assert not wrong, "imports against the flow:\n" + "\n".join(wrong)


def test_capture_profiler_and_planner_never_reach_runtime_passes_backend_or_debug():
    graph = import_graph()
    above = ("runtime", "passes", "backend", "debug")
    wrong = [chain for name in graph if place(name) in (*LOWER, "shared") for chain in entries(graph, name, above)]
    assert not wrong, "lower layers reaching higher ones:\n" + "\n".join(wrong)


def test_passes_import_nothing_of_the_runtime_or_the_backend():
    graph = import_graph()
    wrong = [
        chain
        for name in graph
        if place(name) == "passes"
        for chain in entries(graph, name, ("runtime", "backend", "debug"))
    ]
    assert not wrong, "passes reaching the runtime or the backend:\n" + "\n".join(wrong)


def test_only_the_public_modules_import_the_backend():
    importers = {
        name
        for name, imports in import_graph().items()
        if place(name) != "backend" and any(place(other) == "backend" for other in imports)
    }
    assert importers <= {"protrain_fx", "protrain_fx.explain"}, importers
