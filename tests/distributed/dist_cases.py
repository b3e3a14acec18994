"""GLA inputs for every gate kind, the single-process reference, and relative errors.

Every rank builds the same full inputs from a seeded generator (spawned processes do not share
torch's default seed), computes the reference with ``gla_inductor.chunk_gla`` on them, and
compares its distributed result with it.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

import gla_inductor

GATES = ("vector", "scalar", "gamma", "none", "logsigmoid", "softplus")
SEQUENCE = ("q", "k", "v", "g")  # the tensors with a time axis, [B, T, H, D]


def gla_inputs(gate: str, B: int = 2, T: int = 24, H: int = 4, G: Optional[int] = None, K: int = 8, V: int = 6,
               initial_state: bool = True, seed: int = 0, device="cpu") -> tuple[dict, dict]:
    """fp32 tensors by chunk_gla's argument names (q and k with G heads if given), and the options
    (gate_fn and its constants) that go with the gate kind."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    G = G or H
    t = dict(q=randn(B, T, G, K), k=randn(B, T, G, K), v=randn(B, T, H, V))
    options: dict = {}
    if gate == "vector":
        t["g"] = F.logsigmoid(randn(B, T, H, K) + 2)
    elif gate == "scalar":
        t["g"] = F.logsigmoid(randn(B, T, H) + 2)
    elif gate == "gamma":
        t["g_gamma"] = -randn(H).abs() / 4
    elif gate == "logsigmoid":
        t["g"] = randn(B, T, H, K) + 2
        options = dict(gate_fn="logsigmoid", gate_scale=0.5, gate_lo=-2.0)
    elif gate == "softplus":
        t["g"] = randn(B, T, H)
        t["gate_a"] = -randn(H).abs() / 4
        t["gate_bias"] = randn(H)
        options = dict(gate_fn="softplus")
    if initial_state:
        t["initial_state"] = randn(B, H, K, V)
    return {n: x.float().to(device) for n, x in t.items()}, options


def loss_weights(tensors: dict, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Random weights for o and the final state: the loss sum(w_o * o) + sum(w_h * ht) gives every
    output element its own gradient."""
    gen = torch.Generator().manual_seed(seed)
    q, v = tensors["q"], tensors["v"]
    B, T, H, V = v.shape
    w_o = torch.randn(B, T, H, V, generator=gen).to(v.device)
    w_h = torch.randn(B, H, q.shape[-1], V, generator=gen).to(v.device)
    return w_o, w_h


def forward_backward(fn: Callable, tensors: dict, options: dict, w_o, w_h, **kwargs) -> tuple[dict, dict]:
    """({"o", "ht"}, gradients by name) of fn(**tensors, **options, **kwargs) under the weighted loss."""
    leaves = {n: x.detach().clone().requires_grad_() for n, x in tensors.items()}
    o, ht = fn(**leaves, **options, output_final_state=True, **kwargs)
    loss = (o * w_o).sum() + (ht * w_h).sum()
    loss.backward()
    return {"o": o, "ht": ht}, {n: x.grad for n, x in leaves.items()}


def reference(tensors: dict, options: dict, w_o, w_h, **kwargs) -> tuple[dict, dict]:
    return forward_backward(gla_inductor.chunk_gla, tensors, options, w_o, w_h, **kwargs)


def recording_inductor(graphs: list):
    """Plain Inductor as a torch.compile backend that keeps each graph it compiles (forward and
    backward, after AOTAutograd). AOTAutograd's cache is off while it compiles: a hit would hand
    back compiled code without the graphs."""
    import torch._functorch.config
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner(gm, example_inputs, **kwargs):
        graphs.append(gm)
        return compile_fx_inner(gm, example_inputs, **kwargs)

    def backend(gm, example_inputs):
        with torch._functorch.config.patch(enable_autograd_cache=False):
            return compile_fx(gm, example_inputs, inner_compile=inner)

    return backend


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|; inf on a shape mismatch, 0 for empty tensors (a rank with no steps)."""
    if a.shape != b.shape:
        return float("inf")
    if b.numel() == 0:
        return 0.0
    scale = b.abs().max().clamp_min(1e-30)
    return ((a.double() - b.double()).abs().max() / scale).item()


def expect_error(fn: Callable, error: type, *fragments: str) -> dict:
    """Run fn, which must raise ``error`` with every fragment in its message (anywhere in the chain
    of causes: compiled code wraps the original)."""
    try:
        fn()
    except Exception as e:
        messages, cause = [], e
        while cause is not None:
            messages.append(f"{type(cause).__name__}: {cause}")
            cause = cause.__cause__ or cause.__context__
        text = "\n".join(messages)
        if not any(isinstance(c, error) for c in _chain(e)):
            raise AssertionError(f"expected {error.__name__}, got {text}") from e
        missing = [f for f in fragments if f not in text]
        if missing:
            raise AssertionError(f"message lacks {missing}: {text}") from e
        return {}
    raise AssertionError(f"expected {error.__name__} with {fragments}, nothing raised")


def _chain(e: BaseException):
    while e is not None:
        yield e
        e = e.__cause__ or e.__context__
