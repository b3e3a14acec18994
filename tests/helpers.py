"""What the tests of every stage share: relative errors, chunk_gla's inputs, the float64 oracles
(gla_inductor.reference's time loop run in float64, autograd through it for the gradients) and
the backend's rewrite without Inductor. tests/conftest.py puts this folder on sys.path, so every
test folder imports it as ``helpers``; fixtures stay in conftest.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import gla_inductor
from gla_inductor.backend import rewrite
from gla_inductor.reference import naive_recurrent_gla

GATES = ("vector", "scalar", "constant", "none")
FP32_TOL = 1e-5

# ----------------------------------------------------------------------------------------------
# errors
# ----------------------------------------------------------------------------------------------


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - ref| / max |ref| in float64 (the denominator at least 1e-30); 0 for empty tensors."""
    if ref.numel() == 0:
        return 0.0
    return ((a.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30)).item()


def rel_err_floor(a: torch.Tensor, ref: torch.Tensor, floor: float = 0.0) -> float:
    """max |a - ref| / max(max |ref|, floor); the absolute error where both are 0. Unlike rel_err,
    a nonzero a against an all-zero ref is its absolute error, not a huge ratio: for gradients
    that cancel to rounding noise (the fuzzer's)."""
    if ref.numel() == 0:
        return 0.0
    scale = max(ref.abs().max().item(), floor)
    err = (a.double() - ref).abs().max().item()
    return err / scale if scale > 0 else err


def rel_norm_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """||a - ref|| / ||ref|| (Frobenius) in float64, the denominator at least 1e-30."""
    return ((a.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def assert_rel_close(name: str, actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    """actual has expected's shape, is finite and within tol of it in rel_norm_err."""
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{name}: not finite"
    err = rel_norm_err(actual, expected)
    assert err <= tol, f"{name}: relative error {err:.2e} > {tol:.1e}"


# ----------------------------------------------------------------------------------------------
# chunk_gla's inputs
# ----------------------------------------------------------------------------------------------


def logsigmoid_gate(shape, generator: torch.Generator) -> torch.Tensor:
    """Log gates logsigmoid(N(0, 1)) in float64: ~-0.8 per step."""
    return F.logsigmoid(torch.randn(shape, generator=generator, dtype=torch.float64))


def gla_inputs(gate: str, B=2, T=9, H=2, K=4, V=3, *, G=None, dtype=torch.float32, with_h0=True,
               g_fn=logsigmoid_gate, seed=0) -> dict:
    """chunk_gla's keyword inputs q, k, v, g, g_gamma, initial_state (None where absent), drawn in
    float64 from a generator seeded with `seed` in that order (the gate last) and cast to dtype.

    gate: "vector" (g [B, T, H, K]), "scalar" (g [B, T, H]), "constant" (g_gamma [H]) or "none";
    g_fn(shape, generator) draws the log gate in float64. G: the heads of q and k (grouped heads),
    H by default."""
    gen = torch.Generator().manual_seed(seed)
    G = G or H
    inputs = {
        "q": torch.randn(B, T, G, K, generator=gen, dtype=torch.float64),
        "k": torch.randn(B, T, G, K, generator=gen, dtype=torch.float64),
        "v": torch.randn(B, T, H, V, generator=gen, dtype=torch.float64),
        "g": None,
        "g_gamma": None,
        "initial_state": torch.randn(B, H, K, V, generator=gen, dtype=torch.float64) if with_h0 else None,
    }
    shape = {"vector": (B, T, H, K), "scalar": (B, T, H), "constant": (H,)}.get(gate)
    if shape is not None:
        inputs["g_gamma" if gate == "constant" else "g"] = g_fn(shape, gen)
    return {name: None if x is None else x.to(dtype) for name, x in inputs.items()}


def placed(inputs: dict, device="cpu", requires_grad: bool = False) -> dict:
    """inputs on device as fresh tensors (leaves that require grad when requires_grad); None kept."""
    out = {}
    for name, x in inputs.items():
        out[name] = None if x is None else x.detach().to(device).clone().requires_grad_(requires_grad)
    return out


def as_float64(inputs: dict, requires_grad: bool = False) -> dict:
    """The same values in float64, as fresh leaves (that require grad when requires_grad); None kept."""
    return {n: None if x is None else x.detach().double().requires_grad_(requires_grad) for n, x in inputs.items()}


# B, H, T, K, V of head_first_inputs, which the programs fed with them read as module constants
HEAD_FIRST_SIZES = (2, 3, 6, 4, 5)


def head_first_inputs(gate: str, h0: bool = False, k: int | None = None, v: int | None = None,
                      time: bool = True) -> list:
    """[q, k, v] (+ the log gate, + h0) of a naive program written head-first: q, k [B, H, T, K],
    v [B, H, T, V] at HEAD_FIRST_SIZES (K = k, V = v if given; no time axis without time, for a
    decode step); the gate logsigmoid(N(1, 1)) over "vector" [B, H, T, K], "scalar" [B, H, T],
    "constant" [H] or "value" [B, H, T, V] (not GLA), none for "none"; h0 [B, H, K, V]."""
    B, H, T, K, V = HEAD_FIRST_SIZES
    K, V = k or K, v or V
    gen = torch.Generator().manual_seed(0)
    t = (T,) if time else ()
    args = [torch.randn(B, H, *t, K, generator=gen), torch.randn(B, H, *t, K, generator=gen),
            torch.randn(B, H, *t, V, generator=gen)]
    shape = {"vector": (B, H, *t, K), "scalar": (B, H, *t), "constant": (H,), "value": (B, H, *t, V)}.get(gate)
    if shape:
        args.append(F.logsigmoid(torch.randn(shape, generator=gen) + 1))
    return args + ([torch.randn(B, H, K, V, generator=gen)] if h0 else [])


# ----------------------------------------------------------------------------------------------
# the float64 oracles
# ----------------------------------------------------------------------------------------------


def call(fn, inputs: dict, **kw):
    """fn(q, k, v, g, **the other inputs, **kw): chunk_gla, naive_recurrent_gla or a compiled
    function of q, k, v and g; absent keys are None."""
    args = dict(inputs)
    return fn(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("g", None), **args, **kw)


def loop_reference(inputs: dict, **kw):
    """(o, final state) of the time loop (gla_inductor.reference) on inputs in float64: 16-bit
    values upcast exactly; grouped q and k read by every head of their group."""
    kw.setdefault("output_final_state", True)
    return call(naive_recurrent_gla, as_float64(inputs), **kw)


def loop_reference_grads(inputs: dict, do, dht=None, **kw):
    """(o, final state, gradients) of the float64 time loop: autograd of sum(o * do) (+ sum(ht * dht))
    with respect to each input that is not None, by name. do, dht: tensors or numbers."""
    leaves = as_float64(inputs, requires_grad=True)
    o, ht = call(naive_recurrent_gla, leaves, output_final_state=True, **kw)
    loss = (o * (do.double() if isinstance(do, torch.Tensor) else do)).sum()
    if dht is not None:
        loss = loss + (ht * (dht.double() if isinstance(dht, torch.Tensor) else dht)).sum()
    names = [n for n, x in leaves.items() if x is not None]
    grads = torch.autograd.grad(loss, [leaves[n] for n in names], allow_unused=True, materialize_grads=True)
    return o.detach(), ht.detach(), dict(zip(names, grads))


def compiled_fwd_bwd(fwd, x: dict, do=1.0, dht=1.0) -> tuple:
    """(o, ht, forward code, backward code): a compiled fwd(x) -> (o, ht) run with the backward of
    sum(o * do) + sum(ht * dht) in float64, and the code Inductor generated for each."""
    from torch._inductor.utils import run_and_get_code

    def fwd_bwd():
        o, ht = fwd(x)
        ((o.double() * do).sum() + (ht.double() * dht).sum()).backward()
        return o, ht

    (o, ht), (fwd_code, bwd_code) = run_and_get_code(fwd_bwd)
    return o, ht, fwd_code, bwd_code


def assert_loop_exact(x: dict, o, ht, do=1.0, dht=1.0, **kw) -> None:
    """o, ht and the gradients in x's leaves (of that loss) against the float64 time loop
    (loop_reference_grads), within the kernels' fp32 bounds: 1e-5 for the values, 1e-4 for the
    gradients (a gate's gradient sums cancelling terms)."""
    o64, ht64, grads = loop_reference_grads(x, do, dht, **kw)
    assert rel_norm_err(o, o64) < 1e-5 and rel_norm_err(ht, ht64) < 1e-5
    for name, want in grads.items():
        assert rel_norm_err(x[name].grad, want) < 1e-4, name


def forward_and_grads(fn, inputs: dict, output_final_state: bool = True, seed: int = 1, **kw):
    """o, the final state and the gradient of every given input (fresh leaves: the caller's tensors
    are left as they are) under random upstream gradients, drawn in float64 whatever the output
    dtype so that every fn sees the same values."""
    leaves = {n: x.detach().clone().requires_grad_() for n, x in inputs.items() if x is not None}
    o, ht = call(fn, {**dict.fromkeys(inputs), **leaves}, output_final_state=output_final_state, **kw)
    gen = torch.Generator().manual_seed(seed)
    loss = (o * torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype)).sum()
    if output_final_state:
        loss = loss + (ht * torch.randn(ht.shape, generator=gen, dtype=torch.float64).to(ht.dtype)).sum()
    if not loss.requires_grad:  # the naive loop over no steps and no initial state: constant zeros
        return o, ht, {n: torch.zeros_like(x) for n, x in leaves.items()}
    grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True, materialize_grads=True)
    return o, ht, dict(zip(leaves, grads))


def check_against_loop(inputs: dict, tol: float, *, fn=None, backward=True, output_final_state=True, **kw):
    """fn (chunk_gla by default) against the float64 time loop: o, the final state and, with
    backward, the gradient of every input (shape, dtype, finite, within tol in rel_err)."""
    fn = fn or gla_inductor.chunk_gla
    if not backward:
        o, ht = call(fn, inputs, output_final_state=output_final_state, **kw)
        o_ref, ht_ref = loop_reference(inputs, output_final_state=output_final_state, **kw)
        grads, grads_ref = {}, {}
    else:
        o, ht, grads = forward_and_grads(fn, inputs, output_final_state, **kw)
        o_ref, ht_ref, grads_ref = forward_and_grads(naive_recurrent_gla, as_float64(inputs), output_final_state, **kw)
    assert o.shape == o_ref.shape and rel_err(o, o_ref) <= tol, f"o: {rel_err(o, o_ref):.3g}"
    if output_final_state:
        assert rel_err(ht, ht_ref) <= tol, f"final state: {rel_err(ht, ht_ref):.3g}"
    for name, ref in grads_ref.items():
        got = grads[name]
        assert got.shape == inputs[name].shape and got.dtype == inputs[name].dtype, name
        assert torch.isfinite(got).all(), name
        assert rel_err(got, ref) <= tol, f"d{name}: {rel_err(got, ref):.3g}"
    return o, ht


# ----------------------------------------------------------------------------------------------
# compiled programs against float64 eager
# ----------------------------------------------------------------------------------------------


def outputs(res) -> list:
    """A program's result as a list of outputs."""
    return list(res) if isinstance(res, (tuple, list)) else [res]


def rewrite_then_eager(gm, example_inputs):
    """The backend's rewrite (same counters, gate fusion included), then the rewritten graph run as
    is: for what the rewrite does, without Inductor's compile (seconds per graph on CPU)."""
    rewrite(gm, example_inputs)
    return gm.forward


def assert_rewritten_like_eager(fn, args: list, rewrites: int, tol: float) -> None:
    """fn compiled through the rewrite (rewrite_then_eager) against float64 eager, without grad: the
    outputs and the inputs as each left them within tol, no pass failure, `rewrites` rewrites."""
    eager_args = [a.double() for a in args]
    compiled_args = [a.clone() for a in args]
    with torch.no_grad():
        want = outputs(fn(*eager_args))
        got = outputs(torch.compile(fn, backend=rewrite_then_eager, fullgraph=True)(*compiled_args))
    assert counters["gla_inductor"]["failures"] == 0
    for w, g in zip(want + eager_args, got + compiled_args):  # the outputs, and the inputs as left
        assert rel_err(g, w) <= tol
    assert counters["gla_inductor"]["rewrites"] == rewrites


def compile_rewritten(fn, args, **compile_kw):
    """(outputs, rewrite results) of fn compiled with rewrite_then_eager's rewrite."""
    results = []

    def backend(gm, example_inputs):
        results.append(rewrite(gm, example_inputs))
        return gm.forward

    return outputs(torch.compile(fn, backend=backend, fullgraph=True, **compile_kw)(*args)), results


def check_against_float64(fn, args, got, tol: float = FP32_TOL) -> None:
    """got, the outputs of a compiled fn on args (leaves that require grad), and the gradient of
    every arg under a random weighting of the outputs, against fn run eagerly in float64."""
    outs = outputs(got)
    gen = torch.Generator().manual_seed(1)
    weights = [torch.randn(o.shape, generator=gen, dtype=torch.float64) for o in outs]
    grads = torch.autograd.grad(sum((o.double() * w).sum() for o, w in zip(outs, weights)), args)
    args64 = [a.detach().double().requires_grad_() for a in args]
    want = outputs(fn(*args64))
    assert len(outs) == len(want)
    grads64 = torch.autograd.grad(sum((o * w).sum() for o, w in zip(want, weights)), args64)
    for what, a, b in [("output", o, w.detach()) for o, w in zip(outs, want)] + [
            (f"gradient of an input of shape {tuple(g.shape)}", g, w) for g, w in zip(grads, grads64)]:
        assert a.shape == b.shape and rel_err(a, b) <= tol, f"{what}: {rel_err(a, b):.3g}"


def check_rewrite_exact(fn, args, tol: float = FP32_TOL) -> list:
    """fn compiled with the rewrite only, against float64 eager in value and every gradient;
    returns the rewrites' matches."""
    args = [a.clone().requires_grad_() for a in args]
    got, results = compile_rewritten(fn, args)
    check_against_float64(fn, args, got, tol)
    return [m for r in results for m in r.matches]


def check_spelling(sp, dtype, tol: float) -> None:
    """A spelling (spellings.py) compiled with the backend, Inductor included: rewritten as often as
    it expects, and its outputs and gradients as float64 eager's."""
    args = [a.to(dtype).requires_grad_() for a in sp.make(torch.float32)]
    got = torch.compile(sp.fn, backend=gla_inductor.backend, fullgraph=True)(*args)
    assert counters["gla_inductor"]["rewrites"] == sp.rewrites, dict(counters["gla_inductor"])
    check_against_float64(sp.fn, args, got, tol)


# ----------------------------------------------------------------------------------------------
# non-finite and growing inputs (ops/test_bad_input.py, kernels/test_kernels_extreme_inputs.py)
# ----------------------------------------------------------------------------------------------


def poison(inputs, name, value, t):
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


def nonfinite_cases():
    """(gate, input, value) cases: one NaN, +inf or -inf in each input of each gate kind."""
    for gate in GATES:
        gates = {"vector": ["g"], "scalar": ["g"], "constant": ["g_gamma"]}.get(gate, [])
        names = ["q", "k", "v", "initial_state"] + gates
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


def per_step_error(o, ref):
    """max over steps of |o_t - ref_t| / max |ref_t|: a growing state spans many magnitudes."""
    scale = ref.abs().amax(dim=(0, 2, 3), keepdim=True).clamp_min(1e-300)
    return ((o.double() - ref) / scale).abs().max().item()


def positive_gate(high):
    """A g_fn for gla_inputs: log gates uniform in [0, high] (a growing state), drawn from their own
    generator."""
    return lambda shape, _: high * torch.rand(shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)


# Growing states carry chunk-local exponents up to 32 (64 steps of up to 0.5), whose fp32 rounding
# (32 * 2**-24, 2e-6) enters every decay: the fp32 loop itself is off by up to 7e-6 on these.
POSITIVE_TOL = 3e-5
