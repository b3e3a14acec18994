"""Packed variable-length sequences (``cu_seqlens``) through the public ``chunk_gla`` and the ops on
CPU: the step loop and the chunked PyTorch implementation against each sequence run alone through
the float64 time loop (values, final states, every gradient), the op arguments and fake shapes,
``torch.compile(fullgraph=True)``, and the validation errors. The Triton kernels' varlen paths are
tested in tests/kernels/test_varlen_kernels.py."""

import pytest
import torch
from torch._dynamo.utils import counters

import gla_inductor
from gla_inductor.contract import GLACall
from gla_inductor.gates import GateFn
from gla_inductor.ops import dispatch
from varlen_packing import (C as C_EDGE, EDGE_LENGTHS, assert_matches, assert_prefix_states, make, offsets,
                            random_lengths, reference, rel_err)

pytestmark = pytest.mark.usefixtures("one_thread")

GATES = ("vector", "scalar", "constant", "none")


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("gate", GATES)
def test_packed_matches_each_sequence_alone(cpu_impl, gate, reverse):
    p = make(random_lengths(seed=len(gate) + reverse), gate=gate, reverse=reverse)
    o, ht = p.run(gla_inductor.chunk_gla)
    assert_matches(p, o, ht, tol=1e-5)


def test_float64_is_exact(cpu_impl):
    p = make(random_lengths(seed=7), gate="vector", dtype=torch.float64, reverse=True)
    o, ht = p.run(gla_inductor.chunk_gla)
    assert o.dtype == ht.dtype == torch.float64
    assert_matches(p, o, ht, tol=1e-12)


@pytest.mark.parametrize("gate", ["vector", "scalar"])
def test_grouped_heads(cpu_impl, gate):
    p = make(random_lengths(seed=3), gate=gate, H=4, G=2)
    o, ht = p.run(gla_inductor.chunk_gla)
    assert p.q.shape[2] == 2 and o.shape[2] == 4
    assert_matches(p, o, ht, tol=1e-5)


@pytest.mark.parametrize("gate_fn,gate", [("logsigmoid", "vector"), ("softplus", "scalar"), ("softplus", "vector")])
def test_fused_gates(cpu_impl, gate_fn, gate):
    p = make(random_lengths(seed=5), gate=gate, gate_fn=gate_fn, reverse=gate == "scalar")
    o, ht = p.run(gla_inductor.chunk_gla)
    assert {"gate_a", "gate_bias"} <= set(p.leaves) or gate_fn == "logsigmoid"
    assert_matches(p, o, ht, tol=1e-5)


def test_int64_offsets_without_states(cpu_impl):
    p = make([5, 0, 70], h0=False, offsets_dtype=torch.int64)
    o, ht = gla_inductor.chunk_gla(p.q, p.k, p.v, p.g, scale=p.scale, cu_seqlens=p.cu_seqlens)
    assert ht is None
    assert rel_err(o, reference(p)[0]) < 1e-5


def test_one_sequence_is_the_unpacked_call(cpu_impl):
    p = make([97], gate="scalar", reverse=True)
    o, ht = p.run(gla_inductor.chunk_gla)
    kwargs = {**p.kwargs(), "cu_seqlens": None}
    o_ref, ht_ref = gla_inductor.chunk_gla(p.q, p.k, p.v, p.g, **kwargs)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=0)
    torch.testing.assert_close(ht, ht_ref, rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore::gla_inductor.LayoutWarning")  # T = 0 < H: no layout to guess
def test_empty_sequences_pass_their_state_through(cpu_impl):
    p = make([0, 0], gate="vector")
    o, ht = p.run(gla_inductor.chunk_gla)
    assert o.shape == (1, 0, 2, 8)
    torch.testing.assert_close(ht, p.h0.float(), rtol=0, atol=0)
    (dh0,) = torch.autograd.grad(ht.sum() * 2, p.h0)
    assert torch.equal(dh0, torch.full_like(dh0, 2.0))


# ----------------------------------------------------------------------------------------------
# the ops' arguments, fake shapes, dispatch
# ----------------------------------------------------------------------------------------------


def _call(**changes) -> GLACall:
    q, v = torch.randn(1, 6, 2, 4), torch.randn(1, 6, 2, 4)
    return GLACall(q, q, v, **changes)


def test_op_arguments_without_offsets_are_unchanged():
    # graphs print these calls: 9 arguments, 15 with a fused gate, as before cu_seqlens existed
    fused = _call(gate=GateFn("logsigmoid"), g=torch.randn(1, 6, 2))
    assert len(_call().op_args()) == 9 and len(_call().op_args(full=True)) == 15
    assert len(fused.op_args()) == 15 and len(fused.bwd_op_args(None, None)) == 16
    assert len(_call().bwd_op_args(None, None)) == 10


def test_op_arguments_with_offsets_are_complete():
    cu = offsets([2, 4])
    args = _call(cu_seqlens=cu).op_args()
    assert len(args) == 16 and args[-1] is cu and args[9] == ""
    assert _call(cu_seqlens=cu).bwd_op_args(None, None)[-1] is cu
    assert GLACall.from_op_args(args).cu_seqlens is cu


def test_fake_shapes_follow_the_sequences():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, v = torch.empty(1, 10, 2, 4), torch.empty(1, 10, 2, 6)
        h0, cu = torch.empty(3, 2, 4, 6), torch.empty(4, dtype=torch.int32)
        o, ht = torch.ops.gla_inductor.chunk_fwd(q, q, v, None, None, h0, 0.5, True, False, cu_seqlens=cu)
        grads = torch.ops.gla_inductor.chunk_bwd(q, q, v, None, None, h0, o, ht, 0.5, False, cu_seqlens=cu)
    assert o.shape == (1, 10, 2, 6) and ht.shape == (3, 2, 4, 6)
    assert grads[5].shape == (3, 2, 4, 6)


def test_short_packed_calls_do_not_take_the_recurrent_kernel():
    # the recurrent kernel runs short fixed-length calls; it does not read cu_seqlens
    call = _call(cu_seqlens=offsets([2, 4]))
    assert not dispatch.routes_to_recurrent(call)


# ----------------------------------------------------------------------------------------------
# torch.compile
# ----------------------------------------------------------------------------------------------


def test_compiled_fullgraph_matches_eager(fresh_compiler):
    p = make([3, 0, 70, 5], gate="vector", reverse=True)

    def loss(q, k, v, g, h0, cu_seqlens):
        o, ht = gla_inductor.chunk_gla(q, k, v, g, initial_state=h0, output_final_state=True, reverse=True,
                                       scale=0.3, cu_seqlens=cu_seqlens)
        return (o * 2).sum() + ht.square().sum()

    inputs = (p.q, p.k, p.v, p.g, p.h0, p.cu_seqlens)
    compiled = torch.compile(loss, fullgraph=True)
    got = compiled(*inputs)
    want = loss(*inputs)
    torch.testing.assert_close(got, want)
    for a, b in zip(torch.autograd.grad(got, inputs[:5]), torch.autograd.grad(want, inputs[:5])):
        torch.testing.assert_close(a, b)
    assert not counters["graph_break"]
    # new offsets of the same count reuse the graph, and are read, not baked in
    other = offsets([40, 30, 0, 8])
    torch.testing.assert_close(compiled(*inputs[:5], other), loss(*inputs[:5], other))
    assert counters["stats"]["unique_graphs"] == 1


# ----------------------------------------------------------------------------------------------
# prefix states
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gate", ["vector", "constant"])
def test_prefix_states_of_packed_sequences(cpu_impl, gate):
    p = make([0, 1, 16, 17, 40, 32], gate=gate)
    with torch.no_grad():
        o, ht, states = gla_inductor.chunk_gla(p.q, p.k, p.v, p.g, **p.kwargs(), output_prefix_states=True,
                                               state_interval=16)
    ref_o, ref_ht = reference(p)
    assert rel_err(o, ref_o) < 1e-5 and rel_err(ht, ref_ht) < 1e-5
    assert_prefix_states(p, states, 16, tol=1e-5)


def test_prefix_states_of_fixed_length_sequences(cpu_impl):
    p = make([40, 40], gate="scalar")
    q, k, v, g = (x.detach().view(2, 40, *x.shape[2:]) for x in (p.q, p.k, p.v, p.g))
    with torch.no_grad():
        _, _, states = gla_inductor.chunk_gla(q, k, v, g, initial_state=p.h0, scale=p.scale,
                                              output_prefix_states=True, state_interval=32)
    assert_prefix_states(p, states, 32, tol=1e-5, batched=True)


def test_prefix_states_compile_without_graph_break(fresh_compiler):
    p = make([20, 0, 33], gate="vector")
    x = [t.detach() for t in (p.q, p.k, p.v, p.g, p.h0)]

    def prefill(q, k, v, g, h0, cu_seqlens):
        return gla_inductor.chunk_gla(q, k, v, g, initial_state=h0, cu_seqlens=cu_seqlens, scale=p.scale,
                                      output_prefix_states=True, state_interval=16)[2]

    states = torch.compile(prefill, fullgraph=True)(*x, p.cu_seqlens)
    assert not counters["graph_break"]
    torch.testing.assert_close(states, prefill(*x, p.cu_seqlens))


@pytest.mark.parametrize("kwargs,message", [
    (dict(state_interval=24), "state_interval is 24; expected a power of two, at least 16"),
    (dict(state_interval=8), "state_interval is 8"),
    (dict(reverse=True), "output_prefix_states needs reverse=False"),
])
def test_prefix_state_errors(kwargs, message):
    q = torch.randn(1, 10, 2, 4)
    with pytest.raises(ValueError, match=message):
        gla_inductor.chunk_gla(q, q, q, output_prefix_states=True, **kwargs)


# ----------------------------------------------------------------------------------------------
# validation
# ----------------------------------------------------------------------------------------------


def _bad(change: str):
    q, v = torch.randn(1, 10, 2, 4), torch.randn(1, 10, 2, 4)
    kwargs = dict(initial_state=torch.zeros(2, 2, 4, 4), cu_seqlens=offsets([4, 6]))
    if change == "float offsets":
        kwargs["cu_seqlens"] = kwargs["cu_seqlens"].float()
    elif change == "2-D offsets":
        kwargs["cu_seqlens"] = kwargs["cu_seqlens"][None]
    elif change == "first offset":
        kwargs["cu_seqlens"] = torch.tensor([1, 4, 10], dtype=torch.int32)
    elif change == "decreasing":
        kwargs["cu_seqlens"] = torch.tensor([0, 6, 4, 10], dtype=torch.int32)
        kwargs["initial_state"] = torch.zeros(3, 2, 4, 4)
    elif change == "last offset":
        kwargs["cu_seqlens"] = torch.tensor([0, 4, 9], dtype=torch.int32)
    elif change == "batch":
        q, v = torch.randn(2, 10, 2, 4), torch.randn(2, 10, 2, 4)
    elif change == "state count":
        kwargs["initial_state"] = torch.zeros(3, 2, 4, 4)
    elif change == "state shape":
        kwargs["initial_state"] = torch.zeros(2, 2, 4, 5)
    return lambda: gla_inductor.chunk_gla(q, q, v, **kwargs)


@pytest.mark.parametrize("change,error,message", [
    ("float offsets", TypeError, "cu_seqlens has dtype torch.float32; expected int32 or int64"),
    ("2-D offsets", ValueError, "cu_seqlens has shape (1, 3); expected [N + 1]"),
    ("first offset", ValueError, "cu_seqlens starts at 1; the first offset must be 0"),
    ("decreasing", ValueError, "cu_seqlens decreases from 6 to 4 at entries 1 and 2"),
    ("last offset", ValueError, "cu_seqlens ends at 9 but q has T = 10 steps"),
    ("batch", ValueError, "expected q to be [1, T, H, K] = [1, T, 2, 4]"),
    ("state count", ValueError, "cu_seqlens holds N = 2 sequences; expected initial_state to be [N, H, K, V]"),
    ("state shape", ValueError, "expected initial_state to be [N, H, K, V] = [2, 2, 4, 4]"),
])
def test_validation_errors(change, error, message):
    with pytest.raises(error) as info:
        _bad(change)()
    assert message in str(info.value)


def test_offsets_are_read_once_per_tensor(monkeypatch):
    """The layers of a model pass one offsets tensor: its values are read (on a GPU: a wait for the
    device) once, and again only once it was modified."""
    from gla_inductor import contract

    reads = []
    real = contract._check_offsets
    monkeypatch.setattr(contract, "_check_offsets", lambda *a: reads.append(1) or real(*a))
    q, cu = torch.randn(1, 10, 2, 4), offsets([4, 6])
    for _ in range(3):
        gla_inductor.chunk_gla(q, q, q, cu_seqlens=cu)
    assert len(reads) == 1
    cu[1] = 12  # past the end: read again, and refused
    with pytest.raises(ValueError, match="decreases from 12 to 10"):
        gla_inductor.chunk_gla(q, q, q, cu_seqlens=cu)
    gla_inductor.chunk_gla(q, q, q, cu_seqlens=offsets([4, 6]))
    assert len(reads) == 3


@pytest.mark.parametrize("packed", [False, True], ids=["fixed", "packed"])
def test_states_v_first(cpu_impl, packed):
    """state_v_first (FLA's option): initial_state [.., V, K] read as its transpose, the final state
    returned V-first; values and the initial state's gradient as with K-first states."""
    p = make([C_EDGE + 2, 0, 7] if packed else [9], gate="vector", K=4, V=6, reverse=packed)
    cu = p.cu_seqlens if packed else None
    kwargs = dict(scale=p.scale, output_final_state=True, reverse=p.reverse, cu_seqlens=cu)
    q, k, v, g = (p.q, p.k, p.v, p.g) if packed else (x[:, : x.shape[1]] for x in (p.q, p.k, p.v, p.g))
    h0_vk = p.h0.detach().transpose(-1, -2).contiguous().requires_grad_()
    o, ht = gla_inductor.chunk_gla(q, k, v, g, initial_state=h0_vk, state_v_first=True, **kwargs)
    h0_kv = p.h0.detach().clone().requires_grad_()
    ref_o, ref_ht = gla_inductor.chunk_gla(q, k, v, g, initial_state=h0_kv, **kwargs)
    assert ht.shape == h0_vk.shape and torch.equal(o, ref_o) and torch.equal(ht, ref_ht.transpose(-1, -2))
    dht = torch.randn(ht.shape, generator=torch.Generator().manual_seed(0))
    grad_vk, = torch.autograd.grad((o.sum() + (ht * dht).sum()), [h0_vk])
    grad_kv, = torch.autograd.grad((ref_o.sum() + (ref_ht * dht.transpose(-1, -2)).sum()), [h0_kv])
    assert torch.allclose(grad_vk, grad_kv.transpose(-1, -2))
    with pytest.raises(ValueError, match=r"expected initial_state to be \[[BN], H, V, K\]"):
        gla_inductor.chunk_gla(q, k, v, g, initial_state=h0_kv.detach(), state_v_first=True, **kwargs)


def test_host_copy_of_the_offsets_is_read_instead(monkeypatch):
    """cu_seqlens_cpu (FLA's option): the values checked are the host copy's (for offsets on a GPU:
    no wait for the device), the results those of cu_seqlens; a copy of another shape, or without
    cu_seqlens, is refused."""
    from gla_inductor import contract

    read = []
    real = contract._check_offsets
    monkeypatch.setattr(contract, "_check_offsets", lambda api, offs, T: read.append(offs) or real(api, offs, T))
    q, cu = torch.randn(1, 10, 2, 4), offsets([4, 6])
    host = torch.tensor([0, 4, 10])  # int64, like FLA's
    o, _ = gla_inductor.chunk_gla(q, q, q, cu_seqlens=cu, cu_seqlens_cpu=host)
    assert read == [[0, 4, 10]] and contract._last_checked[0]() is host
    assert torch.equal(o, gla_inductor.chunk_gla(q, q, q, cu_seqlens=cu)[0])
    with pytest.raises(ValueError, match="cu_seqlens decreases from 6 to 4"):
        gla_inductor.chunk_gla(q, q, q, cu_seqlens=cu, cu_seqlens_cpu=torch.tensor([0, 6, 4]))
    with pytest.raises(ValueError, match=r"expected a CPU copy of cu_seqlens, shape \(3,\)"):
        gla_inductor.chunk_gla(q, q, q, cu_seqlens=cu, cu_seqlens_cpu=torch.tensor([0, 10]))
    with pytest.raises(ValueError, match="cu_seqlens_cpu is a host copy of cu_seqlens, which is None"):
        gla_inductor.chunk_gla(q, q, q, cu_seqlens_cpu=host)


def test_edge_lengths_are_the_chunk_edges():
    # the cases above hinge on these: a sequence ending mid-chunk, on a chunk's end, just past it
    from gla_inductor.impl import chunked

    assert EDGE_LENGTHS == (0, 1, chunked.BT - 1, chunked.BT, chunked.BT + 1)
    assert rel_err(torch.ones(3), torch.ones(3)) == 0
