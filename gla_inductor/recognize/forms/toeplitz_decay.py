"""A static decay evaluated along its diagonals: O(H T) instead of O(H T^2).

``static_decay.py`` proves a decay built from positions, constants and module state by evaluating
it in float64 and checking D[h, i, j] = gamma_h ** (i - j) on the triangle. Evaluated whole, the
[H, T, T] mask costs seconds at T = 2048 and exceeds the evaluator's size limit at T = 4096. But
RetNet's masks are Toeplitz by construction: every [T, T] tensor of the mask's subgraph is a
function of i - j alone, so it is known from its 2T - 1 diagonals, and so is the whole check.

Why not fewer positions instead (as ``certify/trial.py`` runs fewer batches and heads)? Slices
along batch and heads are alike where the subgraph treats them alike; positions are not: the
mask is a function of position values, and one wrong at i - j = 3000 (a clamp, a fill past some
distance) looks right on any shorter prefix. Here every diagonal is evaluated, so the proof
covers every (i, j); only the redundancy of a Toeplitz matrix is dropped, and only where it is
proven, op by op:

* a [T, T] tensor made from positions is Toeplitz where it is x_i - y_j or a comparison of x_i
  with y_j, x and y exact integers in arithmetic progressions of the same step (arange, cast,
  viewed as a column and a row): each entry is then a function of i - j, computed exactly;
* a tensor filled with one value ([T, T] ones, zeros, full) is Toeplitz;
* elementwise ops (exp, pow, masked_fill, where, nan_to_num, comparisons, casts, ...) of Toeplitz
  tensors and of tensors constant along both position axes (a per-head [H, 1, 1] buffer) give a
  Toeplitz tensor: the same op applied to the diagonals gives the same values; tril and triu keep
  or zero whole diagonals;
* a row sum of a Toeplitz tensor is a window of its diagonals' running sum, and the tensor divided
  (or multiplied) by one value per row is kept as c[i] * v[i - j] (torchscale divides its mask by
  the root of its row sums: ``row_factor.py`` folds c into q), read further only by nan_to_num
  where every entry is finite (it then changes none).

Anything else (a row sum, a slice, an in-place write, a product x_i * y_j, a buffer holding a
whole mask) is not read here and the caller evaluates the decay whole, as before (with its size
limit). Every value's shape is checked against the node's traced shape, so a broadcast read
wrongly fails instead of proving something else.
"""

from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx as fx

from ..core.algebra import Factor
from ..core.analyzer import Analyzer
from ..core.consts import _ShapeOnly, _float64_like, example_value, module_state, size_hint
from ..core.match import Reject

RTOL = 1e-5  # (static_decay's tolerances, which this check mirrors)
ATOL = 1e-7
_MAX_PLAIN = 1 << 22  # elements of a tensor evaluated whole on the way (per-head buffers, positions)
_EXACT = 2.0 ** 24  # positions exact in float32 (and so in any dtype the code casts them to)


class Toep:
    """A tensor of `shape` (lead + (T, T)) whose entry [..., a, b] is v[..., a - b + T - 1], times
    r[..., a] where a row factor r is given (a mask divided by its row sums); v's and r's leading
    axes broadcast to lead."""

    def __init__(self, v: torch.Tensor, shape: tuple, r: Optional[torch.Tensor] = None):
        self.v, self.shape, self.r = v, tuple(shape), r


class _NotToeplitz(Exception):
    pass


_POINTWISE_FUNCTIONS = {
    torch.exp, torch.exp2, torch.log, torch.log2, torch.log1p, torch.expm1, torch.neg, torch.abs, torch.sqrt,
    torch.rsqrt, torch.sigmoid, torch.nan_to_num, torch.clamp, torch.clamp_min, torch.clamp_max, torch.pow,
    torch.add, torch.sub, torch.mul, torch.div, torch.true_divide, torch.lt, torch.le, torch.gt, torch.ge,
    torch.eq, torch.ne, torch.logical_not, torch.logical_and, torch.logical_or, torch.bitwise_not, torch.where,
    torch.masked_fill, torch.reciprocal, torch.minimum, torch.maximum, torch.square, torch.sign,
    operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.pow, operator.lt,
    operator.le, operator.gt, operator.ge, operator.eq, operator.ne, operator.invert, operator.and_, operator.or_,
}
_POINTWISE_METHODS = {
    "exp", "exp2", "log", "log2", "log1p", "expm1", "neg", "abs", "sqrt", "rsqrt", "sigmoid", "nan_to_num",
    "clamp", "clamp_min", "clamp_max", "pow", "add", "sub", "mul", "div", "lt", "le", "gt", "ge", "eq", "ne",
    "logical_not", "logical_and", "logical_or", "bitwise_not", "masked_fill", "reciprocal", "square", "sign",
    "float", "double", "half", "bfloat16", "bool", "int", "long", "contiguous", "clone", "detach",
    "__invert__", "__and__", "__or__", "to", "type_as",
}
_POSITION_OPS = {torch.sub: "sub", operator.sub: "sub", torch.lt: "lt", operator.lt: "lt", torch.le: "le",
                 operator.le: "le", torch.gt: "gt", operator.gt: "gt", torch.ge: "ge", operator.ge: "ge",
                 torch.eq: "eq", operator.eq: "eq", torch.ne: "ne", operator.ne: "ne"}
_FILLS = {torch.ones: 1, torch.zeros: 0, torch.full: None}


# ---- the decay --------------------------------------------------------------------------------
def evaluate(an: Analyzer, factors: list, axes: list, state: Optional[dict] = None, rows: bool = False):
    """The product of the decay factors over `axes` (the heads, then i and j) as its diagonals,
    float64 [*heads, 2T - 1] with D[.., i, j] at i - j + T - 1; None where some factor is not
    proven Toeplitz (or T < 2). With `rows`, (diagonals, row factor [*heads, T] or None): D[.., i, j]
    is then the row factor at i times the diagonal's entry."""
    *heads, i, j = axes
    T = int(size_hint(an.sizes[i]))
    if T < 2 or int(size_hint(an.sizes[j])) != T:
        return None
    ev = _Evaluator(an, state, T)
    total = torch.ones([int(size_hint(an.sizes[h])) for h in heads] + [2 * T - 1], dtype=torch.float64)
    row = None
    try:
        for f in factors:
            v, r = ev.factor(f, heads, i, j)
            total = total * v
            row = r if row is None else row if r is None else row * r
    except _NotToeplitz:
        return None
    if rows:
        return total, row
    return total if row is None else None


def factor_diagonal(an: Analyzer, f: Factor, axes: list, state: Optional[dict] = None) -> Optional[torch.Tensor]:
    """One decay factor's diagonal D_f[.., i, i] over (*heads, i), None where not proven Toeplitz."""
    *heads, i, j = axes
    T = int(size_hint(an.sizes[i]))
    try:
        v, r = _Evaluator(an, state, T).factor(f, heads, i, j)
    except _NotToeplitz:
        return None
    diag = v[..., T - 1:T] if v.shape[-1] > 1 else v
    return diag * r if r is not None else diag.expand(diag.shape[:-1] + (T,))


def first(bad: torch.Tensor, T: int) -> tuple:
    """(head, i, j) of the first entry, in row-major order of the full [T, T] matrices, where the
    diagonals `bad` [heads, 2T - 1] are True: row 0 holds the diagonals i - j <= 0, each later row
    i one more, i - j = i."""
    h = int(bad.any(-1).nonzero()[0])
    d = torch.arange(-(T - 1), T)
    nonpositive = bad[h] & (d <= 0)
    if nonpositive.any():
        return h, 0, -int(d[nonpositive].max())
    return h, int(d[bad[h]].min()), 0


def check(v: torch.Tensor, T: int) -> bool:
    """static_decay._check on the diagonals v [heads, 2T - 1]: whether D is GLA's constant-gate
    decay reversed; Reject, saying which fact failed, otherwise."""
    d = torch.arange(-(T - 1), T)
    lower, upper = d > 0, d < 0  # j < i, j > i
    reverse = bool(torch.all(v[:, lower] == 0)) and not bool(torch.all(v[:, upper] == 0))
    bad = (v != 0) & (lower if reverse else upper)
    if bad.any():
        h, r, c = first(bad, T)
        raise Reject(f"decay D[i, j] for {'j < i' if reverse else 'j > i'} is {_num(v[h, r - c + T - 1])} "
                     f"(at i={r}, j={c}), expected 0")
    if not torch.isfinite(v).all():
        h, r, c = first(~torch.isfinite(v), T)
        raise Reject(f"decay D[i, j] is {_num(v[h, r - c + T - 1])} (at i={r}, j={c}), expected a finite number")
    diag = v[:, T - 1]
    bad_diag = (diag - 1).abs() > RTOL
    if bad_diag.any():
        h = int(bad_diag.nonzero()[0])
        found = f"decay D[i, i] is {_num(diag[h])} (at i=0), expected 1"
        row = v / diag[:, None]
        if not torch.isfinite(row).all() or _worst(row, gammas(row, T, reverse), T, reverse) is not None:
            raise Reject(found)
        raise Reject(f"{found}: the decay is c * gamma ** (i - j) with c = {_num(diag[h])} (a shifted decay, or "
                     "one scaled per head), not GLA")
    g = gammas(v, T, reverse)
    if not torch.all(g > 0):
        raise Reject(f"decay D[1, 0] is {_num(g.min())}, expected a gamma > 0 (D = gamma ** (i - j))")
    worst = _worst(v, g, T, reverse)
    if worst is not None:
        h, r, c, want = worst
        raise Reject(f"decay D[i, j] is {_num(v[h, r - c + T - 1])} at i={r}, j={c}, expected D[1, 0] ** (i - j) = "
                     f"{_num(want)}: not of the form gamma ** (i - j)")
    return reverse


def _num(x) -> str:
    return f"{float(x):.4g}"


def check_scaled(v: torch.Tensor, r: torch.Tensor, T: int) -> None:
    """static_decay._check's verdict on D[h, i, j] = r[h, i] * v[h, i - j] (a mask divided by its row
    sums): Reject where its diagonal r v_0 is not 1, saying what D is; returns where it is 1 on
    every row (the caller then evaluates D whole)."""
    diag = r * v[:, T - 1:T]
    bad = (diag - 1).abs() > RTOL
    if not bad.any():
        return
    h = int(bad.any(-1).nonzero()[0])
    n = int(bad[h].nonzero()[0])
    found = f"decay D[i, i] is {_num(diag[h, n])} (at i={n}), expected 1"
    row = v / v[:, T - 1:T]  # D / D[i, i] on each row
    try:
        if not torch.isfinite(row).all():
            raise Reject(found)
        check(row, T)
    except Reject:
        raise Reject(found) from None
    if torch.allclose(diag, diag[:, :1].expand_as(diag), rtol=RTOL, atol=ATOL):
        raise Reject(f"{found}: the decay is c * gamma ** (i - j) with c = {_num(diag[h, 0])} (a shifted "
                     "decay, or one scaled per head), not GLA")
    raise Reject(f"{found}: the decay is scaled per query (a row normalization), not GLA")


def gammas(v: torch.Tensor, T: int, reverse: bool) -> torch.Tensor:
    """D[h, 1, 0] (D[h, 0, 1] reversed) from the diagonals."""
    return v[:, T - 2] if reverse else v[:, T]


def _worst(v: torch.Tensor, g: torch.Tensor, T: int, reverse: bool) -> Optional[tuple]:
    """None where the diagonals are gamma ** (i - j) on the triangle, else (h, i, j, expected)."""
    d = torch.arange(-(T - 1), T, dtype=torch.float64)
    steps = -d if reverse else d
    tri = steps >= 0
    want = torch.where(tri, g[:, None].double() ** steps.clamp(min=0), torch.zeros((), dtype=torch.float64))
    err = ((v - want).abs() - RTOL * want.abs() - ATOL).masked_fill(~tri, 0)
    if not (err > 0).any():
        return None
    h, p = (int(x) for x in (err == err.max()).nonzero()[0])
    r, c = (0, T - 1 - p) if reverse else (p - (T - 1), 0)
    return h, r, c, want[h, p]


# ---- the evaluator ----------------------------------------------------------------------------
class _Evaluator:
    """Each node of the decay's subgraph as a Toep or a tensor evaluated whole (small: positions,
    per-head buffers), as consts.evaluate_static runs them (float64 module state, metadata only of
    data tensors); _NotToeplitz where neither is proven."""

    def __init__(self, an: Analyzer, state: Optional[dict], T: int):
        self.an, self.state, self.T, self.memo = an, state or {}, T, {}

    def factor(self, f: Factor, heads: list, i: int, j: int) -> tuple:
        """A decay factor over (*heads, i - j), and its row factor over (*heads, i) or None."""
        if f.kind == "exp":
            exponent = torch.zeros((), dtype=torch.float64)
            for c, gs in f.inner:
                term = torch.full((), c, dtype=torch.float64)
                for g in gs:
                    v, r = self.factor(g, heads, i, j)
                    if r is not None:
                        raise _NotToeplitz  # (exp of a row-scaled mask: not a row factor any more)
                    term = term * v
                exponent = exponent + term
            return exponent.exp(), None
        if f.kind == "tri":
            return self._tri(f, heads, i, j), None
        if f.kind == "const":
            val = self.node(f.node)
            if f.negate:
                if isinstance(val, Toep) and val.r is not None:
                    raise _NotToeplitz
                val = Toep(torch.logical_not(val.v), val.shape) if isinstance(val, Toep) else torch.logical_not(val)
        elif f.kind == "atom":
            if f.atom.fixed:
                raise _NotToeplitz
            val = self.node(f.atom.node)
        else:
            raise _NotToeplitz
        return self._over(val, f.idx, heads, i, j)

    def _tri(self, f: Factor, heads: list, i: int, j: int) -> torch.Tensor:
        d = torch.arange(-(self.T - 1), self.T)
        if tuple(f.idx) == (i, j):
            off = -d  # column minus row
        elif tuple(f.idx) == (j, i):
            off = d
        else:
            raise _NotToeplitz
        keep = (off <= f.diagonal) if f.lower else (off >= f.diagonal)
        return keep.double().reshape([1] * len(heads) + [-1])

    def _over(self, val, idx: tuple, heads: list, i: int, j: int) -> tuple:
        """A node's value, its axes the variables `idx`, over (*heads, i - j), and its row factor
        over (*heads, i) (None: none)."""
        r = None
        if isinstance(val, Toep):
            if len(idx) != len(val.shape) or tuple(idx[-2:]) not in ((i, j), (j, i)):
                raise _NotToeplitz
            if val.r is not None and tuple(idx[-2:]) != (i, j):
                raise _NotToeplitz  # (a factor of the key's column)
            v = val.v.double().expand(val.shape[:-2] + (2 * self.T - 1,))
            v = v if tuple(idx[-2:]) == (i, j) else v.flip(-1)
            lead = idx[:-2]
            if val.r is not None:
                r = _by_heads(val.r.double().expand(val.shape[:-1]), lead, heads)
        elif isinstance(val, torch.Tensor):
            if len(idx) != val.dim() or any(x in (i, j) for x in idx):
                raise _NotToeplitz  # (a factor of rows or columns alone: not Toeplitz)
            v, lead = val.double().unsqueeze(-1), idx
        else:
            raise _NotToeplitz
        return _by_heads(v, lead, heads), r

    def node(self, n: fx.Node):
        if n not in self.memo:
            val = self._node(n)
            _check_shape(n, val, self.T)
            self.memo[n] = val
        return self.memo[n]

    def arg(self, x):
        if isinstance(x, fx.Node):
            ev = example_value(x)
            if x.op == "placeholder" and isinstance(ev, torch.Tensor):
                if x in self.state:
                    return self.state[x]
                val = module_state(x)
                return val.detach().cpu().double() if val is not None else _ShapeOnly(ev)
            if self.an.consts.is_const(x) or self.an.consts.is_static(x):
                return self.node(x)
            return _ShapeOnly(ev) if isinstance(ev, torch.Tensor) else size_hint(ev)
        if isinstance(x, (list, tuple)):
            return type(x)(self.arg(a) for a in x)
        if isinstance(x, dict):
            return {k: self.arg(a) for k, a in x.items()}
        if isinstance(x, torch.device):
            return torch.device("cpu")
        return size_hint(x)

    def _node(self, n: fx.Node):
        if n.op not in ("call_function", "call_method", "placeholder", "get_attr"):
            raise _NotToeplitz
        if n.op == "placeholder":
            return self.arg(n) if isinstance(example_value(n), torch.Tensor) else size_hint(example_value(n))
        if n.op == "get_attr":
            return self.an.consts.evaluate(n)
        args, kwargs = self.arg(n.args), self.arg(dict(n.kwargs))
        ev = example_value(n)
        try:
            if any(isinstance(a, Toep) for a in _flat(args, kwargs)):
                return _pointwise(n, args, kwargs, self.T)
            if isinstance(ev, torch.Tensor) and ev.dim() >= 2 and _hint(ev.shape[-1]) == _hint(ev.shape[-2]) == self.T:
                return _made(n, args, kwargs, self.T)
        except (RuntimeError, TypeError, ValueError, IndexError) as e:  # (shapes that do not broadcast so)
            raise _NotToeplitz from e
        if isinstance(ev, torch.Tensor) and ev.numel() > _MAX_PLAIN:
            raise _NotToeplitz
        try:
            return self.an.consts._run(n, lambda x: self.arg(x))
        except _NotToeplitz:
            raise
        except Exception as e:  # an exotic spelling: the caller evaluates the decay whole
            raise _NotToeplitz from e


def _hint(s) -> int:
    return int(size_hint(s))


def _by_heads(v: torch.Tensor, lead: tuple, heads: list) -> torch.Tensor:
    """v [*lead, n] (lead: variables, None for size 1) over (*heads, n)."""
    present = [x for x in lead if x is not None]
    if any(x not in heads for x in present) or len(set(present)) < len(present):
        raise _NotToeplitz
    keep = [p for p, x in enumerate(lead) if x is not None]
    v = v.reshape([v.shape[p] for p in keep] + [v.shape[-1]])
    v = v.permute([present.index(h) for h in heads if h in present] + [len(present)])
    for p, h in enumerate(heads):
        if h not in present:
            v = v.unsqueeze(p)
    return v


def _flat(args, kwargs) -> list:
    out = []
    for a in list(args) + list(kwargs.values()):
        out += _flat(a, {}) if isinstance(a, (list, tuple)) else [a]
    return out


def _check_shape(n: fx.Node, val, T: int) -> None:
    ev = example_value(n)
    if not isinstance(ev, torch.Tensor):
        if isinstance(val, Toep):
            raise _NotToeplitz
        return
    want = tuple(_hint(s) for s in ev.shape)
    if isinstance(val, Toep):
        ok = val.shape == want and val.v.shape[-1] == 2 * T - 1 and \
            torch.broadcast_shapes(val.v.shape[:-1], want[:-2]) == want[:-2] and \
            (val.r is None or torch.broadcast_shapes(tuple(val.r.shape), want[:-1]) == want[:-1])
    elif isinstance(val, torch.Tensor):
        ok = tuple(val.shape) == want
    else:
        ok = isinstance(val, _ShapeOnly)
    if not ok:
        raise _NotToeplitz


def _pointwise(n: fx.Node, args, kwargs, T: int):
    """An elementwise op (or tril / triu) with a Toeplitz operand: the same op on the diagonals."""
    name = n.target if n.op == "call_method" else getattr(n.target, "__name__", None)
    if any(isinstance(a, Toep) and a.r is not None for a in _flat(args, kwargs)):
        return _on_row_scaled(name, args, kwargs)
    if name in ("tril", "triu"):
        return _band(name, args, kwargs, T)
    if name == "sum":
        return _row_sums(args, kwargs, T)
    if name in ("div", "truediv", "mul") and len(args) == 2 and not kwargs and isinstance(args[0], Toep) \
            and _is_column(args[1], T):
        return _scaled_rows(name, args[0], args[1], T)
    if n.op == "call_method" and n.target not in _POINTWISE_METHODS or \
            n.op == "call_function" and n.target not in _POINTWISE_FUNCTIONS:
        raise _NotToeplitz
    if n.op == "call_method" and n.target in ("to", "type_as"):
        return _cast(args, kwargs)
    shapes = [a.shape if isinstance(a, Toep) else tuple(a.shape) for a in _flat(args, kwargs)
              if isinstance(a, (Toep, torch.Tensor))]
    shape = tuple(torch.broadcast_shapes(*shapes))
    if len(shape) < 2 or shape[-2:] != (T, T):
        raise _NotToeplitz
    args, kwargs = _diagonals(args), _diagonals(kwargs)
    if n.op == "call_method":
        self_, *rest = args
        return Toep(getattr(self_, n.target)(*rest, **kwargs), shape)
    return Toep(n.target(*args, **kwargs), shape)


def _cast(args, kwargs) -> Toep:
    """x.to(...) / x.type_as(y) of a Toep: only a dtype is read (x.to(q) of a data tensor q is
    float64, as consts evaluates it); a device is the CPU."""
    x, *rest = args
    if not isinstance(x, Toep) or any(isinstance(r, Toep) for r in rest):
        raise _NotToeplitz
    dtypes = [r for r in list(rest) + list(kwargs.values()) if isinstance(r, torch.dtype)]
    dtypes += [_float64_like(r) if isinstance(r, _ShapeOnly) else r.dtype for r in rest
               if isinstance(r, (_ShapeOnly, torch.Tensor))]
    if len(dtypes) > 1:
        raise _NotToeplitz
    return Toep(x.v.to(dtypes[0]) if dtypes else x.v, x.shape)


def _is_column(x, T: int) -> bool:
    """x is a tensor [.., T, 1]: one factor per row."""
    return isinstance(x, torch.Tensor) and x.dim() >= 2 and tuple(x.shape[-2:]) == (T, 1)


def _row_sums(args, kwargs, T: int) -> torch.Tensor:
    """X.sum(-1) of a Toep, [.., T] (kept: [.., T, 1]): the sum of row a is that of the diagonals
    a - T + 1 .. a, a window of the diagonals' running sum (float64)."""
    x, rest = args[0], list(args[1:])
    dim = rest.pop(0) if rest else kwargs.get("dim")
    keep = rest.pop(0) if rest else kwargs.get("keepdim", False)
    if isinstance(dim, (list, tuple)) and len(dim) == 1:
        dim = dim[0]
    if not isinstance(x, Toep) or rest or set(kwargs) - {"dim", "keepdim"} or dim not in (-1, len(x.shape) - 1):
        raise _NotToeplitz
    v = x.v.double().expand(x.shape[:-2] + (2 * T - 1,))
    run = torch.cat([torch.zeros(v.shape[:-1] + (1,), dtype=torch.float64), v.cumsum(-1)], -1)
    sums = (run[..., T:] - run[..., :T]).to(x.v.dtype if x.v.is_floating_point() else torch.float64)
    return sums.unsqueeze(-1) if keep else sums


def _scaled_rows(name: str, x: Toep, c: torch.Tensor, T: int) -> Toep:
    """X / c (X * c) for one factor c per row: a row-scaled Toep (the factor kept apart)."""
    if x.r is not None:
        raise _NotToeplitz
    shape = tuple(torch.broadcast_shapes(x.shape, tuple(c.shape)))
    if shape[-2:] != (T, T):
        raise _NotToeplitz
    r = c.double()[..., 0]
    return Toep(x.v, shape, r.reciprocal() if name != "mul" else r)


def _on_row_scaled(name: str, args, kwargs) -> Toep:
    """nan_to_num of a row-scaled Toep whose entries are all finite (no entry changes), else
    nothing: any other op would mix the row factor into the diagonals."""
    x = args[0]
    if name != "nan_to_num" or len(args) != 1 or not isinstance(x, Toep) or x.r is None:
        raise _NotToeplitz
    v, r = x.v.double(), x.r.double()
    big = torch.finfo(x.v.dtype).max if x.v.is_floating_point() else 0.0
    if not (torch.isfinite(v).all() and torch.isfinite(r).all()) or float(v.abs().max() * r.abs().max()) >= big / 2:
        raise _NotToeplitz
    return x


def _diagonals(x):
    """Toeps as their diagonals; other tensors, which must be constant along both position axes,
    with those two axes as one of size 1 (so that they broadcast against the diagonals)."""
    if isinstance(x, Toep):
        return x.v
    if isinstance(x, torch.Tensor):
        if x.dim() >= 1 and x.shape[-1] != 1 or x.dim() >= 2 and x.shape[-2] != 1:
            raise _NotToeplitz
        return x.reshape(tuple(x.shape[:-2]) + (1,)) if x.dim() >= 2 else x
    if isinstance(x, _ShapeOnly):
        raise _NotToeplitz
    if isinstance(x, (list, tuple)):
        return type(x)(_diagonals(a) for a in x)
    if isinstance(x, dict):
        return {k: _diagonals(a) for k, a in x.items()}
    return x


def _band(name: str, args, kwargs, T: int) -> Toep:
    """tril(x, k) keeps the diagonals j - i <= k, triu(x, k) those j - i >= k, zeroing the rest."""
    x, k = args[0], (args[1] if len(args) > 1 else kwargs.get("diagonal", 0))
    if not isinstance(x, Toep) or not isinstance(k, int):
        raise _NotToeplitz
    off = -torch.arange(-(T - 1), T)  # j - i on each diagonal
    keep = off <= k if name == "tril" else off >= k
    return Toep(torch.where(keep, x.v, torch.zeros((), dtype=x.v.dtype)), x.shape)


def _made(n: fx.Node, args, kwargs, T: int) -> Toep:
    """A [.., T, T] tensor from tensors without a Toeplitz operand: a fill, or x_i op y_j."""
    if n.op == "call_function" and n.target in _FILLS:
        return _fill(n.target, args, kwargs, T)
    if n.op == "call_function" and n.target in _POSITION_OPS and len(args) == 2 and not kwargs:
        return _positions(_POSITION_OPS[n.target], args, T)
    if n.op == "call_method" and n.target in ("sub", "lt", "le", "gt", "ge", "eq", "ne") and len(args) == 2 \
            and not kwargs:
        return _positions(n.target, args, T)
    raise _NotToeplitz


def _fill(target, args, kwargs, T: int) -> Toep:
    if target is torch.full:
        size, rest = args[0], args[1:]
    else:
        size, rest = (args[0] if len(args) == 1 and isinstance(args[0], (list, tuple, torch.Size)) else args), ()
    size = tuple(int(s) for s in size)
    if len(size) < 2 or size[-2:] != (T, T) or "out" in kwargs:
        raise _NotToeplitz
    return Toep(target(size[:-2] + (2 * T - 1,), *rest, **kwargs), size)


def _positions(op: str, args, T: int) -> Toep:
    """x op y for a column x [.., T, 1] and a row y [.., 1, T] (either order): exact integers in
    arithmetic progressions of one step s, x_i = x_0 + s i and y_j = y_0 + s j, so that x_i - y_j =
    x_0 - y_0 + s (i - j) exactly, and it and every comparison of x_i with y_j depend on i - j only."""
    a, b = args
    if not all(isinstance(x, torch.Tensor) for x in (a, b)) or a.is_complex() or b.is_complex():
        raise _NotToeplitz
    shape = tuple(torch.broadcast_shapes(a.shape, b.shape))
    if len(shape) < 2 or shape[-2:] != (T, T) or any(s != 1 for s in shape[:-2]):
        raise _NotToeplitz
    along = [_axis(x, T) for x in (a, b)]  # "row": varies with i, "col": with j
    if sorted(along) != ["col", "row"]:
        raise _NotToeplitz
    va, vb = a.reshape(-1), b.reshape(-1)
    if not (_progression(va) and _progression(vb)) or (va[1] - va[0]) != (vb[1] - vb[0]):
        raise _NotToeplitz
    d = torch.arange(-(T - 1), T)
    rows = d.clamp(min=0)  # an entry (i, j) on each diagonal: i = max(d, 0), j = i - d
    cols = rows - d
    pa, pb = (rows, cols) if along[0] == "row" else (cols, rows)
    v = getattr(torch, op)(va[pa], vb[pb])
    return Toep(v.reshape([1] * (len(shape) - 2) + [2 * T - 1]), shape)


def _axis(x: torch.Tensor, T: int) -> str:
    """Which position axis x varies along, right-aligned against [.., T, T]: 'row' for [.., T, 1],
    'col' for [.., 1, T] or [T]; other dims must be 1."""
    s = (1,) * max(0, 2 - x.dim()) + tuple(x.shape)
    if any(n != 1 for n in s[:-2]):
        raise _NotToeplitz
    if s[-2:] == (T, 1):
        return "row"
    if s[-2:] == (1, T):
        return "col"
    raise _NotToeplitz


def _progression(x: torch.Tensor) -> bool:
    """x is exact integers x_0 + s n (n = 0, 1, ...), small enough to be exact in float32."""
    if x.numel() < 2 or x.dtype == torch.bool:
        return False
    x = x.double()
    if not bool(torch.isfinite(x).all()) or not bool((x == x.round()).all()) or bool((x.abs() >= _EXACT).any()):
        return False
    step = x[1] - x[0]
    return bool(torch.equal(x, x[0] + step * torch.arange(x.numel(), dtype=torch.float64)))
