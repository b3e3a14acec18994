"""Nodes whose value depends only on constants and sizes (masks, aranges, zeros).

Such nodes need no symbolic reading: a recognizer that wants to know whether a mask is
causal simply evaluates it. Sizes that are symbolic (``dynamic=True``) are evaluated at
their hint; the mask spellings that Dynamo can trace without guards do not change meaning
with the size.
"""

from __future__ import annotations

import operator
from typing import Any, Optional

import torch
import torch.fx as fx

# Factories whose result depends only on their (size / constant) arguments.
_FACTORIES = {
    torch.ones, torch.zeros, torch.full, torch.arange, torch.eye, torch.empty, torch.tensor,
    torch.ones_like, torch.zeros_like, torch.full_like, torch.tril_indices,
}
_ZERO_FACTORIES = {torch.zeros, torch.zeros_like}
_ZERO_METHODS = {"new_zeros", "zero_"}
_LIKE_METHODS = {"new_ones", "new_zeros", "new_full", "new_tensor"}
_SIZE_METHODS = {"size", "dim", "numel", "__len__"}
_RANDOM = {torch.rand, torch.randn, torch.randint, torch.rand_like, torch.randn_like, torch.bernoulli}
_MAX_CONST_ELEMENTS = 1 << 26


def example_value(node: Any):
    if not isinstance(node, fx.Node):
        return node
    val = node.meta.get("example_value", node.meta.get("val"))
    return val


def is_inplace(node: fx.Node) -> bool:
    if node.op == "call_method":
        name = node.target
        return name.endswith("_") and not name.startswith("__") or name in ("__setitem__",)
    if node.op == "call_function":
        if node.target is operator.setitem:
            return True
        name = getattr(node.target, "__name__", "")
        return name.endswith("_") and not name.startswith("_")
    return False


def _written_in_place(graph: fx.Graph) -> set:
    """Tensors written in place, and those they are views of: their value depends on where
    they are read (a mask built with ones() then tril_() is not the ones())."""
    res = set()
    for n in graph.nodes:
        x = n.args[0] if is_inplace(n) and n.args else None
        while isinstance(x, fx.Node) and x not in res:
            res.add(x)
            val = example_value(x)
            is_view = isinstance(val, torch.Tensor) and val._is_view()
            x = x.args[0] if is_view and x.args else None
    return res


def freeze(x, canon: dict):
    """A hashable key for node arguments (slices and lists are not hashable)."""
    if isinstance(x, fx.Node):
        return ("node", canon.get(x, x))
    if isinstance(x, (list, tuple)):
        return (type(x).__name__,) + tuple(freeze(i, canon) for i in x)
    if isinstance(x, dict):
        return ("dict",) + tuple(sorted((k, freeze(v, canon)) for k, v in x.items()))
    if isinstance(x, slice):
        return ("slice", freeze(x.start, canon), freeze(x.stop, canon), freeze(x.step, canon))
    if isinstance(x, torch.Tensor):
        return ("tensor", id(x))
    hash(x)
    return x


def _hint(x):
    """A concrete Python value for a possibly symbolic one."""
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        node = x.node
        hint = getattr(node, "hint", None)
        if hint is None:
            from torch.fx.experimental.symbolic_shapes import guard_int

            return guard_int(x)
        return hint
    return x


class ConstAnalysis:
    def __init__(self, graph: fx.Graph):
        self.graph = graph
        self._const: dict[fx.Node, bool] = {}
        self._zeros: dict[fx.Node, bool] = {}
        self._values: dict[fx.Node, Any] = {}
        mutated = _written_in_place(graph)
        for n in graph.nodes:
            self._const[n] = n not in mutated and self._classify(n)

    def _classify(self, n: fx.Node) -> bool:
        val = example_value(n)
        if n.op == "placeholder":
            return isinstance(val, (int, float, bool, torch.SymInt, torch.SymFloat))
        if n.op == "get_attr":
            return True
        if n.op not in ("call_function", "call_method"):
            return False
        if is_inplace(n) and n.target not in ("zero_",):
            return False
        if n.op == "call_function" and n.target in _RANDOM:
            return False
        if n.op == "call_method" and n.target in _SIZE_METHODS:
            return True
        if n.op == "call_function" and n.target is getattr and n.args[1] in ("shape", "device", "dtype"):
            return True
        inputs = n.all_input_nodes
        if n.op == "call_function" and n.target in _FACTORIES:
            if n.target in (torch.ones_like, torch.zeros_like, torch.full_like):
                return all(self._const.get(i, False) or i is n.args[0] for i in inputs)
            return all(self._const.get(i, False) for i in inputs)
        if n.op == "call_method" and n.target in _LIKE_METHODS:
            return all(self._const.get(i, False) for i in inputs[1:])
        return bool(inputs) and all(self._const.get(i, False) for i in inputs)

    def is_const(self, n: fx.Node) -> bool:
        return self._const.get(n, False)

    def is_zeros(self, n: fx.Node) -> bool:
        if n.op == "call_function" and n.target in _ZERO_FACTORIES:
            return True
        if n.op == "call_method" and n.target in _ZERO_METHODS:
            return True
        if n.op == "call_function" and n.target is torch.full and len(n.args) > 1:
            return n.args[1] == 0
        return False

    def evaluate(self, n: fx.Node) -> Optional[torch.Tensor]:
        """The concrete value of a const node (on the CPU, sizes at their hints)."""
        if n in self._values:
            return self._values[n]
        val = example_value(n)
        if isinstance(val, torch.Tensor) and val.numel() > _MAX_CONST_ELEMENTS:
            return None
        try:
            res = self._run(n)
        except Exception:  # an exotic spelling: the candidate is simply not proven
            res = None
        self._values[n] = res
        return res

    def _arg(self, x):
        if isinstance(x, fx.Node):
            if x.op == "placeholder":
                val = example_value(x)
                return _ShapeOnly(val) if isinstance(val, torch.Tensor) else _hint(val)
            if x.op != "get_attr" and not self.is_const(x) and not (x in self._values):
                # Only the shape/device/dtype of a non-const tensor is ever read.
                return _ShapeOnly(example_value(x))
            return self.evaluate(x)
        if isinstance(x, (list, tuple)):
            return type(x)(self._arg(i) for i in x)
        if isinstance(x, dict):
            return {k: self._arg(v) for k, v in x.items()}
        if isinstance(x, torch.device):
            return torch.device("cpu")
        return _hint(x)

    def _run(self, n: fx.Node):
        if n.op == "get_attr":
            obj = self.graph.owning_module
            for part in n.target.split("."):
                obj = getattr(obj, part)
            return obj.detach().cpu() if isinstance(obj, torch.Tensor) else obj
        args = self._arg(n.args)
        kwargs = self._arg(dict(n.kwargs))
        if "device" in kwargs:
            kwargs["device"] = torch.device("cpu")
        if n.op == "call_method":
            self_, *rest = args
            if isinstance(self_, _ShapeOnly):
                return self_.call(n.target, rest, kwargs)
            if n.target == "to":
                rest = [r for r in rest if not isinstance(r, (torch.device, str))]
                kwargs.pop("device", None)
            return getattr(self_, n.target)(*rest, **kwargs)
        if n.target is getattr:
            return self_attr(args[0], args[1])
        if n.target in (torch.ones_like, torch.zeros_like, torch.full_like) and isinstance(args[0], _ShapeOnly):
            shape = args[0].shape()
            fill = {torch.ones_like: 1, torch.zeros_like: 0}.get(n.target)
            dtype = kwargs.get("dtype", args[0].val.dtype)
            if fill is None:
                return torch.full(shape, args[1], dtype=dtype)
            return torch.full(shape, fill, dtype=dtype)
        return n.target(*args, **kwargs)


def self_attr(obj, name):
    if isinstance(obj, _ShapeOnly):
        if name == "shape":
            return torch.Size(obj.shape())
        if name == "device":
            return torch.device("cpu")
        if name == "dtype":
            return obj.val.dtype
    return getattr(obj, name)


class _ShapeOnly:
    """Stands for a data tensor of which a const subgraph reads only metadata."""

    def __init__(self, val):
        self.val = val

    def shape(self):
        return tuple(_hint(s) for s in self.val.shape)

    def call(self, name, args, kwargs):
        if name == "size":
            shape = self.shape()
            return shape[args[0]] if args else torch.Size(shape)
        if name == "dim":
            return self.val.dim()
        if name == "numel":
            n = 1
            for s in self.shape():
                n *= s
            return n
        if name in ("new_ones", "new_zeros", "new_full", "new_empty"):
            fill = {"new_ones": 1, "new_zeros": 0, "new_empty": 0}.get(name)
            size = args[0] if len(args) == 1 and isinstance(args[0], (list, tuple, torch.Size)) else args
            if name == "new_full":
                size, fill = args[0], args[1]
            dtype = kwargs.get("dtype", self.val.dtype)
            return torch.full(tuple(size), fill, dtype=dtype)
        raise NotImplementedError(name)
