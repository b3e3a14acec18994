"""The ops' C++ step loops on CPU (gla_inductor/impl/step_loop.py): the forward's value tiles, layouts
and threads and the backward's gradients against the float64 loop, that the ops take them on CPU,
and that they fall back to the chunked PyTorch implementation where they cannot be built.
tests/ops/test_chunk_op.py and tests/ops/test_bad_input.py run their CPU tests with both (the
``cpu_impl`` fixture)."""

import logging

import pytest
import torch

from gla_inductor import config

from gla_inductor.impl import chunked as chunked_impl, step_loop

from gla_inductor.ops import chunk as chunk_op
from gla_inductor.ops import chunk_gla

from helpers import as_float64, check_against_loop, gla_inputs, loop_reference, placed, rel_err


def make_inputs(gate, T=37, K=8, V=40, **kw):
    """chunk_gla's inputs (helpers.gla_inputs) at this module's default sizes, fp32 by default."""
    return gla_inputs(gate, T=T, K=K, V=V, **kw)


def check(x, tol=1e-5, **kw):
    """o and the final state against the float64 loop; o in v's dtype, the state in fp32."""
    o, ht = check_against_loop(x, tol, backward=False, **kw)
    assert o.dtype == x["v"].dtype and ht.dtype == torch.float32


@pytest.fixture
def threads(request):
    saved = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(saved)


@pytest.mark.parametrize("gate", ["vector", "scalar", "constant", "none"])
# 5: the rest only; 8, 24: vectors only; 32: one tile; 77 = two tiles, a vector and 5 more
@pytest.mark.parametrize("V", [5, 8, 24, 32, 77])
@pytest.mark.parametrize("reverse", [False, True], ids=["fwd", "rev"])
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
def test_step_loop_matches_the_loop(gate, V, reverse, threads):
    check(make_inputs(gate, V=V), reverse=reverse)


@pytest.mark.parametrize("gate", ["vector", "scalar"])
def test_grouped_heads(gate):
    check(make_inputs(gate, H=6, G=2, V=12))


def test_without_state_in_or_out():
    x = make_inputs("vector", with_h0=False)
    o, ht = chunk_gla(**x)
    assert ht is None and rel_err(o, loop_reference(x)[0]) <= 1e-5


def test_strided_inputs_and_scale():
    """Head-first tensors viewed as [B, T, H, D], a v whose last dimension is strided, a gate
    sliced from a wider one."""
    x = make_inputs("vector", V=20)
    x["q"], x["k"] = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (x["q"], x["k"]))
    x["v"] = x["v"].transpose(-1, -2).contiguous().transpose(-1, -2)
    x["g"] = torch.cat([x["g"], x["g"]], -1)[..., ::2]
    assert not x["q"].is_contiguous() and x["v"].stride(-1) != 1 and x["g"].stride(-1) == 2
    check(x, scale=0.3)


def test_bf16_inputs():
    check(make_inputs("vector", dtype=torch.bfloat16), tol=1e-2)


def test_long_sequence_of_strong_decay():
    x = make_inputs("vector", T=3000, K=16, V=16)
    x["g"] = x["g"] * 20
    check(x)


@pytest.fixture
def every_gate_steps_back(monkeypatch):
    """The backward's step loop for every gate kind, not only those the ops send to it."""
    monkeypatch.setattr(step_loop, "BACKWARD_GATES", ("vector", "scalar", "constant", "none"))


def check_grads(x, tol=1e-5, **kw):
    """Gradients of every input through chunk_gla against autograd through the float64 loop (and
    the final state's only where there is an initial state)."""
    check_against_loop(x, tol, output_final_state=x["initial_state"] is not None, **kw)


@pytest.mark.parametrize("gate", ["vector", "scalar", "constant", "none"])
@pytest.mark.parametrize("V", [5, 24, 77])
@pytest.mark.parametrize("reverse", [False, True], ids=["fwd", "rev"])
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.usefixtures("every_gate_steps_back")
def test_step_loop_grads_match_the_loop(gate, V, reverse, threads):
    check_grads(make_inputs(gate, V=V), reverse=reverse)


@pytest.mark.parametrize("T", [1, 8, 9, 70])  # chunks of 8 steps up to T = 80: exactly one, one more
def test_step_loop_grads_across_chunk_ends(T):
    check_grads(make_inputs("vector", T=T, V=12))


def test_expanded_initial_state_and_output_gradients():
    """Autograd hands the backward expanded (stride 0) gradients, e.g. those of a sum."""
    x = make_inputs("vector", B=1, V=3)
    x["initial_state"] = x["initial_state"][:, :, :1, :1].expand_as(x["initial_state"])
    do, dht = torch.ones(1).expand_as(x["v"]), torch.ones(1).expand_as(x["initial_state"])
    got = chunk_op._chunk_bwd_impl(*(x.get(n) for n in ("q", "k", "v", "g", "g_gamma", "initial_state")), do, dht,
                              0.5, False)
    with config.patch(cpu_kernel=False):
        want = chunk_op._chunk_bwd_impl(*(x.get(n) for n in ("q", "k", "v", "g", "g_gamma", "initial_state")),
                                   do.contiguous(), dht.contiguous(), 0.5, False)
    for a, b in zip(got, want):
        assert a.shape == b.shape and (b.numel() == 0 or rel_err(a, b.double()) <= 1e-5)
    o, ht = chunk_gla(**x, output_final_state=True)
    with config.patch(cpu_kernel=False):
        o_ref, ht_ref = chunk_gla(**x, output_final_state=True)
    assert rel_err(o, o_ref.double()) <= 1e-5 and rel_err(ht, ht_ref.double()) <= 1e-5


@pytest.mark.usefixtures("every_gate_steps_back")
def test_step_loop_grads_grouped_heads_without_state():
    check_grads(make_inputs("scalar", H=6, G=2, V=12, with_h0=False), scale=0.7)


def test_step_loop_grads_bf16():
    check_grads(make_inputs("vector", dtype=torch.bfloat16), tol=1e-2)


def test_ops_take_the_step_loop_on_cpu(monkeypatch):
    x = make_inputs("scalar")
    chunked, real, real_bwd = [], chunked_impl.forward, chunked_impl.backward

    def fwd_torch(call):
        chunked.append(call.q.dtype)
        return real(call)

    def bwd_torch(call, do, dht):
        chunked.append(("bwd", call.q.dtype))
        return real_bwd(call, do, dht)

    monkeypatch.setattr(chunked_impl, "forward", fwd_torch)
    monkeypatch.setattr(chunked_impl, "backward", bwd_torch)

    def forward_backward(inputs):
        chunk_gla(**placed(inputs, requires_grad=True))[0].sum().backward()

    forward_backward(x)
    assert chunked == [("bwd", torch.float32)]  # a scalar gate's backward: the chunked one
    chunked.clear()
    x = make_inputs("vector")
    forward_backward(x)
    assert chunked == []
    with config.patch(cpu_kernel=False):
        forward_backward(x)
    forward_backward(as_float64(x))  # fp64, the oracles' dtype: the chunked path
    assert chunked == [torch.float32, ("bwd", torch.float32), torch.float64, ("bwd", torch.float64)]


def test_compiled_once_per_cache_dir(tmp_path):
    compiler = step_loop._compiler()
    path = step_loop.compile_library(compiler, tmp_path)
    stamp = path.stat().st_mtime_ns
    assert step_loop.compile_library(compiler, tmp_path) == path and path.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left behind


def test_an_unbuildable_kernel_falls_back_with_a_warning(tmp_path, caplog, monkeypatch):
    with caplog.at_level(logging.WARNING, logger="gla_inductor"):
        assert step_loop.load("false", tmp_path) is None  # a "compiler" that always fails
        assert step_loop.load(None, tmp_path) is None
    assert "could not compile" in caplog.text and "no C++ compiler" in caplog.text
    x = make_inputs("vector")
    expected = chunk_gla(**x, output_final_state=True)
    monkeypatch.setattr(step_loop, "library", lambda: None)
    with config.patch(cpu_kernel=False):
        chunked = chunk_gla(**x, output_final_state=True)
    fallback = chunk_gla(**x, output_final_state=True)
    assert all(torch.equal(a, b) for a, b in zip(fallback, chunked))
    assert all(rel_err(a, b.double()) <= 1e-5 for a, b in zip(fallback, expected))


@pytest.mark.parametrize("bad", ["k", "g", "initial_state", "v"])
def test_direct_op_calls_with_mismatched_shapes_raise(bad):
    """The op called directly with tensors that do not fit together: an error from the chunked
    forward, never the kernel reading past a tensor's end."""
    x = make_inputs("vector", B=1, T=8, H=2, K=4, V=3)
    x[bad] = torch.randn(*x[bad].shape[:-1], x[bad].shape[-1] + 1) if bad != "v" else torch.randn(1, 8, 3, 3)
    with pytest.raises(RuntimeError):
        torch.ops.gla_inductor.chunk_fwd(x["q"], x["k"], x["v"], x["g"], None, x["initial_state"], 1.0, True, False)
