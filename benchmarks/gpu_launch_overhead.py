"""Host time of an eager forward with and without the standalone kernels' direct launches
(``StandaloneKernel.compiled``), in one process, interleaved: the host's own speed drifts by tens of
percent between runs on the GPU machine, so separate runs cannot tell a few tens of microseconds.

    PYTHONPATH=$PWD python benchmarks/gpu_launch_overhead.py [--shape 8,1024,8,64,64] [--rounds 12]

"via Triton" clears each kernel's table of compiled kernels before its launch, so every launch goes
through ``JITFunction.run`` as before the direct launches.
"""

import argparse
import statistics

import torch

import gla_inductor
from gla_inductor.templates import standalone
from gpu_host_profile import host_us
from gpu_schedule import sweep_inputs


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="8,1024,8,64,64")
    p.add_argument("--rounds", type=int, default=12)
    args = p.parse_args()
    B, T, H, K, V = map(int, args.shape.split(","))
    q, k, v, g = sweep_inputs(B, T, H, K, V, "vector")
    direct_call = standalone.StandaloneKernel.__call__

    def via_triton(self, *a, **kw):
        self.compiled.clear()
        return direct_call(self, *a, **kw)

    def call():
        return gla_inductor.chunk_gla(q, k, v, g)[0]

    with torch.no_grad():
        outs = {}
        for name, fn in (("direct", direct_call), ("via Triton", via_triton)):
            standalone.StandaloneKernel.__call__ = fn
            outs[name] = [call() for _ in range(3)][-1]
        assert torch.equal(outs["direct"], outs["via Triton"])
        rows = {"direct": [], "via Triton": []}
        for _ in range(args.rounds):
            for name, fn in (("direct", direct_call), ("via Triton", via_triton)):
                standalone.StandaloneKernel.__call__ = fn
                rows[name].append(host_us(call, 160))
    standalone.StandaloneKernel.__call__ = direct_call
    print(f"| {args.shape} | host us per forward, median of {args.rounds} rounds | min | max |")
    print("|---|---|---|---|")
    for name, values in rows.items():
        print(f"| {name} | {statistics.median(values):.1f} | {min(values):.1f} | {max(values):.1f} |")


if __name__ == "__main__":
    main()
