"""Routes the GLA ops' CUDA calls to the Triton kernels, or to the PyTorch implementations where
the kernels do not apply (the reason is logged once per reason).

``chunk_fwd`` runs short sequences (T <= RECURRENT_MAX_T) on the fused recurrent kernel and longer
ones on the chunked scan; its backward always runs the chunked kernels. ``fused_recurrent`` (the
decode op, ``gla_inductor.decode``) runs the recurrent kernel.
"""

from __future__ import annotations

import functools
import logging

import torch

log = logging.getLogger("gla_inductor")

# The longest sequence run on the fused recurrent kernel, by chunk_fwd's forward and by the
# fused_recurrent op; longer ones run on the chunked kernels. Both kernels read every input once;
# the recurrent one does O(K * V) CUDA-core work per step, one step after another, on a state held
# in registers, the chunked scan does chunks of BT = 64 steps as tensor-core dots with more setup
# per chunk, so the recurrent kernel wins at small T and loses as T grows. Measured on an H100
# (B, H, K, V = 64, 32, 128, 128; benchmarks/results/h100-2026-11-22-decode.md): recurrent 0.10 /
# 0.16 / 0.39 ms at T = 1 / 4 / 16, chunked 0.29 / 0.29 / 0.30 ms: the crossover lies near T = 12.
RECURRENT_MAX_T = 8


@functools.cache
def _note_fallback(reason: str) -> None:
    log.info("gla_inductor: CUDA call falls back to the PyTorch implementation: %s", reason)


def _switched_off(g, g_gamma):
    from . import config

    if not config.triton_kernels:
        return "gla_inductor.config.triton_kernels is off"
    gate = gate_kind(g, g_gamma)
    if gate not in config.triton_gates:
        return f"{gate} gates are not in gla_inductor.config.triton_gates"
    return None


def _unsupported(q, k, v, g, g_gamma, initial_state):
    from .triton_chunk import triton_supports

    return _switched_off(g, g_gamma) or triton_supports(q, k, v, g, g_gamma, initial_state)


def _recurrent_unsupported(q, k, v, g, g_gamma, state):
    from .triton_recurrent import recurrent_supports

    return _switched_off(g, g_gamma) or recurrent_supports(q, k, v, g, g_gamma, state)


def routes_to_recurrent(q, k, v, g, g_gamma, initial_state) -> bool:
    """Whether chunk_fwd_cuda runs these inputs on the fused recurrent kernel."""
    return 0 < q.shape[1] <= RECURRENT_MAX_T and _recurrent_unsupported(q, k, v, g, g_gamma, initial_state) is None


def gate_kind(g, g_gamma) -> str:
    if g is not None:
        return "vector" if g.dim() == 4 else "scalar"
    return "constant" if g_gamma is not None else "none"


def chunk_fwd_cuda(q, k, v, g, g_gamma, initial_state, scale, output_final_state, reverse, *, gate=None,
                   gate_a=None, gate_bias=None):
    """``gate``, a ``gates.GateFn``, names the function of g the kernels apply (none: g is the log gate)."""
    from . import ops
    from .triton_chunk import chunk_fwd_triton

    fused = gate is not None and gate.name
    if routes_to_recurrent(q, k, v, g, g_gamma, initial_state):
        # the recurrent kernel reads log gates: the short sequences it runs make the gate tensor small
        g = ops._plain_gate(q, k, v, g, gate, gate_a, gate_bias, initial_state) if fused else g
        return _chunk_fwd_recurrent(q, k, v, g, g_gamma, initial_state, scale, output_final_state, reverse)
    reason = _unsupported(q, k, v, g, g_gamma, initial_state)
    if reason is not None:
        _note_fallback(reason)
        g = ops._plain_gate(q, k, v, g, gate, gate_a, gate_bias, initial_state) if fused else g
        return ops._fwd_torch(q, k, v, g, g_gamma, initial_state, scale, output_final_state, reverse)
    return chunk_fwd_triton(q, k, v, g, g_gamma, initial_state, scale, output_final_state, reverse, gate=gate,
                            gate_a=gate_a, gate_bias=gate_bias)


def _chunk_fwd_recurrent(q, k, v, g, g_gamma, initial_state, scale, output_final_state, reverse):
    """chunk_fwd's contract on the recurrent kernel: a fresh fp32 final state, or an empty [0]."""
    from .triton_recurrent import fused_recurrent_triton

    B, _, _, K = q.shape
    H = v.shape[2]  # q and k may have fewer heads (grouped)
    ht = q.new_empty((B, H, K, v.shape[-1]) if output_final_state else (0,), dtype=torch.float32)
    o = fused_recurrent_triton(q, k, v, g, g_gamma, initial_state, ht if output_final_state else None, scale,
                               reverse)
    return o, ht


def chunk_bwd_cuda(q, k, v, g, g_gamma, initial_state, do, dht, scale, reverse, *, gate=None, gate_a=None,
                   gate_bias=None):
    from . import ops
    from .triton_chunk import chunk_bwd_triton

    reason = _unsupported(q, k, v, g, g_gamma, initial_state)
    if reason is not None:
        _note_fallback(reason)
        if gate is not None and gate.name:
            g = ops._plain_gate(q, k, v, g, gate, gate_a, gate_bias, initial_state)
        return ops._bwd_torch(q, k, v, g, g_gamma, initial_state, do, dht, scale, reverse)
    return chunk_bwd_triton(q, k, v, g, g_gamma, initial_state, do, dht, scale, reverse, gate=gate, gate_a=gate_a,
                            gate_bias=gate_bias)


def fused_recurrent_cuda(q, k, v, g, g_gamma, state, scale, reverse):
    """The CUDA implementation of the ``gla_inductor::fused_recurrent`` op: reads ``state`` and
    overwrites it with the final state, returns o. Sequences longer than RECURRENT_MAX_T take the
    chunked kernels (through chunk_fwd), where the recurrent kernel is slower."""
    from . import decode
    from .triton_recurrent import fused_recurrent_triton

    if q.shape[1] > RECURRENT_MAX_T:
        return decode._via_chunks(q, k, v, g, g_gamma, state, scale, reverse)
    reason = _recurrent_unsupported(q, k, v, g, g_gamma, state)
    if reason is not None:
        _note_fallback(f"fused_recurrent: {reason}")
        return decode._fused_recurrent_torch(q, k, v, g, g_gamma, state, scale, reverse)
    return fused_recurrent_triton(q, k, v, g, g_gamma, state, state, scale, reverse)
