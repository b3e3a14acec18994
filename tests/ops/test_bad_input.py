"""chunk_gla on bad and extreme inputs: clear errors for malformed ones; empty and one-step
sequences; NaN and Inf propagating as in the naive recurrence; growing states (positive log
gates). The chunked PyTorch implementation and the C++ step loops (CPU); the same numerics on the
Triton kernels are in tests/kernels/test_kernels_extreme_inputs.py.

What "as in the naive recurrence" means here, for one non-finite value in one input:
  NaN   the outputs (o and the final state) are NaN exactly where the naive loop's are. In the
        loop a NaN in k_t, v_t or g_t reaches o only from step t on (in time order), one in q_t
        only o_t, one in h0 every step.
  Inf   the outputs are non-finite exactly where the naive loop's are. Which of them are NaN
        rather than +-Inf is not specified: the chunked form sums q_i . k_j before multiplying
        by v_j, the loop k_j v_j before q_i, and Inf - Inf turns up in different places.
Gradients of non-finite inputs are not specified.
"""

from __future__ import annotations

import pytest
import torch

from gla_inductor.ops import chunk_gla
from gla_inductor.reference import naive_recurrent_gla

from helpers import (GATES, POSITIVE_TOL, assert_nonfinite_like, as_float64, call, forward_and_grads, gla_inputs,
                     nonfinite_cases, per_step_error, poison, positive_gate, rel_err)

pytestmark = pytest.mark.usefixtures("one_thread")

# ----------------------------------------------------------------------------------------------
# malformed inputs: an error that names the tensor and what was expected
# ----------------------------------------------------------------------------------------------


def bad(error, match, **changes):
    """A validation case: the default inputs (B=2, T=6, H=4, K=8, V=3) with some replaced."""

    def build(gate="vector"):
        inputs = gla_inputs(gate, B=2, T=6, H=4, K=8, V=3)
        inputs.update({n: f(inputs) if callable(f) else f for n, f in changes.items()})
        return inputs

    return build, error, match


CASES = {
    # rank
    "q-3d": bad(ValueError, r"q has shape \(6, 4, 8\); expected q to be 4-D \[B, T, H, K\]", q=lambda i: i["q"][0]),
    "q-5d": bad(ValueError, r"expected q to be 4-D", q=lambda i: i["q"][None]),
    "k-3d": bad(ValueError, r"k has shape \(6, 4, 8\) but q has shape \(2, 6, 4, 8\); expected k to be "
                r"\[B, T, H, K\] = \[2, 6, 4, 8\]", k=lambda i: i["k"][0]),
    "v-5d": bad(ValueError, r"expected v to be \[B, T, H, V\] = \[2, 6, 4, V\]", v=lambda i: i["v"][None]),
    # sizes
    "k-K": bad(ValueError, r"k has shape \(2, 6, 4, 7\).*expected k to be \[B, T, H, K\] = \[2, 6, 4, 8\]",
               k=lambda i: i["k"][..., :7]),
    "k-T": bad(ValueError, r"expected k to be \[B, T, H, K\] = \[2, 6, 4, 8\]", k=lambda i: i["k"][:, :5]),
    "k-B": bad(ValueError, r"expected k to be \[B, T, H, K\] = \[2, 6, 4, 8\]", k=lambda i: i["k"][:1]),
    "v-H": bad(ValueError, r"v has shape \(2, 6, 3, 3\).*expected v to be \[B, T, H, V\] = \[2, 6, 4, V\]",
               v=lambda i: i["v"][:, :, :3]),
    "v-T": bad(ValueError, r"expected v to be \[B, T, H, V\] = \[2, 6, 4, V\]", v=lambda i: i["v"][:, 1:]),
    # gates
    "g-vector-K": bad(ValueError, r"expected g to be \[B, T, H, K\] = \[2, 6, 4, 8\]", g=lambda i: i["g"][..., :7]),
    "g-vector-T": bad(ValueError, r"expected g to be \[B, T, H, K\] = \[2, 6, 4, 8\]", g=lambda i: i["g"][:, :5]),
    "g-scalar-H": bad(ValueError, r"expected g to be \[B, T, H\] = \[2, 6, 4\]", g=torch.zeros(2, 6, 3)),
    "g-2d": bad(ValueError, r"g has shape \(2, 6\).*expected g to be \[B, T, H, K\] = \[2, 6, 4, 8\] "
                r"\(vector gate\) or \[B, T, H\] = \[2, 6, 4\] \(scalar gate\)", g=torch.zeros(2, 6)),
    "g-5d": bad(ValueError, r"expected g to be \[B, T, H, K\] = \[2, 6, 4, 8\] \(vector gate\) or",
                g=torch.zeros(2, 6, 4, 8, 1)),
    "g_gamma-size": bad(ValueError, r"g_gamma has shape \(3,\).*expected g_gamma to be \[H\] = \[4\]",
                        g=None, g_gamma=torch.zeros(3)),
    "g_gamma-2d": bad(ValueError, r"expected g_gamma to be \[H\] = \[4\]", g=None, g_gamma=torch.zeros(1, 4)),
    "g_gamma-0d": bad(ValueError, r"expected g_gamma to be \[H\] = \[4\]", g=None, g_gamma=torch.tensor(0.0)),
    "both-gates": bad(ValueError, r"got both g and g_gamma; pass at most one gate", g_gamma=torch.zeros(4)),
    # initial state
    "h0-KV": bad(ValueError, r"expected initial_state to be \[B, H, K, V\] = \[2, 4, 8, 3\]",
                 initial_state=torch.zeros(2, 4, 3, 8)),
    "h0-B": bad(ValueError, r"initial_state has shape \(1, 4, 8, 3\).*\[B, H, K, V\] = \[2, 4, 8, 3\]",
                initial_state=torch.zeros(1, 4, 8, 3)),
    "h0-H": bad(ValueError, r"expected initial_state to be \[B, H, K, V\] = \[2, 4, 8, 3\]",
                initial_state=torch.zeros(2, 2, 8, 3)),
    "h0-3d": bad(ValueError, r"expected initial_state to be \[B, H, K, V\]", initial_state=torch.zeros(4, 8, 3)),
    # dtypes
    "q-int": bad(TypeError, r"q has dtype torch.int64; expected float16, bfloat16, float32 or float64",
                 q=lambda i: i["q"].long()),
    "v-bool": bad(TypeError, r"v has dtype torch.bool; expected float16", v=lambda i: i["v"] > 0),
    "g-int": bad(TypeError, r"g has dtype torch.int32; expected float16", g=lambda i: i["g"].int()),
    "g_gamma-int": bad(TypeError, r"g_gamma has dtype torch.int64", g=None, g_gamma=torch.zeros(4, dtype=torch.long)),
    "h0-int": bad(TypeError, r"initial_state has dtype torch.int64",
                  initial_state=torch.zeros(2, 4, 8, 3, dtype=torch.long)),
    "k-complex": bad(TypeError, r"k has dtype torch.complex64", k=lambda i: i["k"].to(torch.complex64)),
    # not tensors
    "q-list": bad(TypeError, r"q must be a torch.Tensor, got list", q=[1.0]),
    "g-float": bad(TypeError, r"g must be a torch.Tensor, got float", g=0.5),
    # devices (meta stands in for a second device on a CPU-only runner)
    "v-device": bad(ValueError, r"v is on meta but q is on cpu; all tensors must share one device",
                    v=lambda i: i["v"].to("meta")),
    "g-device": bad(ValueError, r"g is on meta but q is on cpu", g=lambda i: i["g"].to("meta")),
    "g_gamma-device": bad(ValueError, r"g_gamma is on meta but q is on cpu", g=None,
                          g_gamma=torch.zeros(4, device="meta")),
    "h0-device": bad(ValueError, r"initial_state is on meta but q is on cpu",
                     initial_state=torch.zeros(2, 4, 8, 3, device="meta")),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_malformed_input_error(case):
    build, error, match = CASES[case]
    with pytest.raises(error, match=match):
        call(chunk_gla, build())


@pytest.mark.usefixtures("cpu_impl")
def test_mixed_float_dtypes_promote():
    """Float dtypes may differ: q, k, v promote (bf16 and fp32 give fp32 o), the rest computes in fp32."""
    inputs = gla_inputs("scalar")
    inputs["q"], inputs["g"] = inputs["q"].bfloat16(), inputs["g"].half()
    o, ht = call(chunk_gla, inputs, output_final_state=True)
    assert o.dtype == torch.float32 and ht.dtype == torch.float32
    ref = as_float64(inputs)
    o_ref, ht_ref = call(naive_recurrent_gla, ref, output_final_state=True)
    torch.testing.assert_close(o.double(), o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ht.double(), ht_ref, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# empty and one-step sequences, forward and backward
# ----------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("cpu_impl")
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("B,T", [(0, 5), (2, 0), (0, 0), (2, 1)], ids=["B0", "T0", "B0-T0", "T1"])
@pytest.mark.parametrize("with_h0", [False, True], ids=["zeros", "h0"])
@pytest.mark.parametrize("reverse", [False, True], ids=["fwd", "rev"])
def test_empty_and_single_step(gate, B, T, with_h0, reverse):
    inputs = gla_inputs(gate, B=B, T=T, with_h0=with_h0, dtype=torch.float64)
    o, ht, grads = forward_and_grads(chunk_gla, inputs, reverse=reverse)
    o_ref, ht_ref, grads_ref = forward_and_grads(naive_recurrent_gla, inputs, reverse=reverse)
    assert o.shape == o_ref.shape == (B, T, 2, 3) and ht.shape == ht_ref.shape == (B, 2, 4, 3)
    torch.testing.assert_close(o, o_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ht, ht_ref, rtol=1e-12, atol=1e-12)
    for name, ref in grads_ref.items():
        assert grads[name].shape == inputs[name].shape, name
        torch.testing.assert_close(grads[name], ref, rtol=1e-12, atol=1e-12, msg=f"d{name}")


# ----------------------------------------------------------------------------------------------
# NaN and Inf
# ----------------------------------------------------------------------------------------------

NONFINITE_T = 150  # three chunks of BT = 64; the bad step sits inside the middle one


@pytest.mark.usefixtures("cpu_impl")
@pytest.mark.parametrize("gate,name,value", list(nonfinite_cases()))
@pytest.mark.parametrize("reverse", [False, True], ids=["fwd", "rev"])
def test_nonfinite_input_propagates_like_the_loop(gate, name, value, reverse):
    inputs = poison(gla_inputs(gate, T=NONFINITE_T), name, value, t=100)
    o, ht = call(chunk_gla, inputs, output_final_state=True, reverse=reverse)
    o_ref, ht_ref = call(naive_recurrent_gla, inputs, output_final_state=True, reverse=reverse)
    assert_nonfinite_like(o, o_ref, value != value, "o")
    assert_nonfinite_like(ht, ht_ref, value != value, "final state")
    assert not torch.isfinite(o).all()  # the case is not vacuous


@pytest.mark.usefixtures("cpu_impl")
@pytest.mark.parametrize("gate", ["vector", "scalar"])
@pytest.mark.parametrize("reverse", [False, True], ids=["fwd", "rev"])
def test_scattered_nans_propagate_like_the_loop(gate, reverse):
    """A few NaNs in every input, over several chunks and batch entries; one batch entry clean."""
    inputs = gla_inputs(gate, B=3, T=300, H=2, K=5, V=7)
    gen = torch.Generator().manual_seed(3)
    for name in ("q", "k", "v", "g"):
        x = inputs[name][1:]  # batch entry 0 stays finite
        x.view(-1)[torch.randperm(x.numel(), generator=gen)[:3]] = float("nan")
    o, ht = call(chunk_gla, inputs, output_final_state=True, reverse=reverse)
    o_ref, ht_ref = call(naive_recurrent_gla, inputs, output_final_state=True, reverse=reverse)
    assert_nonfinite_like(o, o_ref, True, "o")
    assert_nonfinite_like(ht, ht_ref, True, "final state")
    assert torch.isfinite(o[0]).all() and not torch.isfinite(o[1:]).all()


@pytest.mark.usefixtures("cpu_impl")
@pytest.mark.parametrize("gate", ["vector", "scalar", "constant"])
def test_forget_gate_of_minus_inf(gate):
    """g = -inf (forget the state entirely) is finite in the loop, and must be here, with its gradients."""
    inputs = gla_inputs(gate, T=NONFINITE_T, dtype=torch.float64)
    if gate == "constant":
        inputs["g_gamma"][0] = float("-inf")
    else:
        inputs["g"][:, 30] = float("-inf")
        inputs["g"][:, 100:103] = float("-inf")
    o, ht, grads = forward_and_grads(chunk_gla, inputs)
    o_ref, ht_ref, grads_ref = forward_and_grads(naive_recurrent_gla, inputs)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ht, ht_ref, rtol=1e-10, atol=1e-10)
    for name in ("q", "k", "v", "initial_state"):
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=1e-10, atol=1e-10, msg=f"d{name}")


# ----------------------------------------------------------------------------------------------
# growing states: positive log gates
# ----------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("cpu_impl")
@pytest.mark.parametrize("gate", ["vector", "scalar", "constant"])
@pytest.mark.parametrize("T", [64, 130, 256])
@pytest.mark.parametrize("reverse", [False, True], ids=["fwd", "rev"])
def test_positive_log_gates_match_the_loop(gate, T, reverse):
    """g in [0, 0.5]: the state grows by up to exp(T / 2) and stays within fp32's range."""
    inputs = gla_inputs(gate, B=1, T=T, H=2, g_fn=positive_gate(0.5 if gate != "constant" else 0.3))
    o, ht = call(chunk_gla, inputs, output_final_state=True, reverse=reverse)
    ref = as_float64(inputs)
    o_ref, ht_ref = call(naive_recurrent_gla, ref, output_final_state=True, reverse=reverse)
    assert torch.isfinite(o_ref).all()
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    assert per_step_error(o, o_ref) <= POSITIVE_TOL
    assert rel_err(ht, ht_ref) <= POSITIVE_TOL


@pytest.mark.usefixtures("cpu_impl")
@pytest.mark.parametrize("gate", ["vector", "scalar", "constant"])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, POSITIVE_TOL)], ids=["fp64", "fp32"])
@pytest.mark.parametrize("reverse", [False, True], ids=["fwd", "rev"])
def test_positive_log_gates_grads(gate, dtype, tol, reverse):
    inputs = gla_inputs(gate, B=1, T=256, H=2, dtype=dtype, g_fn=positive_gate(0.5 if gate != "constant" else 0.3))
    _, _, grads = forward_and_grads(chunk_gla, inputs, reverse=reverse)
    ref = as_float64(inputs)
    _, _, grads_ref = forward_and_grads(naive_recurrent_gla, ref, reverse=reverse)
    for name, ref in grads_ref.items():
        assert rel_err(grads[name], ref) <= tol, f"d{name}: {rel_err(grads[name], ref):.2e}"


@pytest.mark.usefixtures("cpu_impl")
@pytest.mark.parametrize("gate", ["vector", "scalar", "constant"])
@pytest.mark.parametrize("with_h0", [False, True], ids=["zeros", "h0"])
def test_overflowing_state_is_never_nan_where_the_loop_is_finite(gate, with_h0):
    """g in [0, 1] over 600 steps: the fp32 loop's state overflows to inf after ~180 steps.
    Wherever the fp32 loop is finite, so are we, and close to the exact (fp64) values."""
    inputs = gla_inputs(gate, B=1, T=600, H=2, with_h0=with_h0, g_fn=positive_gate(1.0))
    o, ht = call(chunk_gla, inputs, output_final_state=True)
    o32, _ = call(naive_recurrent_gla, inputs, output_final_state=True)
    ref = as_float64(inputs)
    o64, _ = call(naive_recurrent_gla, ref)
    finite = torch.isfinite(o32)
    assert not finite.all() and finite[:, :100].all()  # the loop does overflow, late
    assert torch.isfinite(o[finite]).all()
    steps = finite.all(dim=(0, 2, 3))
    assert per_step_error(o[:, steps], o64[:, steps]) <= POSITIVE_TOL
