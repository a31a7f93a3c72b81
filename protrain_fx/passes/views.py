"""Views in ATen graphs: which nodes only view another's storage, and whose storage that is. The passes that
follow a parameter or a saved tensor through its views use these (chunks.py, activations.py)."""

from __future__ import annotations

import operator
from typing import cast

from torch import fx


def is_view(node: fx.Node) -> bool:
    """A view op, or an item of a view op's tuple (`split`, `unbind`): it reads nothing, what consumes it does."""
    if node.target is operator.getitem:
        return isinstance(node.args[0], fx.Node) and is_view(node.args[0])
    return getattr(node.target, "is_view", False) and isinstance(node.args[0], fx.Node)


def view_base(node: fx.Node) -> fx.Node:
    """The node whose storage `node` views (itself when it is no view)."""
    while is_view(node):
        node = cast(fx.Node, node.args[0])  # (a view's first argument is a node: `is_view`)
    return node
