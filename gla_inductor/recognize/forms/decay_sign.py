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

Two levels are told apart: POSITIVE (exp, sigmoid, softplus, positive numbers and what they make)
and NONNEG (may be 0: sqrt, abs, relu, a clamp at 0). A zero factor is exact forwards, but the
gate's gradient d/da log(a) = 1 / a meets 0 / 0 there, so a factor that needs a gradient must be
POSITIVE (loop._log_term).
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

# Sign levels, ordered: a proof gives the lowest level its terms allow.
UNKNOWN, NONNEG, POSITIVE = 0, 1, 2  # POSITIVE: > 0 (or NaN), up to underflow

# ops whose result has this level whatever their input
_ALWAYS = {"exp": POSITIVE, "exp2": POSITIVE, "sigmoid": POSITIVE, "softplus": POSITIVE, "ones_like": POSITIVE,
           "new_ones": POSITIVE, "ones": POSITIVE, "rsqrt": NONNEG}
# ops >= 0 whatever their input, > 0 where it is > 0
_LIFTING = {"sqrt", "abs", "relu", "square"}
_FN_NAMES = {
    torch.sqrt: "sqrt", torch.rsqrt: "rsqrt", torch.abs: "abs", torch.sigmoid: "sigmoid", F.sigmoid: "sigmoid",
    F.softplus: "softplus", torch._C._nn.softplus: "softplus", torch.relu: "relu", F.relu: "relu",
    torch.square: "square", torch.ones_like: "ones_like", torch.ones: "ones", torch.reciprocal: "reciprocal",
    torch.minimum: "minimum", torch.maximum: "maximum", torch.clamp: "clamp", torch.clamp_min: "clamp_min",
    torch.special.expit: "sigmoid", torch.full: "full", torch.full_like: "full_like",
}
_METHOD_NAMES = {"sqrt", "rsqrt", "abs", "sigmoid", "relu", "square", "reciprocal", "clamp", "clamp_min",
                 "new_ones", "minimum", "maximum", "pow", "__pow__", "new_full"}


def sign_level(an: Analyzer, node: fx.Node) -> int:
    """POSITIVE where every element of `node` is > 0 or NaN, NONNEG where >= 0 or NaN, else
    UNKNOWN, from the ops that compute it (memoized per graph)."""
    memo = an.memo.setdefault("sign_level", {})
    if node not in memo:
        memo[node] = _level(an, node, [MAX_SIGN_NODES])
    return memo[node]


def nonnegative(an: Analyzer, node: fx.Node) -> bool:
    return sign_level(an, node) >= NONNEG


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


def _number_level(num: float) -> int:
    return POSITIVE if num > 0 or math.isnan(num) else NONNEG if num == 0 else UNKNOWN


def _level(an: Analyzer, x, budget: list) -> int:
    """The sign level of x, a node or a number."""
    num = _number(x)
    if num is not None:
        return _number_level(num)
    if not isinstance(x, fx.Node) or x.op not in ("call_function", "call_method"):
        return UNKNOWN  # inputs, buffers, parameters: their values may change
    budget[0] -= 1
    if budget[0] < 0:
        return UNKNOWN
    name = _name(x)
    ops = [a for a in x.args if isinstance(a, fx.Node)] + [a for a in x.kwargs.values() if isinstance(a, fx.Node)]
    if not all(_same_version(an, x, a) for a in ops):
        return UNKNOWN  # reads a value written in place: what it read is not what the graph shows
    if name in VIEW_OPS:  # a view or cast of a tensor has its elements
        return _level(an, x.args[0], budget) if x.args and isinstance(x.args[0], fx.Node) else UNKNOWN
    if name in _ALWAYS:
        return _ALWAYS[name]
    if name in _LIFTING:
        return max(NONNEG, _level(an, x.args[0], budget)) if x.args else UNKNOWN
    rule = _RULES.get(name)
    return rule(an, x, budget) if rule is not None else UNKNOWN


def _product(an: Analyzer, x: fx.Node, budget: list) -> int:
    """a * b, a / b: the lower level of the two (a floor division may be negative)."""
    if _name(x) == "div" and _arg(x, 2, "rounding_mode") is not None:
        return UNKNOWN
    return min(_level(an, a, budget) for a in x.args[:2])


def _sum(an: Analyzer, x: fx.Node, budget: list) -> int:
    """a + alpha * b: nonnegative terms, positive where one of them is."""
    alpha = _number(x.kwargs.get("alpha", 1))
    levels = [_level(an, a, budget) for a in x.args[:2]]
    if alpha is None or alpha < 0 or UNKNOWN in levels:
        return UNKNOWN
    return max(levels[0], levels[1] if alpha > 0 else NONNEG)


def _clamp(an: Analyzer, x: fx.Node, budget: list) -> int:
    """min(max(x, low), high): the larger level of x and low, then at most high's."""
    low, high = _arg(x, 1, "min"), _arg(x, 2, "max") if _name(x) == "clamp" else None
    level = _level(an, x.args[0], budget)
    if low is not None:
        level = max(level, _level(an, low, budget))
    return level if high is None else min(level, _level(an, high, budget))


def _where(an: Analyzer, x: fx.Node, budget: list) -> int:
    return min(_level(an, a, budget) for a in x.args[1:]) if len(x.args) == 3 else UNKNOWN


def _full(an: Analyzer, x: fx.Node, budget: list) -> int:
    fill = _number(_arg(x, 2 if _name(x) == "new_full" else 1, "fill_value"))
    return UNKNOWN if fill is None else _number_level(fill)


def _pow(an: Analyzer, x: fx.Node, budget: list) -> int:
    """base ** e: >= 0 for an even integer e or a non-integer e (NaN for a negative base), and
    > 0 for a positive base."""
    base, e = _arg(x, 0, "input"), _arg(x, 1, "exponent")
    level = _level(an, base, budget)
    num = _number(e)
    if num is not None and math.isfinite(num) and (num != int(num) or int(num) % 2 == 0):
        level = max(level, NONNEG)
    return level


_RULES = {
    "mul": _product, "div": _product, "add": _sum, "clamp": _clamp, "clamp_min": _clamp, "where": _where,
    "full": _full, "full_like": _full, "new_full": _full, "pow": _pow,
    "reciprocal": lambda an, x, budget: _level(an, x.args[0], budget),  # 1 / 0 = inf
    "maximum": lambda an, x, budget: max(_level(an, a, budget) for a in x.args[:2]),
    "minimum": lambda an, x, budget: min(_level(an, a, budget) for a in x.args[:2]),
}


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
