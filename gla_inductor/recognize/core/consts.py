"""Nodes whose value depends only on constants and sizes (masks, aranges, zeros).

Such nodes need no symbolic reading: a recognizer that wants to know whether a mask is
causal simply evaluates it. Sizes that are symbolic (``dynamic=True``) are evaluated at
their hint; the mask spellings that Dynamo can trace without guards do not change meaning
with the size.
"""

from __future__ import annotations

import functools
import inspect
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


# Methods named like in-place ops that change no tensor's values (autograd flags only).
_NOT_WRITES = {"requires_grad_", "detach_", "share_memory_", "retain_grad"}
# Augmented assignments: Dynamo records `x *= y` on a tensor as operator.imul(x, y).
_AUGMENTED = {
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv, operator.imod,
    operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift,
    operator.imatmul,
}
_AUGMENTED_METHODS = {f"__i{f.__name__[1:]}__" for f in _AUGMENTED}


def written_args(node: fx.Node) -> list:
    """The tensor nodes whose memory `node` writes in place: the first argument of an in-place
    op (`x.mul_(2)`, `torch.exp_(x)`, `x[i] = y`, `x *= y`, `F.relu(x, inplace=True)`, every
    tensor of `torch._foreach_mul_([x, y], 2)`), the `out=` tensors, and the mutable arguments
    of an aten overload. A read of memory written this way sees the new value, which the
    algebra (reading node values) only knows through `Analyzer.versions`."""
    op, target = node.op, node.target
    if op == "call_method":
        inplace = target in _AUGMENTED_METHODS or target == "__setitem__" or (
            target.endswith("_") and not target.startswith("__") and target not in _NOT_WRITES)
    elif op != "call_function":
        return []
    elif target is operator.setitem or _augmented(target):
        inplace = True
    elif isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return _tensor_nodes(node.kwargs.get("out")) + _schema_writes(node)
    else:
        name = getattr(target, "__name__", "")
        inplace = name.endswith("_") and not name.startswith("__") and name not in _NOT_WRITES
        inplace = inplace or _inplace_flag(node)
    res = _tensor_nodes(node.kwargs["out"]) if "out" in node.kwargs else []
    if inplace and node.args:
        res += _tensor_nodes(node.args[0])
    return res


def _augmented(target) -> bool:
    try:
        return target in _AUGMENTED
    except TypeError:  # an unhashable callable
        return False


def is_inplace(node: fx.Node) -> bool:
    return bool(written_args(node))


def _tensor_nodes(x) -> list:
    if isinstance(x, fx.Node):
        val = example_value(x)
        return [x] if val is None or isinstance(val, torch.Tensor) else []  # unknown: assume a tensor
    if isinstance(x, (list, tuple)):
        return [n for i in x for n in _tensor_nodes(i)]
    return []


def _inplace_flag(node: fx.Node) -> bool:
    """`inplace=True` of torch.nn.functional ops (relu, dropout, ...), by keyword or position."""
    if node.kwargs.get("inplace") is True:
        return True
    if getattr(node.target, "__module__", None) != "torch.nn.functional" or not any(a is True for a in node.args):
        return False
    params = _inplace_position(node.target)
    return params is not None and len(node.args) > params and node.args[params] is True


@functools.lru_cache(maxsize=None)
def _inplace_position(target) -> Optional[int]:
    try:
        names = list(inspect.signature(target).parameters)
    except (TypeError, ValueError):
        return None
    return names.index("inplace") if "inplace" in names else None


def _schema_writes(node: fx.Node) -> list:
    """Arguments an aten overload declares written (`Tensor(a!)`); every tensor argument of an
    overload packet whose name says in place."""
    target = node.target
    if isinstance(target, torch._ops.OpOverloadPacket):
        name = target._qualified_op_name.split("::")[-1]
        return _tensor_nodes(node.args[:1]) if name.endswith("_") else []
    res = []
    for n, arg in enumerate(target._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            x = node.args[n] if n < len(node.args) else node.kwargs.get(arg.name)
            res += _tensor_nodes(x)
    return res


def storage_key(node: fx.Node):
    """An identity of the memory a tensor node's value lives in: its example value's storage,
    which views, `.data`, `detach()`, the parts of `split` and casts to the same dtype share
    with their source (as they do at run time). Where that is not known, the node itself."""
    val = example_value(node)
    if isinstance(val, torch.Tensor):
        try:
            return ("storage", val.untyped_storage()._cdata)
        except Exception:  # noqa: BLE001 - a tensor without storage (sparse, nested)
            pass
    return ("node", node)


def _written_later(nodes: list, writes: dict, key) -> set:
    """Tensors whose memory is written in place after they are computed (through any alias):
    their value depends on where they are read (a mask built with ones() then tril_() is not
    the ones()). writes: node -> the tensors it writes."""
    last_write: dict = {}
    for i, n in enumerate(nodes):
        for t in writes.get(n, ()):
            last_write[key(t)] = i
    if not last_write:
        return set()
    return {n for i, n in enumerate(nodes) if last_write.get(key(n), -1) > i}


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


def size_hint(x):
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
    def __init__(self, graph: fx.Graph, writes: Optional[dict] = None, key=storage_key):
        """writes: node -> the tensors it writes in place (computed here when not given)."""
        self.graph = graph
        self._const: dict[fx.Node, bool] = {}
        self._zeros: dict[fx.Node, bool] = {}
        self._values: dict[fx.Node, Any] = {}
        nodes = list(graph.nodes)
        if writes is None:
            writes = {n: ts for n in nodes for ts in (written_args(n),) if ts}
        self._writes = writes
        mutated = _written_later(nodes, writes, key)
        for n in nodes:
            self._const[n] = n not in mutated and self._classify(n)
        # nodes computed from constants and module state (buffers, parameters) only
        self._static: dict[fx.Node, bool] = {}
        self._static_values: dict[fx.Node, Any] = {}
        for n in nodes:
            self._static[n] = n not in mutated and self._classify_static(n)

    def _classify(self, n: fx.Node) -> bool:
        val = example_value(n)
        if n.op == "placeholder":
            return isinstance(val, (int, float, bool, torch.SymInt, torch.SymFloat))
        if n.op == "get_attr":
            return True
        if n.op not in ("call_function", "call_method"):
            return False
        if n in self._writes and n.target not in ("zero_",):
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

    def _classify_static(self, n: fx.Node) -> bool:
        if self._const[n] or n.op == "placeholder" and module_state(n) is not None:
            return True
        if n.op not in ("call_function", "call_method") or n in self._writes:
            return False
        if n.op == "call_function" and n.target in _RANDOM:
            return False
        inputs = n.all_input_nodes
        if n.op == "call_method" and n.target in ("to", "type_as") and inputs and n.args[0] is inputs[0]:
            inputs = inputs[:1]  # x.to(q): only q's dtype is read
        return bool(inputs) and all(self._static.get(i, False) for i in inputs)

    def is_static(self, n: fx.Node) -> bool:
        """Whether n is computed from constants, sizes and module state only (a decay mask
        built from a per-head buffer): its value is known at compile time for the state's
        current values, and follows them when they change."""
        return self._static.get(n, False)

    def evaluate_static(self, n: fx.Node, state: Optional[dict] = None) -> Optional[torch.Tensor]:
        """The value of a static node in float64 (on the CPU, sizes at their hints), from the
        module state's values at compile time, or from `state` (placeholder -> tensor) where
        given. None where it cannot be evaluated."""
        # values from the compile-time state are kept: layers share one mask
        memo: dict = self._static_values if state is None else {}

        def arg(x):
            if isinstance(x, fx.Node):
                if x.op == "placeholder" and isinstance(example_value(x), torch.Tensor):
                    if state is not None and x in state:
                        return state[x]
                    val = module_state(x)
                    return val.detach().cpu().double() if val is not None else _ShapeOnly(example_value(x))
                if self.is_const(x):
                    return self.evaluate(x)
                if not self.is_static(x):
                    return _ShapeOnly(example_value(x))
                if x not in memo:
                    memo[x] = self._run(x, arg)
                return memo[x]
            if isinstance(x, (list, tuple)):
                return type(x)(arg(i) for i in x)
            if isinstance(x, dict):
                return {k: arg(v) for k, v in x.items()}
            if isinstance(x, torch.device):
                return torch.device("cpu")
            return size_hint(x)

        val = example_value(n)
        if not self.is_static(n) or isinstance(val, torch.Tensor) and val.numel() > _MAX_CONST_ELEMENTS:
            return None
        try:
            res = arg(n)
        except Exception:  # an exotic spelling: the candidate is simply not proven
            return None
        return res if isinstance(res, torch.Tensor) else None

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
                return _ShapeOnly(val) if isinstance(val, torch.Tensor) else size_hint(val)
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
        return size_hint(x)

    def _run(self, n: fx.Node, arg=None):
        arg = arg or self._arg
        if n.op == "get_attr":
            obj = self.graph.owning_module
            for part in n.target.split("."):
                obj = getattr(obj, part)
            return obj.detach().cpu() if isinstance(obj, torch.Tensor) else obj
        args = arg(n.args)
        kwargs = arg(dict(n.kwargs))
        if "device" in kwargs:
            kwargs["device"] = torch.device("cpu")
        if n.op == "call_method":
            self_, *rest = args
            if isinstance(self_, _ShapeOnly):
                return self_.call(n.target, rest, kwargs)
            if n.target in ("to", "type_as"):
                # x.to(q) of a data tensor q reads its dtype; values are checked in float64
                rest = [_float64_like(r) if isinstance(r, _ShapeOnly) else r for r in rest]
                rest = [r for r in rest if not isinstance(r, (torch.device, str))]
                kwargs.pop("device", None)
                if n.target == "type_as":
                    return self_.to(rest[0]) if isinstance(rest[0], torch.dtype) else self_.type_as(rest[0])
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


def _float64_like(x: "_ShapeOnly") -> torch.dtype:
    return torch.float64 if x.val.dtype.is_floating_point else x.val.dtype


def module_state(node: fx.Node) -> Optional[torch.Tensor]:
    """The value at compile time of a placeholder that Dynamo lifted from a module's state: its
    buffers, parameters and plain tensor attributes (`self.gamma = ...`, a mask cached in a
    dict on the module). None for other inputs: arguments differ from call to call."""
    arg = node.meta.get("grapharg")
    source = getattr(arg, "source", None)
    name = getattr(source, "name", "")
    name = name() if callable(name) else name
    if not isinstance(name, str):
        return None
    state = "._buffers[" in name or "._parameters[" in name or name.startswith("L['self'].")
    if not state:
        return None
    try:
        val = arg.example
    except Exception:  # noqa: BLE001 - the example is held weakly and may be gone
        return None
    return val if isinstance(val, torch.Tensor) and val.numel() <= _MAX_CONST_ELEMENTS else None


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
        return tuple(size_hint(s) for s in self.val.shape)

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
