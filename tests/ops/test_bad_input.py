"""chunk_gla on bad and extreme inputs: clear errors for malformed ones; empty and one-step
sequences; NaN and Inf propagating as in the naive recurrence; growing states (positive log
gates). The chunked PyTorch implementation (CPU), and the same numerics checks on the Triton
kernels under the interpreter.

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
import torch.nn.functional as F

from gla_inductor.ops import chunk_gla
from gla_inductor.reference import naive_recurrent_gla

GATES = ["vector", "scalar", "constant", "none"]

pytestmark = pytest.mark.usefixtures("one_thread")


def make_inputs(gate, B=2, T=9, H=2, K=4, V=3, dtype=torch.float32, with_h0=True, g_fn=None, seed=0):
    """Keyword inputs of chunk_gla; g_fn(shape) draws the log gate (default logsigmoid of a normal)."""
    gen = torch.Generator().manual_seed(seed)
    g_fn = g_fn or (lambda shape: F.logsigmoid(torch.randn(shape, generator=gen, dtype=torch.float64)))
    inputs = {
        "q": torch.randn(B, T, H, K, generator=gen, dtype=torch.float64),
        "k": torch.randn(B, T, H, K, generator=gen, dtype=torch.float64),
        "v": torch.randn(B, T, H, V, generator=gen, dtype=torch.float64),
        "g": {"scalar": (B, T, H), "vector": (B, T, H, K)}.get(gate),
        "g_gamma": (H,) if gate == "constant" else None,
        "initial_state": torch.randn(B, H, K, V, generator=gen, dtype=torch.float64) if with_h0 else None,
    }
    for name in ("g", "g_gamma"):
        if inputs[name] is not None:
            inputs[name] = g_fn(inputs[name])
    return {name: None if x is None else x.to(dtype) for name, x in inputs.items()}


def call(fn, inputs, **kw):
    args = dict(inputs)
    return fn(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("g"), **args, **kw)


# ----------------------------------------------------------------------------------------------
# malformed inputs: an error that names the tensor and what was expected
# ----------------------------------------------------------------------------------------------


def bad(error, match, **changes):
    """A validation case: the default inputs (B=2, T=6, H=4, K=8, V=3) with some replaced."""

    def build(gate="vector"):
        inputs = make_inputs(gate, B=2, T=6, H=4, K=8, V=3)
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
    inputs = make_inputs("scalar")
    inputs["q"], inputs["g"] = inputs["q"].bfloat16(), inputs["g"].half()
    o, ht = call(chunk_gla, inputs, output_final_state=True)
    assert o.dtype == torch.float32 and ht.dtype == torch.float32
    ref = {n: None if x is None else x.double() for n, x in inputs.items()}
    o_ref, ht_ref = call(naive_recurrent_gla, ref, output_final_state=True)
    torch.testing.assert_close(o.double(), o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ht.double(), ht_ref, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# empty and one-step sequences, forward and backward
# ----------------------------------------------------------------------------------------------


def forward_and_grads(fn, inputs, seed=1, **kw):
    """o, the final state and the gradient of every given input under random upstream gradients."""
    leaves = {n: x.detach().clone().requires_grad_() for n, x in inputs.items() if x is not None}
    o, ht = call(fn, {**dict.fromkeys(inputs), **leaves}, output_final_state=True, **kw)
    gen = torch.Generator().manual_seed(seed)
    loss = (o * torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype)).sum()
    loss = loss + (ht * torch.randn(ht.shape, generator=gen, dtype=torch.float64).to(ht.dtype)).sum()
    if not loss.requires_grad:  # the naive loop over no steps and no initial state: constant zeros
        return o, ht, {n: torch.zeros_like(x) for n, x in leaves.items()}
    grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True, materialize_grads=True)
    return o, ht, dict(zip(leaves, grads))


@pytest.mark.usefixtures("cpu_impl")
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("B,T", [(0, 5), (2, 0), (0, 0), (2, 1)], ids=["B0", "T0", "B0-T0", "T1"])
@pytest.mark.parametrize("with_h0", [False, True], ids=["zeros", "h0"])
@pytest.mark.parametrize("reverse", [False, True], ids=["fwd", "rev"])
def test_empty_and_single_step(gate, B, T, with_h0, reverse):
    inputs = make_inputs(gate, B=B, T=T, with_h0=with_h0, dtype=torch.float64)
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


def _poison(inputs, name, value, t):
    """A copy of the inputs with one element of `name` set to value, at step t if it has steps."""
    inputs = {n: None if x is None else x.clone() for n, x in inputs.items()}
    x = inputs[name]
    if name in ("q", "k", "v", "g"):
        x[(-1, t, -1) + (min(2, x.shape[-1] - 1),) * (x.dim() - 3)] = value
    elif name == "g_gamma":
        x[-1] = value
    else:  # initial_state
        x[-1, -1, min(2, x.shape[2] - 1), min(1, x.shape[3] - 1)] = value
    return inputs


def _nonfinite_cases():
    for gate in GATES:
        names = ["q", "k", "v", "initial_state"] + {"vector": ["g"], "scalar": ["g"], "constant": ["g_gamma"]}.get(gate, [])
        for name in names:
            # a log gate of -inf is a legal gate (forget everything): test_forget_gate_of_minus_inf
            for value in ("nan", "inf") if name.startswith("g") else ("nan", "inf", "-inf"):
                yield pytest.param(gate, name, float(value), id=f"{gate}-{name}-{value}")


def assert_nonfinite_like(got, ref, nan_only: bool, what: str, tol: float = 1e-5):
    """got is non-finite exactly where ref is, and NaN exactly where ref is when nan_only;
    elsewhere close to ref (relative and absolute tolerance ``tol``)."""
    bad_got, bad_ref = ~torch.isfinite(got), ~torch.isfinite(ref)
    if nan_only:
        diff = (got.isnan() != ref.isnan()).nonzero()
        assert diff.numel() == 0, f"{what}: NaN where the loop has none or vice versa at {diff[:4].tolist()}"
    diff = (bad_got != bad_ref).nonzero()
    assert diff.numel() == 0, f"{what}: non-finite where the loop is finite or vice versa at {diff[:4].tolist()}"
    ok = ~bad_ref
    torch.testing.assert_close(got[ok].double(), ref[ok].double(), rtol=tol, atol=tol, msg=what)


@pytest.mark.usefixtures("cpu_impl")
@pytest.mark.parametrize("gate,name,value", list(_nonfinite_cases()))
@pytest.mark.parametrize("reverse", [False, True], ids=["fwd", "rev"])
def test_nonfinite_input_propagates_like_the_loop(gate, name, value, reverse):
    inputs = _poison(make_inputs(gate, T=NONFINITE_T), name, value, t=100)
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
    inputs = make_inputs(gate, B=3, T=300, H=2, K=5, V=7)
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
    inputs = make_inputs(gate, T=NONFINITE_T, dtype=torch.float64)
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


def _per_step_error(o, ref):
    """max over steps of |o_t - ref_t| / max |ref_t|: a growing state spans many magnitudes."""
    scale = ref.abs().amax(dim=(0, 2, 3), keepdim=True).clamp_min(1e-300)
    return ((o.double() - ref) / scale).abs().max().item()


def positive_gate(high):
    return lambda shape: high * torch.rand(shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)


# Growing states carry chunk-local exponents up to 32 (64 steps of up to 0.5), whose fp32 rounding
# (32 * 2**-24, 2e-6) enters every decay: the fp32 loop itself is off by up to 7e-6 on these.
POSITIVE_TOL = 3e-5


@pytest.mark.usefixtures("cpu_impl")
@pytest.mark.parametrize("gate", ["vector", "scalar", "constant"])
@pytest.mark.parametrize("T", [64, 130, 256])
@pytest.mark.parametrize("reverse", [False, True], ids=["fwd", "rev"])
def test_positive_log_gates_match_the_loop(gate, T, reverse):
    """g in [0, 0.5]: the state grows by up to exp(T / 2) and stays within fp32's range."""
    inputs = make_inputs(gate, B=1, T=T, H=2, g_fn=positive_gate(0.5 if gate != "constant" else 0.3))
    o, ht = call(chunk_gla, inputs, output_final_state=True, reverse=reverse)
    ref = {n: None if x is None else x.double() for n, x in inputs.items()}
    o_ref, ht_ref = call(naive_recurrent_gla, ref, output_final_state=True, reverse=reverse)
    assert torch.isfinite(o_ref).all()
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    assert _per_step_error(o, o_ref) <= POSITIVE_TOL
    assert ((ht.double() - ht_ref).abs().max() / ht_ref.abs().max()).item() <= POSITIVE_TOL


@pytest.mark.usefixtures("cpu_impl")
@pytest.mark.parametrize("gate", ["vector", "scalar", "constant"])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, POSITIVE_TOL)], ids=["fp64", "fp32"])
@pytest.mark.parametrize("reverse", [False, True], ids=["fwd", "rev"])
def test_positive_log_gates_grads(gate, dtype, tol, reverse):
    inputs = make_inputs(gate, B=1, T=256, H=2, dtype=dtype, g_fn=positive_gate(0.5 if gate != "constant" else 0.3))
    _, _, grads = forward_and_grads(chunk_gla, inputs, reverse=reverse)
    ref = {n: None if x is None else x.double() for n, x in inputs.items()}
    _, _, grads_ref = forward_and_grads(naive_recurrent_gla, ref, reverse=reverse)
    for name, ref in grads_ref.items():
        err = ((grads[name].double() - ref).abs().max() / ref.abs().max()).item()
        assert err <= tol, f"d{name}: {err:.2e}"


@pytest.mark.usefixtures("cpu_impl")
@pytest.mark.parametrize("gate", ["vector", "scalar", "constant"])
@pytest.mark.parametrize("with_h0", [False, True], ids=["zeros", "h0"])
def test_overflowing_state_is_never_nan_where_the_loop_is_finite(gate, with_h0):
    """g in [0, 1] over 600 steps: the fp32 loop's state overflows to inf after ~180 steps.
    Wherever the fp32 loop is finite, so are we, and close to the exact (fp64) values."""
    inputs = make_inputs(gate, B=1, T=600, H=2, with_h0=with_h0, g_fn=positive_gate(1.0))
    o, ht = call(chunk_gla, inputs, output_final_state=True)
    o32, _ = call(naive_recurrent_gla, inputs, output_final_state=True)
    ref = {n: None if x is None else x.double() for n, x in inputs.items()}
    o64, _ = call(naive_recurrent_gla, ref)
    finite = torch.isfinite(o32)
    assert not finite.all() and finite[:, :100].all()  # the loop does overflow, late
    assert torch.isfinite(o[finite]).all()
    steps = finite.all(dim=(0, 2, 3))
    assert _per_step_error(o[:, steps], o64[:, steps]) <= POSITIVE_TOL


# ----------------------------------------------------------------------------------------------
# the same numerics on the Triton kernels (the interpreter on CPU, compiled on a GPU)
# ----------------------------------------------------------------------------------------------

KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _kernels():
    triton = pytest.importorskip("triton")
    pytest.importorskip("jinja2")
    if KERNEL_DEVICE == "cpu" and type(triton.language.cumsum).__name__ != "InterpretedFunction":
        pytest.skip("triton was imported without TRITON_INTERPRET=1")
    from gla_inductor import triton_chunk

    return triton_chunk


def run_kernels(inputs, reverse=False, scale=0.25, schedule=None):
    """(o, final state) of chunk_fwd_triton, on CPU for comparison. schedule: None (the default one,
    the fused scan at these sizes), "split", "local" or "segments" (local, the carries' walks cut
    in two segments)."""
    x = {n: None if t is None else t.to(KERNEL_DEVICE) for n, t in inputs.items()}
    config = None
    if schedule is not None:
        import dataclasses

        B, T, H, K = x["q"].shape
        tc = _kernels()
        config = tc.default_config(B, T, H, K, x["v"].shape[-1], x["q"].dtype,
                                   x["g"] is not None and x["g"].dim() == 4, x["q"].device)
        config = dataclasses.replace(config, split=schedule == "split", local=schedule in ("local", "segments"),
                                     segments=2 if schedule == "segments" else 1)
    o, ht = _kernels().chunk_fwd_triton(x["q"], x["k"], x["v"], x["g"], x["g_gamma"], x["initial_state"],
                                        scale, True, reverse, config=config)
    return o.cpu(), ht.cpu()


# K = V = 16: the kernels' smallest tiles; T = 100: two chunks of BT = 64, the bad step at 80
KERNEL_SIZES = dict(B=1, H=1, K=16, V=16)

# numpy's overflow and invalid-value warnings from inside the interpreter: expected here
kernel_warnings = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@kernel_warnings
@pytest.mark.parametrize("gate,name,value", list(_nonfinite_cases()))
@pytest.mark.parametrize("reverse", [False, True], ids=["fwd", "rev"])
def test_kernels_nonfinite_input_propagates_like_the_loop(gate, name, value, reverse):
    inputs = _poison(make_inputs(gate, T=100, **KERNEL_SIZES), name, value, t=80)
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
    inputs = make_inputs("scalar", B=2, T=150, H=2, K=16, V=80)
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
    for schedule in ("split", "local", "segments"):
        for gate in ("vector", "scalar"):
            for name, value in (("v", float("nan")), ("v", float("inf")), ("g", float("nan")), ("g", float("inf"))):
                yield pytest.param(schedule, gate, name, value, id=f"{schedule}-{gate}-{name}-{value}")


@kernel_warnings
@pytest.mark.parametrize("schedule,gate,name,value", list(_schedule_cases()))
@pytest.mark.parametrize("reverse", [False, True], ids=["fwd", "rev"])
def test_kernel_schedules_nonfinite_input_propagates_like_the_loop(schedule, gate, name, value, reverse):
    inputs = _poison(make_inputs(gate, T=100, **KERNEL_SIZES), name, value, t=80)
    o, ht = run_kernels(inputs, reverse, schedule=schedule)
    o_ref, ht_ref = call(naive_recurrent_gla, inputs, output_final_state=True, scale=0.25, reverse=reverse)
    assert_nonfinite_like(o, o_ref, value != value, "o")
    assert_nonfinite_like(ht, ht_ref, value != value, "final state")


@kernel_warnings
@pytest.mark.parametrize("gate", ["vector", "scalar", "constant"])
@pytest.mark.parametrize("schedule", [None, "split", "local"], ids=["default", "split", "local"])
def test_kernels_forget_gate_of_minus_inf(gate, schedule):
    """A log gate of -inf (exp(g) = 0, a reset) is finite in the loop: the kernels floor log gates at
    -150 (log2 units), whose decays round to 0 in fp32 (gla_common's _gla_floor_gate)."""
    inputs = make_inputs(gate, T=100, **KERNEL_SIZES)
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

    inputs = make_inputs(gate, T=100, **KERNEL_SIZES)
    x = torch.randn(inputs["g"].shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    x[(0, 80, 0) + (2,) * (x.dim() - 3)] = float("nan")
    heads = x.shape[2:]
    gen = torch.Generator().manual_seed(4)
    a = -torch.rand(heads[0], generator=gen, dtype=torch.float64) if gate_fn == "softplus" else None
    bias = torch.randn(heads, generator=gen, dtype=torch.float64) if gate_fn == "softplus" else None
    fn = GateFn(gate_fn, 0.5 if gate_fn == "logsigmoid" else 1.0, 0.01 if gate_fn == "softplus" else -3.0, 4.0)
    dev = {n: None if t is None else t.to(KERNEL_DEVICE) for n, t in dict(inputs, g=x, a=a, bias=bias).items()}
    o, ht = _kernels().chunk_fwd_triton(dev["q"], dev["k"], dev["v"], dev["g"], None, dev["initial_state"], 0.25,
                                        True, False, gate=fn, gate_a=dev["a"], gate_bias=dev["bias"])
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
    inputs = make_inputs(gate, T=T, **KERNEL_SIZES, g_fn=positive_gate(0.5 if gate != "constant" else 0.3))
    o, ht = run_kernels(inputs, reverse)
    ref = {n: None if x is None else x.double() for n, x in inputs.items()}
    o_ref, ht_ref = call(naive_recurrent_gla, ref, output_final_state=True, scale=0.25, reverse=reverse)
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    assert _per_step_error(o, o_ref) <= POSITIVE_TOL
    assert ((ht.double() - ht_ref).abs().max() / ht_ref.abs().max()).item() <= POSITIVE_TOL


@kernel_warnings
@pytest.mark.parametrize("gate", ["vector", "scalar", "constant"])
def test_kernels_overflowing_state_is_never_nan_where_the_loop_is_finite(gate):
    inputs = make_inputs(gate, T=600, **KERNEL_SIZES, g_fn=positive_gate(1.0))
    o, _ = run_kernels(inputs)
    o32, _ = call(naive_recurrent_gla, inputs, output_final_state=True, scale=0.25)
    o64, _ = call(naive_recurrent_gla, {n: None if x is None else x.double() for n, x in inputs.items()}, scale=0.25)
    finite = torch.isfinite(o32)
    assert not finite.all() and finite[:, :100].all()
    assert torch.isfinite(o[finite]).all()
    steps = finite.all(dim=(0, 2, 3))
    assert _per_step_error(o[:, steps], o64[:, steps]) <= POSITIVE_TOL
