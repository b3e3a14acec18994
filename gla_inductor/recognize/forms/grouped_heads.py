"""Grouped heads: q and k with fewer heads than v, repeated over the heads in the user's code,
which the op reads shared instead ([B, T, G, K], head h reads h // (H // G)).

In a chunked computation the q and k leaves repeat tensors over the heads (Mamba2's C and B
shared by groups of heads): ``shared_qk`` finds the tensors (``certify.spec.SharedLeaf``). In a
parallel form the analyzer already reads through the repeat: q and k are indexed by one part of
a head axis that the output splits in two (``head_letters``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..certify.spec import SharedLeaf, Spec
from ..core.algebra import Factor, comps, factor_vars
from ..certify.subgraph import flat_args, is_constant_pad
from ..core.analyzer import Analyzer
from ..core.consts import example_value
from ..core.emit import LFactor
from ..core.match import Reject
from ..core.op_names import op_name


def shared_qk(an: Analyzer, spec: Spec, anchor: fx.Node) -> Optional[dict]:
    """{"q": SharedLeaf, "k": SharedLeaf} when both leaves repeat tensors over the heads alike, and
    nothing writes into those tensors before the op reads them (at `anchor`); else None."""
    found = {r: _shared(getattr(spec, r)) for r in ("q", "k")}
    if any(s is None for s in found.values()) or found["q"].repeats != found["k"].repeats:
        return None
    for s in found.values():
        if any(an.written_between(n, an.order[n] + 1, an.order[anchor]) for n in (s.x, *s.steps)):
            return None
    return found


def _shared(lf: LFactor) -> Optional[SharedLeaf]:
    if lf.select or lf.unflatten or lf.letters.count("h") != 1:
        return None
    axis, node, steps = lf.letters.index("h"), lf.node, []
    while True:
        if _repeat_args(node)[1] == 1:  # x.repeat_interleave(1) is x: nothing to redo
            node = node.args[0]
        elif _per_head(node, axis):
            steps.append(node)
            node = node.args[0]
        else:
            break
    found = _repeat_of(node, axis)
    if found is None:
        return None
    x, squeeze, repeats = found
    return SharedLeaf(x, squeeze, tuple(reversed(steps)), repeats)


_CASTS = {"to", "float", "double", "half", "bfloat16", "contiguous", "clone"}


def _per_head(n: fx.Node, axis: int) -> bool:
    """Whether n maps its first input alike on every index of `axis` (so it commutes with a repeat
    over it): a cast or copy, or a constant pad that leaves that axis alone."""
    if not (n.args and isinstance(n.args[0], fx.Node)) or any(isinstance(a, fx.Node) for a in flat_args(
            list(n.args[1:]) + list(n.kwargs.values()))):
        return False
    if n.op == "call_method":
        return n.target in _CASTS
    if n.op != "call_function" or n.target not in (F.pad, torch._C._nn.pad) or not is_constant_pad(n):
        return False
    pads, val = n.args[1] if len(n.args) > 1 else n.kwargs.get("pad"), example_value(n)
    if not isinstance(val, torch.Tensor):
        return False
    j = val.dim() - 1 - axis  # F.pad lists the last axis first
    return isinstance(pads, (list, tuple)) and all(p == 0 for p in pads[2 * j : 2 * j + 2])


def _repeat_of(n: fx.Node, axis: int) -> Optional[tuple]:
    """(x, squeeze, r) where n is x repeated r > 1 times over `axis`, each head r times in a row."""
    out = example_value(n)
    if not isinstance(out, torch.Tensor):
        return None
    if op_name(n) == "repeat_interleave":
        x, r, dim = _repeat_args(n)
        if not (r > 1 and type(dim) is int and isinstance(example_value(x), torch.Tensor)) or dim % out.dim() != axis:
            return None
        want = out.shape[:axis] + (out.shape[axis] // r,) + out.shape[axis + 1 :]
        return (x, None, r) if tuple(example_value(x).shape) == tuple(want) else None
    return _expand_merge(n, axis)


def _repeat_args(n: fx.Node) -> tuple:
    """(x, repeats, dim) of x.repeat_interleave(repeats, dim), repeats 0 unless a Python int; else
    (None, 0, None)."""
    if op_name(n) != "repeat_interleave" or not n.args or not isinstance(n.args[0], fx.Node):
        return None, 0, None
    r = n.args[1] if len(n.args) > 1 else n.kwargs.get("repeats")
    dim = n.args[2] if len(n.args) > 2 else n.kwargs.get("dim")
    return n.args[0], r if type(r) is int else 0, dim


def _expand_merge(n: fx.Node, axis: int) -> Optional[tuple]:
    """(y, axis + 1, r) where n is y [.., G, 1, ..] expanded to [.., G, r, ..] and reshaped to
    [.., G * r, ..]: the reshape merges exactly those two axes, so head h is y's h // r."""
    if op_name(n) != "reshape" or not isinstance(n.args[0], fx.Node):
        return None
    m = n.args[0]
    while op_name(m) == "identity" and m.args and isinstance(m.args[0], fx.Node):
        m = m.args[0]
    if op_name(m) != "expand" or not m.args or not isinstance(m.args[0], fx.Node):
        return None
    if not all(isinstance(example_value(x), torch.Tensor) for x in (n, m, m.args[0])):
        return None
    y, out = m.args[0], tuple(example_value(n).shape)
    ys, es = tuple(example_value(y).shape), tuple(example_value(m).shape)
    r = es[axis + 1] if len(es) == len(ys) == len(out) + 1 else 0
    merged = es[:axis] + (es[axis] * r,) + es[axis + 2 :] == out
    if not (merged and r > 1 and ys[axis + 1] == 1 and ys[:axis + 1] + ys[axis + 2 :] == es[:axis + 1] + es[axis + 2 :]):
        return None
    return y, axis + 1, r


# ---- grouped heads in a parallel form ------------------------------------------------------------
@dataclass(frozen=True)
class Heads:
    """How the op's head axis is made of the user's.

    `order`: "" where the heads are one axis (letter "h"); else the sub-letters of the two parts
    of the user's head axis in the op's order, outer first ("AB": the user's order, "BA": the
    parts swapped so that the part q and k are indexed by is the outer one). `qk`: the op's
    letters of q and k ("bt" + that part + "k" where they are grouped, else "bthk")."""

    order: str = ""
    qk: str = "bthk"

    def splits(self) -> dict:
        return {"h": self.order} if self.order else {}

    def op_axes(self, letters: str):
        """An op output's axes (`letters`, as the op holds them) for ``Emitter.relayout``: its head
        axis as the parts in the op's order."""
        return [self.order if c == "h" else c for c in letters] if self.order else letters


def head_letters(entries: list, q: Factor, k: Factor) -> tuple[dict, Heads]:
    """({batch var: letter}, Heads) of a parallel form's batch axes (`entries`, the output's axes
    other than time and value, in order; an entry of several variables is an axis the code merged).

    One or two variables: batch and heads (one is read as the heads, B = 1, so that a constant gate
    per head fits). Three, or two of one axis that q and k have one of: the batch (if any) and a
    head axis of two parts, outer then inner (the analyzer read through `repeat_interleave` or
    expand + reshape of q and k, whose heads are then the outer part, or through `repeat`, the
    inner part). Where q and k are indexed by the same one part, the op reads them grouped with
    that part as its outer head axis: for `repeat` (head h of H = R * G reads h % G) v, the gate,
    the states and the output are read with the parts swapped, so that op head h' = g * R + r
    reads q's h' // R = g."""
    entries = [e for e in entries if e is not None and comps(e)]  # (a size-1 axis has no variable)
    batch = [x for e in entries for x in comps(e)]
    parts = [factor_vars(f) & set(batch[-2:]) for f in (q, k)]
    one_part = parts[0] == parts[1] and len(parts[0]) == 1
    if len(batch) <= 1 or len(batch) == 2 and not (len(entries) == 1 and one_part):
        return {x: "bh"[n + 2 - len(batch)] for n, x in enumerate(batch)}, Heads()
    if len(batch) > 3:
        raise Reject(f"{len(batch)} batch axes; at most 2 (batch, head) are supported, or 3 where the "
                     "heads are split in two parts (grouped q and k)")
    outer, inner = batch[-2:]
    letter = {outer: "A", inner: "B", **({batch[0]: "b"} if len(batch) == 3 else {})}
    if one_part:
        return letter, Heads("AB", "btAk") if parts[0] == {outer} else Heads("BA", "btBk")
    return letter, Heads("AB", "bthk")
