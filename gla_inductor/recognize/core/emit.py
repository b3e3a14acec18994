"""Building the replacement: canonical [B, T, H, D] inputs, the GLA op call, and the
outputs laid out back the way the user's graph had them.

A *group* is a product of factors (with a coefficient) whose index variables carry role
letters: ``b``/``h`` (batch axes), ``t`` (time), ``k``/``v`` (head dims). ``lift`` turns a
group into one tensor whose axes are given role letters, with one ``einsum`` over the
factors' base tensors: time-sliced atoms (``k[:, t]``) become the whole base tensor with
its time axis lettered ``t``, which is what "lifting a loop body to the whole sequence"
means.

A role whose axis the user's code merged from parts (heads from groups x repeats, B*H) is
*split*: ``splits["h"] == "AB"`` names its parts with upper-case sub-letters. A factor that
carries only some parts (the per-group B of Mamba2) is broadcast over the others, and the
parts are merged back into the role's axis by one reshape.

Every recognizer describes the op it inserts as a ``GLACall`` of graph nodes
(``gla_inductor.contract``), and ``emit_op`` turns it into the op call.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx as fx

from ...contract import GLACall
from .consts import example_value
from .match import Reject
from .placement_dtensor import chunk_fwd_target


class EmitError(Exception):
    pass


@dataclass(frozen=True)
class LFactor:
    """A factor with role letters: `letters[i]` names axis i of `node` ('1' for size 1,
    't' for the time axis)."""

    node: fx.Node
    letters: str
    select: tuple = ()  # (axis, index) of `node` fixed first; letters name the axes left
    # Sizes to reshape the selected node to first, when an axis of it is several letters
    # merged (one size per letter); () when every axis is one letter.
    unflatten: tuple = ()
    # A tensor each step of a loop computes from its own time slices: `node` is the last
    # step's, and `lifted.emit(emitter)` the whole sequence, time first (letters[0] == 't').
    lifted: Any = None


@dataclass(frozen=True)
class Group:
    coef: float
    factors: tuple  # LFactor


class Transaction:
    """Every change a rewrite makes to the graph, so that it can be undone.

    Nodes are only created and inputs only re-pointed until `commit`, which erases what the
    rewrite made dead (setitems into replaced buffers); `rollback_to` undoes back to a mark."""

    def __init__(self, graph: fx.Graph):
        self.graph = graph
        self.created: list[fx.Node] = []
        self.rewires: list[tuple] = []
        self.erase: list[fx.Node] = []

    def mark(self) -> tuple:
        return len(self.created), len(self.rewires), len(self.erase)

    def replace_input(self, user: fx.Node, old: fx.Node, new: fx.Node) -> None:
        user.replace_input_with(old, new)
        self.rewires.append((user, old, new))

    def replace_all_uses(self, old: fx.Node, new: fx.Node) -> None:
        for user in list(old.users):
            if user is not new:
                self.replace_input(user, old, new)

    def rollback_to(self, mark: tuple) -> None:
        n_created, n_rewires, n_erase = mark
        while len(self.rewires) > n_rewires:
            user, old, new = self.rewires.pop()
            user.replace_input_with(new, old)
        while len(self.created) > n_created:
            self.graph.erase_node(self.created.pop())
        del self.erase[n_erase:]

    def commit(self) -> None:
        for node in self.erase:
            self.graph.erase_node(node)
        self.erase.clear()


class Emitter:
    """Inserts nodes before `anchor`, giving each a fake `example_value`."""

    def __init__(self, txn: Transaction, anchor: fx.Node, sizes: dict, splits: dict | None = None):
        self.txn = txn
        self.graph = txn.graph
        self.anchor = anchor
        self.sizes = sizes  # role letter -> int or (node, axis) that holds that size
        self.splits = splits or {}  # role letter -> its sub-letters, for merged roles
        self.fake_mode = fake_mode(self.graph)
        self.memo: dict = {}  # nodes emitted once for several uses (a lifted per-step tensor)

    def call(self, target, *args, op: str = "call_function", **kwargs) -> fx.Node:
        with self.graph.inserting_before(self.anchor):
            if op == "call_method":
                node = self.graph.call_method(target, args, kwargs)
            else:
                node = self.graph.call_function(target, args, kwargs)
        self.txn.created.append(node)
        vals = fx.node.map_arg((args, kwargs), lambda n: example_value(n))
        with self.fake_mode:
            if op == "call_method":
                val = getattr(vals[0][0], target)(*vals[0][1:], **vals[1])
            else:
                val = target(*vals[0], **vals[1])
        node.meta["example_value"] = val
        return node

    # ---- building blocks -------------------------------------------------------------
    def size(self, letter: str):
        if letter == "1":
            return 1
        if letter in self.splits:
            n = 1
            for c in self.splits[letter]:
                n = self.times(n, self.size(c))
            return n
        s = self.sizes[letter]
        if isinstance(s, tuple):
            node, axis = s
            val = example_value(node).shape[axis]
            if isinstance(val, int):
                return val
            return self.call("size", node, axis, op="call_method")
        return s

    def times(self, a, b):
        """a * b for sizes that are ints or nodes of symbolic sizes (dynamic=True)."""
        if isinstance(a, int) and isinstance(b, int):
            return a * b
        if isinstance(a, int) and a == 1 or isinstance(b, int) and b == 1:
            return b if isinstance(a, int) else a
        return self.call(operator.mul, a, b)

    def split_letters(self, letters: str) -> str:
        return "".join(self.splits.get(c, c) for c in letters)

    def lift(self, group: Group, out: str, full: bool = True) -> fx.Node:
        """One tensor with axes `out` (role letters) equal to the group's product; axes no
        factor has are broadcast (expanded when `full`)."""
        tensors = [f for f in group.factors if isinstance(example_value(f.node), torch.Tensor)]
        scalars = [f.node for f in group.factors if f not in tensors]
        if not tensors:
            raise EmitError("a group without a tensor")
        xout = self.split_letters(out)
        present = set()
        for f in tensors:
            present |= set(f.letters) - {"1"}
        if not present <= set(xout):
            raise EmitError(f"group has axes {sorted(present)} outside {out}")
        inner = "".join(c for c in xout if c in present)
        node = self._einsum(tensors, inner)
        for s in scalars:
            node = self.call(torch.mul, node, s)
        if group.coef != 1.0:
            node = self.call(torch.mul, node, group.coef)
        # a merged role some factor has part of is broadcast over its other parts
        force = set()
        for r, subs in self.splits.items():
            if r in out and set(subs) & present:
                force |= set(subs)
        node = self.place(node, inner, xout, full, force)
        return self._merge(node, xout, out, full, present | force)

    def place(self, node: fx.Node, have: str, out: str, full: bool = True, force=frozenset()) -> fx.Node:
        """Insert size-1 axes for letters of `out` missing from `have` (a subsequence)."""
        shape_idx = []
        j = 0
        for c in out:
            if j < len(have) and have[j] == c:
                j += 1
            else:
                shape_idx.append(None)
                continue
            shape_idx.append(slice(None))
        if None in shape_idx:
            node = self.call(operator.getitem, node, tuple(shape_idx))
            if full or force:
                sizes = [self.size(c) if c not in have and (full or c in force) else -1 for c in out]
                node = self.call("expand", node, *sizes, op="call_method")
        return node

    def _merge(self, node: fx.Node, xout: str, out: str, full: bool, present: set) -> fx.Node:
        """Reshape the sub-letter axes `xout` into the role axes `out`."""
        if xout == out:
            return node
        sizes = []
        for c in out:
            subs = self.splits.get(c, c)
            sizes.append(self.size(c) if full or set(subs) & present else 1)
        return self.call("reshape", node, *sizes, op="call_method")

    def layout_like(self, node: fx.Node, like: fx.Node) -> fx.Node:
        """node made contiguous where `like` (the user's tensor it replaces) is and node is not:
        the user's code may ``view`` it or what it computes from it elementwise, which a permuted
        layout can refuse (a size-1 batch changes which axes the relayout permutes). The copy is
        one pass over the output, against the op's passes over q, k, v and o."""
        if example_value(like).is_contiguous() and not example_value(node).is_contiguous():
            node = self.call("contiguous", node, op="call_method")
        return node

    def cast_like(self, node: fx.Node, like: fx.Node) -> fx.Node:
        """node in the dtype of `like` (node itself when it has it)."""
        want = example_value(like).dtype
        if example_value(node).dtype != want:
            node = self.call("to", node, want, op="call_method")
        return node

    def as_float32(self, node: fx.Node) -> fx.Node:
        if example_value(node).dtype != torch.float32:
            node = self.call("float", node, op="call_method")
        return node

    def expand_to(self, node: fx.Node, letters: str) -> fx.Node:
        """Broadcast to the full size of every axis in `letters` (a no-op when it is)."""
        sizes = [self.size(c) for c in letters]
        symbolic = any(isinstance(s, fx.Node) for s in sizes)
        if symbolic or tuple(example_value(node).shape) != tuple(sizes):
            node = self.call("expand", node, *sizes, op="call_method")
        return node

    def relayout(self, node: fx.Node, have, want) -> fx.Node:
        """From axes `have` to `want`, each a string of role letters (one per axis) or a list
        of strings (one per axis; several letters for an axis that merges those roles):
        splits merged axes, drops size-1 letters not wanted, permutes, inserts '1' axes and
        merges the wanted groups."""
        if not isinstance(have, str):
            if any(len(g) > 1 for g in have):
                node = self.call("reshape", node, *[self.size(c) for g in have for c in g], op="call_method")
            have = "".join(have)
        groups = list(want)
        flat = "".join(groups)
        keep = "".join(c for c in flat if c != "1" and c in have)  # a role absent here has size 1
        drop = [i for i, c in enumerate(have) if c not in keep]
        for i in reversed(drop):
            node = self.call(torch.squeeze, node, i)
        cur = "".join(c for c in have if c in keep)
        if cur != keep:
            node = self.call(torch.permute, node, tuple(cur.index(c) for c in keep))
        if any(len(g) > 1 for g in groups):
            sizes = []
            for g in groups:
                n = 1
                for c in g:
                    n = self.times(n, self.size(c)) if c != "1" else n
                sizes.append(n)
            return self.call("reshape", node, *sizes, op="call_method")
        idx = tuple(slice(None) if c in keep else None for c in flat)
        if None in idx:
            node = self.call(operator.getitem, node, idx)
        return node

    def _einsum(self, factors, out: str) -> fx.Node:
        if len(factors) == 1 and factors[0].letters.replace("1", "") == out:
            node = self.selected(factors[0])
            # one axis at a time: DTensor has a sharding rule for squeeze.dim on every torch we
            # support, for squeeze.dims (several axes at once) only on recent ones
            for i in reversed([i for i, c in enumerate(factors[0].letters) if c == "1"]):
                node = self.call(torch.squeeze, node, i)
            return node
        dummy = iter("acdefgijlmnopqrsuwxyz")
        specs = []
        for f in factors:
            spec = ""
            for c in f.letters:
                spec += next(dummy) if c == "1" else c
            specs.append(spec)
        eq = ",".join(specs) + "->" + out
        return self.call(torch.einsum, eq, *[self.selected(f) for f in factors])

    def selected(self, f: LFactor) -> fx.Node:
        node = f.node if f.lifted is None else f.lifted.emit(self)
        for axis, index in sorted(f.select, reverse=True):
            node = self.call(torch.select, node, axis, index)
        if f.unflatten:
            node = self.call("reshape", node, *f.unflatten, op="call_method")
        return node


def lfactor(node: fx.Node, select: tuple, per_axis: list, lifted=None, shape=None) -> LFactor:
    """An LFactor of `node` with `select` fixed first, given (letters, sizes) per axis left:
    an axis that carries several letters (roles the code merged) is unflattened into one per
    letter, of the sizes given. `shape`: the node's shape, where it is not its example's."""
    letters = "".join(ls for ls, _ in per_axis)
    if all(len(ls) == 1 for ls, _ in per_axis):
        return LFactor(node, letters, select, lifted=lifted)
    shape = example_value(node).shape if shape is None else shape
    axes = [a for a in range(len(shape)) if a not in {a for a, _ in select}]
    sizes = []
    for a, (ls, sz) in zip(axes, per_axis):
        sizes += [shape[a]] if len(ls) == 1 else list(sz)
    if not all(isinstance(s, int) for s in sizes):
        raise Reject("an input's merged axis has a symbolic size")
    return LFactor(node, letters, select, tuple(sizes), lifted)


# ---- the GLA op ------------------------------------------------------------------------------
def emit_op(em: Emitter, call: GLACall, in_place_state: Optional[fx.Node] = None) -> fx.Node:
    """The GLA op for `call`, a GLACall of graph nodes, inserted by `em`: ``chunk_fwd``, whose
    value is (o, final state); or, given the state it updates in place (the cache a decode step
    reads and writes back, as [B, H, K, V]), ``fused_recurrent``, whose value is o. DTensor inputs
    sharded over time get context parallelism in chunk_fwd's place (``placement_dtensor``)."""
    if in_place_state is not None:
        return em.call(fused_recurrent_op(), *call.recurrent_op_args(in_place_state))
    return em.call(chunk_fwd_target(call), *call.op_args())


def drop_final_state(op: fx.Node, call: GLACall) -> None:
    """Rewrite `op`, emitted for `call`, not to store the final state (nothing reads it)."""
    op.args = call.replace(output_final_state=False).op_args()


def fused_recurrent_op():
    """The in-place recurrent op, or None where it is not registered."""
    ops = torch.ops.gla_inductor
    return ops.fused_recurrent.default if hasattr(ops, "fused_recurrent") else None


def fake_mode(graph: fx.Graph):
    """The fake mode of the graph's own example values (Dynamo's), so new values mix."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    for n in graph.nodes:
        val = example_value(n)
        if isinstance(val, FakeTensor):
            return val.fake_mode
    return FakeTensorMode(allow_non_fake_inputs=True)


def sizes_from(factors) -> dict:
    """Role letter -> (node, axis) of an input that has that axis; b and h default to 1."""
    sizes: dict = {"b": 1, "h": 1}
    for lf in factors:
        val = example_value(lf.node)
        if not isinstance(val, torch.Tensor):
            continue
        if lf.unflatten:
            for c, s in zip(lf.letters, lf.unflatten):
                if c != "1" and (c not in sizes or sizes[c] == 1):
                    sizes[c] = s
            continue
        selected = {a for a, _ in lf.select}
        if lf.lifted is not None:  # axis 0 is time, axis a + 1 the last step's axis a
            axes = [None] + [a for a in range(val.dim()) if a + 1 not in selected]
        else:
            axes = [a for a in range(val.dim()) if a not in selected]
        for axis, c in zip(axes, lf.letters):
            if c != "1" and (c not in sizes or sizes[c] == 1):
                sizes[c] = lf.lifted.steps if axis is None else (lf.node, axis)
    return sizes
