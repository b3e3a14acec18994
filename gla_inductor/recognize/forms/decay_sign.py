"""Which decay factors of a state are provably nonnegative, for a gate g = log(a).

A step S_new = a * S + k (x) v whose a is not written exp(g) is still a GLA step with the gate
log(a), exactly, wherever a >= 0: exp(log(a)) = a (0 gives -inf and back 0; NaN stays NaN; a
negative a would give NaN where the code gives a number). torchscale's RetNet decays its
recurrent state by sqrt(prev_scale) * decay / sqrt(scale), a factor computed from the cache.

The proof reads the factor's graph: an op whose result cannot be negative (exp, sqrt, abs,
sigmoid, softplus, relu, square, an even power, a clamp at a nonnegative minimum, a tensor of
ones), or products, quotients and sums of such terms and of nonnegative Python numbers. The
*values* of buffers, parameters and inputs are never trusted (a buffer can be changed after
compiling; exp(buffer) is fine). NaN from sqrt(-x) counts as nonnegative: the gate carries the
NaN through as the code does.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..core.analyzer import Analyzer
from ..core.op_names import VIEW_OPS, op_name

MAX_SIGN_NODES = 64  # nodes one proof may visit (a factor is a handful of ops)
MAX_DESCRIBE_DEPTH = 3

# ops whose every result is >= 0 (or NaN), whatever their input
_ALWAYS = {"exp", "exp2", "sqrt", "rsqrt", "abs", "sigmoid", "softplus", "relu", "square", "ones_like",
           "new_ones", "ones"}
_FN_NAMES = {
    torch.sqrt: "sqrt", torch.rsqrt: "rsqrt", torch.abs: "abs", torch.sigmoid: "sigmoid", F.sigmoid: "sigmoid",
    F.softplus: "softplus", torch._C._nn.softplus: "softplus", torch.relu: "relu", F.relu: "relu", torch.square: "square", torch.ones_like: "ones_like",
    torch.ones: "ones", torch.reciprocal: "reciprocal", torch.minimum: "minimum", torch.maximum: "maximum",
    torch.clamp: "clamp", torch.clamp_min: "clamp_min", torch.special.expit: "sigmoid", torch.full: "full",
    torch.full_like: "full_like",
}
_METHOD_NAMES = {"sqrt", "rsqrt", "abs", "sigmoid", "relu", "square", "reciprocal", "clamp", "clamp_min",
                 "new_ones", "minimum", "maximum", "pow", "__pow__", "new_full"}


def nonnegative(an: Analyzer, node: fx.Node) -> bool:
    """Whether every element of `node` is >= 0 or NaN, from the ops that compute it (memoized
    per graph)."""
    memo = an.memo.setdefault("nonnegative", {})
    if node not in memo:
        budget = [MAX_SIGN_NODES]
        memo[node] = _nonneg(an, node, budget)
    return memo[node]


def _name(node: fx.Node) -> Optional[str]:
    name = op_name(node)
    if name is not None:
        return name
    if node.op == "call_function":
        try:
            return _FN_NAMES.get(node.target)
        except TypeError:
            return None
    if node.op == "call_method" and node.target in _METHOD_NAMES:
        return "pow" if node.target == "__pow__" else node.target
    return None


def _arg(node: fx.Node, pos: int, key: str, default=None):
    return node.args[pos] if len(node.args) > pos else node.kwargs.get(key, default)


def _number(x) -> Optional[float]:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x)


def _nonneg(an: Analyzer, x, budget: list) -> bool:
    """x (a node or a number) >= 0 or NaN."""
    num = _number(x)
    if num is not None:
        return num >= 0 or math.isnan(num)
    if not isinstance(x, fx.Node) or x.op not in ("call_function", "call_method"):
        return False  # inputs, buffers, parameters: their values may change
    budget[0] -= 1
    if budget[0] < 0:
        return False
    name = _name(x)
    if name in VIEW_OPS:  # a view or cast of a tensor has its elements
        src = x.args[0] if x.args else None
        return isinstance(src, fx.Node) and _same_version(an, x, src) and _nonneg(an, src, budget)
    if name in _ALWAYS:
        return True
    ops = [a for a in x.args if isinstance(a, fx.Node)] + [a for a in x.kwargs.values() if isinstance(a, fx.Node)]
    if not all(_same_version(an, x, a) for a in ops):
        return False  # reads a value written in place: what it read is not what the graph shows
    if name in ("mul", "div", "add", "reciprocal", "minimum"):
        if name == "div" and _arg(x, 2, "rounding_mode") is not None:
            return False  # floor division of a positive by a negative is negative
        return _operands_nonneg(an, x, budget)
    if name == "maximum":
        return any(_nonneg(an, a, budget) for a in x.args[:2])
    if name in ("clamp", "clamp_min"):
        low = _number(_arg(x, 1, "min"))
        return low is not None and low >= 0 or _nonneg(an, x.args[0], budget)
    if name == "where":
        return len(x.args) == 3 and all(_nonneg(an, a, budget) for a in x.args[1:])
    if name in ("full", "full_like", "new_full"):
        fill = _number(_arg(x, 2 if name == "new_full" else 1, "fill_value"))
        return fill is not None and fill >= 0
    if name == "pow":
        return _pow_nonneg(an, x, budget)
    return False


def _operands_nonneg(an: Analyzer, x: fx.Node, budget: list) -> bool:
    args = list(x.args[:2]) if _name(x) != "reciprocal" else list(x.args[:1])
    alpha = _number(x.kwargs.get("alpha", 1))
    return alpha is not None and alpha >= 0 and all(_nonneg(an, a, budget) for a in args)


def _pow_nonneg(an: Analyzer, x: fx.Node, budget: list) -> bool:
    """base ** e: >= 0 for an even integer e, or a non-integer e (NaN for a negative base), or a
    nonnegative base."""
    base, e = _arg(x, 0, "input"), _arg(x, 1, "exponent")
    num = _number(e)
    if num is not None and math.isfinite(num) and (num != int(num) or int(num) % 2 == 0):
        return True
    return _nonneg(an, base, budget)


def _same_version(an: Analyzer, consumer: fx.Node, x) -> bool:
    return not isinstance(x, fx.Node) or an.versions.get((consumer, x), x) is x


def describe(node, depth: int = MAX_DESCRIBE_DEPTH) -> str:
    """A short expression of how a node is computed, for a near miss (`sub(1, x)`)."""
    if not isinstance(node, fx.Node):
        return repr(node) if not isinstance(node, (list, tuple)) else "(" + ", ".join(describe(a, depth) for a in node) + ")"
    if node.op not in ("call_function", "call_method") or depth <= 0:
        return node.name
    name = _name(node) or (node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "op"))
    if name == "getitem" and len(node.args) == 2:  # a time slice x[:, t] is worth showing
        index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        return f"{describe(node.args[0], depth)}[{', '.join(_index_text(i) for i in index)}]"
    if name in VIEW_OPS and node.args:
        return describe(node.args[0], depth)
    args = [describe(a, depth - 1) for a in node.args if not isinstance(a, torch.dtype)]
    return f"{name}({', '.join(args)})"


def _index_text(i) -> str:
    if isinstance(i, slice):
        return ":".join("" if x is None else str(x) for x in (i.start, i.stop)) + ("" if i.step is None else f":{i.step}")
    return "..." if i is Ellipsis else "None" if i is None else str(i) if not isinstance(i, fx.Node) else i.name
