"""Packed-sequence cases for the varlen tests: inputs of N sequences packed along time, and the
reference, each sequence run alone through the float64 time loop of ``gla_inductor.reference``."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

import torch
import torch.nn.functional as F

from gla_inductor.gates import GateFn, log_gate
from gla_inductor.reference import naive_recurrent_gla

C = 64  # the chunk length of the kernels and of impl.chunked
EDGE_LENGTHS = (0, 1, C - 1, C, C + 1)


def offsets(lengths, dtype=torch.int32) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=dtype)


def random_lengths(seed: int, extra: int = 3, longest: int = 2 * C + 3) -> list[int]:
    """The edge lengths 0, 1, C - 1, C, C + 1 and ``extra`` random ones, shuffled."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [*EDGE_LENGTHS, *torch.randint(0, longest, (extra,), generator=gen).tolist()]
    return [lengths[i] for i in torch.randperm(len(lengths), generator=gen).tolist()]


@dataclass
class Packed:
    """Leaf tensors of a packed call (requires_grad), and how to call chunk_gla on them."""

    lengths: list
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: Optional[torch.Tensor]
    g_gamma: Optional[torch.Tensor]
    h0: Optional[torch.Tensor]
    cu_seqlens: torch.Tensor
    gate: GateFn = GateFn()
    gate_a: Optional[torch.Tensor] = None
    gate_bias: Optional[torch.Tensor] = None
    reverse: bool = False
    scale: float = 0.3
    leaves: dict = field(default_factory=dict)

    def kwargs(self) -> dict:
        fn = self.gate
        extra = dict(gate_fn=fn.name, gate_scale=fn.scale, gate_lo=fn.lo, gate_hi=fn.hi, gate_a=self.gate_a,
                     gate_bias=self.gate_bias) if fn.name else {}
        return dict(g_gamma=self.g_gamma, scale=self.scale, initial_state=self.h0, output_final_state=True,
                    reverse=self.reverse, cu_seqlens=self.cu_seqlens, **extra)

    def run(self, chunk_gla):
        return chunk_gla(self.q, self.k, self.v, self.g, **self.kwargs())


def make(lengths, *, gate="vector", H=2, G=None, K=8, V=8, dtype=torch.float32, h0=True, reverse=False,
         gate_fn: str = "", offsets_dtype=torch.int32, seed=0) -> Packed:
    """Packed inputs: q, k [1, T, G, K] (G = H unless grouped), v [1, T, H, V], a log gate of the
    ``gate`` kind (or the input x of ``gate_fn``), initial states [N, H, K, V]."""
    gen = torch.Generator().manual_seed(seed)
    T, G = sum(lengths), G or H

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen)).to(dtype)

    q, k, v = randn(1, T, G, K), randn(1, T, G, K), randn(1, T, H, V)
    g = g_gamma = gate_a = gate_bias = None
    gate_shape = (1, T, H, K) if gate == "vector" else (1, T, H)
    if gate in ("vector", "scalar"):
        x = torch.randn(gate_shape, generator=gen)
        g = (x if gate_fn else F.logsigmoid(x)).to(dtype)
    elif gate == "constant":
        g_gamma = -torch.rand(H, generator=gen)
    if gate_fn == "softplus":
        gate_a = -torch.rand(H, generator=gen) - 0.1
        gate_bias = 0.5 * torch.randn(gate_shape[2:], generator=gen)
    state = randn(len(lengths), H, K, V) if h0 else None
    fn = GateFn(gate_fn, 0.5 if gate_fn == "logsigmoid" else 1.0, -3.0 if gate_fn else None)
    packed = Packed(list(lengths), q, k, v, g, g_gamma, state, offsets(lengths, offsets_dtype), fn, gate_a,
                    gate_bias, reverse)
    for name in ("q", "k", "v", "g", "g_gamma", "h0", "gate_a", "gate_bias"):
        x = getattr(packed, name)
        if x is not None:
            packed.leaves[name] = x.requires_grad_()
    return packed


def reference(p: Packed) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, final states [N, H, K, V]) in float64, every sequence run alone; differentiable."""
    g = p.g if p.g is None or not p.gate.name else log_gate(p.g, p.gate, p.gate_a, p.gate_bias, torch.float64)
    outs, states = [], []
    bounds = p.cu_seqlens.tolist()
    for n, (start, end) in enumerate(zip(bounds, bounds[1:])):
        def part(x):
            return None if x is None else x[:, start:end].double()

        h0 = None if p.h0 is None else p.h0[n:n + 1].double()
        o, ht = naive_recurrent_gla(part(p.q), part(p.k), part(p.v), part(g), g_gamma=p.g_gamma, scale=p.scale,
                                    initial_state=h0, output_final_state=True, reverse=p.reverse)
        outs.append(o)
        states.append(ht)
    return torch.cat(outs, 1), torch.cat(states, 0)


def rel_err(x: torch.Tensor, ref: torch.Tensor, scale: Optional[torch.Tensor] = None) -> float:
    """Frobenius error against a float64 reference, relative to the reference (or to scale)."""
    x, ref = x.double(), ref.double()
    scale = ref if scale is None else scale.double()
    return ((x - ref).norm() / scale.norm().clamp_min(1e-12)).item()


def assert_matches(p: Packed, o, ht, tol: float) -> None:
    """o and ht match the reference, and so does the gradient w.r.t. every leaf of a random linear
    function of them (the final states' gradient path included)."""
    ref_o, ref_ht = reference(p)
    assert o.shape == ref_o.shape and ht.shape == ref_ht.shape
    assert rel_err(o, ref_o) < tol, ("o", rel_err(o, ref_o))
    assert rel_err(ht, ref_ht) < tol, ("ht", rel_err(ht, ref_ht))
    gen = torch.Generator().manual_seed(1)
    # on the outputs' device (reference() runs where the leaves are)
    do, dht = torch.randn(o.shape, generator=gen).to(o.device), torch.randn(ht.shape, generator=gen).to(o.device)
    names = list(p.leaves)
    ours = torch.autograd.grad((o.double() * do).sum() + (ht.double() * dht).sum(), list(p.leaves.values()))
    refs = torch.autograd.grad((ref_o * do).sum() + (ref_ht * dht).sum(), list(p.leaves.values()))
    for name, mine, theirs in zip(names, ours, refs):
        assert mine.shape == theirs.shape, name
        err = rel_err(mine, theirs, _step_terms(p, do, dht) if name == "g_gamma" else None)
        assert err < tol, (f"d{name}", err)


def _step_terms(p: Packed, do: torch.Tensor, dht: torch.Tensor) -> torch.Tensor:
    """[H] the sum over the steps of |dL/dg_t|, the constant gate taken as a gate per step: dg_gamma
    is the sum of those terms, which cancel (to 1/58 of this in a case here), so its error is
    measured against them, as no fp32 sum beats their rounding."""
    T, H = p.v.shape[1], p.g_gamma.shape[0]
    g = p.g_gamma.detach().double().expand(1, T, H).clone().requires_grad_()
    o, ht = reference(replace(p, g=g, g_gamma=None, gate=GateFn()))  # g is the log gate itself
    (dg,) = torch.autograd.grad((o * do).sum() + (ht * dht).sum(), [g])
    return dg.abs().sum(dim=(0, 1))


def assert_prefix_states(p: Packed, states: torch.Tensor, interval: int, tol: float, batched: bool = False) -> None:
    """states holds, at sequence n's slot cu_seqlens[n] // P + n + j, its state after its first
    j * P steps (float64 time loop), for j = 0 .. its length // P. With batched, p's sequences are
    of one length L, run as a batch [N, L], and states [N, L // P + 1] holds them at [n, j]."""
    T, N = sum(p.lengths), len(p.lengths)
    shape = (N, p.lengths[0] // interval + 1) if batched else (1, T // interval + N)
    assert states.shape == (*shape, *p.h0.shape[1:])
    bounds = p.cu_seqlens.tolist()
    g = p.g if p.g is None or not p.gate.name else log_gate(p.g, p.gate, p.gate_a, p.gate_bias, torch.float64)
    for n, (start, end) in enumerate(zip(bounds, bounds[1:])):
        for j in range((end - start) // interval + 1):
            stop = start + j * interval

            def part(x):
                return None if x is None else x[:, start:stop].detach().double()

            _, want = naive_recurrent_gla(part(p.q), part(p.k), part(p.v), part(g), g_gamma=p.g_gamma,
                                          scale=p.scale, initial_state=p.h0[n:n + 1].detach().double(),
                                          output_final_state=True)
            got = states[n, j] if batched else states[0, start // interval + n + j]
            assert rel_err(got, want[0]) < tol, (n, j, rel_err(got, want[0]))
