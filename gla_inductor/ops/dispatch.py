"""The one place that chooses how a GLA op runs, for every device.

``chunk_fwd`` on CUDA runs short sequences (T <= RECURRENT_MAX_T) on the fused recurrent kernel
and longer ones on the chunked kernels (packed sequences always: the recurrent kernel does not read
cu_seqlens); its backward always runs the chunked kernels. On CPU both
run the C++ step loop where it applies (``impl.step_loop``), else the chunked PyTorch algorithm
(``impl.chunked``), which is also every CUDA call's fallback. ``fused_recurrent`` (the decode op)
runs the recurrent kernel on CUDA and a PyTorch time loop on CPU, on a state or, with state
indices, on the slots of a state pool. ``chunk_fwd_states`` (the forward with prefix states) runs
the forward scan on CUDA, elsewhere the forward block by block (``impl.prefix_states``).
``chunk_final_state`` (a run's final state, or the dual's, without outputs) runs the segment sums
kernel on CUDA, elsewhere ``impl.final_state``; ``chunk_sums`` and the ops from its parts (a run cut
around an exchange of states) run the kernels' local schedule only (``chunk_parts_apply``). Every
fallback's reason is logged once.
"""

from __future__ import annotations

import functools
import logging
from typing import Optional

import torch
from torch import Tensor

from .. import config
from ..contract import GLACall
from ..gates import gate_grads
from ..impl import chunked, final_state, prefix_states, recurrent, step_loop
from ..kernels import chunk as chunk_kernels
from ..kernels import final_state as final_state_kernels
from ..kernels import parts as parts_kernels
from ..kernels import recurrent as recurrent_kernels

__all__ = ["RECURRENT_MAX_T", "chunk_bwd", "chunk_bwd_from_parts", "chunk_bwd_gpu", "chunk_final_state",
           "chunk_final_state_gpu", "chunk_fwd", "chunk_fwd_from_parts", "chunk_fwd_gpu", "chunk_fwd_states",
           "chunk_fwd_states_gpu", "chunk_parts_apply", "chunk_sums", "chunk_unsupported_reason",
           "fused_recurrent", "fused_recurrent_gpu", "recurrent_unsupported_reason", "routes_to_recurrent"]

log = logging.getLogger("gla_inductor")

# The longest sequence run on the fused recurrent kernel, by chunk_fwd's forward and by the
# fused_recurrent op; longer ones run on the chunked kernels. Both kernels read every input once;
# the recurrent one does O(K * V) CUDA-core work per step, one step after another, on a state held
# in registers, the chunked scan does chunks of BT = 64 steps as tensor-core dots with more setup
# per chunk, so the recurrent kernel wins at small T and loses as T grows; the crossover measured
# at K = V = 128 lies near T = 12 (benchmarks/results/h100-2026-11-22-decode.md).
RECURRENT_MAX_T = 8


@functools.cache
def _note_fallback(reason: str) -> None:
    log.info("gla_inductor: CUDA call falls back to the PyTorch implementation: %s", reason)


def _switched_off_reason(call: GLACall) -> Optional[str]:
    if not config.triton_kernels:
        return "gla_inductor.config.triton_kernels is off"
    if call.gate_kind not in config.triton_gates:
        return f"{call.gate_kind} gates are not in gla_inductor.config.triton_gates"
    return None


def chunk_unsupported_reason(call: GLACall) -> Optional[str]:
    """None where the chunked kernels run ``call``, else why not."""
    return _switched_off_reason(call) or chunk_kernels.unsupported_reason(call)


def recurrent_unsupported_reason(call: GLACall, state_out: Optional[Tensor] = None) -> Optional[str]:
    """None where the fused recurrent kernel runs ``call``, else why not."""
    return _switched_off_reason(call) or recurrent_kernels.unsupported_reason(call, state_out)


def routes_to_recurrent(call: GLACall) -> bool:
    """Whether chunk_fwd runs a CUDA call on the fused recurrent kernel (not for packed sequences,
    whose lengths it cannot see)."""
    return not call.varlen and 0 < call.q.shape[1] <= RECURRENT_MAX_T and recurrent_unsupported_reason(call) is None


# ----------------------------------------------------------------------------------------------
# chunk_fwd / chunk_bwd
# ----------------------------------------------------------------------------------------------


def chunk_fwd(call: GLACall) -> tuple[Tensor, Tensor]:
    """(o, final state or an empty [0]): the contract of the ``chunk_fwd`` op."""
    return chunk_fwd_gpu(call) if call.q.is_cuda else _chunk_fwd_cpu(call)


def chunk_fwd_gpu(call: GLACall) -> tuple[Tensor, Tensor]:
    """chunk_fwd's GPU route (CPU tensors take it too under TRITON_INTERPRET=1, for tests)."""
    if routes_to_recurrent(call):
        return _chunk_fwd_recurrent(call.with_log_gate())  # short: the gate tensor is small
    reason = chunk_unsupported_reason(call)
    if reason is None:
        return chunk_kernels.forward(call)
    _note_fallback(reason)
    return chunked.forward(call.with_log_gate())


def _chunk_fwd_cpu(call: GLACall) -> tuple[Tensor, Tensor]:
    plain = call.with_log_gate()
    if step_loop.forward_unsupported_reason(plain) is None:
        return step_loop.forward(plain)
    return chunked.forward(plain)


def _chunk_fwd_recurrent(call: GLACall) -> tuple[Tensor, Tensor]:
    """chunk_fwd's contract on the recurrent kernel: a fresh fp32 final state, or an empty [0]."""
    q, v = call.q, call.v
    B, _, _, K = q.shape
    H = v.shape[2]  # q and k may have fewer heads (grouped)
    ht = q.new_empty((B, H, K, v.shape[-1]) if call.output_final_state else (0,), dtype=torch.float32)
    o = recurrent_kernels.forward(call, ht if call.output_final_state else None)
    return o, ht


def chunk_fwd_states(call: GLACall, interval: int) -> tuple[Tensor, Tensor, Tensor]:
    """(o, final state, prefix states): the contract of the ``chunk_fwd_states`` op. On CPU the
    forward runs block by block (``impl.prefix_states``)."""
    if call.q.is_cuda:
        return chunk_fwd_states_gpu(call, interval)
    return prefix_states.forward(call.with_log_gate(), interval, _chunk_fwd_cpu)


def chunk_fwd_states_gpu(call: GLACall, interval: int) -> tuple[Tensor, Tensor, Tensor]:
    """chunk_fwd_states's GPU route (CPU tensors take it too under TRITON_INTERPRET=1, for tests):
    the forward scan storing the prefix states, or the PyTorch forward block by block."""
    reason = chunk_unsupported_reason(call)
    if reason is None and call.q.shape[1] > 0:  # no steps: nothing to launch, the states are h0
        return chunk_kernels.forward_with_prefix_states(call, interval)
    if reason is not None:
        _note_fallback(reason)
    return prefix_states.forward(call.with_log_gate(), interval, chunked.forward)


def chunk_bwd(call: GLACall, do: Tensor, dht: Optional[Tensor]) -> tuple[Tensor, ...]:
    """(dq, dk, dv, dg, dg_gamma, dh0): the contract of the ``chunk_bwd`` op. With a fused gate
    function dg is the gradient w.r.t. g itself where ``gate.input_grad``, else w.r.t. the log gate
    in the compute dtype."""
    return chunk_bwd_gpu(call, do, dht) if call.q.is_cuda else _chunk_bwd_torch(call, do, dht, cpu=True)


def chunk_bwd_gpu(call: GLACall, do: Tensor, dht: Optional[Tensor]) -> tuple[Tensor, ...]:
    """chunk_bwd's GPU route (CPU tensors take it too under TRITON_INTERPRET=1, for tests)."""
    reason = chunk_unsupported_reason(call)
    if reason is None:
        return chunk_kernels.backward(call, do, dht)
    _note_fallback(reason)
    return _chunk_bwd_torch(call, do, dht, cpu=False)


def _chunk_bwd_torch(call: GLACall, do: Tensor, dht: Optional[Tensor], cpu: bool) -> tuple[Tensor, ...]:
    """The backward in PyTorch or C++ (the step loop only on CPU), on the log gate; a fused gate
    without parameters gets x's gradient, as the kernels return it."""
    plain = call.with_log_gate()
    if cpu and step_loop.backward_unsupported_reason(plain, do, dht) is None:
        grads = step_loop.backward(plain, do, dht)
    else:
        grads = chunked.backward(plain, do, dht)
    if call.gate.input_grad:
        dx = gate_grads(grads[3], call.g, call.gate, call.gate_a, call.gate_bias)[0].to(call.g.dtype)
        grads = (*grads[:3], dx, *grads[4:])
    return grads


def chunk_final_state(call: GLACall, do: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """(state, decay): the contract of the ``chunk_final_state`` op (``impl.final_state``)."""
    if call.q.is_cuda:
        return chunk_final_state_gpu(call, do)
    return final_state.final_state(call.with_log_gate(), do)


def chunk_final_state_gpu(call: GLACall, do: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """chunk_final_state's GPU route (CPU tensors take it too under TRITON_INTERPRET=1, for tests)."""
    reason = chunk_unsupported_reason(call)
    if reason is None:
        return final_state_kernels.final_state(call, do)
    _note_fallback(reason)
    return final_state.final_state(call.with_log_gate(), do)


def chunk_parts_apply(call: GLACall) -> bool:
    """Whether ``chunk_sums`` and the ops from its parts run ``call``: where the chunked kernels
    run it on their local schedule (``kernels.parts``); elsewhere context parallelism takes the
    states-only pass and the whole ops."""
    return config.context_parallel_cut and chunk_unsupported_reason(call) is None and parts_kernels.local(call)


def chunk_sums(call: GLACall, do: Optional[Tensor]) -> tuple[Tensor, Optional[Tensor], chunk_kernels.LocalParts]:
    """(S, D, parts): the contract of the ``chunk_sums`` op (``kernels.parts.sums``)."""
    _require_parts(call)
    return parts_kernels.sums(call, do)


def chunk_fwd_from_parts(call: GLACall, parts: chunk_kernels.LocalParts) -> tuple[Tensor, Tensor]:
    """chunk_fwd's contract, on the parts ``chunk_sums`` computed for the call."""
    _require_parts(call)
    return chunk_kernels.forward(call, parts_kernels.config(call), parts)


def chunk_bwd_from_parts(call: GLACall, do: Tensor, dht: Optional[Tensor], parts: chunk_kernels.LocalParts
                         ) -> tuple[Tensor, ...]:
    """chunk_bwd's contract, on the parts ``chunk_sums`` computed for the call and do."""
    _require_parts(call)
    return chunk_kernels.backward(call, do, dht, parts_kernels.config(call), parts)


def _require_parts(call: GLACall) -> None:
    if not chunk_parts_apply(call):
        raise ValueError("gla_inductor: chunk_sums and the ops from its parts run the chunked kernels' local "
                         f"schedule only (chunk_parts_apply): {chunk_unsupported_reason(call) or 'another schedule'}")


# ----------------------------------------------------------------------------------------------
# fused_recurrent
# ----------------------------------------------------------------------------------------------


def fused_recurrent(call: GLACall, state: Tensor) -> Tensor:
    """o of ``call`` (whose initial state is ``state``), overwriting ``state`` with the final state."""
    if call.q.is_cuda:
        return fused_recurrent_gpu(call, state)
    if call.q.shape[1] > recurrent.STEP_LOOP_MAX_T:
        return _via_chunks(call, state)
    return recurrent.step_loop(call, state)


def fused_recurrent_gpu(call: GLACall, state: Tensor) -> Tensor:
    """fused_recurrent's GPU route (CPU tensors take it too under TRITON_INTERPRET=1, for tests):
    the recurrent kernel, except for sequences longer than RECURRENT_MAX_T, which take the chunked
    kernels, where the recurrent kernel is slower."""
    if call.q.shape[1] > RECURRENT_MAX_T:
        return _via_chunks(call, state)
    reason = recurrent_unsupported_reason(call, state)
    if reason is None:
        return recurrent_kernels.forward(call, state)
    _note_fallback(f"fused_recurrent: {reason}")
    if call.q.shape[1] > recurrent.STEP_LOOP_MAX_T:
        return _via_chunks(call, state)
    return recurrent.step_loop(call, state)


def _via_chunks(call: GLACall, state: Tensor) -> Tensor:
    """The decode op through the chunked implementations (the kernels on CUDA); a pool's slots are
    gathered before and scattered after."""
    indices = call.state_indices
    if indices is None:
        o, ht = chunk_fwd(call.replace(initial_state=state, output_final_state=True))
        state.copy_(ht)
        return o
    h0 = recurrent.gather_slots(state, indices, call.state_dtype)
    o, ht = chunk_fwd(call.replace(initial_state=h0, output_final_state=True, state_indices=None))
    recurrent.scatter_slots(state, indices, ht)
    return recurrent.zero_padded(o, indices, state.shape[0])
