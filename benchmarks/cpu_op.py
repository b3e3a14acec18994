"""The CPU implementations alone: time and minor page faults per call of the forward and backward,
as the C++ step loops the ops take and as the chunked PyTorch ones.

    python benchmarks/cpu_op.py

At issue 2's shape (B=2, T=512, H=4, K=V=64), every gate kind: 30 calls after 5, wall time and
``ru_minflt`` per call. To compare code versions, run it in alternating processes with each version
first on PYTHONPATH (benchmarks/results/cpu-2026-11-23-scratch.md): the page faults depend on what
the process allocated before, and the box's speed on its neighbours.
"""

import resource
import time

import torch
import torch.nn.functional as F

from gla_inductor import cpu_recurrent
from gla_inductor.ops import _chunk_bwd_torch, _chunk_fwd_torch


def per_call(fn, calls: int = 30) -> tuple:
    """(ms, minor page faults) per call, after 5 warm-up calls."""
    for _ in range(5):
        fn()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    ms = (time.perf_counter() - start) / calls * 1e3
    return ms, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / calls


def main():
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(2, 512, 4, 64) for _ in range(4))
    gates = {"vector": F.logsigmoid(torch.randn(2, 512, 4, 64)), "scalar": F.logsigmoid(torch.randn(2, 512, 4)),
             "none": None}
    f32 = torch.float32
    # every gate kind through the backward's step loop, also those the ops leave to the chunked one
    cpu_recurrent.BACKWARD_GATES = ("vector", "scalar", "constant", "none")
    for name, g in gates.items():
        step = per_call(lambda: cpu_recurrent.forward(q, k, v, g, None, None, 0.125, False, False, f32, f32))
        fwd = per_call(lambda: _chunk_fwd_torch(q, k, v, g, None, None, 0.125, False, False))
        step_bwd = per_call(lambda: cpu_recurrent.backward(q, k, v, g, None, None, do, None, 0.125, False))
        bwd = per_call(lambda: _chunk_bwd_torch(q, k, v, g, None, None, do, None, 0.125, False))
        print(f"{name:6s} forward: step loop {step[0]:.2f} ms, {step[1]:.0f} faults; chunked {fwd[0]:.2f} ms, "
              f"{fwd[1]:.0f} faults | backward: step loop {step_bwd[0]:.2f} ms, {step_bwd[1]:.0f} faults; "
              f"chunked {bwd[0]:.2f} ms, {bwd[1]:.0f} faults")


if __name__ == "__main__":
    main()
