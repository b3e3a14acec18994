"""Would Inductor's CPU codegen run the chunked forward faster than ``ops._chunk_fwd_torch``?

    python benchmarks/cpu_inductor_forward.py

A measured experiment, not a code path: the anchored vector-gate forward written functionally
(no scratch buffers, no in-place ops, no branches: every chunk in the anchor's range, finite
inputs), compiled by ``torch.compile`` (Inductor, C++ kernels and extern bmm), timed in
alternation with the eager naive loop, the loop compiled with our backend and the op's PyTorch
implementation, at issue 2's shape. If it were much faster, lowering the CPU op by decomposition
would be the way to issue 2's 20x; results in benchmarks/results/cpu-2026-11-23-scratch.md.
"""

import math

import torch

import gla_inductor
from cpu_recognition import inputs, median, naive_loop, seconds
from gla_inductor.ops import BT, _block_sums, _chunk_fwd_torch

LOG2_E = 1 / math.log(2)


def forward(q, k, v, g, scale: float, block_sums):
    """o of GLA with vector gates g through the anchor mid-chunk (NOTE:[GLA anchored fast path]);
    block_sums is ``ops._block_sums`` (an argument: Dynamo warns of the lru_cache)."""
    B, T, H, K = q.shape
    V, NT = v.shape[-1], T // BT

    def chunks(x):
        return x.view(B, NT, BT, H, x.shape[-1]).permute(0, 3, 1, 2, 4)

    qc, kc, vc, gc = chunks(q), chunks(k), chunks(v).contiguous(), chunks(g)
    n = BT // 4
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


def main():
    torch.manual_seed(0)
    x = inputs(2, 512, 4, 64, 64)
    q, k, v, g = x
    sums = _block_sums(q.device)
    compiled_forward = torch.compile(forward, fullgraph=True)
    compiled_loop = torch.compile(naive_loop, backend=gla_inductor.backend, fullgraph=True)
    fns = {
        "eager naive loop": lambda: naive_loop(*x),
        "loop compiled by gla_inductor": lambda: compiled_loop(*x),
        "op's PyTorch implementation": lambda: _chunk_fwd_torch(q, k, v, g, None, None, 0.125, False, False),
        "functional forward, Inductor": lambda: compiled_forward(q, k, v, g, 0.125, sums),
    }
    with torch.no_grad():
        ref = fns["op's PyTorch implementation"]()[0]
        err = ((compiled_forward(q, k, v, g, 0.125, sums) - ref).abs().max() / ref.abs().max()).item()
        times = {name: [] for name in fns}
        for fn in fns.values():
            fn(), fn()
        for _ in range(15):
            for name, fn in fns.items():
                times[name] += [seconds(fn) for _ in range(1 if name.startswith("eager") else 3)]
    print(f"functional forward against the op: max relative difference {err:.1e}")
    for name, t in times.items():
        print(f"| {name} | {median(t) * 1e3:.2f} ms |")


if __name__ == "__main__":
    main()
