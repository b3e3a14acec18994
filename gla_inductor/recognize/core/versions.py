"""What a node reads when memory is written in place, and which nodes compute the same value.

Dynamo graphs hold in-place writes (``cache.copy_(S)``, ``buf[:, t] = o_t``, ``x.mul_(2)``).
The normal form reads node values, so a read after a write must see the written value
(``read_versions``), and value numbering must leave such memory alone (``value_numbering``).
"""

from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx as fx

from .consts import example_value, freeze, is_inplace
from .op_names import VIEW_OPS, op_name


class _Stale:
    """Marks a read of memory that was written in place with a value not known here."""


STALE = _Stale()


def storage_root(node: fx.Node) -> fx.Node:
    """The tensor whose memory `node` may alias: through views, casts (conservatively) and
    in-place ops, which return their first argument."""
    while (op_name(node) in VIEW_OPS or is_inplace(node)) and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def read_versions(nodes: list, order: dict, writes: list, keys: dict) -> dict:
    """(consumer, input) -> what the consumer reads, for each input whose memory (through any
    alias) was written in place after the input was computed: the written value for a whole
    write of that very tensor (`x.copy_(y)`, `x[:] = y`, same shape; y as the write read it),
    else STALE. The algebra reads node values, so without this a read after a write would see
    the value before it."""
    if not writes:
        return {}
    targets = dict(writes)
    first = order[writes[0][0]]
    written: dict = {}  # storage -> (position of the last write, value or STALE, the tensor written)
    res: dict = {}
    for i, n in enumerate(nodes[first:], first):
        if written:
            for a in n.all_input_nodes:
                w = written.get(keys[a])
                if w is not None and w[0] > order[a]:
                    res[(n, a)] = w[1] if w[2] is a else STALE
        for target in targets.get(n, ()):
            value = _whole_write(n, target)
            if value is not None:
                value = res.get((n, value), value)  # y itself may have been written before the copy
            written[keys[target]] = (i, STALE if value is None else value, target)
    return res


def _whole_write(n: fx.Node, target: fx.Node) -> Optional[fx.Node]:
    """y for `x.copy_(y)` / `x[:] = y` into target x (y of x's shape), else None."""
    if n.op == "call_method" and n.target == "copy_" and len(n.args) >= 2:
        x, value = n.args[0], n.args[1]
    elif n.op == "call_function" and n.target is operator.setitem:
        x, index, value = n.args
        whole = (slice(None), Ellipsis)
        if not (index in whole or isinstance(index, tuple) and all(i in whole for i in index)):
            return None
    else:
        return None
    tv, vv = example_value(x), example_value(value) if isinstance(value, fx.Node) else None
    if x is not target or not isinstance(vv, torch.Tensor) or tuple(vv.shape) != tuple(tv.shape):
        return None
    return value


def value_numbering(nodes: list, writes: list, keys: dict) -> dict:
    """Map each pure node to the first node that computes the same thing.

    Dynamo does not CSE, so a loop that recomputes `-A_log.exp()` every step holds T
    equal nodes; atoms compare by their canonical node. Nodes that hold or read memory that
    is written in place anywhere (through any alias) are left alone: their value depends on
    program order."""
    mutated = {keys[t] for _, ts in writes for t in ts}
    # the writes, and every node that holds written memory
    unstable = {w for w, _ in writes} | {n for n in nodes if keys[n] in mutated} if mutated else set()
    canon: dict = {}
    seen: dict = {}
    for n in nodes:
        if n.op not in ("call_function", "call_method") or n.target is operator.getitem:
            continue  # index tuples are costly to hash and Dynamo never repeats them
        if _random(n):
            continue  # two draws with the same arguments differ
        if unstable and (n in unstable or any(a in unstable for a in n.all_input_nodes)):
            continue
        try:
            k = (n.op, n.target, freeze(n.args, canon), freeze(n.kwargs, canon))
            hash(k)
        except TypeError:
            continue
        if k in seen:
            canon[n] = seen[k]
        else:
            seen[k] = n
    return canon


# Sampling ops: equal arguments, different values (a per-step dropout is not one value).
_RANDOM_NAMES = {
    "rand", "randn", "rand_like", "randn_like", "randint", "randint_like", "randperm", "bernoulli",
    "multinomial", "normal", "poisson", "dropout", "dropout1d", "dropout2d", "dropout3d",
    "alpha_dropout", "feature_alpha_dropout", "feature_dropout", "rrelu", "gumbel_softmax",
}


def _random(n: fx.Node) -> bool:
    name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
    return name in _RANDOM_NAMES
