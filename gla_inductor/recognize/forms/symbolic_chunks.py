"""Chunked code compiled with symbolic sizes (``torch.compile(dynamic=True)``), and why the
chunked form leaves it alone.

The chunked form is proven by a float64 certificate that runs the user's subgraph at its sizes
(``certify/certificate.py``): it proves the rewrite at those sizes, not at every size. Under
``dynamic=True`` one graph serves every size its guards admit, so a certificate at the example's
sizes proves nothing about the next call's; specializing the sizes instead would add guards, and
recompile per size where Dynamo would not. So a symbolic size is a near miss, said precisely:

- a chunk loop (``for s in range(0, T, C)``): Dynamo specializes T, so the number of chunks is
  static; the batch, head and feature sizes stay symbolic;
- loop-free chunked code (``x.reshape(B, -1, C, ...)``, cumulative chunk states): the number of
  chunks is symbolic as well, and the normal form does not split a symbolic time axis into
  chunks, so no intra-chunk term is read at all: the reshape that cuts time into chunks is
  reported.

What is rewritten under ``dynamic=True`` all the same: the parallel form's reading, which is
proven by algebra at any size (each chunk's attention with the state entering it read as an
initial state), where it applies. Compiled with static sizes (the default first compile, or
``torch._dynamo.mark_static``), the chunked form is rewritten whole.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx

from ..core.analyzer import Analyzer
from ..core.consts import example_value
from ..core.match import NearMiss, Reject
from ..core.op_names import op_name

ROLE_NAMES = {"b": "B", "h": "H", "k": "K", "v": "V", "c": "the number of chunks", "i": "the chunk length"}

SYMBOLIC_TIME = ("the code cuts a time axis of symbolic length (dynamic=True) into chunks of {chunk}: the chunked "
                 "form is certified in float64 at the sizes it runs at, which would not cover the next call's "
                 "number of chunks, and specializing it would recompile per length; left alone (compile with static "
                 "sizes, or torch._dynamo.mark_static on the time axis, to have it rewritten)")


def symbolic_reason(names: list) -> str:
    """The near miss of a chunked candidate whose roles have symbolic sizes."""
    return (f"the chunked form has symbolic sizes ({', '.join(names)}; dynamic=True): its float64 certificate "
            "proves the rewrite at the sizes it runs at, not at every size one graph serves, and specializing "
            "them would recompile where Dynamo does not; left alone (static sizes, or torch._dynamo.mark_static "
            "on those axes, have it rewritten)")


def check_static(an: Analyzer, variables: dict) -> None:
    """Reject, naming them, where any of the roles' sizes (role -> index variable) is symbolic."""
    names = [ROLE_NAMES.get(role, role) for role, x in variables.items()
             if x is not None and not isinstance(an.sizes[x], int)]
    if names:
        raise Reject(symbolic_reason(names))


def time_cuts(an: Analyzer) -> list:
    """Near misses for reshapes that cut a symbolic axis into a symbolic count of chunks of C,
    where the graph also builds a C x C relation of positions (a mask, a segment sum): loop-free
    chunked code under dynamic=True. One per chunk size."""
    relations = _position_squares(an)
    found: dict = {}
    for n in an.nodes:
        chunk = _cut(n)
        if chunk is not None and chunk in relations:
            found.setdefault(chunk, []).append(n)
    # with everything computed from the chunks: where another form rewrites that computation
    # (the parallel form, chunk by chunk), the near miss is covered and dropped
    return [NearMiss("chunked", SYMBOLIC_TIME.format(chunk=chunk), _downstream(nodes))
            for chunk, nodes in found.items()]


def _downstream(nodes: list) -> list:
    seen, stack = dict.fromkeys(nodes), list(nodes)
    while stack:
        for u in stack.pop().users:
            if u not in seen and u.op != "output":
                seen[u] = None
                stack.append(u)
    return list(seen)


def _position_squares(an: Analyzer) -> set:
    """Sizes C (at their hints) of the [..., C, C] values that position ops build."""
    res = set()
    for n in an.nodes:
        if n.op not in ("call_function", "call_method"):
            continue
        val = example_value(n)
        if op_name(n) in _RELATIONS or getattr(n.target, "__name__", n.target) in _RELATIONS:
            if isinstance(val, torch.Tensor) and val.dim() >= 2:
                rows, cols = (_hint(x) for x in val.shape[-2:])
                if rows is not None and rows == cols and rows >= 2:
                    res.add(rows)
    return res


_RELATIONS = {"tril", "triu", "masked_fill", "where", "ones", "full"}


def _cut(n: fx.Node) -> Optional[int]:
    """C (at its hint) where n reshapes a float tensor's symbolic axis into a symbolic count and
    an axis of C >= 2 (Dynamo writes C as an expression of the length where T // C is symbolic)."""
    if op_name(n) != "reshape" or not n.all_input_nodes:
        return None
    src, out = example_value(n.all_input_nodes[0]), example_value(n)
    if not (isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor)) or not src.is_floating_point():
        return None
    shape = list(out.shape)
    for a in range(len(shape) - 1):
        chunk = _hint(shape[a + 1])
        if not isinstance(shape[a], int) and chunk is not None and chunk >= 2 and _splits(src, shape, a):
            return chunk
    return None


def _hint(x) -> Optional[int]:
    """A size's value for this example, read without adding a guard; None where it has none (a
    size that depends on data)."""
    if isinstance(x, int):
        return x
    hint = getattr(x.node, "hint", None)
    return int(hint) if hint is not None else None


def _splits(src: torch.Tensor, shape: list, a: int) -> bool:
    """The reshape splits src's symbolic axis `a` into shape[a], shape[a + 1] and keeps every other
    axis as it is (rather than merging or moving axes)."""
    have = list(src.shape)
    if len(have) != len(shape) - 1 or isinstance(have[a], int) or _same(have[a], shape[a]):
        return False
    rest = zip(have[:a] + have[a + 1:], shape[:a] + shape[a + 2:])
    return all(_same(x, y) for x, y in rest)


def _same(x, y) -> bool:
    """Equal sizes, compared without a guard: ints by value, symbolic ones by expression."""
    if isinstance(x, int) or isinstance(y, int):
        return isinstance(x, int) and isinstance(y, int) and x == y
    return x.node.expr == y.node.expr
