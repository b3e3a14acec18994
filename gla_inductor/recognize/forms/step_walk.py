"""Tensors each step of an unrolled loop computes from its own time slices.

Dynamo unrolls `dt = F.softplus(dt_raw[:, t] + dt_bias)` into one node per step, each an
opaque atom to the algebra, so the steps' decays (or keys, values) name different nodes.
``step_walk`` reads such a node as a function of slices of tensors computed outside the
steps; steps whose walks agree but for the time index compute the same function, and the
emitted op reads it once over the whole sequence (``StepLift``): replayed on the un-sliced
tensors (time first), or, for an op this replay does not know, the steps' own nodes stacked
over time.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.fx as fx

from ..core.algebra import axis_size, rank_of, unit_slice
from ..core.analyzer import Analyzer
from ..core.consts import example_value, written_args
from ..core.emit import Emitter
from ..core.match import Reject
from ..core.op_names import is_pointwise, op_name

MAX_STEP_NODES = 48  # ops in one step's computation of one tensor


class _Unknown(Exception):
    """Arguments `step_walk` cannot key (symbolic, tensors, unhashable)."""


@dataclass(frozen=True, eq=False)
class StepWalk:
    """One step's computation of `node`. kind "in": an input of the walk, the same tensor
    whichever step reads it (`node` is the canonical node); "slice": `node` reads `base` at
    fixed indices and is otherwise a view of it; "op": `node` applied to its inputs' walks
    (`children`). A slice of a base that is not an input has the base's walk as its child."""

    kind: str
    node: fx.Node
    key: tuple  # the structure with the slice indices left out, inputs' walks by their ids
    id: int  # equal for equal keys (so a key hashes in the time of its own arguments)
    # per slice read, in a fixed order: ((ident, axis, index, base), ...); ident names the
    # sliced tensor the same way in every step (the key of its walk), base is the node
    params: tuple
    size: int
    children: dict = field(default_factory=dict)  # input node -> its walk
    base: Optional[fx.Node] = None  # "slice": the tensor sliced
    how: tuple = ()  # "slice": ("getitem", items) | ("select" | "unbind" | "narrow", dim)


def _slice_of(an: Analyzer, n: fx.Node) -> Optional[tuple]:
    """(base, how, [(axis, index, item position)]) for a node that reads fixed indices of a
    tensor: x[..., i, ...] (ints or one-element slices), x.select(d, i), x.unbind(d)[i],
    x.narrow(d, i, 1). Other slices are kept as they are (part of the structure)."""
    name = op_name(n)
    if name not in ("getitem", "select", "narrow") or not n.args or not isinstance(n.args[0], fx.Node):
        return None
    src = n.args[0]
    if name == "getitem" and op_name(src) == "unbind":
        base, dim, index, how = src.args[0], _arg(src, 1, "dim", 0), n.args[1], "unbind"
        if an.versions.get((src, base), base) is not base:
            return None
    elif name == "getitem":
        return _getitem_slices(an, n)
    elif name == "select":
        base, dim, index, how = src, _arg(n, 1, "dim", None), _arg(n, 2, "index", None), "select"
    else:
        base, dim, index, how = src, _arg(n, 1, "dim", None), _arg(n, 2, "start", None), "narrow"
        if _arg(n, 3, "length", None) != 1:
            return None
    if not isinstance(base, fx.Node) or not _plain_int(dim) or not _plain_int(index):
        return None
    if an.versions.get((n, src), src) is not src:
        return None
    rank = rank_of(base)
    if not rank:
        return None
    dim %= rank
    index = _normal_index(index, axis_size(base, dim))
    if index is None:
        return None
    return base, (how, dim), [(dim, index, None)]


def _getitem_slices(an: Analyzer, n: fx.Node) -> Optional[tuple]:
    base, index = n.args[0], n.args[1]
    if an.versions.get((n, base), base) is not base:
        return None
    index = index if isinstance(index, tuple) else (index,)
    if not all(i is None or i is Ellipsis or isinstance(i, slice) or _plain_int(i) for i in index):
        return None  # tensor or symbolic indices
    rank = rank_of(base)
    n_real = sum(1 for i in index if i is not None and i is not Ellipsis)
    if index.count(Ellipsis) > 1 or n_real > rank:
        return None
    items: list = []
    for i in index:
        items += [slice(None)] * (rank - n_real) if i is Ellipsis else [i]
    items += [slice(None)] * (rank - sum(1 for i in items if i is not None))
    found, axis = [], 0
    for pos, i in enumerate(items):
        if i is None:
            continue
        size = axis_size(base, axis)
        if isinstance(i, slice):
            unit = unit_slice(i, size) if all(x is None or _plain_int(x) for x in (i.start, i.stop, i.step)) else None
            i = unit if isinstance(unit, int) and not isinstance(unit, bool) else None
        if i is not None:
            index = _normal_index(i, size)
            if index is None:
                return None
            found.append((axis, index, pos))
        axis += 1
    if not found:
        return None
    return base, ("getitem", tuple(items)), found


def _arg(n: fx.Node, pos: int, name: str, default):
    return n.args[pos] if len(n.args) > pos else n.kwargs.get(name, default)


def _plain_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _normal_index(index: int, size) -> Optional[int]:
    if isinstance(size, int):
        return index % size if -size <= index < size else None
    return index if index >= 0 else None


def _sliced(an: Analyzer) -> set:
    """The nodes that read a slice at fixed indices, or are computed from one."""
    if "sliced" not in an.memo:
        sliced: set = set()
        for n in an.nodes:
            if any(x in sliced for x in n.all_input_nodes) or _slice_of(an, n) is not None:
                sliced.add(n)
        an.memo["sliced"] = sliced
    return an.memo["sliced"]


def step_walk(an: Analyzer, node: fx.Node) -> Optional[StepWalk]:
    """How `node` is computed from slices of tensors computed outside the steps; None for a
    node that reads no slice, or that is an input itself (memoized per graph)."""
    if node.op not in ("call_function", "call_method") or node not in _sliced(an):
        return None
    w = _walk_of(an, node)
    return None if w.kind == "in" else w


def _walk_of(an: Analyzer, node: fx.Node) -> StepWalk:
    """node's walk, inputs first. Each node's walk depends on its inputs' walks only (not on
    who asks), so the steps' walks are comparable; a node past a long loop reaches back
    through every step, hence a stack rather than recursion."""
    memo = an.memo.setdefault("walks", {})
    stack = [node]
    while stack:
        n = stack[-1]
        if n in memo:
            stack.pop()
            continue
        todo = [x for x in _walk_inputs(an, n) if x not in memo]
        if todo:
            stack += todo
            continue
        memo[stack.pop()] = _make_walk(an, n, memo)
    return memo[node]


def _is_input(an: Analyzer, n: fx.Node) -> bool:
    """Nodes the walk does not look into. A node that reads no slice is named by value
    numbering, which leaves getitem alone: `w[None]` taken anew each step is walked."""
    if n not in _sliced(an) and n.target is not operator.getitem:
        return True
    return n.op not in ("call_function", "call_method") or bool(written_args(n))


def _walk_inputs(an: Analyzer, n: fx.Node) -> list:
    if _is_input(an, n):
        return []
    sl = _slice_of(an, n)
    return [sl[0]] if sl is not None else n.all_input_nodes


def _make_walk(an: Analyzer, n: fx.Node, memo: dict) -> StepWalk:
    """n's walk from its inputs' (in memo). Where n cannot be read as a step's computation
    (too large, reads a value written in place, arguments with no key), n is an input: a
    tensor named by its node, equal between steps only where they read the same one."""
    if _is_input(an, n):
        return _input_walk(an, n)
    try:
        sl = _slice_of(an, n)
        return _slice_walk(an, n, sl, memo[sl[0]]) if sl is not None else _op_walk(an, n, memo)
    except _Unknown:
        return _input_walk(an, n)


def _op_walk(an: Analyzer, n: fx.Node, memo: dict) -> StepWalk:
    children = {}
    for x in n.all_input_nodes:
        if an.versions.get((n, x), x) is not x:
            return _input_walk(an, n)  # reads a value written in place: n is what it read
        children[x] = memo[x]
    size = 1 + sum(c.size for c in children.values())
    if size > MAX_STEP_NODES:
        return _input_walk(an, n)  # too large to be one step's
    key = ("op", n.op, _frozen(n.target, {}), _frozen((n.args, n.kwargs), {x: c.id for x, c in children.items()}))
    params = tuple(p for c in children.values() for p in c.params)
    return StepWalk("op", n, key, _key_id(an, key), params, size, children)


def _input_walk(an: Analyzer, n: fx.Node) -> StepWalk:
    c = an.canon.get(n, n)
    return StepWalk("in", c, ("in", c), _key_id(an, ("in", c)), (), 0)


def _key_id(an: Analyzer, key: tuple) -> int:
    ids = an.memo.setdefault("walk_ids", {})
    return ids.setdefault(key, len(ids))


def _slice_walk(an: Analyzer, n: fx.Node, sl: tuple, bw: StepWalk) -> StepWalk:
    """Fixed indices are the walk's params, not its structure, whether the base is an input
    (x[:, t]) or itself computed from slices (`g[:, t]` of g = qkvg.unbind(2)[3], which
    reads no time slice of the loop: the same tensor every step)."""
    base, how, found = sl
    if bw.kind == "in":
        base = bw.node
    size = 1 + bw.size
    if size > MAX_STEP_NODES:
        return _input_walk(an, n)
    positions = tuple(pos for _, _, pos in found)
    if how[0] == "getitem":
        template = tuple("#" if p in positions else _frozen(i, {}) for p, i in enumerate(how[1]))
    else:
        template = how[1]
    ident = bw.id
    key = ("slice", ident, how[0], template, positions)
    own = tuple((ident, a, i, base) for a, i, _ in found)
    children = {} if bw.kind == "in" else {base: bw}
    return StepWalk("slice", n, key, _key_id(an, key), bw.params + (own,), size, children, base=base, how=how)


def _frozen(x, keys: dict):
    """A hashable structure of node arguments, nodes replaced by their walks' keys."""
    if isinstance(x, fx.Node):
        return keys[x]
    if isinstance(x, (list, tuple)):
        return (type(x).__name__,) + tuple(_frozen(i, keys) for i in x)
    if isinstance(x, dict):
        return ("dict",) + tuple((k, _frozen(v, keys)) for k, v in sorted(x.items()))
    if isinstance(x, slice):
        return ("slice", _frozen(x.start, keys), _frozen(x.stop, keys), _frozen(x.step, keys))
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool, torch.Tensor)):
        raise _Unknown
    try:
        hash(x)
    except TypeError:
        raise _Unknown from None
    return x


@dataclass(eq=False)
class StepLift:
    """A per-step tensor lifted to the whole sequence (the `lifted` of an LFactor)."""

    walk: StepWalk  # the step's own walk (the last step's is emitted)
    sig: tuple  # the walk's key and its slice indices, 't' for the time index
    varies: dict  # walk -> whether it reads a time slice
    is_time: set
    steps: int
    stacks: Optional[dict]  # sig -> {tau: node} when the replay does not know an op

    def deps(self) -> list:
        if self.stacks is not None:
            return list(self.stacks[self.sig].values())
        found: dict = {}
        self._deps(self.walk, found)
        return [n for n in found if isinstance(n, fx.Node)]

    def _deps(self, w: StepWalk, found: dict) -> None:
        if not self.varies[w] or w.kind == "in":
            found[w.node] = None
        elif w.kind == "slice" and not self.varies_of(w):
            found[w.base] = None
        else:
            for c in w.children.values():
                self._deps(c, found)

    def emit(self, em: Emitter) -> fx.Node:
        if self.stacks is not None:
            nodes = self.stacks[self.sig]
            key = ("stack", self.sig)
            if key not in em.memo:
                em.memo[key] = em.call(torch.stack, [nodes[t] for t in range(self.steps)], 0)
            return em.memo[key]
        return self._emit(em, self.walk)

    def _emit(self, em: Emitter, w: StepWalk) -> fx.Node:
        if not self.varies[w]:
            return w.node
        key = ("replay", w.node)
        if key not in em.memo:
            if w.kind == "slice" and not self.varies_of(w):
                em.memo[key] = self._emit_slice(em, w)
            else:
                target, args, kwargs, pads = _replay_call(w.node, self.varies_of(w), self.steps)
                new = {}
                for x, c in w.children.items():
                    node = self._emit(em, c)
                    if pads.get(x):
                        node = em.call(operator.getitem, node, (slice(None),) + (None,) * pads[x])
                    new[x] = node
                args, kwargs = fx.node.map_arg((args, kwargs), new.__getitem__)
                em.memo[key] = em.call(target, *args, op=w.node.op, **kwargs)
        return em.memo[key]

    def varies_of(self, w: StepWalk) -> set:
        return {x for x, c in w.children.items() if self.varies[c]}

    def _emit_slice(self, em: Emitter, w: StepWalk) -> fx.Node:
        """The base with the time axis first, the other fixed indices selected."""
        params = w.params[-1]  # the slice's own indices (its base's come first)
        how, arg = w.how
        if how != "getitem":
            node = em.call(torch.movedim, w.base, arg, 0)
            return em.call(torch.unsqueeze, node, arg + 1) if how == "narrow" else node
        time = [p for (b, a, _, _), p in zip(params, w.key[4]) if (b, a) in self.is_time][0]
        items = list(arg)
        unit = isinstance(items[time], slice)
        items[time] = slice(None)
        node = w.base
        if any(i != slice(None) for i in items):
            node = em.call(operator.getitem, node, tuple(items))
        pos = sum(1 for i in items[:time] if not _plain_int(i))  # the time axis in the result
        if pos:
            node = em.call(torch.movedim, node, pos, 0)
        return em.call(torch.unsqueeze, node, pos + 1) if unit else node


def lift_step_tensor(w: StepWalk, ctx: dict) -> tuple:
    """(varies, sig, StepLift or None) of a step's walk: records the time indices it reads
    in ctx; the lift is None when the walk reads no time slice (the same tensor every step)."""
    is_time = ctx["is_time"]
    sig = (w.key, tuple(tuple("t" if (b, a) in is_time else i for b, a, i, _ in leaf) for leaf in w.params))
    for leaf in w.params:
        time = [(a, i, node) for b, a, i, node in leaf if (b, a) in is_time]
        if len(time) > 1:
            raise Reject("an input is indexed by the step at more than one position")
        for a, i, node in time:
            ctx["taus"].add(i)
            ctx["time_axes"].add((node, a))
    if not any((b, a) in is_time for leaf in w.params for b, a, _, _ in leaf):
        return False, sig, None  # (the params hold every slice the walk reads)
    varies: dict = {}
    _mark_varying(w, is_time, varies)
    shared = ctx["shared"]
    stacks = None
    if not _replayable(w, varies, is_time, shared["steps"]):
        stacks = shared["stacks"]
        taus = {i for leaf in w.params for b, a, i, _ in leaf if (b, a) in is_time}
        stacks.setdefault(sig, {})[next(iter(taus))] = w.node
    return True, sig, StepLift(w, sig, varies, is_time, shared["steps"], stacks)


def _mark_varying(w: StepWalk, is_time: set, varies: dict) -> bool:
    if w not in varies:
        own = w.params[-1] if w.kind == "slice" else ()
        varies[w] = any((b, a) in is_time for b, a, _, _ in own)
        for c in w.children.values():
            varies[w] |= _mark_varying(c, is_time, varies)
    return varies[w]


def _replayable(w: StepWalk, varies: dict, is_time: set, steps: int) -> bool:
    vary = {x for x, c in w.children.items() if varies[c]}
    if not vary:  # an input, or a slice of a tensor that is the same every step
        return True
    if w.kind == "slice" and any((b, a) in is_time for b, a, _, _ in w.params[-1]):
        return False  # a time slice of a tensor that varies: stacked
    if _replay_call(w.node, vary, steps) is None:
        return False
    return all(_replayable(c, varies, is_time, steps) for c in w.children.values())


_REDUCTIONS = {"sum", "mean", "amax", "amin", "logsumexp", "softmax", "log_softmax", "cumsum"}
_DIM_SLOTS = {"unsqueeze": ((1, "dim"),), "squeeze": ((1, "dim"),), "transpose": ((1, "dim0"), (2, "dim1"))}


def _replay_call(n: fx.Node, vary: set, steps: int) -> Optional[tuple]:
    """(target, args, kwargs, pads) that compute n over inputs with a leading time axis of
    `steps` (the inputs in `vary`), pads[x] size-1 axes to insert after x's time axis; None
    where not known. Dims counted from the start shift by one, negative dims stay."""
    args, kwargs = list(n.args), dict(n.kwargs)
    direct = [x for x in args + list(kwargs.values()) if isinstance(x, fx.Node)]
    if any(x not in direct for x in vary):
        return None  # a varying tensor inside a list argument
    if is_pointwise(n):  # broadcasting: the per-step axes align to the right of time
        if any(rank_of(x) == 0 and example_value(x).dtype != example_value(n).dtype for x in vary):
            return None  # a 0-dim tensor does not promote dtypes; with a time axis it would
        return n.target, args, kwargs, {x: rank_of(n) - rank_of(x) for x in vary}
    if not args or vary != {args[0]}:
        return None
    name = op_name(n)
    fn = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
    if name == "identity":
        return n.target, args, kwargs, {}
    if name == "matmul" or fn == "linear":  # batch axes broadcast: the others' must not exist
        others = [x for x in direct if x is not args[0]]
        return (n.target, args, kwargs, {}) if all(rank_of(x) <= 2 for x in others) else None
    slots = _DIM_SLOTS.get(name, ((1, "dim"),) if fn in _REDUCTIONS else None)
    if slots is not None:
        for pos, key in slots:
            if len(args) > pos:
                holder, where = args, pos
            elif key in kwargs:
                holder, where = kwargs, key
            elif name == "squeeze":
                continue  # every size-1 axis (time has the loop's length, at least 2)
            else:
                return None
            shifted = _shift_dims(holder[where])
            if shifted is None:
                return None
            holder[where] = shifted
        return n.target, args, kwargs, {}
    if name == "permute" and not kwargs:
        dims = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
        if not all(_plain_int(d) for d in dims):
            return None
        return n.target, [args[0], [0] + [d % rank_of(args[0]) + 1 for d in dims]], {}, {}
    if name == "getitem" and isinstance(example_value(args[0]), torch.Tensor) and op_name(args[0]) != "unbind":
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        if not all(i is None or i is Ellipsis or isinstance(i, slice) or _plain_int(i) for i in index):
            return None
        return n.target, [args[0], (slice(None),) + index], {}, {}
    if n.op == "call_method" and n.target in ("expand", "view", "reshape") and not kwargs:
        sizes = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
        if not all(_plain_int(s) for s in sizes):
            return None
        if n.target == "expand":
            return "expand", [args[0], -1, *sizes], {}, {}
        return "reshape", [args[0], steps, *sizes], {}, {}  # time first is no view of the step's layout
    return None


def _shift_dims(dims):
    """Dims of a per-step tensor in the same tensor with time first."""
    if _plain_int(dims):
        return dims + 1 if dims >= 0 else dims
    if isinstance(dims, (list, tuple)) and dims and all(_plain_int(d) for d in dims):
        return type(dims)(d + 1 if d >= 0 else d for d in dims)
    return None
