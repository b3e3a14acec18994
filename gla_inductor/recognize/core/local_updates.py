"""In-place updates of a local tensor read as the values they compute.

Users write a state update as ``S *= decay; S += k v`` or ``S.mul_(d); S.add_(x)``. Dynamo keeps
the writes, and the normal form reads node values, so every later read of S is STALE to the
algebra and no form sees the recurrence. Where the written memory is the program's own and
nothing else can see it, each write is the functional op on the value before it
(``S.mul_(d)`` is ``S * d``), and each read of S reads the latest such value. That is what this
module makes of the graph before the forms read it (the program computes the same either way:
the writes' memory was the program's alone).

Only where that is exact:
  * the memory is a fresh tensor of the program: a constructor (``new_zeros``, ``torch.zeros``,
    ...), a clone, or the result of an arithmetic op, never an input, a buffer or a view;
  * every write is a whole-tensor ``mul_ / add_ / sub_ / div_`` (or ``*=``, ``+=``, ``-=``, ``/=``),
    or a mask or triangle ``masked_fill_ / tril_ / triu_`` (scores masked in place, as FLA's naive
    chunked linear attention writes ``(q @ k^T).masked_fill_(triu, 0) @ v``), whose functional
    result keeps the tensor's shape and dtype (no promotion the write would have cast away);
  * every other reader makes a new tensor from the value (arithmetic, reductions, products,
    stack / cat, clone, a copy into other memory): no view or alias that a later write would
    change behind the reader's back.
Anything else leaves the tensor's writes as they are.
"""

from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx as fx

from .consts import example_value, written_args
from .emit import Emitter, Transaction, fake_mode
from .op_names import op_name

# in-place write -> (the functional op, call_method or call_function)
_METHOD_WRITES = {"mul_": "mul", "add_": "add", "sub_": "sub", "div_": "div", "masked_fill_": "masked_fill",
                  "tril_": "tril", "triu_": "triu"}
_FUNCTION_WRITES = {operator.imul: operator.mul, operator.iadd: operator.add, operator.isub: operator.sub,
                    operator.itruediv: operator.truediv}
# readers whose result is new memory computed from the value read
_FRESH_OPS = {"add", "sub", "mul", "div", "neg", "exp", "exp2", "pow", "sum", "matmul", "bmm", "mm", "einsum",
              "where", "masked_fill", "rsub", "tril", "triu"}
_FRESH_FUNCTIONS = {torch.stack, torch.cat, torch.clone}
_CONSTRUCTOR_METHODS = {"new_zeros", "new_ones", "new_full", "clone"}
_CONSTRUCTORS = {torch.zeros, torch.ones, torch.full, torch.zeros_like, torch.ones_like, torch.full_like, torch.clone}


def functionalize(graph: fx.Graph) -> int:
    """Replace the qualifying local tensors' in-place writes by their functional values, their
    readers re-pointed to the value current where they read. Returns how many tensors."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    done = 0
    for root in list(graph.nodes):
        if _is_write(root) or not _fresh(root):
            continue
        members = _chain(root)
        if len(members) > 1 and _only_safe_readers(members) and _shape_and_dtype_kept(root, members):
            _rewrite(graph, sorted(members, key=order.__getitem__), order)
            done += 1
    return done


def _is_write(n: fx.Node) -> bool:
    return (n.op == "call_method" and n.target in _METHOD_WRITES
            or n.op == "call_function" and n.target in _FUNCTION_WRITES) and bool(n.args) \
        and isinstance(n.args[0], fx.Node)


def _fresh(n: fx.Node) -> bool:
    """Whether n's value is memory of its own: a constructor, a clone, an arithmetic result."""
    if not isinstance(example_value(n), torch.Tensor) or written_args(n):
        return False  # (`torch.mul(a, b, out=c)` returns c's memory)
    if n.op == "call_method":
        return n.target in _CONSTRUCTOR_METHODS or op_name(n) in _FRESH_OPS
    if n.op == "call_function":
        return n.target in _CONSTRUCTORS or op_name(n) in _FRESH_OPS
    return False


def _chain(root: fx.Node) -> set:
    """root and the writes into it: each write's first argument is root or an earlier write (which
    returns its first argument)."""
    members, todo = {root}, [root]
    while todo:
        node = todo.pop()
        for user in node.users:
            if _is_write(user) and user.args[0] is node and user not in members:
                members.add(user)
                todo.append(user)
    return members


def _only_safe_readers(members: set) -> bool:
    for m in members:
        for user in m.users:
            if user in members and user.args[0] is m:
                continue  # the next write
            if not _safe_reader(user, m):
                return False
    return True


def _safe_reader(user: fx.Node, m: fx.Node) -> bool:
    if user.op == "output":
        return True
    if user.op == "call_method" and user.target == "copy_":
        return len(user.args) >= 2 and user.args[0] is not m  # m copied into other memory
    if written_args(user):
        return False  # it writes somewhere (`out=`, an in-place op this module does not read)
    if user.op == "call_function" and user.target in _FRESH_FUNCTIONS:
        return True
    if user.op == "call_method" and user.target == "clone":
        return True
    return op_name(user) in _FRESH_OPS and not _is_write(user)


def _shape_and_dtype_kept(root: fx.Node, members: set) -> bool:
    """Each write's functional result has the tensor's shape and dtype (checked on the example
    values: the op on the value before it)."""
    ref = example_value(root)
    for w in members:
        if not _is_write(w):
            continue
        val = _functional_value(w)
        if not isinstance(val, torch.Tensor) or val.shape != ref.shape or val.dtype != ref.dtype:
            return False
    return True


def _functional_value(w: fx.Node) -> Optional[torch.Tensor]:
    vals = fx.node.map_arg((w.args, w.kwargs), example_value)
    with fake_mode(w.graph):
        try:
            if w.op == "call_method":
                return getattr(vals[0][0], _METHOD_WRITES[w.target])(*vals[0][1:], **vals[1])
            return _FUNCTION_WRITES[w.target](*vals[0], **vals[1])
        except Exception:  # noqa: BLE001 - not computable here: not rewritten
            return None


def _rewrite(graph: fx.Graph, members: list, order: dict) -> None:
    """Walk the graph from the root: each write becomes its functional op on the current value,
    each read reads the current value."""
    member_set = set(members)
    readers = sorted({u for m in members for u in m.users if u not in member_set}, key=order.__getitem__)
    writes = [w for w in members if _is_write(w)]
    current = members[0]
    events = sorted([(order[w], 1, w) for w in writes] + [(order[u], 0, u) for u in readers],
                    key=lambda e: (e[0], e[1]))
    txn = Transaction(graph)  # (its bookkeeping only: the change is kept)
    for _, is_write, node in events:
        if is_write:
            em = Emitter(txn, node, {})
            args = [current] + [current if a in member_set else a for a in node.args[1:]]
            kwargs = {k: current if a in member_set else a for k, a in node.kwargs.items()}
            if node.op == "call_method":
                value = em.call(_METHOD_WRITES[node.target], *args, op="call_method", **kwargs)
            else:
                value = em.call(_FUNCTION_WRITES[node.target], *args, **kwargs)
            for key in ("stack_trace", "source_fn_stack", "nn_module_stack"):
                if key in node.meta:
                    value.meta[key] = node.meta[key]
            current = value
        else:
            for a in list(node.all_input_nodes):
                if a in member_set:
                    txn.replace_input(node, a, current)
    for w in reversed(writes):  # each write's users: the later writes, erased first
        graph.erase_node(w)
