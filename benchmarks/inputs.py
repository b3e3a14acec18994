"""Inputs of the benchmarks, and GLA as a user writes it naively (what the backend recognizes).

Layout [B, T, H, D]: q, k [B, T, H, K], v [B, T, H, V]; log gates like a GLA layer's,
``logsigmoid(x) / 16``: [B, T, H, K] (vector gate) or [B, T, H] (scalar gate).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

# The kernel benchmark's shapes (B, T, H, K, V): the main shape, a long sequence with many heads,
# wide heads with few of them, fewer (batch, head) pairs, small heads, and a long sequence with few
# programs.
KERNEL_SHAPES = [
    (8, 2048, 16, 128, 128),
    (1, 8192, 96, 128, 128),
    (8, 2048, 4, 256, 512),
    (4, 2048, 16, 128, 128),
    (8, 1024, 8, 64, 64),
    (2, 16384, 16, 128, 128),
]
QUICK_SHAPES = [(2, 256, 4, 64, 64)]
# the tile sweeps' shapes (`tune`): the main shape, and --quick's, as --shapes text
SWEEP_MAIN = "8,2048,16,128,128"
SWEEP_QUICK = "2,256,4,64,64"


def log_gate(shape, device, dtype, generator: Optional[torch.Generator] = None, scale: float = 1 / 16):
    """``logsigmoid(randn) * scale``, computed in fp32 then cast: gates in (-inf, 0), most near
    -log(2) * scale, as a GLA layer's ``logsigmoid(x) / 16``."""
    x = torch.randn(shape, device=device, generator=generator)
    return (F.logsigmoid(x) * scale).to(dtype)


def gla_inputs(B: int, T: int, H: int, K: int, V: int, *, gate: str = "vector", device: str = "cuda",
               dtype: torch.dtype = torch.bfloat16, gate_dtype: Optional[torch.dtype] = None,
               requires_grad: bool = False, seed: int = 0) -> tuple:
    """q, k, v and the log gate g (None for gate "none"), seeded.

    gate_dtype defaults to ``dtype`` for vector gates and fp32 for scalar ones (how FLA's layers
    pass them, and how the kernel benchmark always measured them); the tile sweeps pass bf16 for
    both."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, device=device, generator=gen).to(dtype)

    q, k, v = randn(B, T, H, K), randn(B, T, H, K), randn(B, T, H, V)
    if gate == "vector":
        g = log_gate((B, T, H, K), device, gate_dtype or dtype, gen)
    elif gate == "scalar":
        g = log_gate((B, T, H), device, gate_dtype or torch.float32, gen)
    elif gate == "none":
        g = None
    else:
        raise ValueError(f"gate must be 'vector', 'scalar' or 'none', got {gate!r}")
    out = (q, k, v, g)
    if requires_grad:
        out = tuple(None if x is None else x.requires_grad_() for x in out)
    return out


def sweep_inputs(shape, gate: str):
    """q, k, v and a bf16 gate of the tile sweeps at shape (B, T, H, K, V), on CUDA."""
    B, T, H, K, V = shape
    return gla_inputs(B, T, H, K, V, gate=gate, gate_dtype=torch.bfloat16)


def ab_inputs(B: int, T: int, H: int, K: int, V: int, gate: str, device: str = "cuda") -> tuple:
    """q, k, v, g, g_gamma of ``tune ab``: the sweeps' bf16 gate for "vector", "scalar" and "none",
    and for "constant" no g and a seeded g_gamma [H] in (-1/16, 0]."""
    if gate != "constant":
        return (*gla_inputs(B, T, H, K, V, gate=gate, device=device, gate_dtype=torch.bfloat16), None)
    q, k, v, _ = gla_inputs(B, T, H, K, V, gate="none", device=device)
    gen = torch.Generator(device=device).manual_seed(2)
    return q, k, v, None, -torch.rand(H, device=device, generator=gen) / 16


def state(B: int, H: int, K: int, V: int, *, device: str = "cuda", seed: int = 1) -> torch.Tensor:
    """A random fp32 recurrent state [B, H, K, V] (a decode cache)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(B, H, K, V, device=device, generator=gen)


# ---------------------------------------------------------------------------------------------
# GLA written naively: the programs the benchmarks compile
# ---------------------------------------------------------------------------------------------


def naive_loop(q, k, v, g):
    """The time loop of the README, [B, T, H, D], vector gate: what the CPU benchmark compiles."""
    B, T, H, K = q.shape
    S = q.new_zeros(B, H, K, v.shape[-1])
    o = torch.zeros_like(v)
    for t in range(T):
        S = S * g[:, t].exp()[..., None] + k[:, t, :, :, None] * v[:, t, :, None, :]
        o[:, t] = (q[:, t, :, :, None] * S).sum(-2) * K**-0.5
    return o


def naive_parallel_scalar(q, k, v, g):
    """The parallel form with a causal decay mask, scalar gate [B, T, H], fp32 math, output in the
    input dtype: the eager and default-torch.compile baselines of the kernel benchmark."""
    dtype = v.dtype
    q, k, v, g = (x.transpose(1, 2).float() for x in (q, k, v, g))
    G = g.cumsum(-1)
    n = q.shape[2]
    mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    D = torch.exp(G[..., :, None] - G[..., None, :]).masked_fill(~mask, 0)
    o = ((q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5 * D) @ v
    return o.transpose(1, 2).to(dtype)


def naive_pairwise_vector(q, k, v, g):
    """GLA as written from the paper, vector gate: pairwise decays on the causal triangle (a
    [B, H, T, T, K] tensor: only compiled with the backend is it affordable)."""
    q, k, v, g = (t.transpose(1, 2) for t in (q, k, v, g))  # [B, H, T, D]
    G = g.float().cumsum(2)
    n = q.shape[2]
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    diff = (G[:, :, :, None, :] - G[:, :, None, :, :]).masked_fill(~causal[:, :, None], float("-inf"))
    A = (q[:, :, :, None, :] * k[:, :, None, :, :] * diff.exp()).sum(-1) * q.shape[-1] ** -0.5
    return (A.to(v.dtype) @ v).transpose(1, 2)


def naive_steps(q, k, v, g, state, scale):
    """The recurrence step by step in the state's dtype, from ``state``: (o, final state)."""
    S, dt = state, state.dtype
    o = []
    for t in range(q.shape[1]):
        S = S * g[:, t].to(dt).exp()[..., None] + k[:, t].to(dt)[..., None] * v[:, t].to(dt)[..., None, :]
        o.append((q[:, t].to(dt)[..., None] * S).sum(-2) * scale)
    return torch.stack(o, 1).to(q.dtype), S


# ---------------------------------------------------------------------------------------------
# FLA, optional
# ---------------------------------------------------------------------------------------------


def fla_ops() -> tuple:
    """(namespace of FLA's GLA ops, None) or (None, why not): FLA is optional everywhere."""
    try:
        from fla.ops.gla import chunk_gla, fused_recurrent_gla
        from fla.ops.simple_gla import chunk_simple_gla
    except Exception as e:  # noqa: BLE001 - ImportError, or FLA failing on this torch / triton
        return None, f"FLA not importable ({type(e).__name__}: {str(e)[:120]}): its columns are skipped"
    import types

    try:
        from fla.ops.simple_gla import fused_recurrent_simple_gla
    except Exception:  # noqa: BLE001 - older FLA: its scalar-gate step columns are skipped
        fused_recurrent_simple_gla = None
    return types.SimpleNamespace(chunk_gla=chunk_gla, chunk_simple_gla=chunk_simple_gla,
                                 fused_recurrent_gla=fused_recurrent_gla,
                                 fused_recurrent_simple_gla=fused_recurrent_simple_gla), None


def fla_version() -> Optional[str]:
    """fla-core's version where FLA is installed (for the results' stamp), else None."""
    from importlib import metadata

    for dist in ("fla-core", "flash-linear-attention"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None
