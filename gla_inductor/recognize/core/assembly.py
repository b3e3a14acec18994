"""Outputs assembled over time: a stack or cat of per-step values, or a buffer filled one
time step at a time (``o[:, t] = o_t``). The time loops and the chunk loops read their outputs
from these."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.fx as fx

from .algebra import axis_size, rank_of, unit_slice
from .analyzer import Analyzer


@dataclass
class Assembly:
    kind: str  # "stack" | "cat" | "setitem" | "read" (a single step's read itself)
    result: fx.Node  # stack/cat node, or the buffer for setitem
    elements: list  # value nodes, in assembly order (time positions)
    dim: int  # the time axis of the result
    positions: list = field(default_factory=list)  # setitem: the time index of each element
    setitems: list = field(default_factory=list)
    # setitem through a one-step slice, `o[:, :, t:t + 1] = o_t`: the slot keeps the time axis
    keeps_time: bool = False


def find_outputs(an: Analyzer) -> list[Assembly]:
    """Stacks, cats, and buffers filled by `buf[..., t, ...] = value` along one axis, of values
    not written in place since they were computed (the elements are read as their nodes)."""
    if "outputs" not in an.memo:
        an.memo["outputs"] = _find_outputs(an)
    return an.memo["outputs"]


def _find_outputs(an: Analyzer) -> list[Assembly]:
    found = []
    buffers: dict = {}
    for n in an.graph.nodes:
        if n.op == "call_function" and n.target in (torch.stack, torch.cat) and n.args:
            elems = n.args[0]
            if isinstance(elems, (list, tuple)) and all(isinstance(e, fx.Node) and _fresh(an, n, e) for e in elems):
                dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)
                rank = rank_of(n)
                kind = "stack" if n.target is torch.stack else "cat"
                found.append(Assembly(kind, n, list(elems), dim % rank))
        elif n.op == "call_function" and n.target is operator.setitem:
            buf, index, value = n.args
            axis_pos = _time_index(buf, index)
            if axis_pos is None or not isinstance(value, fx.Node) or not _fresh(an, n, value):
                buffers.setdefault(buf, []).append(None)
                continue
            buffers.setdefault(buf, []).append((n, axis_pos, value))
    for buf, writes in buffers.items():
        if None in writes or not writes:
            continue
        axes = {(a, keeps) for _, (a, _, keeps), _ in writes}
        if len(axes) != 1:
            continue
        a, keeps = axes.pop()
        asm = Assembly("setitem", buf, [w[2] for w in writes], a, keeps_time=keeps)
        asm.positions = [w[1][1] for w in writes]
        asm.setitems = [w[0] for w in writes]
        found.append(asm)
    return found


def _fresh(an: Analyzer, consumer: fx.Node, x: fx.Node) -> bool:
    return an.versions.get((consumer, x), x) is x


def _time_index(buf, index) -> Optional[tuple]:
    """(axis, t, keeps_time) for an index that is full slices except on one axis, where it
    is an integer t (keeps_time False) or a one-step slice t:t + 1 (keeps_time True)."""
    if not isinstance(buf, fx.Node):
        return None
    rank = rank_of(buf)
    if not isinstance(index, tuple):
        index = (index,)
    if Ellipsis in index:
        i = index.index(Ellipsis)
        index = index[:i] + (slice(None),) * (rank - len(index) + 1) + index[i + 1 :]
    index = index + (slice(None),) * (rank - len(index))
    if len(index) != rank:
        return None
    picks = []
    for a, i in enumerate(index):
        if isinstance(i, int) and not isinstance(i, bool):
            size = axis_size(buf, a)
            picks.append((a, i % size if isinstance(size, int) else i, False))
        elif not isinstance(i, slice):
            return None
        elif i != slice(None):
            t = unit_slice(i, axis_size(buf, a))
            if t is None or t == "full":
                return None
            picks.append((a, t, True))
    return picks[0] if len(picks) == 1 else None
