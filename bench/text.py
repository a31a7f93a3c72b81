"""Real text to train on without downloads: the docstrings of the Python standard library and of the installed
packages (transformers, torch), byte-level tokens (ids 0-255, within any vocabulary)."""

from __future__ import annotations

import ast
import importlib
import logging
import sysconfig
from pathlib import Path

import torch

log = logging.getLogger(__name__)

PACKAGES = ("transformers", "torch")  # besides the standard library


def corpus(max_bytes: int) -> bytes:
    """English prose: the module, class and function docstrings of the sources, in sorted file order, UTF-8,
    up to `max_bytes`."""
    roots = [Path(sysconfig.get_paths()["stdlib"])]
    for name in PACKAGES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        roots.append(Path(module.__file__).parent)
    parts, size = [], 0
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            for doc in _docstrings(path):
                parts.append(doc.encode())
                size += len(parts[-1]) + 2
            if size >= max_bytes:
                break
        if size >= max_bytes:
            break
    log.info("text corpus: %.1f MiB of docstrings from %s", size / 2**20, ", ".join(str(r) for r in roots))
    return b"\n\n".join(parts)[:max_bytes]


def _docstrings(path: Path) -> list[str]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
        return []
    nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)))]
    docs = (ast.get_docstring(n) for n in nodes)
    return [d for d in docs if d and len(d) > 80]  # prose, not one-liners


def text_batches(seq: int, batch: int, n: int, device: torch.device, seed: int) -> list[torch.Tensor]:
    """`n` batches of (batch, seq) byte tokens: windows of the corpus (twice the bytes needed), in an order
    shuffled by `seed` (the same for every system), each window used once."""
    data = torch.frombuffer(bytearray(corpus(2 * batch * n * seq)), dtype=torch.uint8).long()
    windows = data[: data.numel() // seq * seq].view(-1, seq)
    if windows.shape[0] < batch * n:
        raise ValueError(f"the corpus has {windows.shape[0]} windows of {seq} bytes; {batch * n} are needed")
    order = torch.randperm(windows.shape[0], generator=torch.Generator().manual_seed(seed))[: batch * n]
    return [windows[order[i * batch : (i + 1) * batch]].to(device) for i in range(n)]
