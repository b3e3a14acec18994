"""What an argument of a GLA op is, read as *index maps* of whole tensors: the reading
``packed_spans`` uses to prove that N calls run on time slices of the same tensors.

A ``Leaf`` is a tensor node ``base`` re-indexed by views only (getitem, select, narrow, squeeze,
unsqueeze, expand, permute, transpose, a permuting einsum): each axis of ``base`` is either
read at ``out index j + offset`` or fixed at one index, and an axis of the result that no base
axis reads is broadcast. Views compose exactly on this form, so ``q[:, s:e]`` squeezed,
unsqueezed and expanded by the emitter, or ``q[:, :, s:e]`` permuted by an einsum, all read
base axis 1 (or 2) at ``out 1 + s``.

A ``Point`` is an elementwise op over such expressions (a gate computed from a slice,
``logsigmoid(x[:, s:e]) / 16``, a cast). A view of a point is pushed down to its operands when
every operand has the point's shape (no broadcasting across the view), so views always sit on
leaves.

Everything else is a leaf with the identity map. Only static sizes are read.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass, replace
from typing import Callable, Union

import torch
import torch.fx as fx

from ..core.consts import example_value, freeze
from ..core.op_names import is_pointwise, op_name


class NotAView(Exception):
    """An argument that cannot be read as index maps; the message says why."""


@dataclass(frozen=True)
class Leaf:
    base: fx.Node
    # per axis of base: ("o", out axis, offset) read at out index + offset, or ("c", index) fixed
    entries: tuple
    shape: tuple  # the sizes of the result


@dataclass(frozen=True)
class Point:
    node: fx.Node  # the elementwise op, re-emitted with Expr operands
    args: tuple  # Expr for a tensor operand, else the argument as it is
    kwargs: tuple  # (name, value) pairs
    shape: tuple


Expr = Union[Leaf, Point]

# methods whose value is their operand's, cast or copied: elementwise for this reading
_VALUE_METHODS = {"contiguous", "clone", "float", "double", "half", "bfloat16", "to"}


def static_shape(node: fx.Node) -> tuple:
    val = example_value(node)
    if not isinstance(val, torch.Tensor):
        raise NotAView("not a tensor")
    shape = tuple(val.shape)
    if not all(isinstance(s, int) for s in shape):
        raise NotAView("symbolic sizes")
    return shape


def identity(node: fx.Node) -> Leaf:
    shape = static_shape(node)
    return Leaf(node, tuple(("o", a, 0) for a in range(len(shape))), shape)


# ---- reading a node ------------------------------------------------------------------------
def trace(node: fx.Node, visited: set | None = None) -> Expr:
    """`node` as index maps of nodes the views and elementwise ops start from; `visited`
    collects the nodes read through."""
    if visited is not None:
        visited.add(node)
    if node.op in ("call_function", "call_method"):
        view = _view_of(node)
        if view is not None:
            operand, fn = view
            try:
                return push(trace(operand, visited), fn)
            except NotAView:  # a view of a broadcasting op: of that op's value, as a whole
                return fn(identity(operand))
        if is_pointwise(node) or node.op == "call_method" and node.target in _VALUE_METHODS or \
                node.target is torch.clone:
            return _point(node, visited)
    return identity(node)


def _point(node: fx.Node, visited) -> Expr:
    shape = static_shape(node)
    args = tuple(trace(a, visited) if _is_tensor(a) else _plain(a) for a in node.args)
    kwargs = tuple((k, trace(v, visited) if _is_tensor(v) else _plain(v)) for k, v in node.kwargs.items())
    return Point(node, args, kwargs, shape)


def _is_tensor(a) -> bool:
    return isinstance(a, fx.Node) and isinstance(example_value(a), torch.Tensor)


def _plain(a):
    if isinstance(a, fx.Node):  # a number computed in the graph: kept as the node
        return a
    freeze(a, {})  # raises on what cannot be compared across calls
    return a


def push(expr: Expr, fn: Callable[[Leaf], Leaf]) -> Expr:
    """The view `fn` of `expr`: applied to a leaf, pushed into a point's operands."""
    if isinstance(expr, Leaf):
        return fn(expr)
    operands = [a for a in list(expr.args) + [v for _, v in expr.kwargs] if isinstance(a, (Leaf, Point))]
    if any(a.shape != expr.shape for a in operands):
        raise NotAView("a view of an elementwise op that broadcasts")
    args = tuple(push(a, fn) if isinstance(a, (Leaf, Point)) else a for a in expr.args)
    kwargs = tuple((k, push(v, fn) if isinstance(v, (Leaf, Point)) else v) for k, v in expr.kwargs)
    pushed = [a for a in list(args) + [v for _, v in kwargs] if isinstance(a, (Leaf, Point))]
    return Point(expr.node, args, kwargs, pushed[0].shape)


# ---- views: each a function of a Leaf ------------------------------------------------------
def _view_of(node: fx.Node):
    """(operand, view function) where `node` is a view of its first argument, else None."""
    name = op_name(node)
    args = node.args
    if name == "einsum" and len(args) == 2 and isinstance(args[0], str):
        return _einsum_permute(args[0], args[1])
    if not args or not isinstance(args[0], fx.Node):
        return None
    x, rest, kw = args[0], args[1:], node.kwargs
    if name == "getitem" and isinstance(example_value(x), torch.Tensor):
        return x, lambda lf: _getitem(lf, rest[0])
    if name == "getitem" and isinstance(rest[0], int) and _is_split(x):
        return _split_part(x, rest[0])
    if name == "select":
        return x, lambda lf: _getitem_axis(lf, _arg(rest, kw, 0, "dim"), _arg(rest, kw, 1, "index"))
    if name == "narrow":
        dim, start, length = _arg(rest, kw, 0, "dim"), _arg(rest, kw, 1, "start"), _arg(rest, kw, 2, "length")
        return x, lambda lf: _narrow(lf, dim, start, length)
    if name == "squeeze":
        dims = _arg(rest, kw, 0, "dim", None)
        return x, lambda lf: _squeeze(lf, dims)
    if name == "unsqueeze":
        return x, lambda lf: _unsqueeze(lf, _arg(rest, kw, 0, "dim"))
    if name == "expand" and node.target != "expand_as" and node.target is not torch.broadcast_to:
        sizes = rest[0] if len(rest) == 1 and isinstance(rest[0], (tuple, list)) else rest
        return x, lambda lf: _expand(lf, tuple(sizes))
    if name == "permute":
        dims = rest[0] if len(rest) == 1 and isinstance(rest[0], (tuple, list)) else rest
        return x, lambda lf: _permute(lf, tuple(dims))
    if name == "transpose":
        return x, lambda lf: _transpose(lf, _arg(rest, kw, 0, "dim0"), _arg(rest, kw, 1, "dim1"))
    return None


def _is_split(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is torch.split or \
        node.op == "call_method" and node.target == "split"


def _split_part(split: fx.Node, i: int):
    """Part i of ``x.split(sizes, dim)``: x narrowed to that part's steps."""
    args, kw = split.args[1:], split.kwargs
    sizes, dim = _arg(args, kw, 0, "split_size_or_sections"), _arg(args, kw, 1, "dim", 0)
    x = split.args[0]
    total = static_shape(x)[_int(dim)]
    if isinstance(sizes, int):
        sizes = [sizes] * (total // sizes) + ([total % sizes] if total % sizes else [])
    if not isinstance(sizes, (list, tuple)) or not all(isinstance(n, int) for n in sizes) or i >= len(sizes):
        raise NotAView("a split by computed sizes")
    start = sum(sizes[:i])
    return x, lambda lf: _narrow(lf, dim, start, sizes[i])


def _arg(rest, kw, i, name, default=...):
    if i < len(rest):
        return rest[i]
    if name in kw:
        return kw[name]
    if default is ...:
        raise NotAView(f"a view without its {name}")
    return default


def _int(x) -> int:
    if not isinstance(x, int):
        raise NotAView("a view by a computed index")
    return x


def _reads(lf: Leaf, axis: int) -> list:
    """The base axes that read out axis `axis`."""
    return [i for i, e in enumerate(lf.entries) if e[0] == "o" and e[1] == axis]


def _renumber(lf: Leaf, mapping: dict, shape: tuple, fixed: dict | None = None) -> Leaf:
    """The leaf with out axes renamed by `mapping` (old -> new) and the base axes reading an
    out axis in `fixed` (old out axis -> index offset) fixed there."""
    entries = []
    for e in lf.entries:
        if e[0] == "o" and fixed and e[1] in fixed:
            entries.append(("c", e[2] + fixed[e[1]]))
        elif e[0] == "o":
            entries.append(("o", mapping[e[1]], e[2]))
        else:
            entries.append(e)
    return Leaf(lf.base, tuple(entries), shape)


def _getitem(lf: Leaf, index) -> Leaf:
    index = index if isinstance(index, tuple) else (index,)
    real = sum(1 for i in index if i is not None and i is not Ellipsis)
    if sum(1 for i in index if i is Ellipsis) > 1:
        raise NotAView("two ellipses")
    expanded = []
    for i in index:
        expanded += [slice(None)] * (len(lf.shape) - real) if i is Ellipsis else [i]
    expanded += [slice(None)] * (len(lf.shape) - sum(1 for i in expanded if i is not None))
    mapping, fixed, offsets, shape = {}, {}, {}, []
    axis = 0
    for i in expanded:
        if i is None:
            shape.append(1)
            continue
        size = lf.shape[axis]
        if isinstance(i, slice):
            start, stop, step = i.indices(size) if all(
                isinstance(v, (int, type(None))) for v in (i.start, i.stop, i.step)) else (None, None, None)
            if step != 1:
                raise NotAView("a strided or computed slice")
            mapping[axis] = len(shape)
            offsets[axis] = start
            shape.append(max(stop - start, 0))
        elif isinstance(i, int):
            fixed[axis] = i + size if i < 0 else i
        else:
            raise NotAView("indexing by a tensor")
        axis += 1
    entries = []
    for e in lf.entries:
        if e[0] == "o" and e[1] in fixed:
            entries.append(("c", e[2] + fixed[e[1]]))
        elif e[0] == "o":
            entries.append(("o", mapping[e[1]], e[2] + offsets[e[1]]))
        else:
            entries.append(e)
    return Leaf(lf.base, tuple(entries), tuple(shape))


def _getitem_axis(lf: Leaf, dim, index) -> Leaf:
    dim = _int(dim) % len(lf.shape)
    return _getitem(lf, (slice(None),) * dim + (_int(index),))


def _narrow(lf: Leaf, dim, start, length) -> Leaf:
    dim = _int(dim) % len(lf.shape)
    start = _int(start) % lf.shape[dim] if _int(start) < 0 else start
    return _getitem(lf, (slice(None),) * dim + (slice(start, start + _int(length)),))


def _squeeze(lf: Leaf, dims) -> Leaf:
    if dims is None:
        dims = [a for a, s in enumerate(lf.shape) if s == 1]
    dims = {_int(d) % len(lf.shape) for d in (dims if isinstance(dims, (tuple, list)) else [dims])}
    dims = {d for d in dims if lf.shape[d] == 1}
    keep = [a for a in range(len(lf.shape)) if a not in dims]
    return _renumber(lf, {a: i for i, a in enumerate(keep)}, tuple(lf.shape[a] for a in keep),
                     fixed=dict.fromkeys(dims, 0))


def _unsqueeze(lf: Leaf, dim) -> Leaf:
    dim = _int(dim) % (len(lf.shape) + 1)
    mapping = {a: a + (a >= dim) for a in range(len(lf.shape))}
    return _renumber(lf, mapping, lf.shape[:dim] + (1,) + lf.shape[dim:])


def _expand(lf: Leaf, sizes: tuple) -> Leaf:
    lead = len(sizes) - len(lf.shape)
    if lead < 0:
        raise NotAView("expand to fewer axes")
    shape, fixed = [], {}
    for i, s in enumerate(sizes):
        s = _int(s)
        old = i - lead
        have = lf.shape[old] if old >= 0 else 1
        new = have if s == -1 else s
        if old >= 0 and have == 1 and new != 1:
            fixed[old] = 0  # a size-1 axis broadcast: its base axes are read at one index
        elif have != new:
            raise NotAView("expand of a size that is not 1")
        shape.append(new)
    mapping = {a: a + lead for a in range(len(lf.shape))}
    return _renumber(lf, mapping, tuple(shape), fixed)


def _permute(lf: Leaf, dims: tuple) -> Leaf:
    dims = tuple(_int(d) % len(lf.shape) for d in dims)
    if sorted(dims) != list(range(len(lf.shape))):
        raise NotAView("not a permutation")
    return _renumber(lf, {old: new for new, old in enumerate(dims)}, tuple(lf.shape[d] for d in dims))


def _transpose(lf: Leaf, a, b) -> Leaf:
    dims = list(range(len(lf.shape)))
    a, b = _int(a) % len(dims), _int(b) % len(dims)
    dims[a], dims[b] = dims[b], dims[a]
    return _permute(lf, tuple(dims))


def _einsum_permute(equation: str, x):
    eq = equation.replace(" ", "")
    m = re.fullmatch(r"([a-zA-Z]+)->([a-zA-Z]+)", eq)
    if not m or not isinstance(x, fx.Node):
        return None
    src, dst = m.groups()
    if len(set(src)) != len(src) or sorted(src) != sorted(dst):
        return None
    return x, lambda lf: _permute(lf, tuple(src.index(c) for c in dst))


# ---- keys and emission ---------------------------------------------------------------------
def key(expr: Expr, time_axis: int = 1):
    """What two calls' arguments must share to be slices of one tensor along `time_axis`: the
    expression with the time offset and size left out."""
    if isinstance(expr, Leaf):
        entries = tuple(("o", e[1], "s") if e[0] == "o" and e[1] == time_axis else e for e in expr.entries)
        shape = tuple("T" if a == time_axis else s for a, s in enumerate(expr.shape))
        return ("leaf", expr.base, entries, shape)
    args = tuple(key(a, time_axis) if isinstance(a, (Leaf, Point)) else freeze(a, {}) for a in expr.args)
    kwargs = tuple((k, key(v, time_axis) if isinstance(v, (Leaf, Point)) else freeze(v, {}))
                   for k, v in expr.kwargs)
    return ("point", expr.node.op, expr.node.target, args, kwargs)


def leaves(expr: Expr) -> list:
    if isinstance(expr, Leaf):
        return [expr]
    return [lf for a in list(expr.args) + [v for _, v in expr.kwargs] if isinstance(a, (Leaf, Point))
            for lf in leaves(a)]


def nodes_read(expr: Expr) -> list:
    """The graph nodes the expression reads: its leaves' bases, numbers computed in the graph."""
    if isinstance(expr, Leaf):
        return [expr.base]
    return [n for a in list(expr.args) + [v for _, v in expr.kwargs]
            for n in (nodes_read(a) if isinstance(a, (Leaf, Point)) else [a] if isinstance(a, fx.Node) else [])]


def time_reads(expr: Expr, time_axis: int = 1) -> list:
    """(base, base axis, offset) of every leaf axis that reads the time axis."""
    return [(lf.base, i, e[2]) for lf in leaves(expr) for i, e in enumerate(lf.entries)
            if e[0] == "o" and e[1] == time_axis]


def at_time(expr: Expr, offset: int, length: int, time_axis: int = 1) -> Expr:
    """The same expression reading `length` steps from `offset` of its time axis."""
    if isinstance(expr, Leaf):
        entries = tuple(("o", e[1], offset) if e[0] == "o" and e[1] == time_axis else e for e in expr.entries)
        shape = tuple(length if a == time_axis else s for a, s in enumerate(expr.shape))
        return Leaf(expr.base, entries, shape)
    args = tuple(at_time(a, offset, length, time_axis) if isinstance(a, (Leaf, Point)) else a for a in expr.args)
    kwargs = tuple((k, at_time(v, offset, length, time_axis) if isinstance(v, (Leaf, Point)) else v)
                   for k, v in expr.kwargs)
    shape = tuple(length if a == time_axis else s for a, s in enumerate(expr.shape))
    return replace(expr, args=args, kwargs=kwargs, shape=shape)


def emit(em, expr: Expr) -> fx.Node:
    """`expr` as graph nodes, inserted by the Emitter `em`."""
    if isinstance(expr, Leaf):
        return _emit_leaf(em, expr)
    args = tuple(emit(em, a) if isinstance(a, (Leaf, Point)) else a for a in expr.args)
    kwargs = {k: emit(em, v) if isinstance(v, (Leaf, Point)) else v for k, v in expr.kwargs}
    return em.call(expr.node.target, *args, op=expr.node.op, **kwargs)


def _emit_leaf(em, lf: Leaf) -> fx.Node:
    """base -> fixed axes selected -> offsets and sizes narrowed -> permuted to out order ->
    broadcast axes inserted and expanded."""
    node, base_shape = lf.base, static_shape(lf.base)
    if lf == identity(lf.base):
        return node
    index, read = [], []  # read: out axis of each axis kept, in base order
    for i, e in enumerate(lf.entries):
        if e[0] == "c":
            index.append(e[1])
            continue
        _, out, off = e
        index.append(slice(None) if (off, lf.shape[out]) == (0, base_shape[i]) else slice(off, off + lf.shape[out]))
        read.append(out)
    if any(i != slice(None) for i in index):
        node = em.call(operator.getitem, node, tuple(index))
    if len(set(read)) != len(read):
        raise NotAView("two axes of a tensor read as one")
    order = sorted(range(len(read)), key=lambda j: read[j])
    if order != list(range(len(read))):
        node = em.call(torch.permute, node, tuple(order))
    present = sorted(read)
    if len(present) < len(lf.shape):
        node = em.call(operator.getitem, node, tuple(slice(None) if a in present else None
                                                     for a in range(len(lf.shape))))
        node = em.call("expand", node, *lf.shape, op="call_method")
    return node
