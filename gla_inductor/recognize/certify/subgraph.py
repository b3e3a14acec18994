"""The subgraph a certificate runs: the nodes between a candidate's inputs (the leaves) and
its outputs, built only from analytic ops (sums, products, contractions, exp, cumsum, views,
pads, concatenation, masks that are constants), and the values of its constants."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..core.analyzer import Analyzer
from ..core.consts import example_value
from ..core.op_names import op_name


def subgraph(an: Analyzer, outputs: list, cut: set, static: bool = False) -> tuple[set, set, dict]:
    """(nodes, frontier, consts): the nodes between `cut` and `outputs`, the data they read
    that is neither cut nor analytic (placeholders, other ops), and their constants (with
    `static`, values computed from module state too: decay tables in buffers). The
    in-place writes into their memory (through any alias) before the last output belong to
    the computation; later ones (a cache the final state is copied into) do not."""
    stop = max(an.order[o] for o in outputs)

    def writes(n):
        return an.written_between(n, 0, stop)

    nodes, frontier, consts = set(), set(), {}
    stack = list(outputs)
    while stack:
        n = stack.pop()
        if n in nodes or n in cut or n in frontier or n in consts:
            continue
        if _uninitialized(n):
            consts[n] = "empty"
            stack += writes(n)
            continue
        if an.consts.is_const(n) or _factory(n) or static and an.consts.is_static(n):
            consts[n] = None
            if _factory(n):  # a buffer the code fills in place
                stack += writes(n)
            continue
        if not is_analytic(an, n):
            frontier.add(n)
            continue
        nodes.add(n)
        stack += [x for x in n.all_input_nodes]
        stack += writes(n)
    return nodes, frontier, consts


def _factory(n: fx.Node) -> bool:
    if n.op == "call_function":
        return n.target in (torch.zeros, torch.ones, torch.full, torch.zeros_like, torch.ones_like, torch.full_like)
    return n.op == "call_method" and n.target in ("new_zeros", "new_ones", "new_full")


def _uninitialized(n: fx.Node) -> bool:
    if n.op == "call_function":
        return n.target in (torch.empty, torch.empty_like)
    return n.op == "call_method" and n.target in ("new_empty", "empty_like")


_ANALYTIC = {
    "mul", "div", "add", "sub", "rsub", "neg", "matmul", "bmm", "mm", "einsum", "exp", "exp2", "sum",
    "unsqueeze", "squeeze", "permute", "transpose", "reshape", "t", "identity", "expand", "select",
    "narrow", "unbind", "repeat_interleave", "repeat", "getitem", "tril", "triu",
    # x ** y is exp(y log x) for x > 0, a polynomial in x for integer y, and NaN for other y
    # at x < 0, which the certificate rejects; a gate read as the decay itself is drawn
    # positive, and where its rewrite reads one, the graph checks it positive at run time
    "pow",
}
_ANALYTIC_FNS = {torch.cumsum, torch.cat, torch.stack, torch.split, torch.chunk, F.pad, torch._C._nn.pad, torch.flip}
_ANALYTIC_METHODS = {"cumsum", "split", "chunk", "flip"}


def is_analytic(an: Analyzer, n: fx.Node) -> bool:
    """Ops whose value is an analytic function of their data inputs: no data-dependent branch."""
    if n.op == "call_method" and n.target in _ANALYTIC_METHODS:
        return True
    if n.op == "call_function" and n.target in _ANALYTIC_FNS:
        return n.target not in (F.pad, torch._C._nn.pad) or is_constant_pad(n)
    if n.op == "call_function" and n.target is operator.setitem:
        return not any(isinstance(x, fx.Node) for x in flat_args(n.args[1]))
    name = op_name(n)
    if name == "getitem":
        return not any(isinstance(x, fx.Node) for x in flat_args(n.args[1:]))
    if name in ("masked_fill", "where"):
        mask = n.args[1] if name == "masked_fill" else n.args[0]
        return isinstance(mask, fx.Node) and an.consts.is_const(mask)
    return name in _ANALYTIC


def is_constant_pad(n: fx.Node) -> bool:
    mode = n.args[2] if len(n.args) > 2 else n.kwargs.get("mode", "constant")
    return mode == "constant"


def flat_args(x) -> list:
    if isinstance(x, (list, tuple)):
        return [y for i in x for y in flat_args(i)]
    if isinstance(x, slice):
        return [x.start, x.stop, x.step]
    return [x]


def evaluate_consts(an: Analyzer, consts: dict) -> bool:
    """Fill in the constants' values; memory the code allocates without initializing is NaN,
    so that a computation reading it cannot be certified."""
    for n in consts:
        val = example_value(n)
        if consts[n] == "empty" or n.op == "call_function" and n.target is torch.empty:
            consts[n] = torch.full(tuple(val.shape), float("nan"), dtype=val.dtype)
        elif an.consts.is_const(n) or _factory(n):
            consts[n] = an.consts.evaluate(n)
        else:  # module state at its compile-time value (``reads_module_state`` says so)
            consts[n] = an.consts.evaluate_static(n)
        if consts[n] is None and isinstance(val, torch.Tensor):
            return False
    return True


def reads_module_state(an: Analyzer, consts: dict) -> list:
    """The constants whose values come from module state (buffers, parameters) rather than
    from the code: a rewrite that bakes them in must follow or guard them at run time."""
    return [n for n in consts if not an.consts.is_const(n) and not _factory(n) and not _uninitialized(n)]
