"""The Triton kernels (``gla_inductor.kconfigs``; the interpreter on CPU, compiled on a GPU) on
extreme inputs, as tests/ops/test_bad_input.py checks the CPU implementations: NaN and Inf
propagating as in the naive recurrence (see that file for what this means), in every schedule;
a log gate of -inf; NaN in a fused gate's input; growing states (positive log gates).
"""

from __future__ import annotations

import pytest
import torch

from gla_inductor.reference import naive_recurrent_gla
from gla_inductor.contract import GLACall
from gla_inductor.kernels import configs as kconfigs

from helpers import (POSITIVE_TOL, as_float64, assert_nonfinite_like, call, gla_inputs, nonfinite_cases,
                     per_step_error, poison, positive_gate, rel_err)

pytestmark = pytest.mark.usefixtures("one_thread")

KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _kernels():
    triton = pytest.importorskip("triton")
    pytest.importorskip("jinja2")
    if KERNEL_DEVICE == "cpu" and type(triton.language.cumsum).__name__ != "InterpretedFunction":
        pytest.skip("triton was imported without TRITON_INTERPRET=1")
    from gla_inductor.kernels import chunk as kchunk

    return kchunk


def run_kernels(inputs, reverse=False, scale=0.25, schedule=None):
    """(o, final state) of chunk_fwd_triton, on CPU for comparison. schedule: None (the default one,
    the fused scan at these sizes), "split", "local" or "segments" (local, the carries' walks cut
    in two segments), "terms" (the carry computing its chunk terms; not for vector gates) or
    "terms-segments"."""
    x = {n: None if t is None else t.to(KERNEL_DEVICE) for n, t in inputs.items()}
    config = None
    if schedule is not None:
        import dataclasses

        B, T, H, K = x["q"].shape
        _kernels()
        config = kconfigs.default_config(B, T, H, K, x["v"].shape[-1], x["q"].dtype,
                                   x["g"] is not None and x["g"].dim() == 4, x["q"].device)
        config = dataclasses.replace(config, split=schedule == "split", local=schedule in ("local", "segments"),
                                     terms=schedule.startswith("terms"),
                                     segments=2 if schedule.endswith("segments") else 1)
    gla_call = GLACall(x["q"], x["k"], x["v"], x["g"], x["g_gamma"], x["initial_state"], scale, True, reverse)
    o, ht = _kernels().forward(gla_call, config=config)
    return o.cpu(), ht.cpu()


# K = V = 16: the kernels' smallest tiles; T = 100: two chunks of BT = 64, the bad step at 80
KERNEL_SIZES = dict(B=1, H=1, K=16, V=16)

# numpy's overflow and invalid-value warnings from inside the interpreter: expected here
kernel_warnings = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@kernel_warnings
@pytest.mark.parametrize("gate,name,value", list(nonfinite_cases()))
@pytest.mark.parametrize("reverse", [False, True], ids=["fwd", "rev"])
def test_kernels_nonfinite_input_propagates_like_the_loop(gate, name, value, reverse):
    inputs = poison(gla_inputs(gate, T=100, **KERNEL_SIZES), name, value, t=80)
    o, ht = run_kernels(inputs, reverse)
    o_ref, ht_ref = call(naive_recurrent_gla, inputs, output_final_state=True, scale=0.25, reverse=reverse)
    assert_nonfinite_like(o, o_ref, value != value, "o")
    assert_nonfinite_like(ht, ht_ref, value != value, "final state")


@kernel_warnings
def test_kernels_redo_only_the_poisoned_programs():
    """The fused scan walks again only the programs a non-finite value reached (one (batch, head)
    and one value tile here, the last of two tiles of 64, or of three of 32 on a GPU with more SMs
    than programs; its first chunk): their o and final state as the loop's,
    every other program's bit for bit those of the clean input."""
    inputs = gla_inputs("scalar", B=2, T=150, H=2, K=16, V=80)
    o_clean, ht_clean = run_kernels(inputs)
    poisoned = {n: None if x is None else x.clone() for n, x in inputs.items()}
    poisoned["v"][1, 30, 0, 70] = float("nan")
    o, ht = run_kernels(poisoned)
    o_ref, ht_ref = call(naive_recurrent_gla, poisoned, output_final_state=True, scale=0.25)
    # On CUDA the fp32 dots are "tf32x3" (three TF32 products): at this shape, clean or poisoned,
    # value tiles of 32 or 64, o was up to 2.8e-5 from float64 on an H100, where the fp32 loop was
    # 1.3e-6 (the interpreter's dots are exact fp32)
    tol = 1e-4 if KERNEL_DEVICE == "cuda" else 1e-5
    assert_nonfinite_like(o, o_ref, True, "o", tol)
    assert_nonfinite_like(ht, ht_ref, True, "final state", tol)
    same = torch.ones_like(o, dtype=torch.bool)
    same[1, :, 0, 64:] = False
    assert torch.equal(o[same], o_clean[same])
    assert torch.equal(ht[:, :, :, :64], ht_clean[:, :, :, :64])
    assert torch.equal(ht[0], ht_clean[0]) and torch.equal(ht[1, 1], ht_clean[1, 1])


# the other schedules, on the cases where they differ from the fused scan: values (the in-chunk A @ v),
# gates (the chunk-local kernel's gate sums and anchors)
def _schedule_cases():
    for schedule in ("split", "local", "segments", "terms", "terms-segments"):
        for gate in ("vector", "scalar") if not schedule.startswith("terms") else ("scalar",):
            for name, value in (("v", float("nan")), ("v", float("inf")), ("g", float("nan")), ("g", float("inf"))):
                yield pytest.param(schedule, gate, name, value, id=f"{schedule}-{gate}-{name}-{value}")


@kernel_warnings
@pytest.mark.parametrize("schedule,gate,name,value", list(_schedule_cases()))
@pytest.mark.parametrize("reverse", [False, True], ids=["fwd", "rev"])
def test_kernel_schedules_nonfinite_input_propagates_like_the_loop(schedule, gate, name, value, reverse):
    inputs = poison(gla_inputs(gate, T=100, **KERNEL_SIZES), name, value, t=80)
    o, ht = run_kernels(inputs, reverse, schedule=schedule)
    o_ref, ht_ref = call(naive_recurrent_gla, inputs, output_final_state=True, scale=0.25, reverse=reverse)
    assert_nonfinite_like(o, o_ref, value != value, "o")
    assert_nonfinite_like(ht, ht_ref, value != value, "final state")


@kernel_warnings
@pytest.mark.compat  # every carry's non-finite check and the terms carry's gate prefetch, on the newest triton too
@pytest.mark.parametrize("schedule,gate", [("local", "vector"), ("segments", "vector"), ("terms", "scalar"),
                                           ("terms-segments", "scalar"), ("terms", "constant")])
@pytest.mark.parametrize("reverse", [False, True], ids=["fwd", "rev"])
def test_kernel_schedules_values_poisoned_in_several_chunks(schedule, gate, reverse):
    """Non-finite values in several chunks and columns, two in one column and chunk, one in the
    first chunk: o is not finite exactly at the steps a value feeds, in its own chunk and in every
    later one, and the final state where the loop's is not; the other columns stay finite."""
    inputs = gla_inputs(gate, T=200, B=1, H=2, K=16, V=16)
    for t, h, c, value in ((5, 0, 3, float("inf")), (70, 1, 0, float("nan")), (150, 1, 9, float("-inf")),
                           (140, 1, 9, float("nan")), (195, 0, 15, float("nan"))):
        inputs["v"][0, t, h, c] = value
    o, ht = run_kernels(inputs, reverse, schedule=schedule)
    o_ref, ht_ref = call(naive_recurrent_gla, inputs, output_final_state=True, scale=0.25, reverse=reverse)
    # over 200 steps the clean input's fp32 outputs are up to 3e-5 from the loop's (vector gates)
    assert_nonfinite_like(o, o_ref, False, "o", tol=1e-4)
    assert_nonfinite_like(ht, ht_ref, False, "final state", tol=1e-4)
    assert torch.isfinite(o[:, :, 0, 4:15]).all()  # clean columns stay clean


@kernel_warnings
@pytest.mark.parametrize("gate", ["vector", "scalar", "constant"])
@pytest.mark.parametrize("schedule", [None, "split", "local", "terms"], ids=["default", "split", "local", "terms"])
def test_kernels_forget_gate_of_minus_inf(gate, schedule):
    """A log gate of -inf (exp(g) = 0, a reset) is finite in the loop: the kernels floor log gates at
    -150 (log2 units), whose decays round to 0 in fp32 (gla_common's _gla_floor_gate)."""
    if schedule == "terms" and gate == "vector":
        pytest.skip("the carry computes chunk terms for scalar, constant and no gates only")
    inputs = gla_inputs(gate, T=100, **KERNEL_SIZES)
    if gate == "constant":
        inputs["g_gamma"][0] = float("-inf")
    else:
        inputs["g"][:, 30] = float("-inf")
        inputs["g"][:, 70:73] = float("-inf")
    o, ht = run_kernels(inputs, schedule=schedule)
    o_ref, ht_ref = call(naive_recurrent_gla, inputs, output_final_state=True, scale=0.25)
    torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ht, ht_ref, rtol=1e-4, atol=1e-4)


@kernel_warnings
@pytest.mark.parametrize("gate", ["vector", "scalar"])
@pytest.mark.parametrize("gate_fn", ["logsigmoid", "softplus"])
def test_kernels_fused_gate_nan_input_propagates_like_the_loop(gate, gate_fn):
    """A NaN in a fused gate's input x stays NaN through its clamps (gla_common's _gla_gate), as
    through torch's logsigmoid, softplus and clamp: the loop on the gate torch computes is NaN from
    that step on and finite before it."""
    from gla_inductor.gates import GateFn, log_gate

    inputs = gla_inputs(gate, T=100, **KERNEL_SIZES)
    x = torch.randn(inputs["g"].shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    x[(0, 80, 0) + (2,) * (x.dim() - 3)] = float("nan")
    heads = x.shape[2:]
    gen = torch.Generator().manual_seed(4)
    a = -torch.rand(heads[0], generator=gen, dtype=torch.float64) if gate_fn == "softplus" else None
    bias = torch.randn(heads, generator=gen, dtype=torch.float64) if gate_fn == "softplus" else None
    fn = GateFn(gate_fn, 0.5 if gate_fn == "logsigmoid" else 1.0, 0.01 if gate_fn == "softplus" else -3.0, 4.0)
    dev = {n: None if t is None else t.to(KERNEL_DEVICE) for n, t in dict(inputs, g=x, a=a, bias=bias).items()}
    gla_call = GLACall(dev["q"], dev["k"], dev["v"], dev["g"], None, dev["initial_state"], 0.25, True, False, gate=fn,
                   gate_a=dev["a"], gate_bias=dev["bias"])
    o, ht = _kernels().forward(gla_call)
    ref = dict(inputs, g=log_gate(x, fn, a, bias, torch.float64))
    o_ref, ht_ref = call(naive_recurrent_gla, ref, output_final_state=True, scale=0.25)
    assert torch.isnan(o_ref).any()  # the case is not vacuous
    assert_nonfinite_like(o.cpu().double(), o_ref, True, "o")
    assert_nonfinite_like(ht.cpu().double(), ht_ref, True, "final state")


@kernel_warnings
@pytest.mark.parametrize("gate", ["vector", "scalar", "constant"])
@pytest.mark.parametrize("T", [64, 130, 256])
@pytest.mark.parametrize("reverse", [False, True], ids=["fwd", "rev"])
def test_kernels_positive_log_gates_match_the_loop(gate, T, reverse):
    inputs = gla_inputs(gate, T=T, **KERNEL_SIZES, g_fn=positive_gate(0.5 if gate != "constant" else 0.3))
    o, ht = run_kernels(inputs, reverse)
    ref = as_float64(inputs)
    o_ref, ht_ref = call(naive_recurrent_gla, ref, output_final_state=True, scale=0.25, reverse=reverse)
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    assert per_step_error(o, o_ref) <= POSITIVE_TOL
    assert rel_err(ht, ht_ref) <= POSITIVE_TOL


@kernel_warnings
@pytest.mark.parametrize("gate", ["vector", "scalar", "constant"])
def test_kernels_overflowing_state_is_never_nan_where_the_loop_is_finite(gate):
    inputs = gla_inputs(gate, T=600, **KERNEL_SIZES, g_fn=positive_gate(1.0))
    o, _ = run_kernels(inputs)
    o32, _ = call(naive_recurrent_gla, inputs, output_final_state=True, scale=0.25)
    o64, _ = call(naive_recurrent_gla, as_float64(inputs), scale=0.25)
    finite = torch.isfinite(o32)
    assert not finite.all() and finite[:, :100].all()
    assert torch.isfinite(o[finite]).all()
    steps = finite.all(dim=(0, 2, 3))
    assert per_step_error(o[:, steps], o64[:, steps]) <= POSITIVE_TOL
