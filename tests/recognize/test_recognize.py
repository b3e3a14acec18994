"""End to end on CPU: each naive spelling compiles with the backend, is rewritten exactly as
often as expected, and matches float64 eager in value and in every gradient."""

import pytest
import torch
from torch._dynamo.utils import counters

import gla_inductor
from helpers import FP32_TOL, check_spelling, rel_err, rewrite_then_eager
from spellings import NEAR_MISSES, SPELLINGS

BF16_TOL = 1e-2

pytestmark = [pytest.mark.usefixtures("seeded_compiler"), pytest.mark.compat]


@pytest.mark.parametrize("sp", SPELLINGS, ids=lambda s: s.name)
def test_spelling_is_rewritten_and_exact(sp):
    check_spelling(sp, torch.float32, FP32_TOL)
    assert counters["gla_inductor"][f"rewrites_{sp.form}"] == 1


@pytest.mark.parametrize("name", ["loop_broadcast_setitem", "parallel_scalar_masked_fill", "loop_einsum_state"])
def test_bf16(name):
    sp = next(s for s in SPELLINGS if s.name == name)
    check_spelling(sp, torch.bfloat16, BF16_TOL)


@pytest.mark.parametrize("sp", NEAR_MISSES, ids=lambda s: s.name)
def test_near_miss_is_left_alone(sp):
    args = sp.make(torch.float32)
    out = torch.compile(sp.fn, backend=rewrite_then_eager, fullgraph=True)(*args)
    assert counters["gla_inductor"]["rewrites"] == 0
    ref = sp.fn(*[a.double() for a in args])
    assert rel_err(out, ref) <= FP32_TOL


def near_miss_reasons(fn, *args) -> list:
    """What the rewrite left alone and why (as `explain` reports it, without compiling)."""
    from gla_inductor.backend import rewrite

    reasons = []

    def capture(gm, example_inputs):
        result = rewrite(gm, example_inputs)
        assert not result.matches
        reasons.extend(n.reason for n in result.near_misses)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=capture)(*args)
    return reasons


def test_near_miss_reasons_are_reported():
    reasons = {sp.name: near_miss_reasons(sp.fn, *sp.make(torch.float32)) for sp in NEAR_MISSES}
    assert any("delta-rule" in r for r in reasons["near_delta_rule"])
    assert any("over V" in r for r in reasons["near_gate_over_v"])
    assert any("no outer product" in r for r in reasons["near_elementwise"])
    assert any("not causal" in r for r in reasons["near_non_causal"])
    assert any("not causal" in r for r in reasons["near_shifted_mask"])
    assert any("not read into an assembled output" in r for r in reasons["near_normalized"])
    assert any("time order" in r for r in reasons["near_time_reversed_output"])
    assert any("time order" in r for r in reasons["near_shuffled_stack"])
    assert any("certified" in r for r in reasons["near_ssd_segsum_shifted"])
    assert any("delta-rule" in r for r in reasons["near_chunk_loop_delta"])


def test_explain_report():
    sp = SPELLINGS[0]
    report = gla_inductor.explain(sp.fn, *sp.make(torch.float32))
    assert len(report.matches) == 1
    m = report.matches[0]
    assert (m.form, m.gate, m.layout) == ("loop", "vector", "bthk")
    assert m.shapes == {"B": 2, "T": 9, "H": 3, "K": 4, "V": 5}
    assert any("S = S * g[:, t].exp()" in line for line in m.source)
    text = str(report)
    assert "1 rewrite(s)" in text and "loop" in text and "vector" in text


def test_final_state_and_initial_state_grads():
    """loop_einsum_state returns the final state: both outputs and dh0 are checked."""
    sp = next(s for s in SPELLINGS if s.name == "loop_einsum_state")
    check_spelling(sp, torch.float32, FP32_TOL)


def test_parallel_dynamic_no_recompile():
    from torch._dynamo.testing import CompileCounterWithBackend

    sp = next(s for s in SPELLINGS if s.name == "parallel_scalar_masked_fill")
    cnt = CompileCounterWithBackend(gla_inductor.backend)
    compiled = torch.compile(sp.fn, backend=cnt, dynamic=True, fullgraph=True)
    for t in (11, 17, 24):
        q, k, v = (torch.randn(2, 3, t, d) for d in (4, 4, 5))
        g = torch.nn.functional.logsigmoid(torch.randn(2, 3, t))
        assert rel_err(compiled(q, k, v, g), sp.fn(q.double(), k.double(), v.double(), g.double())) <= FP32_TOL
    assert cnt.frame_count == 1
    assert counters["gla_inductor"]["rewrites"] == 1


def test_disable_a_form():
    sp = next(s for s in SPELLINGS if s.form == "parallel")
    with gla_inductor.config.patch(forms=("loop",)):
        torch.compile(sp.fn, backend=gla_inductor.backend)(*sp.make(torch.float32))
    assert counters["gla_inductor"]["rewrites"] == 0


def test_internal_failure_compiles_unchanged(monkeypatch):
    """An exception inside the pass is logged and the graph compiled as if it were off."""
    def boom(an):
        raise RuntimeError("injected")

    monkeypatch.setitem(gla_inductor.recognize.RECOGNIZERS, "loop", boom)
    sp = next(s for s in SPELLINGS if s.name == "parallel_scalar_masked_fill")  # small to compile
    args = sp.make(torch.float32)
    out = torch.compile(sp.fn, backend=gla_inductor.backend)(*args)
    assert counters["gla_inductor"]["failures"] == 1
    assert counters["gla_inductor"]["rewrites"] == 0
    assert rel_err(out, sp.fn(*[a.double() for a in args])) <= FP32_TOL


def test_failed_replacement_is_undone(monkeypatch):
    """A match whose emission fails is rolled back; the graph still compiles and is exact."""
    from gla_inductor.recognize.core import emit

    real = emit.Emitter.call

    def flaky(self, target, *args, **kwargs):
        if target is torch.ops.gla_inductor.chunk_fwd.default:
            raise RuntimeError("injected")
        return real(self, target, *args, **kwargs)

    monkeypatch.setattr(emit.Emitter, "call", flaky)
    sp = next(s for s in SPELLINGS if s.name == "parallel_scalar_masked_fill")  # small to compile
    args = sp.make(torch.float32)
    report = gla_inductor.explain(sp.fn, *args)
    assert not report.matches
    assert any("replacement failed" in n.reason for n in report.near_misses)
    out = torch.compile(sp.fn, backend=gla_inductor.backend)(*args)
    assert rel_err(out, sp.fn(*[a.double() for a in args])) <= FP32_TOL


def test_backend_by_name_with_mode():
    """The entry point makes backend="gla_inductor" work; mode= reaches Inductor's config."""
    from gla_inductor.backend import config_patches

    sp = SPELLINGS[0]
    args = sp.make(torch.float32)
    out = torch.compile(sp.fn, backend="gla_inductor", mode="max-autotune-no-cudagraphs")(*args)
    assert counters["gla_inductor"]["rewrites"] == 1
    assert rel_err(out, sp.fn(*[a.double() for a in args])) <= FP32_TOL
    assert config_patches(mode="max-autotune-no-cudagraphs")["max_autotune"] is True
    assert config_patches(options={"epilogue_fusion": False})["epilogue_fusion"] is False


def test_verify_mode_accepts_and_refuses(monkeypatch):
    sp = SPELLINGS[0]
    args = sp.make(torch.float32)
    with gla_inductor.config.patch(verify=True):
        torch.compile(sp.fn, backend=gla_inductor.backend)(*args)
        assert counters["gla_inductor"]["rewrites"] == 1
        # A wrong op (here: the output scaled by 2) must be refused and the original kept.
        real = torch.ops.gla_inductor.chunk_fwd.default

        def wrong(*a):
            o, ht = real(*a)
            return o * 2, ht

        from gla_inductor.recognize.core import emit

        call = emit.Emitter.call
        monkeypatch.setattr(emit.Emitter, "call", lambda self, t, *a, **k: call(self, wrong if t is real else t, *a, **k))
        torch._dynamo.reset()
        out = torch.compile(sp.fn, backend=gla_inductor.backend)(*args)
    assert counters["gla_inductor"]["verify_refused"] == 1
    assert counters["gla_inductor"]["rewrites"] == 1
    assert rel_err(out, sp.fn(*[a.double() for a in args])) <= FP32_TOL
