"""Fused gates: the GLA ops can take a gate function's input instead of the log gate itself.

Models compute their log gates with one of a few functions of a projection x:

  "logsigmoid"  g = clamp(logsigmoid(x) * scale)            GLA (logsigmoid(x) / 16), log(sigmoid(x))
  "softplus"    g = a * clamp(softplus(x + bias))           Mamba2 / Gated DeltaNet: a = -exp(A_log)
                                                            per head, bias = dt_bias

clamp is to [lo, hi] (either optional). Passed ``gate_fn`` and its parameters, the ops read x where
they would read g, and the kernels apply the function as they load it (``_gla_gate`` in
``templates/gla_common.py.jinja``), so no gate tensor of x's size is ever written; x has the shape
of g, [B, T, H, K] (vector) or [B, T, H] (scalar). ``a`` is [H]; ``bias`` is shaped like x's head
dimensions, [H, K] or [H]. The ops' backward returns the gradient w.r.t. x (and a, bias). For
"logsigmoid", which has no parameters, the kernels apply the function's derivative themselves as
they store the gradient (``GateFn.input_grad``): no log-gate gradient of x's size is written and
read again. For "softplus" they return the log gate's gradient, which ``gate_grads`` turns into
those of x, a and bias (the sums giving a's and bias's gradients need it).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["GATE_FNS", "GateFn", "check_gate_name", "gate_grads", "log_gate"]

GATE_FNS = ("logsigmoid", "softplus")
_CODES = {"": 0, "logsigmoid": 1, "softplus": 2}  # GATE_FN of the kernels


class GateFn(NamedTuple):
    """A fused gate function and its constants ("" is no function: the ops read the log gate).

    A NamedTuple rather than a dataclass: the public functions build one, and a ``GLACall`` around
    it, in the frames that ``torch.compile(fullgraph=True)`` traces. Dynamo wraps a namedtuple
    wherever it meets one; torch 2.11's Dynamo cannot wrap a dataclass instance it meets without
    a source, as it meets ``GLACall``'s default ``GateFn()`` (inlining a function with no source,
    such as a dataclass's generated ``__init__``, it wraps every default value, passed or not).
    So no ``__post_init__``: names are checked by ``check_gate_name`` (the public functions'
    validation) and ``kernel_options``."""

    name: str = ""
    scale: float = 1.0
    lo: Optional[float] = None
    hi: Optional[float] = None

    @property
    def input_grad(self) -> bool:
        """Whether the ops' backward returns the gradient w.r.t. x itself (in x's dtype) rather
        than w.r.t. the log gate (fp32, for ``gate_grads``): for functions without parameters."""
        return self.name == "logsigmoid"

    def kernel_options(self) -> dict:
        """The kernels' constexprs (finite floats: the options are emitted as code)."""
        check_gate_name(self.name)
        return dict(
            GATE_FN=_CODES[self.name],
            GATE_SCALE=float(self.scale),
            HAS_LO=self.lo is not None,
            GATE_LO=float(self.lo) if self.lo is not None else 0.0,
            HAS_HI=self.hi is not None,
            GATE_HI=float(self.hi) if self.hi is not None else 0.0,
        )


def check_gate_name(name: str, api: str = "") -> None:
    """Raise unless ``name`` is a gate function (or "", none); ``api`` prefixes the message."""
    if name not in _CODES:
        prefix = f"{api}: " if api else ""
        raise ValueError(f"{prefix}gate_fn must be one of {GATE_FNS} (or empty), got {name!r}")


def _clamp(y: Tensor, fn: GateFn) -> Tensor:
    return y if fn.lo is None and fn.hi is None else y.clamp(fn.lo, fn.hi)


def _clamp_passes(y: Tensor, fn: GateFn) -> Tensor:
    """Where torch.clamp passes its gradient: lo <= y <= hi."""
    keep = torch.ones_like(y, dtype=torch.bool)
    if fn.lo is not None:
        keep &= y >= fn.lo
    if fn.hi is not None:
        keep &= y <= fn.hi
    return keep


def _heads(p: Tensor, x: Tensor) -> Tensor:
    """A per-head parameter ([H] or [H, K]) broadcast against x ([B, T, H] or [B, T, H, K])."""
    return p.view(*p.shape, *([1] * (x.dim() - 2 - p.dim())))


def log_gate(x: Tensor, fn: GateFn, a: Optional[Tensor], bias: Optional[Tensor], dtype: torch.dtype) -> Tensor:
    """The log gate of x, computed in ``dtype`` (the PyTorch path of the ops)."""
    x = x.to(dtype)
    if fn.name == "logsigmoid":
        return _clamp(F.logsigmoid(x) * fn.scale, fn)
    if fn.name == "softplus":
        return _heads(a.to(dtype), x) * _clamp(F.softplus(x + _heads(bias.to(dtype), x)), fn)
    return x


def _log1p(u: Tensor) -> Tensor:
    """log(1 + u), accurate for small u, from exp/log only: what the kernels compute (gla_common's
    _gla_log1p), and what Inductor's Triton code runs under the CPU interpreter too (libdevice's
    log1p, which torch.log1p lowers to, does not)."""
    w = 1 + u
    return torch.where(w == 1, u, torch.log(w) * (u / (w - 1)))


def _logsigmoid(x: Tensor) -> Tensor:
    return torch.minimum(x, torch.zeros_like(x)) - _log1p(torch.exp(-x.abs()))


def _softplus(z: Tensor) -> Tensor:
    return torch.where(z > 20, z, _log1p(torch.exp(z.clamp_max(20))))


def gate_grads(dg: Tensor, x: Tensor, fn: GateFn, a: Optional[Tensor], bias: Optional[Tensor]
               ) -> tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """(dx, da, dbias) from dg, the gradient w.r.t. the log gate, computed in dg's dtype (in the
    backward graph: Inductor fuses it into one pointwise kernel and the parameters' sums)."""
    dtype = dg.dtype
    x = x.to(dtype)
    if fn.name == "logsigmoid":
        y = _logsigmoid(x) * fn.scale
        dx = dg * torch.sigmoid(-x) * fn.scale * _clamp_passes(y, fn)
        return dx, None, None
    # softplus: g = a * clamp(softplus(z)), z = x + bias
    a_, z = _heads(a.to(dtype), x), x + _heads(bias.to(dtype), x)
    sp = _softplus(z)
    dx = dg * a_ * torch.sigmoid(z) * _clamp_passes(sp, fn)
    head_dims = tuple(range(2, 2 + a.dim()))
    da = (dg * _clamp(sp, fn)).sum([d for d in range(dg.dim()) if d not in head_dims])
    dbias = dx.sum((0, 1))
    return dx, da, dbias
