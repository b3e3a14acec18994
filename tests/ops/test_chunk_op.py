"""gla_inductor::chunk_fwd / chunk_bwd and chunk_gla against the float64 naive loop (CPU)."""

import pytest
import torch
import torch.nn.functional as F

from gla_inductor.impl import chunked as chunked_impl
from gla_inductor.kernels import chunk as kchunk, recurrent as krecurrent
from gla_inductor.ops import chunk as chunk_op
from gla_inductor.ops import chunk_gla
from gla_inductor.reference import naive_recurrent_gla

from helpers import GATES, as_float64, call, check_against_loop, forward_and_grads, gla_inputs, rel_err

pytestmark = pytest.mark.usefixtures("one_thread", "cpu_impl")


def make_inputs(gate, T=65, K=5, V=6, dtype=torch.float64, **kw):
    """chunk_gla's inputs (helpers.gla_inputs) at this module's default sizes, in float64."""
    return gla_inputs(gate, T=T, K=K, V=V, dtype=dtype, **kw)


# ----------------------------------------------------------------------------------------------
# forward
# ----------------------------------------------------------------------------------------------

# (with_h0, output_final_state, reverse)
FWD_MODES = [(False, False, False), (True, True, False), (True, True, True), (False, True, True)]


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("T", [0, 1, 63, 64, 65, 130])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)], ids=["fp64", "fp32"])
@pytest.mark.parametrize("mode", FWD_MODES, ids=lambda m: "h0{}-ht{}-rev{}".format(*map(int, m)))
def test_forward_matches_naive(gate, T, dtype, tol, mode):
    with_h0, output_final_state, reverse = mode
    inputs = make_inputs(gate, T=T, dtype=dtype, with_h0=with_h0)
    kw = dict(output_final_state=output_final_state, reverse=reverse)
    o, ht = call(chunk_gla, inputs, **kw)
    o_ref, ht_ref = call(naive_recurrent_gla, as_float64(inputs), **kw)
    assert o.shape == o_ref.shape and o.dtype == dtype
    assert rel_err(o, o_ref) <= tol
    if output_final_state:
        assert ht.shape == ht_ref.shape and rel_err(ht, ht_ref) <= tol
    else:
        assert ht is None


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("K,V", [(5, 12), (96, 5), (12, 96)])
def test_forward_odd_head_dims(gate, K, V):
    inputs = make_inputs(gate, T=70, H=1, K=K, V=V, dtype=torch.float32)
    o, ht = call(chunk_gla, inputs, output_final_state=True)
    o_ref, ht_ref = call(naive_recurrent_gla, as_float64(inputs), output_final_state=True)
    assert rel_err(o, o_ref) <= 1e-5 and rel_err(ht, ht_ref) <= 1e-5


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("reverse", [False, True])
def test_forward_bf16(gate, reverse):
    inputs = make_inputs(gate, T=100, dtype=torch.bfloat16)
    o, ht = call(chunk_gla, inputs, output_final_state=True, reverse=reverse)
    o_ref, ht_ref = call(naive_recurrent_gla, as_float64(inputs), output_final_state=True, reverse=reverse)
    assert o.dtype == torch.bfloat16 and ht.dtype == torch.float32
    assert rel_err(o, o_ref) <= 1e-2 and rel_err(ht, ht_ref) <= 1e-2


def test_output_dtypes_and_contiguity():
    inputs = make_inputs("vector", T=10, dtype=torch.bfloat16)
    inputs["v"] = inputs["v"].float()
    # non-contiguous q: the op must not assume a layout
    inputs["q"] = inputs["q"].transpose(1, 2).contiguous().transpose(1, 2)
    o, ht = call(chunk_gla, inputs, output_final_state=True)
    assert o.dtype == torch.float32 and o.is_contiguous()
    assert ht.dtype == torch.float32 and ht.is_contiguous()
    o_ref, _ = call(naive_recurrent_gla, as_float64(inputs))
    assert rel_err(o, o_ref) <= 1e-5

    raw = torch.ops.gla_inductor.chunk_fwd(*make_inputs("none", T=3).values(), 1.0, False, False)
    assert raw[1].shape == (0,)


def test_outputs_contiguous_for_strided_state():
    # T = 0 passes the state straight through; the outputs must still be fresh and contiguous
    inputs = make_inputs("vector", T=0, K=4, V=3)
    inputs["initial_state"] = inputs["initial_state"].transpose(-1, -2).contiguous().transpose(-1, -2)
    dht = torch.randn(2, 2, 3, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64).transpose(-1, -2)
    _, ht = torch.ops.gla_inductor.chunk_fwd(*inputs.values(), 1.0, True, False)
    do = torch.zeros(2, 0, 2, 3, dtype=torch.float64)
    grads = torch.ops.gla_inductor.chunk_bwd(*inputs.values(), do, dht, 1.0, False)
    assert ht.is_contiguous() and all(x.is_contiguous() for x in grads)
    torch.testing.assert_close(ht, inputs["initial_state"])
    torch.testing.assert_close(grads[5], dht)


# ----------------------------------------------------------------------------------------------
# backward
# ----------------------------------------------------------------------------------------------


def check_grads(inputs, tol, **kw):
    """o, the final state and every gradient against the float64 loop (helpers.check_against_loop)."""
    check_against_loop(inputs, tol, **kw)


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("T", [1, 65, 128, 130])
@pytest.mark.parametrize("reverse", [False, True])
def test_grads_match_naive(gate, T, reverse):
    # T = 128 forwards: q, k and exp(g) of a vector gate are read through strided views of the
    # inputs; otherwise (padding, reverse) from chunked copies
    check_grads(make_inputs(gate, T=T), 1e-10, reverse=reverse)


@pytest.mark.parametrize("gate", ["vector", "scalar"])
@pytest.mark.parametrize("T", [128, 100])
def test_non_contiguous_inputs(gate, T):
    # inputs laid out [B, H, T, D] and transposed: the strided chunk views must follow any strides
    inputs = make_inputs(gate, T=T)
    for name in ("q", "k", "v", "g"):
        x = inputs[name]
        if x is not None:
            inputs[name] = x.transpose(1, 2).contiguous().transpose(1, 2)
    check_grads(inputs, 1e-10)


@pytest.mark.parametrize("gate", ["scalar", "vector"])
def test_grads_without_state_io(gate):
    # no initial state, no final state: dht is None inside the backward
    check_grads(make_inputs(gate, T=70, with_h0=False), 1e-10, output_final_state=False)


@pytest.mark.parametrize("gate", GATES)
def test_grads_fp32(gate):
    check_grads(make_inputs(gate, T=130, dtype=torch.float32), 1e-5)


def test_grads_bf16_dtypes():
    inputs = make_inputs("vector", T=20, dtype=torch.bfloat16)
    _, _, grads = forward_and_grads(chunk_gla, inputs)
    assert all(grads[n].dtype == torch.bfloat16 for n in grads)


def test_empty_sequence_grads():
    # T = 0: the final state is the initial state, so dh0 = dht and nothing else has gradient entries
    inputs = make_inputs("vector", T=0)
    check_grads(inputs, 1e-12)


def test_empty_batch():
    inputs = make_inputs("vector", B=0, T=70)
    o, ht, grads = forward_and_grads(chunk_gla, inputs)
    assert o.shape == (0, 70, 2, 6) and ht.shape == (0, 2, 5, 6)
    assert all(grads[n].shape == inputs[n].shape for n in grads)


# ----------------------------------------------------------------------------------------------
# numerical stability
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gate", ["scalar", "vector", "constant"])
def test_strong_decay_long_sequence(gate):
    # log-gates down to -20 per step: chunk-wide cumulative gates reach ~ -1000, and G_i - G_j over
    # the whole sequence would be ~ -40000; nothing may overflow or lose the well-scaled terms
    inputs = make_inputs(gate, B=1, T=4096, H=1, K=4, V=4, dtype=torch.float32, with_h0=True,
                         g_fn=lambda shape, gen: -20 * torch.rand(shape, generator=gen, dtype=torch.float64))
    check_grads(inputs, 1e-5)


@pytest.mark.parametrize("gate", ["scalar", "vector", "constant"])
def test_positive_log_gates(gate):
    inputs = make_inputs(gate, B=1, T=200, H=2, K=4, V=4, dtype=torch.float32,
                         g_fn=lambda shape, gen: torch.full(shape, 0.05, dtype=torch.float64))
    check_grads(inputs, 1e-5)


@pytest.mark.parametrize("gate", ["scalar", "vector"])
@pytest.mark.parametrize("log_gate", [-20.0, -100.0])
def test_strong_decay_every_step(gate, log_gate):
    # the same hard decay at every step and key: every block prefix and suffix of the vector path
    # underflows beyond a few steps (exp(-100) is already subnormal in fp32), which may only drop
    # terms that are smaller still
    inputs = make_inputs(gate, B=1, T=200, H=2, K=8, V=4, dtype=torch.float32,
                         g_fn=lambda shape, gen: torch.full(shape, log_gate, dtype=torch.float64))
    check_grads(inputs, 1e-5)


def test_vector_gate_mixed_decay_keys():
    # half the keys forget at once, half barely: the decays of different keys must not mix
    def g_fn(shape, gen):
        g = torch.full(shape, -1e-3, dtype=torch.float64)
        g[..., ::2] = -20.0
        return g

    check_grads(make_inputs("vector", B=1, T=300, H=1, K=6, V=3, dtype=torch.float32, g_fn=g_fn), 1e-5)


@pytest.mark.parametrize("gate", ["scalar", "vector"])
def test_soft_decay_after_hard(gate):
    # 8 steps of log-gate ~ -200, then 8 of ~ -0.05, in turn: spans of soft steps that follow hard
    # ones must be summed on their own; as a difference of prefix sums that include the hard
    # steps they would carry an error of ~1e3 * eps (a mutation doing that for the block suffixes
    # fails here)
    def g_fn(shape, gen):
        soft = (torch.arange(shape[1]) - 4) % 16 >= 8
        hard = -200 * (1 + torch.rand(shape, generator=gen, dtype=torch.float64))
        return torch.where(soft.view(1, -1, *[1] * (len(shape) - 2)), hard / 4000, hard)

    check_grads(make_inputs(gate, B=1, T=256, H=2, K=4, V=4, dtype=torch.float32, g_fn=g_fn), 1e-5)


@pytest.mark.parametrize("T", [2, 3, 15, 17, 33, 100, 127, 129])
@pytest.mark.parametrize("reverse", [False, True])
def test_vector_gate_partial_blocks(T, reverse):
    # T not a multiple of the split blocks (16, 32, 64): padded steps must stay inert at every level
    check_grads(make_inputs("vector", T=T, K=3), 1e-10, reverse=reverse)


def test_split_scores_match_pairwise():
    # the vector-gate A, level by level, against the direct [BT, BT, K] definition
    torch.manual_seed(0)
    q, k = torch.randn(2, 3, chunked_impl.BT, 5, dtype=torch.float64), torch.randn(2, 3, chunked_impl.BT, 5, dtype=torch.float64)
    g = F.logsigmoid(torch.randn(2, 3, chunked_impl.BT, 5, dtype=torch.float64)) * 4
    intra = chunked_impl._intra(q, k.clone(), None, g.exp())
    gc = g.cumsum(-2)
    span = gc[..., :, None, :] - gc[..., None, :, :]  # fine in fp64 at this size
    causal = torch.ones(chunked_impl.BT, chunked_impl.BT, dtype=torch.bool).tril()[:, :, None]
    ref = (q[..., :, None, :] * k[..., None, :, :] * span.exp() * causal).sum(-1)
    torch.testing.assert_close(intra.A, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(intra.qg, q * gc.exp(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(intra.kg, k * (gc[..., -1:, :] - gc).exp(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(intra.decay, gc[..., -1:, :].exp(), rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------------------------
# op registrations
# ----------------------------------------------------------------------------------------------


def fwd_args(gate, with_h0, output_final_state, reverse, dtype=torch.float32, T=70):
    inputs = make_inputs(gate, B=1, T=T, H=2, K=4, V=3, dtype=dtype, with_h0=with_h0)
    for x in inputs.values():
        if x is not None:
            x.requires_grad_()
    return (*inputs.values(), 0.5, output_final_state, reverse)


@pytest.mark.parametrize(
    "args",
    [
        fwd_args("vector", True, True, False),
        fwd_args("none", False, False, True),
        fwd_args("scalar", True, False, False, dtype=torch.bfloat16, T=5),
        fwd_args("constant", False, True, True, dtype=torch.float64),
    ],
    ids=["vector-h0-ht", "none-rev", "scalar-bf16", "constant-fp64"],
)
def test_opcheck_chunk_fwd(args):
    torch.library.opcheck(torch.ops.gla_inductor.chunk_fwd.default, args)


@pytest.mark.parametrize("gate,with_dht", [("vector", True), ("none", False), ("constant", True)])
def test_opcheck_chunk_bwd(gate, with_dht):
    inputs = make_inputs(gate, B=1, T=70, H=2, K=4, V=3, dtype=torch.float32, with_h0=with_dht)
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(1, 70, 2, 3, generator=gen)
    dht = torch.randn(1, 2, 4, 3, generator=gen) if with_dht else None
    torch.library.opcheck(torch.ops.gla_inductor.chunk_bwd.default, (*inputs.values(), do, dht, 0.5, False))


def test_cpu_calls_never_reach_the_kernels(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("a GPU kernel launched for CPU tensors")

    for module in (kchunk, krecurrent):
        monkeypatch.setattr(module, "forward", fail)
    monkeypatch.setattr(kchunk, "backward", fail)
    check_grads(make_inputs("vector", T=3), 1e-10)


# ----------------------------------------------------------------------------------------------
# eager calls bypass torch.library's dispatch (ops.chunk._EagerChunkGLA)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("reverse", [False, True], ids=["fwd", "rev"])
def test_eager_calls_bypass_the_ops_with_the_same_results(gate, reverse, monkeypatch):
    inputs = make_inputs(gate, T=70)
    ref_inputs = {n: None if x is None else x.clone() for n, x in inputs.items()}
    o, ht, grads = forward_and_grads(chunk_gla, inputs, reverse=reverse)
    assert type(o.grad_fn).__name__ == "_EagerChunkGLABackward"
    monkeypatch.setattr(chunk_op, "_eager_fast_path", lambda tensors: False)
    o_ref, ht_ref, grads_ref = forward_and_grads(chunk_gla, ref_inputs, reverse=reverse)
    assert type(o_ref.grad_fn).__name__ != "_EagerChunkGLABackward"
    assert torch.equal(o, o_ref) and torch.equal(ht, ht_ref)
    assert grads.keys() == grads_ref.keys()
    for name, ref in grads_ref.items():
        assert torch.equal(grads[name], ref), name


def test_eager_fused_gate_grads_bypass_the_ops(monkeypatch):
    """da and dbias of a fused softplus gate come back through the bypass too."""
    inputs = make_inputs("scalar", T=70)
    H = inputs["q"].shape[2]
    gen = torch.Generator().manual_seed(1)
    gate = {"gate_fn": "softplus", "gate_a": -torch.rand(H, generator=gen, dtype=torch.float64),
            "gate_bias": torch.randn(H, generator=gen, dtype=torch.float64)}

    def run():
        leaves = {**{n: x.detach().clone().requires_grad_() for n, x in inputs.items() if x is not None},
                  **{n: x.detach().clone().requires_grad_() for n, x in gate.items() if n != "gate_fn"}}
        args = {n: leaves.get(n) for n in inputs}
        o, _ = call(chunk_gla, args, gate_fn="softplus", gate_a=leaves["gate_a"], gate_bias=leaves["gate_bias"])
        return o, torch.autograd.grad((o * o).sum(), list(leaves.values()))

    o, grads = run()
    assert type(o.grad_fn).__name__ == "_EagerChunkGLABackward"
    monkeypatch.setattr(chunk_op, "_eager_fast_path", lambda tensors: False)
    o_ref, grads_ref = run()
    assert torch.equal(o, o_ref)
    for got, ref in zip(grads, grads_ref, strict=True):
        assert torch.equal(got, ref)


def test_dispatch_modes_see_the_ops():
    """Under a dispatch mode (tracing, fake tensors, op counters) chunk_gla calls the op itself."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.funcs = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.funcs.append(str(func))
            return func(*args, **(kwargs or {}))

    inputs = make_inputs("vector", T=10, dtype=torch.float32)
    with Record() as mode:
        o, _ = call(chunk_gla, inputs)
    assert "gla_inductor.chunk_fwd.default" in mode.funcs
    torch.testing.assert_close(o, call(chunk_gla, inputs)[0], rtol=0, atol=0)


def test_eager_double_backward_is_refused():
    inputs = make_inputs("vector", T=10)
    q = inputs["q"].requires_grad_()
    o, _ = call(chunk_gla, inputs)
    do = torch.randn_like(o).requires_grad_()
    (dq,) = torch.autograd.grad(o, q, do, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        dq.sum().backward()


# ----------------------------------------------------------------------------------------------
# validation
# ----------------------------------------------------------------------------------------------


def bad(**changes):
    def build():
        inputs = make_inputs("vector", B=2, T=6, H=4, K=8, V=3, dtype=torch.float32)
        inputs.update({n: f(inputs) if callable(f) else f for n, f in changes.items()})
        return inputs

    return build


VALIDATION_CASES = {
    "q-3d": (bad(q=lambda i: i["q"][0]), ValueError, r"q has shape \(6, 4, 8\); expected q to be 4-D"),
    "k-shape": (bad(k=lambda i: i["k"][:, :5]), ValueError,
                r"k has shape \(2, 5, 4, 8\) but q has shape \(2, 6, 4, 8\); expected k to be "
                r"\[B, T, H, K\] = \[2, 6, 4, 8\]"),
    "v-shape": (bad(v=lambda i: i["v"][:, :, :3]), ValueError,
                r"expected v to be \[B, T, H, V\] = \[2, 6, 4, V\]"),
    "g-vector": (bad(g=lambda i: i["g"][..., :7]), ValueError,
                 r"expected g to be \[B, T, H, K\] = \[2, 6, 4, 8\]"),
    "g-scalar": (bad(g=torch.zeros(2, 6, 3)), ValueError, r"expected g to be \[B, T, H\] = \[2, 6, 4\]"),
    "g_gamma": (bad(g=None, g_gamma=torch.zeros(3)), ValueError, r"expected g_gamma to be \[H\] = \[4\]"),
    "both-gates": (bad(g_gamma=torch.zeros(4)), ValueError, r"both g and g_gamma"),
    "h0": (bad(initial_state=torch.zeros(2, 4, 3, 8)), ValueError,
           r"expected initial_state to be \[B, H, K, V\] = \[2, 4, 8, 3\]"),
    "dtype": (bad(k=lambda i: i["k"].long()), TypeError, r"k has dtype torch.int64; expected float16"),
    "not-tensor": (bad(v=[1.0]), TypeError, r"v must be a torch.Tensor, got list"),
    "device": (bad(initial_state=torch.zeros(2, 4, 8, 3, device="meta")), ValueError,
               r"initial_state is on meta but q is on cpu"),
}


@pytest.mark.parametrize("case", VALIDATION_CASES, ids=list(VALIDATION_CASES))
def test_validation_errors(case):
    build, error, match = VALIDATION_CASES[case]
    with pytest.raises(error, match=match):
        call(chunk_gla, build())


# ----------------------------------------------------------------------------------------------
# torch.compile
# ----------------------------------------------------------------------------------------------


def compiled_chunk_gla(backend, gate_kw, **compile_kw):
    torch._dynamo.reset()

    def fn(q, k, v, g, initial_state):
        return chunk_gla(q, k, v, g, **gate_kw, initial_state=initial_state, output_final_state=True)

    compiled = torch.compile(fn, fullgraph=True, backend=backend, **compile_kw)
    return lambda q, k, v, g, **kw: compiled(q, k, v, g, kw["initial_state"])


@pytest.mark.parametrize("gate", ["vector", "constant"])
@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_fullgraph_aot_eager(gate, dynamic):
    inputs = make_inputs(gate, T=70, dtype=torch.float32)
    gate_kw = {"g_gamma": inputs.pop("g_gamma")} if gate == "constant" else {}
    inputs.pop("g_gamma", None)
    compiled = compiled_chunk_gla("aot_eager", gate_kw, dynamic=dynamic)
    eager_inputs = {n: None if x is None else x.clone() for n, x in inputs.items()}
    o, ht, grads = forward_and_grads(compiled, inputs)
    o_ref, ht_ref, grads_ref = forward_and_grads(
        lambda *args, **kw: chunk_gla(*args, **gate_kw, **kw), eager_inputs
    )
    torch.testing.assert_close(o, o_ref)
    torch.testing.assert_close(ht, ht_ref)
    for name in grads_ref:
        torch.testing.assert_close(grads[name], grads_ref[name], msg=name)


def test_compile_graphs_hold_opaque_ops():
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    codes = {}

    def capture(kind):
        def compiler(gm, example_inputs):
            codes[kind] = gm.code
            return make_boxed_func(gm.forward)

        return compiler

    backend = aot_autograd(fw_compiler=capture("fw"), bw_compiler=capture("bw"))
    inputs = make_inputs("vector", T=70, dtype=torch.float32)
    inputs.pop("g_gamma")
    forward_and_grads(compiled_chunk_gla(backend, {}), inputs)
    assert "gla_inductor.chunk_fwd" in codes["fw"] and "chunk_bwd" not in codes["fw"]
    assert "gla_inductor.chunk_bwd" in codes["bw"] and "chunk_fwd" not in codes["bw"]
