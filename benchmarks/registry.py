"""The named benchmarks and tools of ``python -m benchmarks NAME``.

Each entry's module defines ``add_arguments(parser)`` and ``run(args) -> Result | None``; modules
are imported only when their name is run, so ``--help`` needs no GPU and no optional package.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Entry:
    module: str
    summary: str
    tool: bool = False  # a tool (sweeps, profiles): subcommands, results mostly printed


BENCHMARKS = {
    "kernels": Entry("benchmarks.kernels",
                     "chunk_gla kernels, forward and forward+backward, vector and scalar gates, against FLA "
                     "chunk_gla / chunk_simple_gla, the naive parallel form eager and under default torch.compile "
                     "(CUDA)"),
    "block": Entry("benchmarks.block",
                   "a whole GLA block (projections, gate, GLA, norm, output gate) compiled with the backend, "
                   "against the same block calling FLA: ms, memory, compile time (CUDA)"),
    "decode": Entry("benchmarks.decode",
                    "one-token decode with the fused recurrent kernel against FLA and naive PyTorch, % of copy "
                    "bandwidth; the kernel's tiles; recurrent against chunked kernels over T (CUDA)"),
    "models": Entry("benchmarks.models",
                    "transformers' Mamba2 (torch path): mixer, grouped mixer, model prefill and decode, eager vs "
                    "default Inductor vs the backend (CUDA; --quick runs tiny shapes on CPU too)"),
    "cpu": Entry("benchmarks.cpu",
                 "CPU: recognition time, the naive loop eager vs compiled (forward, training), the CPU ops "
                 "(step loops vs chunked PyTorch)"),
    "compile-time": Entry("benchmarks.compile_time",
                          "cold compile time of the block, ours and FLA's, each run in a fresh process with "
                          "empty caches (CUDA)"),
    "never-slower": Entry("benchmarks.never_slower",
                          "decode, short steps and prefill: ours (cost rule on and off) against naive eager, "
                          "default Inductor and FLA, with and without CUDA graphs; ratios ours / best other; "
                          "a CPU section (--section decode,short,prefill,cpu)"),
    "pool-decode": Entry("benchmarks.pool_decode",
                         "decoding into a serving engine's state pool in place (ssm_state_indices, K- and "
                         "V-first pools, bf16 pool) against FLA, % of the state bytes' copy floor (CUDA; "
                         "--device cpu: tiny shapes)"),
    "varlen": Entry("benchmarks.varlen",
                    "packed variable-length sequences (cu_seqlens): ours against FLA chunk_gla / "
                    "chunk_simple_gla and against ours at equal tokens unpacked (CUDA; --device cpu: tiny)"),
    "cp-scaling": Entry("benchmarks.cp_scaling",
                        "context-parallel (and tensor-parallel) GLA over 1, 2, 4 GPUs with NCCL: speed-up and "
                        "the communication share of the step (several GPUs; --device cpu: gloo, tiny)"),
    "tp-overhead": Entry("benchmarks.tp_overhead",
                         "tensor parallel over heads: a DTensor chunk_gla call per rank against plain tensors of "
                         "the rank's heads, eager and compiled, forward and forward+backward (several GPUs; "
                         "--device cpu: gloo, tiny)"),
    "tune": Entry("benchmarks.tune",
                  "tile sweeps of the kernels (schedule, segments, slices, dqkg), stage ablations, A/B of code "
                  "versions (CUDA)", tool=True),
    "profile": Entry("benchmarks.profiling",
                     "host time and cProfile of eager calls, CUDA kernel tables, Nsight Compute helpers, an "
                     "offline sm_90 compile for registers and spills", tool=True),
}
