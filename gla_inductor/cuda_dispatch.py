"""Routes the GLA ops' CUDA calls to the Triton kernels, or to the chunked PyTorch
implementation where the kernels do not apply (the reason is logged once per reason)."""

from __future__ import annotations

import functools
import logging

log = logging.getLogger("gla_inductor")


@functools.cache
def _note_fallback(reason: str) -> None:
    log.info("gla_inductor: CUDA call falls back to the PyTorch implementation: %s", reason)


def _unsupported(q, k, v, g, g_gamma, initial_state):
    from . import config
    from .triton_chunk import triton_supports

    if not config.triton_kernels:
        return "gla_inductor.config.triton_kernels is off"
    gate = gate_kind(g, g_gamma)
    if gate not in config.triton_gates:
        return f"{gate} gates are not in gla_inductor.config.triton_gates"
    return triton_supports(q, k, v, g, g_gamma, initial_state)


def gate_kind(g, g_gamma) -> str:
    if g is not None:
        return "vector" if g.dim() == 4 else "scalar"
    return "constant" if g_gamma is not None else "none"


def chunk_fwd_cuda(q, k, v, g, g_gamma, initial_state, scale, output_final_state, reverse):
    from . import ops
    from .triton_chunk import chunk_fwd_triton

    reason = _unsupported(q, k, v, g, g_gamma, initial_state)
    if reason is not None:
        _note_fallback(reason)
        return ops._chunk_fwd_torch(q, k, v, g, g_gamma, initial_state, scale, output_final_state, reverse)
    return chunk_fwd_triton(q, k, v, g, g_gamma, initial_state, scale, output_final_state, reverse)


def chunk_bwd_cuda(q, k, v, g, g_gamma, initial_state, do, dht, scale, reverse):
    from . import ops
    from .triton_chunk import chunk_bwd_triton

    reason = _unsupported(q, k, v, g, g_gamma, initial_state)
    if reason is not None:
        _note_fallback(reason)
        return ops._chunk_bwd_torch(q, k, v, g, g_gamma, initial_state, do, dht, scale, reverse)
    return chunk_bwd_triton(q, k, v, g, g_gamma, initial_state, do, dht, scale, reverse)
