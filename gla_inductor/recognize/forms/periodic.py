"""Long unrolled loops, proven without a normal form per step.

Dynamo unrolls a loop of T steps into T copies of its body, and computing the normal form
(``core/analyzer.py``) of every node of a long loop is most of the recognition time. Yet the
copies differ only in the time index of their slices. Here step i is read as a *window*:
the nodes computed after the previous state S_{i-1} that its new state S_i and its output's
element read, with S_{i-1} as a hole, the tensors computed before it as inputs (by value
number), and the fixed indices of slices of those inputs as parameters; everything else
(ops, arguments, the number of users where the algebra's cuts look at it) is structure.

``find`` proves, for a chain of states found by shape alone (``_chains``), that the windows
of steps 1 to n - 1 have one structure and that their parameters are step 1's with the time
indices moved on by one per step (forwards or backwards). Each window reads its hole whole
(a sum or a product with another tensor, where the algebra cuts S_{i-1} to one atom), so a
step's normal form depends on the previous one only through its axes; ``steps.find_steps``
parses the head and steps 1 and 2 and checks their axes alike. By induction every later
step's normal form is step 2's with the parameters substituted, and so are its parse as a
GLA step, its read, and every check the loop recognizer makes of a step
(``loop.analyze_chain`` parses only those three; step 2 stands for the last where the op is
built). No node outside the windows reads a value of steps 3 to n - 1 other than to assemble
or return it, so no other normal form needs theirs, which are never computed.

Whatever is not proven here (a short loop, an index that wraps around or counts from the
end, an in-place write inside a step, a constant sliced per step, a final state read by more
than its assembly, a state read through a view) takes the general path, which parses every
node.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.fx as fx

from ..core.analyzer import Analyzer
from ..core.consts import example_value
from ..core.op_names import is_pointwise, op_name
from ..core.rules import RULES

MIN_STEPS = 8  # shorter loops gain little: every step is parsed
MAX_READ_DEPTH = 6  # users between a state and the assembled element that reads it


@dataclass
class Window:
    """One step's nodes, in the order they are computed (inputs first)."""

    tokens: tuple  # per node: its structure (see _token)
    params: tuple  # the fixed indices of slices of inputs, in node order
    nodes: list


@dataclass
class Proof:
    states: list  # the chain S_0 .. S_{n-1} (S_0 is the head)
    elements: list  # the assembled element that reads each state
    assembly: object  # core.assembly.Assembly holding exactly those elements
    interior: range  # the positions taken from step 1 (3 .. n - 1)
    nodes: set = field(default_factory=set)  # the interior windows' nodes: never parsed
    sample: list = field(default_factory=list)  # the nodes of steps 1 and 2's windows
    failed: bool = False  # set by steps.find_steps when step 1 or 2 does not parse as expected

    analyzed = (0, 1, 2)  # the positions the loop recognizer parses


def find(an: Analyzer, outputs: list) -> list[Proof]:
    """Proofs for the long periodic chains of the graph (memoized per graph)."""
    if "periodic" not in an.memo:
        chains = [c for c in _chains(an) if len(c) >= MIN_STEPS]
        an.memo["periodic"] = [p for p in (_prove(an, c, outputs) for c in chains) if p is not None]
    return an.memo["periodic"]


def unread(an: Analyzer, is_kind) -> set:
    """The nodes of proven steps 3 and later whose kind (a function of the normal form, such
    as being a parallel-form candidate) another recognizer need not compute: none of steps 1
    and 2's nodes is of that kind, and the later steps have their structure."""
    found: set = set()
    for p in an.memo.get("periodic", ()):
        if not p.failed and not any(is_kind(x) for x in p.sample):
            found |= p.nodes
    return found


def proof_of(an: Analyzer, states: list) -> Optional[Proof]:
    """The proof for exactly this chain of state nodes, if one holds."""
    for p in an.memo.get("periodic", ()):
        if not p.failed and p.states == states:
            return p
    return None


# ---- chains by shape ------------------------------------------------------------------------
def _sums(an: Analyzer) -> list:
    """The possible states: sums (S * d + k v, S + k v) of rank 2 or more, not in place (the
    algebra cuts sums, so the next step reads a state whole)."""
    writers = _writers(an)
    found = []
    for n in an.nodes:
        if n.op in _CALLS and n not in writers and op_name(n) in ("add", "sub"):
            val = example_value(n)
            if isinstance(val, torch.Tensor) and val.dim() >= 2:
                found.append(n)
    return found


def _writers(an: Analyzer) -> set:
    if "writers" not in an.memo:
        an.memo["writers"] = {n for n, _ in an.writes}
    return an.memo["writers"]


def _links(sums: list) -> dict:
    """sum -> the one sum of its shape it reads, directly or through one product (S * d):
    a guess that `_prove` and the parse of steps 1 and 2 confirm."""
    is_sum = set(sums)
    links = {}
    for n in sums:
        near = [x for y in n.all_input_nodes for x in ([y] if y in is_sum else y.all_input_nodes if op_name(y) == "mul" else [])]
        found = {x for x in near if x in is_sum and example_value(x).shape == example_value(n).shape}
        if len(found) == 1:
            links[n] = found.pop()
    return links


def _chains(an: Analyzer) -> list[list]:
    sums = _sums(an)
    links = _links(sums)
    succ: dict = {}
    for n, p in links.items():
        succ.setdefault(p, []).append(n)
    chains = []
    for head in (n for n in sums if n not in links):
        chain = [head]
        while len(succ.get(chain[-1], ())) == 1:
            chain.append(succ[chain[-1]][0])
        first = _first_state(an, head)
        chains.append(chain if first is None else [first] + chain)
    return chains


def _first_state(an: Analyzer, head: fx.Node) -> Optional[fx.Node]:
    """The state before the first sum when it is an outer product (`S = k v if S is None
    else ...`): the one product of the sum's shape that the sum decays (reads through a
    product); not a zero state, which the algebra drops, nor an initial state from outside."""
    shape = example_value(head).shape
    found = {x for y in head.all_input_nodes if op_name(y) == "mul" for x in y.all_input_nodes
             if op_name(x) in ("mul", "matmul", "einsum", "bmm") and not an.consts.is_const(x)
             and isinstance(example_value(x), torch.Tensor) and example_value(x).shape == shape}
    return found.pop() if len(found) == 1 else None


# ---- the proof ----------------------------------------------------------------------------------
def _prove(an: Analyzer, states: list, outputs: list) -> Optional[Proof]:
    elements = _elements_of(states, outputs)
    asm = _assembly(outputs, elements)
    if asm is None:
        return None
    n = len(states)
    windows = [None] + [_window(an, states[i - 1], [states[i], elements[i]]) for i in range(1, n)]
    if any(w is None for w in windows[1:]) or any(w.tokens != windows[1].tokens for w in windows[2:]):
        return None
    if not _params_shift(windows[1:]):
        return None
    interior = range(3, n)
    nodes = {x for i in interior for x in windows[i].nodes}
    if not all(u in nodes or _inert(u) for x in nodes for u in x.users):
        return None
    return Proof(states, elements, asm, interior, nodes, windows[1].nodes + windows[2].nodes)


def _inert(n: fx.Node) -> bool:
    """A consumer whose own value the algebra takes without reading its inputs' (an output,
    a stack or a buffer write: no rule of the algebra, not elementwise)."""
    return n.op == "output" or op_name(n) not in RULES and not is_pointwise(n)


def _elements_of(states: list, outputs: list) -> list:
    """For each state, the one assembled element computed from it without passing another
    state (None where there is not exactly one)."""
    elements = {e for asm in outputs for e in asm.elements}
    chain = set(states)
    res = []
    for state in states:
        found, frontier, seen = set(), [state], {state}
        for _ in range(MAX_READ_DEPTH):
            nxt = []
            for u in (u for x in frontier for u in x.users if u not in seen and u not in chain):
                seen.add(u)
                (found.add if u in elements else nxt.append)(u)
            frontier = nxt
        res.append(found.pop() if len(found) == 1 else None)
    return res


def _assembly(outputs: list, elements: list):
    """The assembly whose elements are exactly the states' reads, one each."""
    if None in elements or len(set(elements)) != len(elements):
        return None
    for asm in outputs:
        if set(asm.elements) == set(elements) and len(asm.elements) == len(elements):
            return asm
    return None


def _params_shift(windows: list) -> bool:
    """Every window's parameters are the first's, with those that change (the time indices)
    moved on by the same +1 or -1 per step, and never negative (-1 then 0 is no step of one:
    a negative index counts from the end)."""
    first, second, last = windows[0].params, windows[1].params, windows[-1].params
    moving = [j for j, (a, b) in enumerate(zip(first, second)) if a != b]
    if not moving or len(first) != len(second):
        return False
    step = second[moving[0]] - first[moving[0]]
    if step not in (1, -1) or any(second[j] - first[j] != step or min(first[j], last[j]) < 0 for j in moving):
        return False
    for i, w in enumerate(windows):
        want = list(first)
        for j in moving:
            want[j] += step * i
        if list(w.params) != want:
            return False
    return True


# ---- windows --------------------------------------------------------------------------------------
_CALLS = ("call_function", "call_method")


def _window(an: Analyzer, prev: fx.Node, roots: list) -> Optional[Window]:
    """The nodes after `prev` (in graph order) that the roots read, not through `prev`;
    None where a node is not plain computation (an in-place write, a read of a tensor
    written in place, a constant that could be evaluated differently per step)."""
    start = an.order[prev]
    index: dict = {}
    tokens, params = [], []
    todo = list(reversed(roots))
    while todo:
        n = todo[-1]
        if n in index:
            todo.pop()
            continue
        pending = [x for x in n.all_input_nodes if x not in index and x is not prev and an.order[x] > start]
        if pending:
            todo += pending
            continue
        todo.pop()
        tok = _token(an, n, index, prev, params)
        if tok is None:
            return None
        index[n] = len(tokens)
        tokens.append(tok)
    return Window(tuple(tokens), tuple(params), list(index))


def _token(an: Analyzer, n: fx.Node, index: dict, prev: fx.Node, params: list) -> Optional[tuple]:
    """n's structure: op, target, arguments with nodes named by their place in the window
    (or 'prev', or their value number outside), its number of users where the algebra looks
    at it (a product read twice is cut; a sum always is: the last state is read once, the
    others twice). The fixed indices of a slice of a tensor from outside the window go to
    params instead (see _fixed)."""
    if n.op not in _CALLS or n in _writers(an) or an.consts.is_const(n):
        return None
    refs = {}
    for x in n.all_input_nodes:
        if an.versions.get((n, x), x) is not x:
            return None
        if x is prev:
            if not _reads_whole(n):
                return None
            refs[x] = ("prev", tuple(example_value(x).shape), example_value(x).dtype)
        else:
            refs[x] = ("n", index[x]) if x in index else _outside(an, x, params)
    body = _call_key(n, refs, params)
    if body is None:
        return None
    users = None if op_name(n) in ("add", "sub") else len(n.users)
    return (n.op, n.target, body, users)


def _reads_whole(n: fx.Node) -> bool:
    """n reads the previous state (a sum) as one atom: a sum, or a product with another
    tensor (the algebra cuts a sum there). Then a step's normal form sees of the previous
    one only its axes (steps.find_steps compares them), not its terms."""
    if op_name(n) in ("add", "sub"):
        return True
    tensors = [x for x in n.args if isinstance(x, fx.Node)]
    return op_name(n) in ("mul", "matmul", "bmm", "einsum") and len(tensors) >= 2 and not n.kwargs


def _outside(an: Analyzer, x: fx.Node, params: list) -> tuple:
    """The key of a tensor computed before the window: its value number, or for a slice at
    fixed indices (`ks = k.unbind(1)` before the loop, `ks[t]` in it) the slice's key, its
    indices among the window's params."""
    if x.op in _CALLS and x not in _writers(an) and all(an.versions.get((x, y), y) is y for y in x.all_input_nodes):
        refs = {y: ("in", an.canon.get(y, y)) for y in x.all_input_nodes}
        mark = len(params)
        if _fixed(x, refs) is not None:
            body = _call_key(x, refs, params)
            if body is not None:
                return ("in-slice", x.op, x.target, body)
        del params[mark:]
    return ("in", an.canon.get(x, x))


def _call_key(n: fx.Node, refs: dict, params: list) -> Optional[tuple]:
    """The arguments' key, fixed indices of a slice among params (None: unkeyable)."""
    try:
        fixed = _fixed(n, refs)
        args = tuple(_index_key(a, fixed[1], params, refs) if fixed and i == fixed[0] else _frozen(a, refs)
                     for i, a in enumerate(n.args))
        return args, _frozen(tuple(sorted(n.kwargs.items())), refs)
    except _Unkeyed:
        return None


def _fixed(n: fx.Node, refs: dict) -> Optional[tuple]:
    """(argument position, which of its items are fixed indices) of a slice of a tensor from
    outside the window read at fixed indices: `x[:, t]`, `x[:, t:t + 1]`, `x.select(1, t)`,
    `x.narrow(1, t, 1)`, `x.unbind(1)[t]` (the algebra reads these as the atom x with axis 1
    fixed to t). Other integers are structure."""
    if not n.args or not isinstance(n.args[0], fx.Node) or refs[n.args[0]][0] not in ("in", "in-slice"):
        return None
    name, base = op_name(n), n.args[0]
    if name == "getitem" and op_name(base) == "unbind":
        return 1, "int"
    if name == "getitem" and isinstance(example_value(base), torch.Tensor):
        return 1, "items"
    if name == "select" and len(n.args) == 3:
        return 2, "int"
    if name == "narrow" and len(n.args) == 4 and n.args[3] == 1:
        return 2, "int"
    return None


def _index_key(x, how: str, params: list, refs: dict):
    """An index argument's key, its fixed indices appended to params: the int itself ("int"),
    or ("items") the plain ints and unit slices t:t+1 of a basic getitem index."""
    if type(x) is int:
        params.append(x)
        return ("#",)
    if how == "items" and isinstance(x, slice) and _unit(x):
        params.append(x.start)
        return ("#:#+1",)
    basic = all(i is None or i is Ellipsis or type(i) in (int, slice) for i in x) if type(x) is tuple else False
    if how == "items" and basic:
        return ("tuple",) + tuple(_index_key(i, how, params, refs) if type(i) is int or type(i) is slice and _unit(i)
                                  else _frozen(i, refs) for i in x)
    return _frozen(x, refs)


class _Unkeyed(Exception):
    """An argument with no stable key (symbolic sizes, tensors, unhashable objects)."""


_ATOMIC = {int, float, bool, str, type(None), type(Ellipsis), torch.dtype, torch.device, torch.layout,
           torch.memory_format}


def _frozen(x, refs: dict):
    """A hashable structure of arguments, nodes replaced by their refs."""
    t = type(x)
    if t in _ATOMIC:
        return (t, x)  # 1 and 1.0 and True differ as arguments
    if t is fx.Node:
        return refs[x]
    if isinstance(x, (list, tuple)):  # (fx's immutable_list among them)
        return (t,) + tuple(_frozen(i, refs) for i in x)
    if t is slice:
        return (t, _frozen(x.start, refs), _frozen(x.stop, refs), _frozen(x.step, refs))
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool, torch.Tensor, fx.Node)):
        raise _Unkeyed
    try:
        hash(x)
    except TypeError:
        raise _Unkeyed from None
    return (t, x)


def _unit(x: slice) -> bool:
    return type(x.start) is int and type(x.stop) is int and x.stop == x.start + 1 and x.step is None
