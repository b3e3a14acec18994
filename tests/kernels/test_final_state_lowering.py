"""The Inductor lowering of ``chunk_final_state`` (the states-only pass that context parallelism
runs): compiled graphs run gla_chunk_segsum as a template and fold its segments in generated code,
with no extern call of the eager op, and agree with the float64 time loop."""

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import final_state_cases as cases
import gla_inductor  # noqa: F401  (registers the ops and their lowerings)
from gla_inductor.kernels import final_state as kernel

triton = pytest.importorskip("triton")
ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
INTERPRETED = type(triton.language.cumsum).__name__ == "InterpretedFunction"
pytestmark = [pytest.mark.skipif(not (ON_GPU or INTERPRETED), reason="needs a GPU or TRITON_INTERPRET=1"),
              pytest.mark.usefixtures("inductor_triton", "one_thread"), pytest.mark.compat]

SEGSUM_KERNEL = "GLA segment sums"  # a comment the template leaves in its kernel's source
EXTERN_CALL = "torch.ops.gla_inductor.chunk_final_state.default("


def _op(t: dict, dual: bool):
    def run(q, k, v, g, g_gamma, do, gate_a, gate_bias):
        return torch.ops.gla_inductor.chunk_final_state(q, k, v, g, g_gamma, do if dual else None, t["scale"],
                                                        t["reverse"], t["gate_fn"], 1.0, None, None, gate_a,
                                                        gate_bias)

    return run


def _args(t: dict):
    names = ("q", "k", "v", "g", "g_gamma", "do", "gate_a", "gate_bias")
    return [None if t[n] is None else t[n].to(DEVICE) for n in names]


def _check(got, t: dict, dual: bool, tol: float):
    state, decay = got
    want_state, want_decay = cases.reference(t, dual)
    state_dtype = torch.float64 if t["q"].dtype == torch.float64 else torch.float32
    assert state.dtype == decay.dtype == state_dtype and state.shape == want_state.shape
    assert decay.shape == want_decay.shape
    err = (state.double().cpu() - want_state).abs().max().item()
    assert err <= tol * want_state.abs().max().item(), f"state: max error {err}"
    if want_decay.numel():
        assert (decay.double().cpu() - want_decay).abs().max().item() <= tol * want_decay.abs().max().item()


@pytest.mark.parametrize("segments", [1, 3])
@pytest.mark.parametrize("dual", [False, True], ids=["state", "dual"])
@pytest.mark.parametrize("gate", ["vector", "scalar", "gamma", "none", "softplus"])
def test_compiled_pass_runs_the_template(gate, dual, segments, monkeypatch):
    """One template launch and the fold of its segments (forced to 3 here: on a CPU the launcher
    would pick one) as generated code, equal to the time loop."""
    monkeypatch.setattr(kernel, "segments", lambda *a, **kw: segments)
    t = dict(cases.inputs(gate, T=150, K=16, V=8, dtype=torch.float32), reverse=dual)
    got, (code,) = run_and_get_code(torch.compile(_op(t, dual), fullgraph=True), *_args(t))
    assert code.count(SEGSUM_KERNEL) == 1 and EXTERN_CALL not in code
    _check(got, t, dual, tol=1e-5)


def test_bf16_head_size_128_takes_the_pass_tiles():
    """16-bit inputs at K = V = 128 take the pass's own tiles (all of V in one value tile)."""
    t = cases.inputs("vector", B=1, T=70, H=2, G=2, K=128, V=128, dtype=torch.bfloat16)
    got, (code,) = run_and_get_code(torch.compile(_op(t, False), fullgraph=True), *_args(t))
    assert code.count(SEGSUM_KERNEL) == 1 and EXTERN_CALL not in code
    assert "BV : tl.constexpr = 128" in code
    _check(got, t, False, tol=2e-2)


def test_do_is_read_in_its_own_dtype():
    """A do whose dtype is not the inputs' (fp32 against bf16) is read as it comes, as the backward
    reads it, so the tile is the one for fp32 operands (the scan's), as the eager launch picks it."""
    t = cases.inputs("vector", B=1, T=70, H=2, G=2, K=128, V=128, dtype=torch.bfloat16)
    t["do"] = t["do"].float()
    got, (code,) = run_and_get_code(torch.compile(_op(t, True), fullgraph=True), *_args(t))
    assert code.count(SEGSUM_KERNEL) == 1 and "BV : tl.constexpr = 64" in code
    _check(got, t, True, tol=2e-2)


def test_float64_lowers_to_the_eager_op():
    t = cases.inputs("scalar", T=20)
    got, (code,) = run_and_get_code(torch.compile(_op(t, True), fullgraph=True), *_args(t))
    assert EXTERN_CALL in code and SEGSUM_KERNEL not in code
    _check(got, t, True, tol=1e-10)
