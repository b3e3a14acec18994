"""Grouped heads (GQA-style; Mamba2's B and C shared by groups of heads): q, k [B, T, G, K] with
G dividing v's H heads, head h reading q/k head h // (H // G), without the repeat materialized.

Checked against autograd through the float64 time loop of ``gla_inductor.reference`` on q and k
repeated by ``repeat_interleave`` (so dq and dk are summed over each group there): the chunked
PyTorch path, the Triton kernels under the interpreter (``conftest.py`` sets TRITON_INTERPRET=1
without a GPU), the Inductor lowering, shape errors, and the recognizer passing the tensors before
the repeat to the op (the transformers Mamba2 mixer with n_groups > 1).
"""

import dataclasses
import importlib
import re

import pytest
import torch
from torch._dynamo.utils import counters

import gla_inductor
from gla_inductor.impl import chunked as chunked_impl
from gla_inductor.kernels import chunk as kchunk, configs as kconfigs
from gla_inductor.ops import dispatch
from gla_inductor.backend import rewrite
from gla_inductor.recognize.certify import certificate
from gla_inductor.reference import naive_recurrent_gla
from gla_inductor.contract import GLACall
from helpers import GATES, as_float64, gla_inputs, loop_reference_grads, placed, rel_norm_err
from spellings import chunked_hf_einsum

triton = pytest.importorskip("triton")
ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
KERNELS_RUN_HERE = ON_GPU or type(triton.language.cumsum).__name__ == "InterpretedFunction"
needs_kernels = pytest.mark.skipif(not KERNELS_RUN_HERE, reason="needs a GPU or TRITON_INTERPRET=1")

B, T, H, K, V = 1, 37, 4, 8, 8  # odd T: three 16-step chunks for the kernels, the last one partial
GROUPS = [1, 2, H]  # heads of q and k: one shared by all heads, pairs, none shared


pytestmark = pytest.mark.usefixtures("one_thread", "fresh_compiler")


def make(G: int, gate: str, seed: int = 0, requires_grad: bool = True) -> dict:
    """chunk_gla's fp32 inputs (helpers.gla_inputs) on DEVICE, leaves that require grad by default:
    q, k with G heads, the rest with H."""
    return placed(gla_inputs(gate, B, T, H, K, V, G=G, seed=seed), DEVICE, requires_grad)


def weights(seed: int = 1):
    """Random cotangents for o and the final state."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(B, T, H, V, generator=gen, dtype=torch.float64).to(DEVICE),
            torch.randn(B, H, K, V, generator=gen, dtype=torch.float64).to(DEVICE))


def reference(x: dict, reverse: bool):
    """(o, ht, grads) in float64: the time loop, which reads q and k repeated to H heads by
    repeat_interleave (helpers.loop_reference_grads), under the cotangents of weights()."""
    return loop_reference_grads(x, *weights(), reverse=reverse)


def check(x: dict, o, ht, reverse: bool, tol: float) -> None:
    """o, ht and the gradients left in x's tensors against the reference; dq, dk grouped like q, k."""
    o64, ht64, grads = reference(x, reverse)
    assert o.shape == (B, T, H, V) and rel_norm_err(o, o64) < tol and rel_norm_err(ht, ht64) < tol
    for name, want in grads.items():
        assert x[name].grad.shape == x[name].shape, name
        assert rel_norm_err(x[name].grad, want) < 10 * tol, name  # gate gradients sum cancelling terms


def run_chunk_gla(x: dict, reverse: bool):
    o, ht = gla_inductor.chunk_gla(**x, output_final_state=True, reverse=reverse)
    w, wh = weights()
    ((o.double() * w).sum() + (ht.double() * wh).sum()).backward()
    return o, ht


@pytest.fixture
def on_kernels(monkeypatch):
    """chunk_gla (ops, autograd and all) on the Triton launchers with 16-step chunks: in place of the
    ops' PyTorch forward and backward (CPU, under the interpreter) and of their CUDA dispatch. The
    fixture's value, called with split=True or local=True, picks that schedule."""
    chosen = {}

    def config(q, v, g):
        cfg = kconfigs.default_config(B, T, H, K, V, q.dtype, g is not None and g.dim() == 4, q.device)
        return dataclasses.replace(cfg, block_t=16, **chosen)

    def fwd(call):
        return kchunk.forward(call, config=config(call.q, call.v, call.g))

    def bwd(call, do, dht):
        return kchunk.backward(call, do, dht, config=config(call.q, call.v, call.g))

    monkeypatch.setattr(dispatch, "chunk_fwd", fwd)
    monkeypatch.setattr(dispatch, "chunk_bwd", bwd)
    return lambda **schedule: chosen.update(schedule)


# ---- (a) the ops: the chunked PyTorch path and the Triton kernels ----------------------------------
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("G", GROUPS)
def test_torch_path(G, gate):
    x = make(G, gate)
    reverse = gate == "scalar"
    o, ht = run_chunk_gla(x, reverse)
    check(x, o, ht, reverse, 1e-5)


@needs_kernels
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("G", GROUPS)
def test_triton_kernels(G, gate, on_kernels):
    """The fused schedule: gla_chunk_scan (forward, states, dual) and gla_chunk_bwd_dqkg."""
    x = make(G, gate)
    reverse = gate == "constant"
    o, ht = run_chunk_gla(x, reverse)
    check(x, o, ht, reverse, 1e-5)


@needs_kernels
@pytest.mark.parametrize("schedule", ["split", "local"])
def test_triton_other_schedules(schedule, on_kernels):
    """gla_chunk_output (split) and gla_chunk_local (local) read shared q and k too."""
    on_kernels(**{schedule: True})
    x = make(2, "vector")
    o, ht = run_chunk_gla(x, False)
    check(x, o, ht, False, 1e-5)


@needs_kernels
def test_recurrent_kernel():
    """The fused recurrent kernel (short sequences on CUDA) reads shared q and k as well."""
    from gla_inductor.kernels import recurrent as krecurrent

    x = make(2, "scalar", requires_grad=False)
    x = dict(x, q=x["q"][:, :5], k=x["k"][:, :5], v=x["v"][:, :5], g=x["g"][:, :5])
    ht = torch.empty(B, H, K, V, device=DEVICE)
    o = krecurrent.forward(GLACall(x["q"], x["k"], x["v"], x["g"], None, x["initial_state"], 0.3, reverse=False), ht)
    want_o, want_ht = naive_recurrent_gla(*(x[n].double() for n in ("q", "k", "v", "g")), scale=0.3,
                                          initial_state=x["initial_state"].double(), output_final_state=True)
    assert rel_norm_err(o, want_o) < 1e-5 and rel_norm_err(ht, want_ht) < 1e-5


def test_fake_shapes():
    """The ops' fake functions: o and the state per head of v, dq and dk grouped like q and k."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k = torch.empty(B, T, 2, K), torch.empty(B, T, 2, K)
        v, g = torch.empty(B, T, H, V), torch.empty(B, T, H, K)
        o, ht = torch.ops.gla_inductor.chunk_fwd(q, k, v, g, None, None, 1.0, True, False)
        grads = torch.ops.gla_inductor.chunk_bwd(q, k, v, g, None, None, o, ht, 1.0, False)
    assert o.shape == (B, T, H, V) and ht.shape == (B, H, K, V)
    assert [tuple(t.shape) for t in grads[:4]] == [(B, T, 2, K), (B, T, 2, K), (B, T, H, V), (B, T, H, K)]


# ---- (b) shapes that do not group --------------------------------------------------------------
@pytest.mark.parametrize("case, match", [
    ("G=3 of H=4", r"v has shape \(1, 37, 4, 8\) but q has shape \(1, 37, 3, 8\); expected v to be "
                   r"\[B, T, H, V\] = \[1, 37, 3, V\], or with H any multiple of q and k's 3 heads"),
    ("k has other heads", r"k has shape \(1, 37, 4, 8\) but q has shape \(1, 37, 2, 8\); expected k to be "
                          r"\[B, T, G, K\] = \[1, 37, 2, 8\]: q and k must have the same number of heads"),
    ("g has q's heads", r"expected g to be \[B, T, H, K\] = \[1, 37, 4, 8\]"),
    ("initial_state has q's heads", r"expected initial_state to be \[B, H, K, V\] = \[1, 4, 8, 8\]"),
])
def test_bad_shapes(case, match):
    x = make(2, "vector", requires_grad=False)
    if case == "G=3 of H=4":
        x["q"] = x["k"] = torch.randn(B, T, 3, K)
    elif case == "k has other heads":
        x["k"] = torch.randn(B, T, H, K)
    elif case == "g has q's heads":
        x["g"] = x["g"][:, :, :2]
    else:
        x["initial_state"] = x["initial_state"][:, :2]
    with pytest.raises(ValueError, match=match):
        gla_inductor.chunk_gla(**x)


# ---- (c) the recognizer passes the tensors before the repeat ------------------------------------------
def op_inputs(gm) -> list:
    """The shapes of q and k at every chunk_fwd node of a rewritten graph."""
    return [tuple(tuple(a.meta["example_value"].shape) for a in n.args[:2]) for n in gm.graph.nodes
            if n.target is torch.ops.gla_inductor.chunk_fwd.default]


def no_repeat_feeds(gm) -> bool:
    """No repeat_interleave or expand node is an ancestor of q or k of the op."""
    for n in gm.graph.nodes:
        if n.target is not torch.ops.gla_inductor.chunk_fwd.default:
            continue
        stack = list(n.args[:2])
        while stack:
            a = stack.pop()
            name = a.target if isinstance(a.target, str) else getattr(a.target, "__name__", "")
            if name in ("repeat_interleave", "expand"):
                return False
            stack += a.all_input_nodes
    return True


def expand_heads(x, r):
    """x [B, T, G, N] over r * G heads by expand + reshape (each group's heads in a row)."""
    b, t, g, n = x.shape
    return x[:, :, :, None, :].expand(b, t, g, r, n).reshape(b, t, g * r, n)


def ssd_expanded(x, dt, A, Bg, Cg, h0):
    """The transformers scan with B and C repeated over the heads by expand + reshape first."""
    r = x.shape[2] // Bg.shape[2]
    return chunked_hf_einsum(x, dt, A, expand_heads(Bg, r), expand_heads(Cg, r), h0)


@pytest.mark.parametrize("fn", [chunked_hf_einsum, ssd_expanded], ids=["repeat_interleave", "expand_reshape"])
def test_recognizer_passes_shared_q_and_k(fn):
    """transformers' chunked scan with 2 groups of 3 heads: the op reads [B, T, 2, N] q and k."""
    b, t, h, groups, n, p = 2, 9, 6, 2, 3, 5
    args = (torch.randn(b, t, h, p), torch.randn(b, t, h), -torch.rand(h), torch.randn(b, t, groups, n),
            torch.randn(b, t, groups, n), torch.randn(b, h, p, n))
    graphs = []

    def backend(gm, example_inputs):
        rewrite(gm, example_inputs)
        graphs.append(gm)
        return gm.forward

    got = torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)(*args)
    want = fn(*[a.double() for a in args])
    assert counters["gla_inductor"]["rewrites"] == 1
    assert op_inputs(graphs[0]) == [((b, 12, groups, n), (b, 12, groups, n))]  # T padded to 3 chunks of 4
    assert no_repeat_feeds(graphs[0])
    for g, w in zip(got, want):
        assert rel_norm_err(g, w) < 1e-5


def test_certificate_runs_grouped_reference():
    """The certificate's float64 reference (the naive loop) takes grouped q and k itself."""
    x = as_float64(make(2, "vector"))
    o, ht = certificate.reference_op(x["q"], x["k"], x["v"], x["g"], None, x["initial_state"], 0.5, True, False)
    rep = {n: x[n].repeat_interleave(2, dim=2) for n in ("q", "k")}
    o2, ht2 = naive_recurrent_gla(rep["q"], rep["k"], x["v"], x["g"], scale=0.5, initial_state=x["initial_state"],
                                  output_final_state=True)
    assert torch.equal(o, o2) and torch.equal(ht, ht2)


def mamba2_mixer():
    transformers = pytest.importorskip("transformers")
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer

    cfg = transformers.Mamba2Config(hidden_size=64, num_heads=8, head_dim=16, expand=2, state_size=16,
                                    n_groups=2, chunk_size=16, conv_kernel=4, num_hidden_layers=1)
    torch.manual_seed(0)
    return Mamba2Mixer(cfg, layer_idx=0), torch.randn(2, 40, 64)


def test_mamba2_mixer_with_groups():
    """transformers' Mamba2Mixer with n_groups = 2 for 8 heads, compiled with the backend: one
    rewrite, whose op reads C and B with their 2 heads (no repeat feeds it); output as eager's."""
    mixer, x = mamba2_mixer()
    graphs = []
    backend_module = importlib.import_module("gla_inductor.backend")  # the package's `backend` is the function
    backend_module._listeners.append(lambda gm, result: graphs.append(gm))
    try:
        with torch.no_grad():
            got = torch.compile(mixer, backend=gla_inductor.backend, dynamic=False)(x)
            want = mixer(x)
    finally:
        backend_module._listeners.pop()
    assert counters["gla_inductor"]["rewrites"] == 1
    assert op_inputs(graphs[0]) == [((2, 48, 2, 16), (2, 48, 2, 16))]  # 40 steps padded to 3 chunks
    assert no_repeat_feeds(graphs[0])
    assert rel_norm_err(got, want.double()) < 1e-4


def test_mamba2_mixer_with_groups_trains():
    """The same mixer rewritten (the rewritten graph run eagerly), one training step: the gradients
    of C and B come back summed over each group, through the op's backward; as eager's."""
    mixer, x = mamba2_mixer()

    def backend(gm, example_inputs):
        rewrite(gm, example_inputs)
        return gm.forward

    got = torch.compile(mixer, backend=backend, dynamic=False)(x)
    got.square().sum().backward()
    got_grads = {n: p.grad.clone() for n, p in mixer.named_parameters()}
    mixer.zero_grad()
    want = mixer(x)
    want.square().sum().backward()
    assert counters["gla_inductor"]["rewrites"] == 1
    assert rel_norm_err(got, want.double()) < 1e-4
    for n, p in mixer.named_parameters():
        assert rel_norm_err(got_grads[n], p.grad.double()) < 1e-3, n


# ---- (d) the Inductor lowering ----------------------------------------------------------------------


@needs_kernels
@pytest.mark.parametrize("gate", ["vector", "scalar"])
def test_lowering(gate, inductor_triton):
    """Compiled chunk_gla with 2 q/k heads for 4 heads runs the templates forward and backward (no
    call of the eager op; the backward sums the per-head dq and dk), matching float64."""
    from torch._inductor.utils import run_and_get_code

    x = make(2, gate)
    fwd = torch.compile(lambda x: gla_inductor.chunk_gla(**x, output_final_state=True), fullgraph=True)

    def fwd_bwd():
        o, ht = fwd(x)
        w, wh = weights()
        ((o.double() * w).sum() + (ht.double() * wh).sum()).backward()
        return o, ht

    (o, ht), (fwd_code, bwd_code) = run_and_get_code(fwd_bwd)
    extern = re.compile(r"^\s*[\w, ]+ = torch\.ops\.gla_inductor\.\w+\.default\(", re.MULTILINE)
    assert not extern.search(fwd_code + bwd_code)
    assert "GROUP : tl.constexpr = 2" in fwd_code and "GROUP : tl.constexpr = 2" in bwd_code
    check(x, o, ht, False, 1e-5)
