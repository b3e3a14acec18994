"""User-facing switches of the backend. Change them directly or with `patch`:

    with gla_inductor.config.patch(forms=("parallel",)):
        torch.compile(model, backend=gla_inductor.backend)(x)
"""

from __future__ import annotations

import contextlib

# Forms the recognizer looks for; drop one to disable its recognition.
forms: tuple = ("loop", "parallel")

# Rewrite graphs at all (False: the backend is plain Inductor).
enabled: bool = True

# Check every rewritten graph against the original at compile time, on the example inputs,
# and keep the original where they differ (slow: the naive graph runs once more).
verify: bool = False
verify_rtol: float = 1e-3

# Run the GLA ops on CUDA with the Triton kernels; False forces the chunked PyTorch
# implementation (the fallback every unsupported case takes anyway).
triton_kernels: bool = True

# Gate kinds the Triton kernels run; the others take the PyTorch implementation. Only the
# vector gate is validated on the H100 so far: the scalar, constant and gate-free paths gave
# wrong outputs there at B*H*cdiv(V, 64) < 132 (see benchmarks/results/h100-kernels.md).
triton_gates: tuple = ("vector",)


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
