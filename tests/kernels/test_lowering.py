"""The Inductor lowerings of the GLA ops (``gla_inductor.lowerings``): compiled graphs run our
Triton templates as generated code, forward and backward, with pointwise epilogues fused.

Without a GPU, Inductor generates Triton for CPU tensors and runs it under the Triton interpreter
(``cpu_backend="triton"`` plus a stub for the Triton backend hash, which a CPU-only Triton cannot
compute; ../shared/research/inductor.md §7). On a GPU the same tests run on CUDA.
"""

import dataclasses
import re

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

import gla_inductor
from gla_inductor.kernels import chunk as kchunk, configs as kconfigs
from gla_inductor.reference import naive_recurrent_gla

from helpers import (assert_loop_exact, compiled_fwd_bwd, gla_inputs, loop_reference, loop_reference_grads, placed,
                     rel_norm_err)

triton = pytest.importorskip("triton")
ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
INTERPRETED = type(triton.language.cumsum).__name__ == "InterpretedFunction"
pytestmark = [pytest.mark.skipif(not (ON_GPU or INTERPRETED), reason="needs a GPU or TRITON_INTERPRET=1"), pytest.mark.compat]

# how the output code calls the eager op (a fallback), as opposed to comments that name it
EXTERN_CALL = re.compile(r"^\s*[\w, ]+ = torch\.ops\.gla_inductor\.\w+\.default\(", re.MULTILINE)
SCAN_KERNEL = "GLA chunk scan"  # comments the templates leave in their kernels' source
DQKG_KERNEL = "GLA backward for q, k and the gate"
LOCAL_KERNEL = "GLA chunk-local terms"
CARRY_KERNEL = "GLA inter-chunk scan"


@pytest.fixture(autouse=True)
def triton_everywhere(inductor_triton):
    """Every test here compiles with Triton kernels (conftest's inductor_triton)."""
    yield
    torch._dynamo.reset()


@pytest.fixture
def force_schedule(monkeypatch, fresh_default_config):
    """force_schedule(local): the local schedule (True) or the fused scan (False) at any head size."""

    def force(local: bool):
        monkeypatch.setattr(kconfigs, "local_schedule", lambda BK, vector_gate: local)

    return force


def _inputs(B, T, H, K, V, gate, h0, dtype=torch.float32, seed=0, requires_grad=True):
    """chunk_gla's inputs (helpers.gla_inputs) on DEVICE, leaves that require grad by default."""
    return placed(gla_inputs(gate, B, T, H, K, V, dtype=dtype, with_h0=h0, seed=seed), DEVICE, requires_grad)


def _code_of(fn, *args):
    """(result, generated code of every graph) of a compiled call and its backward."""
    return run_and_get_code(fn, *args)


@pytest.mark.parametrize("gate", ["vector", "scalar", "constant", "none"])
@pytest.mark.parametrize("reverse", [False, True])
def test_forward_and_backward_run_the_templates(gate, reverse):
    x = _inputs(2, 21, 2, 16, 24, gate, h0=True)
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(2, 21, 2, 24, generator=gen, dtype=torch.float64).to(DEVICE)
    wh = torch.randn(2, 2, 16, 24, generator=gen, dtype=torch.float64).to(DEVICE)

    @torch.compile(fullgraph=True)
    def fwd(x):
        return gla_inductor.chunk_gla(**x, output_final_state=True, reverse=reverse)

    o, ht, fwd_code, bwd_code = compiled_fwd_bwd(fwd, x, w, wh)
    assert not EXTERN_CALL.search(fwd_code + bwd_code)
    # the forward: the fused scan (vector gates below K = 64), or the carry computing its chunk terms
    forward_kernel = SCAN_KERNEL if gate == "vector" else CARRY_KERNEL
    assert fwd_code.count(forward_kernel) == 1 and DQKG_KERNEL not in fwd_code
    # the backward: the states scan and the dual scan, then dq/dk/dg
    assert bwd_code.count(SCAN_KERNEL) == 2 and bwd_code.count(DQKG_KERNEL) == 1

    assert_loop_exact(x, o, ht, w, wh, reverse=reverse)


@pytest.mark.parametrize("gate", ["vector", "scalar", "none"])
def test_local_schedule_runs_its_templates(gate, force_schedule):
    """The local schedule (chosen on a GPU for large heads; forced here): forward = chunk-local terms
    plus the carry scan, backward = local terms, two carry scans, dq/dk/dg; gradients exact."""
    force_schedule(True)
    x = _inputs(1, 37, 2, 16, 24, gate, h0=True)
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(1, 37, 2, 24, generator=gen, dtype=torch.float64).to(DEVICE)

    @torch.compile(fullgraph=True)
    def fwd(x):
        return gla_inductor.chunk_gla(**x, output_final_state=True, reverse=True)

    o, ht, fwd_code, bwd_code = compiled_fwd_bwd(fwd, x, w)
    assert not EXTERN_CALL.search(fwd_code + bwd_code)
    assert fwd_code.count(LOCAL_KERNEL) == 1 and fwd_code.count(CARRY_KERNEL) == 1 and SCAN_KERNEL not in fwd_code
    assert bwd_code.count(LOCAL_KERNEL) == 1 and bwd_code.count(CARRY_KERNEL) == 2
    assert bwd_code.count(DQKG_KERNEL) == 1 and SCAN_KERNEL not in bwd_code

    assert_loop_exact(x, o, ht, w, reverse=True)


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_local_schedule_warp_major_rows(reverse, force_schedule):
    """A vector gate's chunk-local kernel whose rows take warp-major order (configs.local_row_order,
    from K = 32 at 8 warps): its scores are stored from two branches (gentle and steep chunks) by
    one store_output, pasted twice. Values and gradients exact; the gate's sums run in that order."""
    force_schedule(True)
    x = _inputs(1, 150, 2, 40, 24, "vector", h0=True)
    with torch.no_grad():
        x["g"][:, 70:74] = -8.0  # the middle chunk is steep: the pairwise path

    @torch.compile(fullgraph=True)
    def fwd(x):
        return gla_inductor.chunk_gla(**x, output_final_state=True, reverse=reverse)

    o, ht, fwd_code, bwd_code = compiled_fwd_bwd(fwd, x)
    assert fwd_code.count(LOCAL_KERNEL) == 1 and bwd_code.count(LOCAL_KERNEL) == 1
    assert "_gla_warp_cumsum(b_g" in fwd_code and "_gla_warp_cumsum(b_g" in bwd_code
    assert_loop_exact(x, o, ht, reverse=reverse)


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("local", [False, True], ids=["scan", "local"])
def test_nonfinite_values_propagate_like_the_loop(local, value, force_schedule):
    """A non-finite value in a compiled forward: o is non-finite from its step on in its column, as
    in the time loop, and finite (and exact) before it, in its chunk too; NaN exactly where the
    loop's is for a NaN. The fused scan redoes the poisoned program's walk and stores o again
    through the same fused epilogue (here * 2 + 1); the local schedule's carry checks each chunk."""
    force_schedule(local)
    x = _inputs(1, 100, 2, 16, 24, "vector", h0=False, requires_grad=False)
    x["v"][0, 80, 1, 5] = value  # in the second chunk of 64 steps

    @torch.compile(fullgraph=True)
    def fwd(x):
        o, ht = gla_inductor.chunk_gla(**x, output_final_state=True)
        return o * 2 + 1, ht

    (o, ht), (code,) = run_and_get_code(fwd, x)
    assert code.count(CARRY_KERNEL if local else SCAN_KERNEL) == 1 and not EXTERN_CALL.search(code)
    if not local:
        assert len(re.findall(r"def (triton_\w+)\(", code)) == 1  # the epilogue is in the template
    o64, ht64 = loop_reference(x)
    for got, want in ((o, o64 * 2 + 1), (ht, ht64)):
        bad = ~torch.isfinite(want)
        assert bad.any() and torch.equal(~torch.isfinite(got), bad)
        if value != value:
            assert torch.equal(got.isnan(), want.isnan())
        assert rel_norm_err(got[~bad], want[~bad]) < 1e-5


@pytest.mark.parametrize("gate", ["vector", "scalar", "none"])
def test_carries_in_segments(gate, monkeypatch):
    """Carries cut into segments (chosen on a GPU for long sequences with few heads; forced here):
    each carry is two launches, the segments' sums then the walk; o, the final state and the
    gradients as without segments."""
    from gla_inductor.lowerings import chunk as lowering

    def segmented(*args):
        return dataclasses.replace(kconfigs.default_config(*args), local=True, segments=2)

    monkeypatch.setattr(lowering, "default_config", segmented)
    x = _inputs(1, 150, 2, 16, 24, gate, h0=True)  # 3 chunks: segments of 2 and 1

    @torch.compile(fullgraph=True)
    def fwd(x):
        return gla_inductor.chunk_gla(**x, output_final_state=True)

    o, ht, fwd_code, bwd_code = compiled_fwd_bwd(fwd, x)
    assert not EXTERN_CALL.search(fwd_code + bwd_code)
    assert fwd_code.count(LOCAL_KERNEL) == 1 and fwd_code.count(CARRY_KERNEL) == 2
    assert bwd_code.count(CARRY_KERNEL) == 4  # the states carry and the dual one, each after its sums
    assert_loop_exact(x, o, ht)


@pytest.mark.parametrize("segments, splits", [(1, 1), (2, 1), (2, 3)])
@pytest.mark.parametrize("gate", ["scalar", "constant", "none"])
def test_carry_computing_its_terms(gate, segments, splits, monkeypatch):
    """The forward as one carry that computes its chunk terms from q, k and the gate (TERMS; forced
    here): no chunk-local kernel, the carry alone (after its segments' sums, in pieces with
    splits); a pointwise consumer fused into its store; o, the final state and the gradients (the
    fused scans' backward) exact."""
    from gla_inductor.lowerings import chunk as lowering

    def with_terms(*args):
        return dataclasses.replace(kconfigs.default_config(*args), local=False, terms=True, segments=segments,
                                   sum_splits=splits)

    monkeypatch.setattr(lowering, "default_config", with_terms)
    # 3 chunks: segments of 2 and 1; in pieces, 5 chunks: segments of 3 and 2, the second folding 3 pieces
    x = _inputs(1, 150 if splits == 1 else 300, 2, 16, 24, gate, h0=True)

    @torch.compile(fullgraph=True)
    def fwd(x):
        o, ht = gla_inductor.chunk_gla(**x, output_final_state=True)
        return o * 2 + 1, ht

    o, ht, fwd_code, bwd_code = compiled_fwd_bwd(fwd, x)
    assert not EXTERN_CALL.search(fwd_code + bwd_code)
    assert fwd_code.count(LOCAL_KERNEL) == 0 and fwd_code.count(CARRY_KERNEL) == segments
    assert fwd_code.count(SCAN_KERNEL) == 0
    o64, ht64, grads = loop_reference_grads(x, 2.0, 1.0)
    assert rel_norm_err(o, o64 * 2 + 1) < 1e-5 and rel_norm_err(ht, ht64) < 1e-5
    for name, want in grads.items():
        assert rel_norm_err(x[name].grad, want) < 1e-4, name


def test_pointwise_consumers_fuse_into_the_forward_template():
    """Output gating, a dtype cast and the transpose back to [B, T, H * V] are stored by the template
    itself: the compiled forward is one kernel."""
    B, T, H, K, V = 2, 19, 2, 16, 16
    x = _inputs(B, T, H, K, V, "vector", h0=False, requires_grad=False)
    z = torch.randn(B, T, H, V, device=DEVICE)

    def block(x, z):
        o, _ = gla_inductor.chunk_gla(**x)
        # silu's libdevice.exp does not run under the Triton interpreter (returns None), sigmoid does
        gate = F.silu(z) if ON_GPU else z * torch.sigmoid(z)
        return (o * gate).to(torch.bfloat16).reshape(B, T, H * V)

    out, (code,) = run_and_get_code(torch.compile(block, fullgraph=True), x, z)
    kernels = re.findall(r"def (triton_\w+)\(", code)
    assert len(kernels) == 1 and kernels[0].startswith("triton_tem_fused"), kernels
    assert not EXTERN_CALL.search(code)
    assert out.dtype == torch.bfloat16 and out.shape == (B, T, H * V)
    torch.testing.assert_close(out.float(), block(x, z).float(), rtol=1e-2, atol=1e-2)


def test_transposed_inputs_are_read_in_place():
    """Head-first tensors viewed as [B, T, H, D] reach the kernel through their strides: no copy."""
    B, T, H, K = 1, 12, 2, 16
    q, k, v = (torch.randn(B, H, T, K, device=DEVICE) for _ in range(3))
    g = F.logsigmoid(torch.randn(B, H, T, K, device=DEVICE))

    def head_first(q, k, v, g):
        o, _ = gla_inductor.chunk_gla(*(t.transpose(1, 2) for t in (q, k, v, g)))
        return o

    out, (code,) = run_and_get_code(torch.compile(head_first, fullgraph=True), q, k, v, g)
    kernels = re.findall(r"def (triton_\w+)\(", code)
    assert len(kernels) == 1, kernels  # no copy kernels before the template
    torch.testing.assert_close(out, head_first(q, k, v, g), rtol=1e-5, atol=1e-5)


def test_sequence_length_changes_without_recompiling():
    counters.clear()

    @torch.compile(dynamic=True, fullgraph=True)
    def fwd(q, k, v, g):
        return gla_inductor.chunk_gla(q, k, v, g)[0]

    for T in (9, 23, 40):
        x = _inputs(1, T, 2, 16, 16, "scalar", h0=False, seed=T, requires_grad=False)
        out = fwd(x["q"], x["k"], x["v"], x["g"])
        want = loop_reference(x)[0]
        assert rel_norm_err(out, want) < 1e-5, T
    assert counters["stats"]["unique_graphs"] == 1


def test_backend_naive_loop_runs_the_templates():
    """The full path: a naive loop, rewritten by the backend, lowered to our templates."""
    from spellings import SPELLINGS

    spelling = next(s for s in SPELLINGS if s.fn.__name__ == "loop_broadcast_setitem")
    args = [a.to(DEVICE) for a in spelling.make(torch.float32)]
    compiled = torch.compile(spelling.fn, backend=gla_inductor.backend, fullgraph=True)
    out, (code,) = run_and_get_code(compiled, *args)
    assert SCAN_KERNEL in code and not EXTERN_CALL.search(code)
    torch.testing.assert_close(out, spelling.fn(*args), rtol=1e-4, atol=1e-4)


def test_unsupported_inputs_lower_to_the_eager_op():
    """float64 is beyond the kernels: the graph calls the eager op (and says why in the log)."""
    x = _inputs(1, 8, 1, 16, 16, "vector", h0=False, dtype=torch.float64, requires_grad=False)
    out, (code,) = run_and_get_code(torch.compile(lambda x: gla_inductor.chunk_gla(**x)[0]), x)
    assert EXTERN_CALL.search(code) and SCAN_KERNEL not in code
    want = loop_reference(x)[0]
    assert rel_norm_err(out, want) < 1e-10


def test_switch_forces_the_eager_op():
    x = _inputs(1, 8, 1, 16, 16, "none", h0=False, requires_grad=False)
    with gla_inductor.config.patch(triton_kernels=False):
        _, (code,) = run_and_get_code(torch.compile(lambda x: gla_inductor.chunk_gla(**x)[0]), x)
    assert EXTERN_CALL.search(code) and SCAN_KERNEL not in code


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs and benchmarking autotuning need a GPU")
@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_compile_modes(mode):
    """CUDA graphs replay with new input values; autotuning picks among several template configs.
    The naive loop goes through our backend, with the mode."""
    from spellings import SPELLINGS

    spelling = next(s for s in SPELLINGS if s.fn.__name__ == "loop_broadcast_setitem")
    compiled = torch.compile(spelling.fn, backend=gla_inductor.backend, mode=mode, fullgraph=True)
    for seed in range(3):  # warm-up, recording, replay
        torch.manual_seed(seed)
        args = [a.to(DEVICE).requires_grad_() for a in spelling.make(torch.float32)]
        out = compiled(*args)
        out.sum().backward()
        ref_args = [a.detach().double().requires_grad_() for a in args]
        ref = spelling.fn(*ref_args)
        ref.sum().backward()
        assert rel_norm_err(out, ref) < 1e-4, seed
        for a, r in zip(args, ref_args):
            assert rel_norm_err(a.grad, r.grad) < 1e-4, seed


@pytest.mark.parametrize("gate_fn", ["logsigmoid", "softplus"])
def test_fused_gate_is_computed_by_the_templates(gate_fn):
    """The backend fuses the gate function into the op (recognize/gate.py): the compiled forward is
    the scan template alone, reading x (no kernel computes the gate first), and the backward's
    templates read x too. Outputs and the gradients of x, a and bias match float64."""
    B, T, H, K, V = 2, 21, 2, 16, 24
    x = _inputs(B, T, H, K, V, "vector", h0=False)
    gen = torch.Generator().manual_seed(5)
    xg = torch.randn(B, T, H, K, generator=gen).mul(2).to(DEVICE).requires_grad_()
    A_log = torch.randn(H, generator=gen).to(DEVICE).requires_grad_()
    dt_bias = torch.randn(H, K, generator=gen).to(DEVICE).requires_grad_()

    def gla(q, k, v, xg, A_log, dt_bias):
        if gate_fn == "logsigmoid":
            g = (F.logsigmoid(xg) / 16).clamp_min(-0.5)
        else:
            g = -A_log.exp()[:, None] * F.softplus(xg + dt_bias)
        return gla_inductor.chunk_gla(q, k, v, g)[0]

    args = [x["q"], x["k"], x["v"], xg, A_log, dt_bias]
    compiled = torch.compile(gla, backend=gla_inductor.backend, fullgraph=True)
    counters.clear()

    def fwd_bwd():
        out = compiled(*args)
        out.double().square().sum().backward()
        return out

    out, (fwd_code, bwd_code) = run_and_get_code(fwd_bwd)
    assert counters["gla_inductor"]["fused_gates"] == 1
    kernels = re.findall(r"def (triton_\w+)\(", fwd_code)
    others = [k for k in kernels if not k.startswith("triton_tem")]
    assert len(kernels) - len(others) == 1
    # beside the template, only a = -exp(A_log) of the softplus gate, [H]: no kernel computes the gate
    assert others == ([] if gate_fn == "logsigmoid" else ["triton_poi_fused_exp_neg_unsqueeze_0"]), kernels
    assert not EXTERN_CALL.search(fwd_code + bwd_code)
    assert bwd_code.count(SCAN_KERNEL) == 2 and bwd_code.count(DQKG_KERNEL) == 1
    if gate_fn == "logsigmoid":  # x's gradient comes from the dq/dk/dg template (GateFn.input_grad)
        bwd_kernels = re.findall(r"def (triton_\w+)\(", bwd_code)
        assert all(k.startswith("triton_tem") for k in bwd_kernels), bwd_kernels

    ref_args = [a.detach().double().requires_grad_() for a in args]
    g64 = ((F.logsigmoid(ref_args[3]) / 16).clamp_min(-0.5) if gate_fn == "logsigmoid"
           else -ref_args[4].exp()[:, None] * F.softplus(ref_args[3] + ref_args[5]))
    ref = naive_recurrent_gla(*ref_args[:3], g64)[0]
    ref.square().sum().backward()
    assert rel_norm_err(out, ref) < 1e-5
    used = [0, 1, 2, 3] + ([4, 5] if gate_fn == "softplus" else [])
    for i in used:
        assert rel_norm_err(args[i].grad, ref_args[i].grad) < 1e-4, i
