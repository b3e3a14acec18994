"""Which torch function or method a graph node calls, by one canonical name per operation
(``operator.mul``, ``torch.mul``, ``x.mul``, ``x.__rmul__`` are all "mul"), and which calls
are elementwise."""

from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

_FUNCTIONS = {
    operator.mul: "mul", torch.mul: "mul", operator.truediv: "div", torch.div: "div",
    torch.true_divide: "div", operator.add: "add", torch.add: "add", operator.sub: "sub",
    torch.sub: "sub", torch.rsub: "rsub", operator.neg: "neg", torch.neg: "neg",
    operator.matmul: "matmul", torch.matmul: "matmul", torch.bmm: "bmm", torch.mm: "mm",
    torch.einsum: "einsum", torch.exp: "exp", torch.exp2: "exp2", operator.pow: "pow",
    torch.pow: "pow", torch.sum: "sum", torch.unsqueeze: "unsqueeze", torch.squeeze: "squeeze",
    torch.permute: "permute", torch.transpose: "transpose", torch.swapaxes: "transpose",
    torch.reshape: "reshape", torch.t: "t", torch.masked_fill: "masked_fill",
    torch.where: "where", torch.tril: "tril", torch.triu: "triu", operator.getitem: "getitem",
    torch.select: "select", torch.narrow: "narrow", torch.unbind: "unbind",
    torch.clone: "identity", torch.broadcast_to: "expand", torch.flatten: "reshape",
    torch.unflatten: "reshape", torch.repeat_interleave: "repeat_interleave", getattr: "getattr",
    torch.cumsum: "cumsum", torch.flip: "flip",
    # x.mT, x.mH, x.T as Dynamo traces them since torch 2.15 (before: getattr(x, "mT"))
    torch.ops.aten.mT: "mT", torch.ops.aten.mH: "mH", torch.ops.aten.numpy_T: "numpy_T",
}
_METHODS = {
    "mul": "mul", "__mul__": "mul", "__rmul__": "mul", "div": "div", "__truediv__": "div",
    "add": "add", "__add__": "add", "__radd__": "add", "sub": "sub", "__sub__": "sub",
    "neg": "neg", "__neg__": "neg", "matmul": "matmul", "__matmul__": "matmul", "bmm": "bmm",
    "mm": "mm", "exp": "exp", "exp2": "exp2", "sum": "sum", "unsqueeze": "unsqueeze",
    "squeeze": "squeeze", "permute": "permute", "transpose": "transpose",
    "swapaxes": "transpose", "view": "reshape", "reshape": "reshape", "t": "t",
    "expand": "expand", "expand_as": "expand", "contiguous": "identity", "clone": "identity",
    "float": "identity", "double": "identity", "half": "identity", "bfloat16": "identity",
    "to": "identity", "type_as": "identity", "type": "identity", "masked_fill": "masked_fill",
    "tril": "tril", "triu": "triu", "select": "select", "narrow": "narrow", "unbind": "unbind",
    "view_as": "reshape", "reshape_as": "reshape", "__getitem__": "getitem",
    "flatten": "reshape", "unflatten": "reshape", "repeat_interleave": "repeat_interleave",
    "repeat": "repeat", "pow": "pow", "__pow__": "pow", "cumsum": "cumsum", "flip": "flip",
}

# Ops whose value is their operand's, re-indexed: their abstract value keeps the operand's root.
VIEW_OPS = {
    "identity", "unsqueeze", "squeeze", "permute", "transpose", "t", "reshape", "expand",
    "getitem", "select", "narrow", "repeat_interleave", "repeat", "getattr", "mT", "mH", "numpy_T",
}


def _pointwise_targets() -> tuple:
    """Elementwise ops (with broadcasting): functions by object, methods by name."""
    names = (
        "softplus", "sigmoid", "silu", "tanh", "relu", "gelu", "logsigmoid", "log_sigmoid", "log",
        "log1p", "exp", "expm1", "sqrt", "rsqrt", "abs", "clamp", "clamp_min", "clamp_max",
        "square", "reciprocal", "mul", "add", "sub", "div", "true_divide", "neg", "pow", "where",
        "exp2", "elu", "softsign", "erf", "sin", "cos", "minimum", "maximum",
    )
    fns = set()
    for mod in (torch, F, torch._C._nn, torch.special):
        for n in names:
            f = getattr(mod, n, None)
            if callable(f):
                fns.add(f)
    fns |= {operator.mul, operator.add, operator.sub, operator.truediv, operator.neg, operator.pow}
    methods = set(names) | {"__mul__", "__rmul__", "__add__", "__radd__", "__sub__", "__rsub__",
                            "__truediv__", "__rtruediv__", "__neg__", "__pow__", "__rpow__"}
    return fns, methods


_POINTWISE_FNS, _POINTWISE_METHODS = _pointwise_targets()


def is_pointwise(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in _POINTWISE_METHODS
    if node.op == "call_function":
        try:
            return node.target in _POINTWISE_FNS
        except TypeError:
            return False
    return False


def op_name(node: fx.Node) -> Optional[str]:
    if node.op == "call_function":
        try:
            return _FUNCTIONS.get(node.target)
        except TypeError:
            return None
    if node.op == "call_method":
        return _METHODS.get(node.target)
    return None
