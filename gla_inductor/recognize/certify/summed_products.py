"""Sums of products, evaluated without the product.

The broadcast-multiply-sum spelling of a contraction, ``(C[..., :, None, :] * B[..., None, :, :]).sum(-1)``
(transformers' Mamba2 ``torch_forward``), materializes the broadcast product: at Mamba2 1.3B
sizes a [b, c, l, l, h, n] tensor, gigabytes in float64 even at two batches and two heads. The
certificate runs such subgraphs in float64, so it evaluates each product whose only reader is
a sum as one ``einsum`` instead (the same sum of the same products, in another order), and its
memory estimate counts no product tensor for it.
"""

from __future__ import annotations

import operator
import string
from typing import Optional

import torch
import torch.fx as fx

_MULS = {operator.mul, torch.mul}


def is_summed_product(n: fx.Node) -> bool:
    """Whether `n` multiplies two tensors and its only reader sums the product (no dtype given)."""
    if not _is_mul(n) or len(n.users) != 1:
        return False
    (user,) = n.users
    return _sum_args(user) is not None and user.args[0] is n


def fuse(gm: fx.GraphModule) -> fx.GraphModule:
    """Replace every sum of a summed product in `gm` by one `sum_of_product` call."""
    for n in list(gm.graph.nodes):
        if is_summed_product(n):
            (user,) = n.users
            dim, keepdim = _sum_args(user)
            with gm.graph.inserting_before(user):
                fused = gm.graph.call_function(sum_of_product, (n.args[0], n.args[1], dim, keepdim))
            user.replace_all_uses_with(fused)
            gm.graph.erase_node(user)
            gm.graph.erase_node(n)
    gm.recompile()
    return gm


def sum_of_product(a, b, dim, keepdim: bool):
    """``(a * b).sum(dim, keepdim)`` for broadcastable tensors, as an einsum."""
    if not all(isinstance(x, torch.Tensor) and x.is_floating_point() for x in (a, b)):
        return torch.sum(a * b, dim, keepdim=keepdim) if dim is not None else torch.sum(a * b)
    shape = torch.broadcast_shapes(a.shape, b.shape)
    n = len(shape)
    summed = set(range(n)) if dim is None else {d % n for d in ((dim,) if isinstance(dim, int) else dim)}
    letters = string.ascii_letters[:n]
    (xa, sa), (xb, sb) = _operand(a, shape, letters), _operand(b, shape, letters)
    out = "".join(letters[i] for i in range(n) if i not in summed)
    result = torch.einsum(f"{sa},{sb}->{out}", xa, xb)
    if keepdim:
        result = result.reshape([1 if i in summed else s for i, s in enumerate(shape)])
    return result


def _operand(x: torch.Tensor, shape, letters: str):
    """`x` aligned right to `shape`, without the axes it only broadcasts along, and its letters."""
    x = x.reshape((1,) * (len(shape) - x.dim()) + tuple(x.shape))
    keep = [i for i in range(len(shape)) if not (x.shape[i] == 1 and shape[i] != 1)]
    return x.reshape([x.shape[i] for i in keep]), "".join(letters[i] for i in keep)


def _is_mul(n: fx.Node) -> bool:
    if n.op == "call_function" and n.target in _MULS or n.op == "call_method" and n.target == "mul":
        return len(n.args) == 2 and not n.kwargs and all(isinstance(x, fx.Node) for x in n.args)
    return False


def _sum_args(n: fx.Node) -> Optional[tuple]:
    """(dim, keepdim) of a sum node with no dtype, else None."""
    if not (n.op == "call_method" and n.target == "sum" or n.op == "call_function" and n.target is torch.sum):
        return None
    if set(n.kwargs) - {"dim", "keepdim"} or len(n.args) > 3:
        return None
    dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
    keepdim = n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim", False)
    if isinstance(dim, (tuple, list)) and not dim:  # sum over dim=[] sums every axis: left as it is
        return None
    if not (dim is None or isinstance(dim, int) or isinstance(dim, (tuple, list)) and all(isinstance(d, int) for d in dim)):
        return None
    if not isinstance(keepdim, bool):
        return None
    return dim, keepdim
