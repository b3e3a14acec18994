"""Custom ops of a chunked run cut where context parallelism exchanges states (``kernels.parts``).

``gla_inductor::chunk_sums`` is ``chunk_final_state``'s contract (a run's state from a zero start,
or with do the gradient w.r.t. its initial state, and the decay across it) computed as the first
half of the run itself, so that it also returns the parts the run goes on from:
``gla_inductor::chunk_fwd_from_parts`` is ``chunk_fwd`` and ``gla_inductor::chunk_bwd_from_parts``
``chunk_bwd`` on those parts. The parts are kernel intermediates in a fixed order (``PARTS``), an
absent one (no gate: dl, ds) an empty [0]. They run only where ``dispatch.chunk_parts_apply`` (else a
ValueError says why); no autograd formulas (context parallelism brings its own backward); Inductor
lowers them to the templates of the whole ops (``lowerings/chunk.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..contract import CHUNK_BWD_ARGS, GLACall
from ..kernels import parts as parts_kernels
from ..kernels.chunk import LocalParts
from . import dispatch
from .chunk import _chunk_bwd_fake, _chunk_fwd_fake, _first_trace
from .final_state import FINAL_STATE_ARGS, final_state_call

__all__ = ["PARTS", "chunk_bwd_from_parts", "chunk_fwd_from_parts", "chunk_sums", "from_list", "to_list"]

PARTS = ("qs", "ks", "A", "dl", "hs", "ds")


def to_list(parts: LocalParts) -> list[Tensor]:
    """The parts as the ops pass them: in ``PARTS`` order, an empty [0] for an absent one."""
    return [x if x is not None else parts.qs.new_empty(0) for x in (getattr(parts, n) for n in PARTS)]


def from_list(call: GLACall, tensors: list[Tensor]) -> LocalParts:
    """The inverse of ``to_list``: dl and ds are absent exactly without a gate."""
    named = dict(zip(PARTS, tensors))
    if call.gate_kind == "none":
        named.update(dl=None, ds=None)
    return LocalParts(**named)


def _arguments(op) -> str:
    """An op's arguments as its schema spells them, for the ops below that take them too."""
    return str(op.default._schema).split("(", 1)[1].rsplit(") ->", 1)[0]


def _define(name: str, schema: str, impl, fake) -> None:
    qualname = f"gla_inductor::{name}"
    torch.library.define(qualname, schema)
    torch.library.impl(qualname, "default")(impl)
    torch.library.register_fake(qualname)(fake)


def _chunk_sums_impl(*args, **kwargs) -> tuple[Tensor, ...]:
    """(S, D, *parts): S and D as ``chunk_final_state``'s (D an empty [0] without a gate), then the
    parts in ``PARTS`` order; arguments as ``chunk_final_state``'s."""
    named = dict(zip(FINAL_STATE_ARGS, args), **kwargs)
    S, D, parts = dispatch.chunk_sums(final_state_call(named), named.get("do"))
    return (S, S.new_empty(0) if D is None else D, *to_list(parts))


def _chunk_sums_fake(*args, **kwargs) -> tuple[Tensor, ...]:
    _first_trace()
    call = final_state_call(dict(zip(FINAL_STATE_ARGS, args), **kwargs))
    specs = parts_kernels.shapes(call)

    def new(name: str) -> Tensor:
        spec = specs[name]
        return call.q.new_empty(0) if spec is None else call.q.new_empty(spec[0], dtype=spec[1])

    return tuple(new(n) for n in ("S", "D", *PARTS))


def _chunk_fwd_from_parts_impl(parts: list[Tensor], *args, **kwargs) -> tuple[Tensor, Tensor]:
    """``chunk_fwd`` (its arguments after ``parts``) on the parts ``chunk_sums`` computed for it."""
    call = GLACall.from_op_args(args, kwargs)
    return dispatch.chunk_fwd_from_parts(call, from_list(call, parts))


def _chunk_bwd_from_parts_impl(parts: list[Tensor], *args, **kwargs) -> tuple[Tensor, ...]:
    """``chunk_bwd`` (its arguments after ``parts``) on the parts ``chunk_sums`` computed for it and do."""
    named = dict(zip(CHUNK_BWD_ARGS, args), **kwargs)
    call = GLACall.from_op_args(args, kwargs, names=CHUNK_BWD_ARGS)
    return dispatch.chunk_bwd_from_parts(call, named["do"], named.get("dht"), from_list(call, parts))


# The schemas are chunk_final_state's, chunk_fwd's and chunk_bwd's arguments (parts first where the
# op takes them): the halves take what the whole ops take.
_define("chunk_sums", f"({_arguments(torch.ops.gla_inductor.chunk_final_state)}) -> ({', '.join(['Tensor'] * 8)})",
        _chunk_sums_impl, _chunk_sums_fake)
_define("chunk_fwd_from_parts", f"(Tensor[] parts, {_arguments(torch.ops.gla_inductor.chunk_fwd)}) -> (Tensor, Tensor)",
        _chunk_fwd_from_parts_impl, lambda parts, *args, **kwargs: _chunk_fwd_fake(*args, **kwargs))
_define("chunk_bwd_from_parts",
        f"(Tensor[] parts, {_arguments(torch.ops.gla_inductor.chunk_bwd)}) -> ({', '.join(['Tensor'] * 6)})",
        _chunk_bwd_from_parts_impl, lambda parts, *args, **kwargs: _chunk_bwd_fake(*args, **kwargs))
chunk_sums = torch.ops.gla_inductor.chunk_sums
chunk_fwd_from_parts = torch.ops.gla_inductor.chunk_fwd_from_parts
chunk_bwd_from_parts = torch.ops.gla_inductor.chunk_bwd_from_parts
