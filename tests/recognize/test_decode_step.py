"""One-token decode steps (and short steps from a cache): each spelling is rewritten as often
as expected, matches float64 eager in its output and in the cache it writes back, and runs
the in-place `fused_recurrent` op when nothing needs gradients, `chunk_fwd` + the user's
write-back otherwise."""

import pytest
import torch
from torch._dynamo.utils import counters

import gla_inductor
from gla_inductor.backend import rewrite
from helpers import FP32_TOL, check_spelling, outputs, rel_err
from spellings import DECODES

BY_NAME = {s.name: s for s in DECODES}

pytestmark = pytest.mark.usefixtures("one_thread", "seeded_compiler")


def run_checked(sp, args, compiled):
    """Run compiled and float64 eager on copies of the inputs; compare outputs and caches."""
    ref_args = [a.detach().double().clone() for a in args]
    refs = outputs(sp.fn(*ref_args))
    got_args = [a.clone() for a in args]
    got = outputs(compiled(*got_args))
    for o, r in zip(got, refs):
        assert rel_err(o, r) <= FP32_TOL
    if sp.cache_arg is not None:
        assert rel_err(got_args[sp.cache_arg], ref_args[sp.cache_arg]) <= FP32_TOL, "the cache written back"
    return got


def ops_in(gm) -> set:
    return {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}


def rewritten_ops(sp, args) -> set:
    graphs = []

    def capture(gm, example_inputs):
        rewrite(gm)
        graphs.append(ops_in(gm))
        return gm.forward

    torch.compile(sp.fn, backend=capture, fullgraph=True)(*[a.clone() for a in args])
    return graphs[0]


@pytest.mark.parametrize("sp", DECODES, ids=lambda s: s.name)
def test_decode_is_rewritten_and_exact(sp):
    args = sp.make(torch.float32)
    with torch.no_grad():
        run_checked(sp, args, torch.compile(sp.fn, backend=gla_inductor.backend, fullgraph=True))
    assert counters["gla_inductor"]["rewrites"] == sp.rewrites, dict(counters["gla_inductor"])
    if sp.rewrites:
        assert counters["gla_inductor"][f"rewrites_{sp.form}"] == 1


@pytest.mark.parametrize("name", ["decode_broadcast_copy", "decode_mamba2", "loop_cache_writeback"])
def test_write_back_runs_in_place_when_inference(name):
    """No gradients: one fused_recurrent on the cache, no chunk_fwd, no copy left."""
    sp = BY_NAME[name]
    ops = rewritten_ops(sp, sp.make(torch.float32))
    assert "gla_inductor.fused_recurrent.default" in ops
    assert "gla_inductor.chunk_fwd.default" not in ops


def test_write_back_with_grads_is_left_alone():
    """Inputs that require grad under grad mode: the in-place op may not run, and chunk_fwd
    would save the cache for backward, which the write-back overwrites: left alone, exact."""
    sp = BY_NAME["decode_broadcast_copy"]
    q, k, v, g, cache = sp.make(torch.float32)
    leaves = [x.requires_grad_() for x in (q, k, v)]
    report = gla_inductor.explain(sp.fn, *leaves, g, cache.clone())
    assert not report.matches
    assert any("gradients are needed" in n.reason for n in report.near_misses)
    torch._dynamo.reset()
    run_checked(sp, (*leaves, g, cache), torch.compile(sp.fn, backend=gla_inductor.backend, fullgraph=True))


def test_returned_state_trains():
    check_spelling(BY_NAME["decode_einsum_returned"], torch.float32, FP32_TOL)


def test_near_miss_reasons():
    def reasons(name):
        sp = BY_NAME[name]
        torch._dynamo.reset()
        return [n.reason for n in gla_inductor.explain(sp.fn, *sp.make(torch.float32)).near_misses]

    assert any("delta-rule" in r for r in reasons("near_decode_delta"))
    assert any("not read by a query" in r for r in reasons("near_decode_exclusive"))
    assert any("modified in place" in r for r in reasons("near_decode_reset_before_read"))


@pytest.mark.parametrize("name", ["decode_broadcast_copy", "decode_mamba2"])
def test_lowered_decode_has_no_extern_call(name):
    """Compiled with Inductor's C++ backend, the in-place decode op lowers to generated code (the
    decomposition: config.decode_lowering "auto" on CPU), no extern call of the eager op; the cache
    is written and exact (Mamba2's: B/C shared by groups of heads, a V x K state)."""
    from torch._inductor.utils import run_and_get_code

    sp = BY_NAME[name]
    args = sp.make(torch.float32)
    with torch.no_grad():
        compiled = torch.compile(sp.fn, backend=gla_inductor.backend, fullgraph=True)
        _, (code, *_) = run_and_get_code(run_checked, sp, args, compiled)
    assert counters["gla_inductor"]["rewrites"] == 1
    assert "torch.ops.gla_inductor.fused_recurrent.default(" not in code, code
