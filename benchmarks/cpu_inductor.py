"""Would Inductor's CPU codegen run the chunked forward faster than the op's PyTorch implementation?

A measured experiment, not a code path (``python -m benchmarks cpu --parts inductor``): the anchored
vector-gate forward written functionally (no scratch buffers, no in-place ops, no branches: every
chunk in the anchor's range, finite inputs), compiled by ``torch.compile`` (Inductor: C++ kernels and
extern bmm), timed in alternation with the eager naive loop, the loop compiled with the backend and
the op's PyTorch implementation. Were it much faster, lowering the CPU op by decomposition would
pay; at B=2, T=512, H=4, K=V=64 it was not (results/archive/cpu-2026-11-23-scratch.md).
"""

from __future__ import annotations

import math

import torch

from benchmarks import harness, inputs

LOG2_E = 1 / math.log(2)


def functional_forward(q, k, v, g, scale: float, block_sums, chunk: int):
    """o of GLA with vector gates g through the anchor mid-chunk; block_sums is the op's block-sum
    matrix (an argument: Dynamo warns of the lru_cache behind it)."""
    B, T, H, K = q.shape
    V, NT = v.shape[-1], T // chunk

    def chunks(x):
        return x.view(B, NT, chunk, H, x.shape[-1]).permute(0, 3, 1, 2, 4)

    qc, kc, vc, gc = chunks(q), chunks(k), chunks(v).contiguous(), chunks(g)
    n = chunk // 4
    y = (gc * LOG2_E).unflatten(-2, (n, 4)).cumsum(-2)
    X = torch.matmul(block_sums, y[..., -1, :].double()).exp2().float()
    e = (y.exp2() * X[..., :n, None, :]).flatten(-3, -2)
    from_start, to_end = X[..., n:, :], e[..., -1:, :]
    qa, ka = qc * e, kc / e
    A = (qa @ ka.mT).tril()
    update = (ka * to_end).mT @ vc
    decay = (from_start * to_end).mT  # [B, H, NT, K, 1]
    S, states = q.new_zeros(B, H, K, V), []
    for c in range(NT):
        states.append(S)
        S = decay[:, :, c] * S + update[:, :, c]
    o = ((qa * from_start) @ torch.stack(states, 2) + A @ vc) * scale
    return o.permute(0, 2, 3, 1, 4).reshape(B, T, H, V)


def run_experiment(shape, rounds: int) -> list:
    """Rows: ms of each of the four, and the functional forward's difference to the op."""
    import gla_inductor
    from benchmarks import internals

    B, T, H, K, V = shape
    chunk = internals.CPU_CHUNK
    if T % chunk:
        raise ValueError(f"the functional forward needs T a multiple of {chunk}, got T={T}")
    x = inputs.gla_inputs(B, T, H, K, V, device="cpu", dtype=torch.float32)
    q, k, v, g = x
    scale = K**-0.5
    sums = internals.block_sums(q.device)
    compiled_forward = torch.compile(functional_forward, fullgraph=True)
    compiled_loop = torch.compile(inputs.naive_loop, backend=gla_inductor.backend, fullgraph=True)
    fns = {
        "eager naive loop": lambda: inputs.naive_loop(*x),
        "loop compiled by gla_inductor": lambda: compiled_loop(*x),
        "op's PyTorch implementation": lambda: internals.chunked_forward_torch(q, k, v, g, scale=scale),
        "functional forward, Inductor": lambda: compiled_forward(q, k, v, g, scale, sums, chunk),
    }
    with torch.no_grad():
        ref = fns["op's PyTorch implementation"]()[0]
        err = harness.rel_err(fns["functional forward, Inductor"](), ref)
        times = harness.measure(fns, clock="cpu", rounds=rounds, warmup_ms=0,
                                calls={n: 1 if n.startswith("eager") else 3 for n in fns})
    return [{"part": "inductor", "what": name, "ms": t.median, "functional_rel_err_vs_op": err}
            for name, t in times.items()]
