"""Cleaning up after a rewrite: the nodes it left without users."""

from __future__ import annotations

import torch.fx as fx

from .consts import is_inplace
from .op_names import op_name


def dead_code_elimination(graph: fx.Graph) -> None:
    """Drop unused pure nodes. fx's own DCE treats every call_method as pure, which would
    drop a user's in-place `cache.copy_(...)`; here in-place ops are always kept."""
    for node in reversed(list(graph.nodes)):
        if node.users or node.op not in ("call_function", "call_method") or is_inplace(node):
            continue
        if node.op == "call_function" and op_name(node) is None and node.is_impure():
            continue
        graph.erase_node(node)
