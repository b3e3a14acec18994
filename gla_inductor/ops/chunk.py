"""Custom ops ``gla_inductor::chunk_fwd`` / ``gla_inductor::chunk_bwd``: fake and autograd registrations.

The ops are opaque to Dynamo and AOTAutograd: the forward graph holds one ``chunk_fwd`` node and
the backward graph one ``chunk_bwd`` node (through ``register_autograd``), which the lowerings can
then replace by Triton templates. Their arguments are a ``GLACall`` spelled out by the schemas of
``contract`` (``CHUNK_FWD_ARGS``, ``CHUNK_BWD_ARGS``); ``dispatch`` runs them. Packed sequences
pass their offsets as the trailing ``cu_seqlens``, which has no gradient.

``gla_inductor::chunk_fwd_states`` is the forward that also returns the prefix states (for prefix
caching; ``CHUNK_STATES_ARGS``), inference only: it has no autograd formula, and Inductor calls it
as an extern kernel.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from ..contract import CHUNK_BWD_ARGS, CHUNK_STATES_ARGS, GLACall
from ..impl import prefix_states
from ..gates import gate_grads
from . import dispatch

__all__ = ["chunk_bwd", "chunk_fwd", "chunk_fwd_states", "eager_backward", "eager_forward", "on_first_trace",
           "register_eager_route", "run_chunk_gla"]

# Called once before the first trace through the fake implementations: the package face installs
# the loader of the Inductor lowerings here, so that a graph reaching Inductor has them registered
# without importing Inductor with the package.
_before_first_trace: list[Callable[[], None]] = []


def on_first_trace(fn: Callable[[], None]) -> None:
    _before_first_trace.append(fn)


def _first_trace() -> None:
    while _before_first_trace:
        _before_first_trace.pop()()


# ----------------------------------------------------------------------------------------------
# chunk_fwd
# ----------------------------------------------------------------------------------------------


def _chunk_fwd_impl(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Optional[Tensor],
    g_gamma: Optional[Tensor],
    initial_state: Optional[Tensor],
    scale: float,
    output_final_state: bool,
    reverse: bool,
    gate_fn: str = "",
    gate_scale: float = 1.0,
    gate_lo: Optional[float] = None,
    gate_hi: Optional[float] = None,
    gate_a: Optional[Tensor] = None,
    gate_bias: Optional[Tensor] = None,
    cu_seqlens: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """GLA forward. Returns (o [B, T, H, V], final state [B, H, K, V], or [0] when not requested).

    q, k may be [B, T, G, K] with G dividing v's H heads: head h reads q/k head h // (H // G).
    With ``gate_fn``, g holds the input of that gate function (``gla_inductor.gates``). With
    ``cu_seqlens`` [N + 1], B is 1 and holds N packed sequences; initial and final states are
    [N, H, K, V]."""
    return dispatch.chunk_fwd(GLACall.from_op_args(tuple(locals().values())))  # the parameters, in order


chunk_fwd = torch.library.custom_op("gla_inductor::chunk_fwd", _chunk_fwd_impl, mutates_args=())


@chunk_fwd.register_fake
def _chunk_fwd_fake(*args, **kwargs):
    _first_trace()
    call = GLACall.from_op_args(args, kwargs)
    q, v = call.q, call.v
    B, T, _, K = q.shape
    H, V = v.shape[2], v.shape[-1]  # q and k may have fewer heads than v (grouped)
    o = q.new_empty(B, T, H, V, dtype=call.output_dtype)
    N = call.num_sequences  # B, or the packed sequences
    ht = q.new_empty((N, H, K, V) if call.output_final_state else (0,), dtype=call.state_dtype)
    return o, ht


# ----------------------------------------------------------------------------------------------
# chunk_bwd
# ----------------------------------------------------------------------------------------------


def _chunk_bwd_impl(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Optional[Tensor],
    g_gamma: Optional[Tensor],
    initial_state: Optional[Tensor],
    do: Tensor,
    dht: Optional[Tensor],
    scale: float,
    reverse: bool,
    gate_fn: str = "",
    gate_scale: float = 1.0,
    gate_lo: Optional[float] = None,
    gate_hi: Optional[float] = None,
    gate_a: Optional[Tensor] = None,
    gate_bias: Optional[Tensor] = None,
    cu_seqlens: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """GLA backward, recomputing the states from the inputs.

    Returns (dq, dk, dv, dg, dg_gamma, dh0), each shaped like its input (dq, dk grouped like q, k);
    [0] for an absent input. With ``cu_seqlens``, dht and dh0 are [N, H, K, V] like the states.
    With ``gate_fn``, dg is the gradient w.r.t. g itself, like g, for a function without parameters
    (``GateFn.input_grad``: the kernels apply its derivative as they store dg); otherwise the gradient
    w.r.t. the log gate, in the compute dtype (fp32 or fp64), which ``gates.gate_grads`` turns into
    those w.r.t. the gate function's inputs.
    """
    return dispatch.chunk_bwd(GLACall.from_op_args(tuple(locals().values()), names=CHUNK_BWD_ARGS), do, dht)  # in order


chunk_bwd = torch.library.custom_op("gla_inductor::chunk_bwd", _chunk_bwd_impl, mutates_args=())


@chunk_bwd.register_fake
def _chunk_bwd_fake(*args, **kwargs):
    _first_trace()
    call = GLACall.from_op_args(args, kwargs, names=CHUNK_BWD_ARGS)

    def grad_like(x):
        # new_empty, not empty_like: the real op returns contiguous tensors whatever x's strides
        return call.q.new_empty(0) if x is None else x.new_empty(x.shape)

    grads = [grad_like(x) for x in (call.q, call.k, call.v, call.g, call.g_gamma, call.initial_state)]
    if call.fused_gate and not call.gate.input_grad:
        grads[3] = call.g.new_empty(call.g.shape, dtype=call.compute_dtype)
    return tuple(grads)


# ----------------------------------------------------------------------------------------------
# chunk_fwd_states (inference only: no autograd formula)
# ----------------------------------------------------------------------------------------------


def _chunk_fwd_states_impl(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Optional[Tensor],
    g_gamma: Optional[Tensor],
    initial_state: Optional[Tensor],
    scale: float,
    state_interval: int,
    gate_fn: str = "",
    gate_scale: float = 1.0,
    gate_lo: Optional[float] = None,
    gate_hi: Optional[float] = None,
    gate_a: Optional[Tensor] = None,
    gate_bias: Optional[Tensor] = None,
    cu_seqlens: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The GLA forward (not reverse) with the prefix states, for prefix caching. Returns (o, final
    state, prefix states): every ``state_interval`` steps the state after the steps so far, fp32,
    [B, T // P + 1, H, K, V] with slot j after the first j * P steps (slot 0: the initial state);
    with cu_seqlens [1, T // P + N, H, K, V], sequence n's from slot cu_seqlens[n] // P + n on."""
    call = GLACall.from_op_args(tuple(locals().values()), names=CHUNK_STATES_ARGS)  # the parameters, in order
    return dispatch.chunk_fwd_states(call.replace(output_final_state=True), state_interval)


chunk_fwd_states = torch.library.custom_op("gla_inductor::chunk_fwd_states", _chunk_fwd_states_impl, mutates_args=())


@chunk_fwd_states.register_fake
def _chunk_fwd_states_fake(*args, **kwargs):
    named = dict(zip(CHUNK_STATES_ARGS, args), **kwargs)
    call = GLACall.from_op_args(args, kwargs, names=CHUNK_STATES_ARGS).replace(output_final_state=True)
    o, ht = _chunk_fwd_fake(*call.op_args())
    q, v = call.q, call.v
    hp = q.new_empty(*prefix_states.slots(call, named["state_interval"]), v.shape[2], q.shape[-1], v.shape[-1],
                     dtype=call.state_dtype)
    return o, ht, hp


# ----------------------------------------------------------------------------------------------
# autograd
# ----------------------------------------------------------------------------------------------


def _chunk_fwd_setup_context(ctx, inputs, output):
    call = GLACall.from_op_args(inputs)
    ctx.save_for_backward(call.q, call.k, call.v, call.g, call.g_gamma, call.initial_state, call.gate_a,
                          call.gate_bias, call.cu_seqlens)
    # the call without its tensors, which come back from saved_tensors
    ctx.call = call.replace(q=None, k=None, v=None, g=None, g_gamma=None, initial_state=None, gate_a=None,
                            gate_bias=None, cu_seqlens=None)


def _saved_call(ctx) -> GLACall:
    q, k, v, g, g_gamma, initial_state, gate_a, gate_bias, cu_seqlens = ctx.saved_tensors
    return ctx.call.replace(q=q, k=k, v=v, g=g, g_gamma=g_gamma, initial_state=initial_state, gate_a=gate_a,
                            gate_bias=gate_bias, cu_seqlens=cu_seqlens)


def _chunk_fwd_backward(ctx, do, dht, bwd: Optional[Callable] = None):
    """The backward of chunk_fwd, through the chunk_bwd op, or through ``bwd`` (``_EagerChunkGLA``)."""
    call = _saved_call(ctx)
    if not call.output_final_state:
        dht = None
    if do is None:
        do = call.v.new_zeros(call.v.shape, dtype=call.output_dtype)
    grads = (bwd or torch.ops.gla_inductor.chunk_bwd)(*call.bwd_op_args(do, dht))
    dq, dk, dv, dg, dg_gamma, dh0 = grads
    da = dbias = None
    if call.fused_gate and not call.gate.input_grad:
        dg, da, dbias = gate_grads(dg, call.g, call.gate, call.gate_a, call.gate_bias)
        dg = dg.to(call.g.dtype)
        da = None if da is None else da.to(call.gate_a.dtype)
        dbias = None if dbias is None else dbias.to(call.gate_bias.dtype)

    def present(grad, x):
        return None if x is None else grad

    # none for cu_seqlens (integer offsets) or the non-tensor arguments
    by_name = dict(q=dq, k=dk, v=dv, g=present(dg, call.g), g_gamma=present(dg_gamma, call.g_gamma),
                   initial_state=present(dh0, call.initial_state), gate_a=da, gate_bias=dbias)
    return tuple(by_name.get(name) for name in _FWD_ARG_NAMES)


_FWD_ARG_NAMES = tuple(a.name for a in chunk_fwd._opoverload._schema.arguments)

chunk_fwd.register_autograd(_chunk_fwd_backward, setup_context=_chunk_fwd_setup_context)


# ----------------------------------------------------------------------------------------------
# eager calls
# ----------------------------------------------------------------------------------------------


class _EagerChunkGLA(torch.autograd.Function):
    """chunk_fwd and its backward for eager calls of ``chunk_gla``: the ops' implementations and
    autograd formula without torch.library's dispatch and autograd wrappers, which cost their own
    host time on every call (benchmarks/results/archive/h100-2026-11-23-launch.md). Compiled graphs
    keep the ops (``_eager_fast_path``)."""

    @staticmethod
    def forward(ctx, *inputs):
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None, as through the op
        ctx.num_inputs = len(inputs)  # with or without cu_seqlens
        o, ht = _chunk_fwd_impl(*inputs)
        _chunk_fwd_setup_context(ctx, inputs, (o, ht))
        if not ctx.call.output_final_state:
            ctx.mark_non_differentiable(ht)
        return o, ht

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dht):
        return _chunk_fwd_backward(ctx, do, dht, bwd=_chunk_bwd_impl)[:ctx.num_inputs]


_PLAIN_TENSORS = (Tensor, torch.nn.Parameter)


def _no_tracing() -> bool:
    """Outside compilation and with no torch function or dispatch mode active (fake tensors,
    tracing, FlopCounter): only there may a call bypass the ops, which such modes see and trace."""
    return not (torch.compiler.is_compiling() or torch._C._is_torch_function_mode_enabled()
                or torch._C._len_torch_dispatch_stack() > 0)


def _eager_fast_path(tensors) -> bool:
    """Whether ``chunk_gla`` may bypass the ops: outside compilation, with no torch function or
    dispatch mode active (fake tensors, tracing, FlopCounter) and plain tensors only (no subclass
    or functorch wrapper), where only the ops see and trace what happens."""
    return _no_tracing() and all(
        x is None or type(x) in _PLAIN_TENSORS and not torch._C._functorch.is_functorch_wrapped_tensor(x)
        for x in tensors
    )


def eager_forward(ctx, args: tuple) -> tuple[Tensor, Tensor]:
    """chunk_fwd's implementation on plain tensors, saving on ``ctx`` what ``eager_backward`` needs:
    the forward of an autograd Function that runs a tensor subclass's local parts."""
    o, ht = _chunk_fwd_impl(*args)
    _chunk_fwd_setup_context(ctx, args, (o, ht))
    return o, ht


def eager_backward(ctx, do: Optional[Tensor], dht: Optional[Tensor]) -> tuple:
    """The gradients of ``eager_forward``'s arguments (None for the non-tensor ones)."""
    return _chunk_fwd_backward(ctx, do, dht, bwd=_chunk_bwd_impl)


# Eager routes for tensor subclasses: each takes chunk_fwd's full arguments and returns (o, ht), or
# None where it does not take the call (``distributed`` runs DTensors' local parts without DTensor's
# dispatch). Outside compilation and dispatch modes only, like the fast path.
_eager_routes: list[Callable[[tuple], Optional[tuple[Tensor, Tensor]]]] = []


def register_eager_route(route: Callable[[tuple], Optional[tuple[Tensor, Tensor]]]) -> None:
    if route not in _eager_routes:
        _eager_routes.append(route)


def run_chunk_gla(call: GLACall) -> tuple[Tensor, Tensor]:
    """chunk_fwd on a call of tensors, through the op, or the eager fast path where it may."""
    args = call.op_args(full=True)
    if _eager_fast_path([*call.tensors().values(), call.cu_seqlens]):
        return _EagerChunkGLA.apply(*args)
    if _eager_routes and _no_tracing():
        for route in _eager_routes:
            out = route(args)
            if out is not None:
                return out
    return torch.ops.gla_inductor.chunk_fwd(*args)
