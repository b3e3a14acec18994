"""The Inductor lowering of the decode op (``gla_inductor.lowerings.recurrent``): compiled graphs
run ``gla_inductor::fused_recurrent`` as the recurrent template or as decomposed IR, with no extern
call of the eager op, and update the caller's state (or pool slots) in place.

The template runs as Inductor-generated Triton: on CUDA with a GPU, else on CPU tensors under the
Triton interpreter (conftest's ``inductor_triton``). The decomposition runs as Inductor's C++ on CPU.
Every result is checked against the float64 time loop.
"""

import logging
import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from gla_inductor import config
from gla_inductor.kernels.recurrent import RecurrentConfig
from gla_inductor.lowerings import recurrent as lrecurrent

from helpers import GATES, assert_rel_close, gla_inputs, loop_reference, placed

triton = pytest.importorskip("triton")
ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
INTERPRETED = type(triton.language.cumsum).__name__ == "InterpretedFunction"
needs_decomposition = pytest.mark.skipif(not lrecurrent._ORDERS_INPUT_MUTATION,
                                         reason="the decomposition needs torch >= 2.13 (it falls back there)")
needs_triton = pytest.mark.skipif(not (ON_GPU or INTERPRETED), reason="needs a GPU or TRITON_INTERPRET=1")

# how the output code calls the eager op (a fallback), as opposed to comments that name it
EXTERN_CALL = re.compile(r"^\s*[\w, ]+ = torch\.ops\.gla_inductor\.fused_recurrent\.default\(|"
                         r"^\s*torch\.ops\.gla_inductor\.fused_recurrent\.default\(", re.MULTILINE)
TEMPLATE_KERNEL = "GLA fused recurrence"  # a comment the template leaves in its kernel's source
SCALE = 0.3
TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 1e-2}


@pytest.fixture
def triton_inductor(inductor_triton):
    """Inductor generates Triton for the test's device (the interpreter on CPU)."""
    yield
    torch._dynamo.reset()


@pytest.fixture
def cpp_inductor():
    """Inductor's own CPU backend (C++), with fresh caches."""
    import torch._inductor.config as ic

    torch._dynamo.reset()
    with ic.patch(fx_graph_cache=False, force_disable_caches=True):
        yield
    torch._dynamo.reset()


def _inputs(gate, B=2, T=1, H=4, G=None, K=8, V=12, dtype=torch.float32, device=DEVICE, seed=0):
    x = placed(gla_inputs(gate, B, T, H, K, V, G=G, dtype=dtype, seed=seed), device)
    return x["q"], x["k"], x["v"], x["g"], x["g_gamma"], x["initial_state"]


def _reference(q, k, v, g, g_gamma, state, reverse=False):
    inputs = dict(q=q, k=k, v=v, g=g, g_gamma=g_gamma, initial_state=state)
    return loop_reference(inputs, scale=SCALE, reverse=reverse)


def _wrapper(code: str) -> str:
    """The output code's host function (the kernels' sources and comments left out)."""
    return code[code.index("def call("):code.index("def get_args(")]


def _compiled_step(reverse=False, transpose_state=False):
    def step(q, k, v, g, g_gamma, x):
        state = x.transpose(-1, -2) if transpose_state else x
        return torch.ops.gla_inductor.fused_recurrent(q, k, v, g, g_gamma, state, SCALE, reverse) * 2

    return torch.compile(step, backend="inductor", fullgraph=True)


def _run_twice(mode, gate, *, reverse=False, transpose_state=False, **sizes):
    """Two compiled calls, each checked against float64; returns the first call's code."""
    q, k, v, g, g_gamma, h0 = _inputs(gate, **sizes)
    x = h0.transpose(-1, -2).contiguous() if transpose_state else h0.clone()
    as_state = (lambda t: t.transpose(-1, -2)) if transpose_state else (lambda t: t)
    address = x.data_ptr()
    with config.patch(decode_lowering=mode):
        compiled = _compiled_step(reverse, transpose_state)
        ref_o, ref_ht = _reference(q, k, v, g, g_gamma, h0, reverse)
        out, (code, *_) = run_and_get_code(compiled, q, k, v, g, g_gamma, x)
        tol = TOL[q.dtype]
        assert_rel_close("o", out / 2, ref_o, tol)
        assert_rel_close("state", as_state(x), ref_ht, tol)
        # a second step continues from the updated state, as a decoding loop does
        ref_o2, ref_ht2 = _reference(q, k, v, g, g_gamma, ref_ht, reverse)
        assert_rel_close("o (second call)", compiled(q, k, v, g, g_gamma, x) / 2, ref_o2, tol)
        assert_rel_close("state (second call)", as_state(x), ref_ht2, tol)
    assert x.data_ptr() == address
    return code


# ----------------------------------------------------------------------------------------------
# the template (Triton)
# ----------------------------------------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("T", [1, 3])
def test_template_updates_the_state_in_place(triton_inductor, gate, T):
    code = _run_twice("template", gate, T=T, reverse=T == 3 and gate == "scalar")
    assert TEMPLATE_KERNEL in code and not EXTERN_CALL.search(code), code
    host = _wrapper(code)  # one launch; the kernel writes the caller's state, no copy of it
    assert host.count(".run(") == 1 and "copy_" not in host and "clone" not in host, host


@needs_triton
def test_template_auto_grouped_heads_and_transposed_state(triton_inductor):
    """auto takes the template where Inductor generates Triton; q, k with 2 heads for v's 4."""
    code = _run_twice("auto", "vector", T=2, G=2, transpose_state=True)
    assert TEMPLATE_KERNEL in code and not EXTERN_CALL.search(code), code


@needs_triton
def test_template_bf16_inputs_and_state(triton_inductor):
    q, k, v, g, _, h0 = _inputs("vector", T=2, dtype=torch.bfloat16)
    x = h0.clone()
    with config.patch(decode_lowering="template"):
        out, (code, *_) = run_and_get_code(_compiled_step(), q, k, v, g, None, x)
    ref_o, ref_ht = _reference(q, k, v, g, None, h0)
    assert out.dtype == torch.bfloat16 and x.dtype == torch.bfloat16
    assert_rel_close("o", out / 2, ref_o, TOL[torch.bfloat16])
    assert_rel_close("state", x, ref_ht, TOL[torch.bfloat16])
    assert TEMPLATE_KERNEL in code and not EXTERN_CALL.search(code), code


@needs_triton
@needs_decomposition
def test_float64_takes_the_decomposition_under_auto(triton_inductor):
    """The kernel has no fp64: auto decomposes (Triton pointwise and reduction kernels). No gate:
    the interpreter cannot run libdevice's fp64 exp."""
    code = _run_twice("auto", "none", T=2, dtype=torch.float64)
    assert TEMPLATE_KERNEL not in code and not EXTERN_CALL.search(code), code


# ----------------------------------------------------------------------------------------------
# the decomposition (Inductor's C++ on CPU)
# ----------------------------------------------------------------------------------------------


@needs_decomposition
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("T", [1, 4])
def test_decomposition_in_cpp(cpp_inductor, gate, T):
    code = _run_twice("auto", gate, T=T, reverse=gate == "vector" and T == 4, device="cpu")
    assert not EXTERN_CALL.search(code) and "cpp_fused" in code, code


@needs_decomposition
def test_decomposition_grouped_transposed_float64(cpp_inductor):
    code = _run_twice("decompose", "scalar", T=2, G=1, transpose_state=True, dtype=torch.float64, device="cpu")
    assert not EXTERN_CALL.search(code), code


@needs_decomposition
def test_extern_and_fallbacks_are_logged(cpp_inductor, caplog):
    """extern: the eager op; past DECOMPOSE_MAX_T steps auto falls back to it with the reason."""
    code = _run_twice("extern", "vector", T=2, device="cpu")
    assert EXTERN_CALL.search(code), code
    torch._dynamo.reset()
    lrecurrent._note_fallback.cache_clear()
    with caplog.at_level(logging.INFO, logger="gla_inductor"):
        code = _run_twice("auto", "vector", T=lrecurrent.DECOMPOSE_MAX_T + 1, device="cpu")
    assert EXTERN_CALL.search(code), code
    assert any("fused_recurrent lowers to an extern call" in r.message and "T = 9" in r.message
               for r in caplog.records), caplog.text


def test_torch_without_input_mutation_order_falls_back(cpp_inductor, caplog, monkeypatch):
    """Where Inductor does not order the state's copy after the output's read (torch < 2.13),
    auto and decompose take the extern op, with the reason logged, and stay exact."""
    monkeypatch.setattr(lrecurrent, "_ORDERS_INPUT_MUTATION", False)
    lrecurrent._note_fallback.cache_clear()
    with caplog.at_level(logging.INFO, logger="gla_inductor"):
        code = _run_twice("auto", "scalar", T=1, device="cpu")
    assert EXTERN_CALL.search(code), code
    assert any("torch >= 2.13" in r.message for r in caplog.records), caplog.text


def test_unknown_mode_is_refused(cpp_inductor):
    q, k, v, g, _, h0 = _inputs("vector", device="cpu")
    with config.patch(decode_lowering="fast"), pytest.raises(Exception, match="decode_lowering is 'fast'"):
        _compiled_step()(q, k, v, g, None, h0)


# ----------------------------------------------------------------------------------------------
# state pools
# ----------------------------------------------------------------------------------------------


def _pool_case(v_first: bool, device=DEVICE):
    """Inputs of 3 sequences, one padded (-1), decoding into slots 5 and 0 of a 7-slot pool."""
    q, k, v, g, _, _ = _inputs("vector", B=3, T=1, device=device)
    gen = torch.Generator().manual_seed(3)
    pool_kv = torch.randn(7, 4, 8, 12, generator=gen).to(device)
    stored = pool_kv.transpose(-1, -2).contiguous() if v_first else pool_kv.clone()
    idx = torch.tensor([5, -1, 0], device=device)
    return q, k, v, g, stored, idx


def _check_pool(out, stored, before, q, k, v, g, idx, v_first):
    kv = (lambda t: t.transpose(-1, -2)) if v_first else (lambda t: t)
    untouched = [s for s in range(7) if s not in (5, 0)]
    assert torch.equal(stored[untouched], before[untouched])  # bit for bit
    assert torch.equal(out[1], torch.zeros_like(out[1]))  # the padded entry
    for b, slot in ((0, 5), (2, 0)):
        ref_o, ref_ht = _reference(q[b:b + 1], k[b:b + 1], v[b:b + 1], g[b:b + 1], None, kv(before)[slot:slot + 1])
        assert_rel_close(f"o[{b}]", out[b:b + 1], ref_o, TOL[torch.float32])
        assert_rel_close(f"slot {slot}", kv(stored)[slot:slot + 1], ref_ht, TOL[torch.float32])


def _pool_step(v_first):
    def step(q, k, v, g, stored, idx):
        pool = stored.transpose(-1, -2) if v_first else stored
        return torch.ops.gla_inductor.fused_recurrent(q, k, v, g, None, pool, SCALE, False, idx)

    return torch.compile(step, backend="inductor", fullgraph=True)


@needs_triton
@pytest.mark.parametrize("v_first", [False, True], ids=["kv", "vk"])
def test_template_pool_slots_in_place(triton_inductor, v_first):
    q, k, v, g, stored, idx = _pool_case(v_first)
    before = stored.clone()
    with config.patch(decode_lowering="auto"):
        out, (code, *_) = run_and_get_code(_pool_step(v_first), q, k, v, g, stored, idx)
    _check_pool(out, stored, before, q, k, v, g, idx, v_first)
    assert TEMPLATE_KERNEL in code and not EXTERN_CALL.search(code), code
    host = _wrapper(code)
    assert "copy_" not in host and "clone" not in host, host  # the pool is never copied


@needs_decomposition
def test_pool_under_decompose_falls_back_with_the_reason(cpp_inductor, caplog):
    q, k, v, g, stored, idx = _pool_case(False, "cpu")
    before = stored.clone()
    lrecurrent._note_fallback.cache_clear()
    with config.patch(decode_lowering="decompose"), caplog.at_level(logging.INFO, logger="gla_inductor"):
        out, (code, *_) = run_and_get_code(_pool_step(False), q, k, v, g, stored, idx)
    _check_pool(out, stored, before, q, k, v, g, idx, False)
    assert EXTERN_CALL.search(code), code
    assert any("a state pool (state_indices)" in r.message for r in caplog.records), caplog.text


# ----------------------------------------------------------------------------------------------
# dynamic shapes
# ----------------------------------------------------------------------------------------------


def _dynamic_batches(device, code_check):
    """Batch sizes 2, 3, 5 (Dynamo makes B symbolic from the second), then a 2-token step; each
    lowered and exact."""
    compiled = _compiled_step()
    for B, T in ((2, 1), (3, 1), (5, 1), (3, 2)):
        q, k, v, g, _, h0 = _inputs("vector", B=B, T=T, G=2, device=device)
        x = h0.clone()
        out, (code, *_) = run_and_get_code(compiled, q, k, v, g, None, x)
        ref_o, ref_ht = _reference(q, k, v, g, None, h0)
        assert_rel_close(f"o (B = {B})", out / 2, ref_o, TOL[torch.float32])
        assert_rel_close(f"state (B = {B})", x, ref_ht, TOL[torch.float32])
        assert not EXTERN_CALL.search(code) and code_check(code), code


@needs_triton
def test_template_with_a_dynamic_batch(triton_inductor):
    _dynamic_batches(DEVICE, lambda code: TEMPLATE_KERNEL in code)


@needs_decomposition
def test_decomposition_with_a_dynamic_batch(cpp_inductor):
    _dynamic_batches("cpu", lambda code: "cpp_fused" in code)


@needs_triton
def test_template_with_every_size_dynamic(triton_inductor):
    """``dynamic=True``: batch, heads and head sizes symbolic. The template specializes the head
    sizes and the group size with guards (a new head size recompiles) rather than falling back to
    the eager op; every call is lowered and exact."""
    def step(q, k, v, g, x):
        return torch.ops.gla_inductor.fused_recurrent(q, k, v, g, None, x, SCALE, False) * 2

    compiled = torch.compile(step, backend="inductor", fullgraph=True, dynamic=True)
    for B, H, G, K, V in ((2, 4, 2, 8, 12), (3, 6, 3, 8, 12), (2, 4, 2, 16, 8)):
        q, k, v, g, _, h0 = _inputs("vector", B=B, H=H, G=G, K=K, V=V)
        x = h0.clone()
        out, (code, *_) = run_and_get_code(compiled, q, k, v, g, x)
        ref_o, ref_ht = _reference(q, k, v, g, None, h0)
        assert_rel_close(f"o {B, H, K, V}", out / 2, ref_o, TOL[torch.float32])
        assert_rel_close(f"state {B, H, K, V}", x, ref_ht, TOL[torch.float32])
        assert not EXTERN_CALL.search(code) and TEMPLATE_KERNEL in code, code


@needs_triton
@pytest.mark.parametrize("v_first", [False, True], ids=["kv", "vk"])
def test_template_one_step_in_blocks(triton_inductor, v_first, monkeypatch):
    """A decode step walks the state in blocks (of keys for a K-first pool, of values for a V-first
    one; the defaults choose them on a GPU): padded entries, untouched slots and the partial blocks
    (K = 8 of 16 padded keys, V = 12 of a 16-wide tile) as with whole tiles."""
    blocks = (RecurrentConfig(block_v=16, num_warps=1, value_block=8) if v_first else
              RecurrentConfig(block_v=16, num_warps=2, num_stages=2, key_block=8))
    steps = []

    def chosen(*args):
        steps.append(args[-1])
        return blocks

    monkeypatch.setattr(lrecurrent, "default_recurrent_config", chosen)
    q, k, v, g, stored, idx = _pool_case(v_first)
    before = stored.clone()
    with config.patch(decode_lowering="template"):
        out, (code, *_) = run_and_get_code(_pool_step(v_first), q, k, v, g, stored, idx)
    _check_pool(out, stored, before, q, k, v, g, idx, v_first)
    assert steps == [1]  # asked for one step: T is 1 in the graph
    assert ("i_vb" if v_first else "i_kb") in code and not EXTERN_CALL.search(code), code
