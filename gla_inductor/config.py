"""User-facing switches of the backend. Change them directly or with `patch`:

    with gla_inductor.config.patch(forms=("parallel",)):
        torch.compile(model, backend=gla_inductor.backend)(x)
"""

from __future__ import annotations

import contextlib

# Forms the recognizer looks for; drop one to disable its recognition.
forms: tuple = ("chunked", "loop", "decode", "parallel", "chunk_states", "packed")

# Rewrite graphs at all (False: the backend is plain Inductor).
enabled: bool = True

# Leave a recognized instance to Inductor where the cost model says the rewrite would be slower
# (gla_inductor.cost: decoding and short steps without gradients); explain() shows the estimate.
cost_rule: bool = True

# How the cost rule decides those candidates: "max-autotune" times both choices (the rewrite and
# Inductor's code for the user's nodes, gla_inductor/recognize/measure.py) in compiles with
# max-autotune and asks the model in others; "always" times them in every compile; "never" asks
# the model. A candidate that cannot be timed is decided by the model.
cost_measure: str = "max-autotune"

# Fuse a recognized gate function (logsigmoid(x) / c, log(sigmoid(x)), a * softplus(x + bias))
# into the GLA op that reads its output, so the kernels read x (gla_inductor.gates).
fuse_gates: bool = True

# Check every rewritten graph against the original at compile time, on the example inputs,
# and keep the original where they differ (slow: the naive graph runs once more).
verify: bool = False
verify_rtol: float = 1e-3

# Run the GLA ops on CUDA with the Triton kernels; False forces the chunked PyTorch
# implementation (the fallback every unsupported case takes anyway).
triton_kernels: bool = True

# Gate kinds the Triton kernels run; the others take the PyTorch implementation. All four pass
# the kernel tests on an H100 (torch 2.11, triton 3.6; benchmarks/results/archive/h100-2026-11-22.md).
triton_gates: tuple = ("vector", "scalar", "constant", "none")

# How compiled graphs run the decode op gla_inductor::fused_recurrent (gla_inductor/lowerings/recurrent.py):
# "template": the recurrent Triton kernel as an Inductor template (one pass over the state for all steps);
# "decompose": the steps as pointwise and reduction IR, which Inductor fuses as it fuses the naive step;
# "extern": a call of the eager op (Python on every call); "auto": the template where Inductor generates
# Triton for the device, else the decomposition up to 8 steps, else extern. A call the chosen way cannot
# run (say, a state pool in "decompose") lowers to extern, with the reason logged.
decode_lowering: str = "auto"

# Context parallelism (gla_inductor.distributed): where the chunked kernels run the local schedule,
# cut each rank's chunk_fwd and chunk_bwd in two around the exchange of states, the first half
# giving the state to exchange (gla_inductor/kernels/parts.py); False: a states-only pass before
# each whole op, which reads the rank's inputs once more.
context_parallel_cut: bool = True

# Run the ops on CPU as step loops in C++ (gla_inductor/impl/step_loop.py says why), compiled on
# first use; False forces the chunked PyTorch implementation, which fp64 and machines without a
# C++ compiler take anyway.
cpu_kernel: bool = True

# Bytes of intermediates the CPU implementation may keep between calls, per thread
# (gla_inductor/impl/scratch.py says why); 0 allocates every one afresh.
cpu_scratch_bytes: int = 64 * 2**20


# A rewrite whose decay tables live in module state (MiniMax's lightning attention, a retention mask in a
# buffer) checks them on every call (gla_inductor/recognize/forms/fallback.py). Where a table changed after
# compiling is no gate's table: "fallback" runs the user's own code instead, a torch.cond in the graph
# (Inductor reads its predicate on the host: one synchronization per call on CUDA); "raise" checks with
# torch._assert_async instead (no synchronization) and fails.
table_guard: str = "fallback"


@contextlib.contextmanager
def patch(**changes):
    import sys

    mod = sys.modules[__name__]
    old = {k: getattr(mod, k) for k in changes}
    for k, v in changes.items():
        if k not in old:
            raise AttributeError(f"gla_inductor.config has no option {k!r}")
        setattr(mod, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(mod, k, v)
