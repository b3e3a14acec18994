"""Inputs and the float64 time-loop references of the ``chunk_final_state`` op, shared by its op
tests (tests/ops) and kernel tests (tests/kernels)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gla_inductor.gates import GateFn, log_gate
from gla_inductor.reference import naive_recurrent_gla

GATES = ("vector", "scalar", "gamma", "none", "logsigmoid", "softplus")


def inputs(gate: str, B=2, T=75, H=4, G=2, K=8, V=6, dtype=torch.float64, seed=0) -> dict:
    """The op's keyword arguments (q and k grouped: G heads for v's H) and output gradients do."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    t = dict(q=randn(B, T, G, K), k=randn(B, T, G, K), v=randn(B, T, H, V), g=None, g_gamma=None, scale=0.3,
             reverse=False, gate_fn="", gate_a=None, gate_bias=None)
    if gate == "vector":
        t["g"] = F.logsigmoid(randn(B, T, H, K) + 2)
    elif gate == "scalar":
        t["g"] = F.logsigmoid(randn(B, T, H) + 1)
    elif gate == "gamma":
        t["g_gamma"] = -randn(H).abs() / 4
    elif gate == "logsigmoid":
        t.update(g=randn(B, T, H, K) + 2, gate_fn="logsigmoid")
    elif gate == "softplus":
        t.update(g=randn(B, T, H, K), gate_fn="softplus", gate_a=-randn(H).abs() / 4, gate_bias=randn(H, K))
    t = {n: x.to(dtype) if isinstance(x, torch.Tensor) else x for n, x in t.items()}
    t["do"] = randn(B, T, H, V).to(dtype)
    return t


def log_gate_of(t: dict) -> torch.Tensor:
    """The plain float64 log gate (what the time loop reads), or None."""
    if t["g"] is None:
        return None
    x = {n: (None if t[n] is None else t[n].double()) for n in ("g", "gate_a", "gate_bias")}
    return log_gate(x["g"], GateFn(t["gate_fn"]), x["gate_a"], x["gate_bias"], torch.float64) if t["gate_fn"] \
        else x["g"]


def reference(t: dict, dual: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(state, decay) in float64 from the time loop: its final state from zero, or autograd's
    gradient of sum <do, o> w.r.t. its initial state; the decay as exp of the summed log gates."""
    q, k, v, do = (t[n].double() for n in ("q", "k", "v", "do"))
    g = log_gate_of(t)
    g_gamma = None if t["g_gamma"] is None else t["g_gamma"].double()
    B, T, H, V = v.shape
    K = q.shape[-1]
    h0 = torch.zeros(B, H, K, V, dtype=torch.float64, requires_grad=True)
    o, ht = naive_recurrent_gla(q, k, v, g, g_gamma=g_gamma, scale=t["scale"], initial_state=h0,
                                output_final_state=True, reverse=t["reverse"])
    if not dual:
        state = ht.detach()
    else:  # no steps: o does not depend on h0
        state = torch.autograd.grad((o * do).sum(), h0)[0] if T else torch.zeros_like(h0)
    if g is not None:
        decay = g.sum(1).exp()
    elif g_gamma is not None:
        decay = (T * g_gamma).exp().expand(B, H)
    else:
        decay = torch.empty(0, dtype=torch.float64)
    return state, decay


def op_args(t: dict, dual: bool) -> tuple:
    """The op's positional arguments, in its schema's order."""
    return (t["q"], t["k"], t["v"], t["g"], t["g_gamma"], t["do"] if dual else None, t["scale"], t["reverse"],
            t["gate_fn"], 1.0, None, None, t["gate_a"], t["gate_bias"])
