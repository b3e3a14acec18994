"""Snapshots of rewritten graphs (fixed small shapes; accept with EXPECTTEST_ACCEPT=1).

The Dynamo graph after the rewrite shows exactly what replaced the naive code, one snapshot per
form, gate kind and layout (and per op: the in-place decode op); spellings whose graph nearly
copies one of them are pinned by their op call instead (NEAR_COPIES, at the end). The post-grad
graphs show the GLA ops in the forward and backward that Inductor lowers."""

import expecttest
import pytest
import torch
from torch._dynamo.testing import normalize_gm
from torch._dynamo.utils import counters

import gla_inductor
from gla_inductor.backend import rewrite
from helpers import FP32_TOL, outputs, rel_err
from spellings import DECODES, SPELLINGS

pytestmark = pytest.mark.compat  # run again on the newest torch and triton (.ci/run)

BY_NAME = {s.name: s for s in SPELLINGS + DECODES}


def _rewritten(name: str):
    """(the Dynamo graph module after the rewrite, its readable code, the outputs of the rewritten
    graph, the inputs) of a spelling compiled with the backend's rewrite alone."""
    sp = BY_NAME[name]
    graphs = []

    def capture(gm, example_inputs):
        rewrite(gm)
        graphs.append((gm, normalize_gm(gm.print_readable(print_output=False))))
        return gm.forward

    torch._dynamo.reset()
    torch.manual_seed(0)
    args = sp.make(torch.float32)
    out = torch.compile(sp.fn, backend=capture, fullgraph=True)(*args)
    assert len(graphs) == 1
    (gm, code), = graphs
    return gm, code, out, args


def rewritten_graph(name: str) -> str:
    return _rewritten(name)[1]


def post_grad_graphs(name: str) -> list:
    """The forward and backward graphs after Inductor's post-grad passes."""
    sp = BY_NAME[name]
    seen = []

    def record(graph):
        seen.append(normalize_gm(graph.python_code("self").src))

    torch._dynamo.reset()
    torch.manual_seed(0)
    args = [a.requires_grad_() for a in sp.make(torch.float32)]
    with torch._inductor.config.patch(post_grad_custom_pre_pass=record, fx_graph_cache=False):
        out = torch.compile(sp.fn, backend=gla_inductor.backend, fullgraph=True)(*args)
        out = out[0] if isinstance(out, tuple) else out
        out.sum().backward()
    return seen


class TestRewrittenGraphs(expecttest.TestCase):
    def test_decode_broadcast_copy(self):
        self.assertExpectedInline(rewritten_graph("decode_broadcast_copy"), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_g_: "f32[2, 3, 4]", L_cache_: "f32[2, 3, 4, 5]", L_k_: "f32[2, 3, 4]", L_v_: "f32[2, 3, 5]", L_q_: "f32[2, 3, 4]"):
        l_g_ = L_g_
        l_cache_ = L_cache_
        l_k_ = L_k_
        l_v_ = L_v_
        l_q_ = L_q_

        getitem_4: "f32[2, 1, 3, 4]" = l_q_[(slice(None, None, None), None, slice(None, None, None), slice(None, None, None))];  l_q_ = None
        expand: "f32[2, 1, 3, 4]" = getitem_4.expand(-1, 1, -1, -1);  getitem_4 = None
        getitem_5: "f32[2, 1, 3, 4]" = l_k_[(slice(None, None, None), None, slice(None, None, None), slice(None, None, None))];  l_k_ = None
        expand_1: "f32[2, 1, 3, 4]" = getitem_5.expand(-1, 1, -1, -1);  getitem_5 = None
        getitem_6: "f32[2, 1, 3, 5]" = l_v_[(slice(None, None, None), None, slice(None, None, None), slice(None, None, None))];  l_v_ = None
        expand_2: "f32[2, 1, 3, 5]" = getitem_6.expand(-1, 1, -1, -1);  getitem_6 = None
        getitem_7: "f32[2, 1, 3, 4]" = l_g_[(slice(None, None, None), None, slice(None, None, None), slice(None, None, None))];  l_g_ = None
        fused_recurrent_default: "f32[2, 1, 3, 5]" = torch.ops.gla_inductor.fused_recurrent.default(expand, expand_1, expand_2, getitem_7, None, l_cache_, 1.0, False);  expand = expand_1 = expand_2 = getitem_7 = l_cache_ = None
        squeeze: "f32[2, 3, 5]" = torch.squeeze(fused_recurrent_default, 1);  fused_recurrent_default = None

        mul_3: "f32[2, 3, 5]" = squeeze * 0.5;  squeeze = None
        return (mul_3,)
""")

    def test_decode_bmm_flat(self):
        self.assertExpectedInline(rewritten_graph("decode_bmm_flat"), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_g_: "f32[6, 4]", L_cache_: "f32[6, 4, 5]", L_k_: "f32[6, 4]", L_v_: "f32[6, 5]", L_q_: "f32[6, 4]"):
        l_g_ = L_g_
        l_cache_ = L_cache_
        l_k_ = L_k_
        l_v_ = L_v_
        l_q_ = L_q_

        getitem: "f32[6, 1, 1, 4]" = l_q_[(slice(None, None, None), None, None, slice(None, None, None))];  l_q_ = None
        expand: "f32[6, 1, 1, 4]" = getitem.expand(-1, 1, 1, -1);  getitem = None
        getitem_1: "f32[6, 1, 1, 4]" = l_k_[(slice(None, None, None), None, None, slice(None, None, None))];  l_k_ = None
        expand_1: "f32[6, 1, 1, 4]" = getitem_1.expand(-1, 1, 1, -1);  getitem_1 = None
        getitem_2: "f32[6, 1, 1, 5]" = l_v_[(slice(None, None, None), None, None, slice(None, None, None))];  l_v_ = None
        expand_2: "f32[6, 1, 1, 5]" = getitem_2.expand(-1, 1, 1, -1);  getitem_2 = None
        getitem_3: "f32[6, 1, 1, 4]" = l_g_[(slice(None, None, None), None, None, slice(None, None, None))];  l_g_ = None
        getitem_4: "f32[6, 1, 4, 5]" = l_cache_[(slice(None, None, None), None, slice(None, None, None), slice(None, None, None))];  l_cache_ = None
        fused_recurrent_default: "f32[6, 1, 1, 5]" = torch.ops.gla_inductor.fused_recurrent.default(expand, expand_1, expand_2, getitem_3, None, getitem_4, 1.0, False);  expand = expand_1 = expand_2 = getitem_3 = getitem_4 = None
        squeeze_1: "f32[6, 1, 5]" = torch.squeeze(fused_recurrent_default, 2);  fused_recurrent_default = None
        squeeze_2: "f32[6, 5]" = torch.squeeze(squeeze_1, 1);  squeeze_1 = None
        getitem_5: "f32[6, 1, 5]" = squeeze_2[(slice(None, None, None), None, slice(None, None, None))];  squeeze_2 = None

        squeeze: "f32[6, 5]" = getitem_5.squeeze(1);  getitem_5 = None
        return (squeeze,)
""")

    def test_decode_mamba2(self):
        self.assertExpectedInline(rewritten_graph("decode_mamba2"), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[2, 4, 5]", L_Bg_: "f32[2, 2, 4]", L_dt_: "f32[2, 4]", L_A_log_: "f32[4]", L_cache_: "f32[2, 4, 5, 4]", L_Cg_: "f32[2, 2, 4]"):
        l_x_ = L_x_
        l_bg_ = L_Bg_
        l_dt_ = L_dt_
        l_a_log_ = L_A_log_
        l_cache_ = L_cache_
        l_cg_ = L_Cg_

        getitem: "f32[2, 4, 1]" = l_dt_[(Ellipsis, None)];  l_dt_ = None
        expand: "f32[2, 4, 5]" = getitem.expand(-1, -1, 5);  getitem = None
        softplus: "f32[2, 4, 5]" = torch._C._nn.softplus(expand);  expand = None
        dt: "f32[2, 4, 5, 1]" = softplus[(Ellipsis, None)]

        float_1: "f32[4]" = l_a_log_.float();  l_a_log_ = None
        exp: "f32[4]" = torch.exp(float_1);  float_1 = None
        neg: "f32[4]" = -exp;  exp = None
        getitem_2: "f32[4, 1, 1]" = neg[(slice(None, None, None), None, None)];  neg = None
        A: "f32[4, 5, 4]" = getitem_2.expand(-1, 5, 4);  getitem_2 = None

        mul: "f32[2, 4, 5, 4]" = dt * A;  dt = A = None
        dA: "f32[2, 4, 5, 4]" = torch.exp(mul);  mul = None

        getitem_4: "f32[2, 1, 2, 4]" = l_cg_[(slice(None, None, None), None, slice(None, None, None), slice(None, None, None))];  l_cg_ = None
        expand_4: "f32[2, 1, 2, 4]" = getitem_4.expand(-1, 1, -1, -1);  getitem_4 = None
        getitem_5: "f32[2, 1, 2, 4]" = l_bg_[(slice(None, None, None), None, slice(None, None, None), slice(None, None, None))];  l_bg_ = None
        expand_5: "f32[2, 1, 2, 4]" = getitem_5.expand(-1, 1, -1, -1);  getitem_5 = None
        select: "f32[2, 4]" = torch.select(softplus, 2, 0);  softplus = None
        reshape_4: "f32[2, 2, 2]" = select.reshape(2, 2, 2);  select = None
        reshape_5: "f32[2, 2, 2, 5]" = l_x_.reshape(2, 2, 2, 5)
        einsum: "f32[2, 2, 2, 5]" = torch.functional.einsum('bAB,bABv->bABv', reshape_4, reshape_5);  reshape_4 = reshape_5 = None
        getitem_6: "f32[2, 1, 2, 2, 5]" = einsum[(slice(None, None, None), None, slice(None, None, None), slice(None, None, None), slice(None, None, None))];  einsum = None
        expand_6: "f32[2, 1, 2, 2, 5]" = getitem_6.expand(-1, 1, -1, -1, -1);  getitem_6 = None
        reshape_6: "f32[2, 1, 4, 5]" = expand_6.reshape(2, 1, 4, 5);  expand_6 = None
        select_1: "f32[2, 4, 5]" = torch.select(dA, 3, 0);  dA = None
        select_2: "f32[2, 4]" = torch.select(select_1, 2, 0);  select_1 = None
        reshape_7: "f32[2, 2, 2]" = select_2.reshape(2, 2, 2);  select_2 = None
        getitem_7: "f32[2, 1, 2, 2]" = reshape_7[(slice(None, None, None), None, slice(None, None, None), slice(None, None, None))];  reshape_7 = None
        expand_7: "f32[2, 1, 2, 2]" = getitem_7.expand(-1, -1, -1, -1);  getitem_7 = None
        reshape_8: "f32[2, 1, 4]" = expand_7.reshape(2, 1, 4);  expand_7 = None
        log: "f32[2, 1, 4]" = torch.log(reshape_8);  reshape_8 = None
        permute: "f32[2, 4, 4, 5]" = torch.permute(l_cache_, (0, 1, 3, 2));  l_cache_ = None
        fused_recurrent_default: "f32[2, 1, 4, 5]" = torch.ops.gla_inductor.fused_recurrent.default(expand_4, expand_5, reshape_6, log, None, permute, 1.0, False);  expand_4 = expand_5 = reshape_6 = log = permute = None
        squeeze: "f32[2, 4, 5]" = torch.squeeze(fused_recurrent_default, 1);  fused_recurrent_default = None
        reshape_9: "f32[8, 5, 1]" = squeeze.reshape(8, 5, 1);  squeeze = None

        view_2: "f32[2, 4, 5]" = reshape_9.view(2, 4, 5);  reshape_9 = None
        add_1: "f32[2, 4, 5]" = view_2 + l_x_;  view_2 = l_x_ = None
        return (add_1,)
""")

    def test_chunked_hf_einsum(self):
        self.assertExpectedInline(rewritten_graph("chunked_hf_einsum"), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[2, 9, 4, 5]", L_dt_: "f32[2, 9, 4]", L_Bg_: "f32[2, 9, 2, 3]", L_Cg_: "f32[2, 9, 2, 3]", L_A_: "f32[4]", L_h0_: "f32[2, 4, 5, 3]"):
        l_x_ = L_x_
        l_dt_ = L_dt_
        l_bg_ = L_Bg_
        l_cg_ = L_Cg_
        l_a_ = L_A_
        l_h0_ = L_h0_

        dt: "f32[2, 9, 4]" = torch._C._nn.softplus(l_dt_);  l_dt_ = None

        to: "f32[2, 9, 2, 3]" = l_bg_.to(torch.float32);  l_bg_ = None

        to_1: "f32[2, 9, 2, 3]" = l_cg_.to(torch.float32);  l_cg_ = None

        getitem: "f32[2, 9, 4, 1]" = dt[(Ellipsis, None)]
        x: "f32[2, 9, 4, 5]" = l_x_ * getitem;  l_x_ = getitem = None
        to_2: "f32[4]" = l_a_.to(torch.float32);  l_a_ = None
        a: "f32[2, 9, 4]" = to_2 * dt;  to_2 = dt = None

        t: "f32[2, 12, 4, 5]" = torch._C._nn.pad(x, (0, 0, 0, 0, 0, 3), 'constant', None);  x = None
        t_1: "f32[2, 12, 4]" = torch._C._nn.pad(a, (0, 0, 0, 3), 'constant', None);  a = None

        pad_5: "f32[2, 12, 2, 3]" = torch._C._nn.pad(to_1, (0, 0, 0, 0, 0, 3), 'constant', None);  to_1 = None
        pad_6: "f32[2, 12, 2, 3]" = torch._C._nn.pad(to, (0, 0, 0, 0, 0, 3), 'constant', None);  to = None
        permute_4: "f32[2, 4, 3, 5]" = torch.permute(l_h0_, (0, 1, 3, 2));  l_h0_ = None
        chunk_fwd_default = torch.ops.gla_inductor.chunk_fwd.default(pad_5, pad_6, t, t_1, None, permute_4, 1.0, True, False);  pad_5 = pad_6 = t = t_1 = permute_4 = None
        getitem_11: "f32[2, 12, 4, 5]" = chunk_fwd_default[0]
        getitem_12: "f32[2, 4, 3, 5]" = chunk_fwd_default[1];  chunk_fwd_default = None
        permute_5: "f32[2, 4, 5, 3]" = torch.permute(getitem_12, (0, 1, 3, 2));  getitem_12 = None

        getitem_10: "f32[2, 9, 4, 5]" = getitem_11[(slice(None, None, None), slice(None, 9, None))];  getitem_11 = None
        return (getitem_10, permute_5)
""")

    def test_chunk_loop_cat(self):
        self.assertExpectedInline(rewritten_graph("chunk_loop_cat"), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_q_: "f32[2, 3, 9, 4]", L_v_: "f32[2, 3, 9, 5]", L_k_: "f32[2, 3, 9, 4]", L_g_: "f32[2, 3, 9]"):
        l_q_ = L_q_
        l_v_ = L_v_
        l_k_ = L_k_
        l_g_ = L_g_

        q: "f32[2, 3, 9, 4]" = l_q_ * 0.5;  l_q_ = None

        einsum: "f32[2, 9, 3, 4]" = torch.functional.einsum('bhtk->bthk', q);  q = None
        einsum_1: "f32[2, 9, 3, 4]" = torch.functional.einsum('bhtk->bthk', l_k_);  l_k_ = None
        einsum_2: "f32[2, 9, 3, 5]" = torch.functional.einsum('bhtv->bthv', l_v_);  l_v_ = None
        einsum_3: "f32[2, 9, 3]" = torch.functional.einsum('bht->bth', l_g_);  l_g_ = None
        chunk_fwd_default = torch.ops.gla_inductor.chunk_fwd.default(einsum, einsum_1, einsum_2, einsum_3, None, None, 1.0, True, False);  einsum = einsum_1 = einsum_2 = einsum_3 = None
        getitem_30: "f32[2, 9, 3, 5]" = chunk_fwd_default[0]
        permute: "f32[2, 3, 9, 5]" = torch.permute(getitem_30, (0, 2, 1, 3));  getitem_30 = None
        contiguous: "f32[2, 3, 9, 5]" = permute.contiguous();  permute = None
        getitem_31: "f32[2, 3, 4, 5]" = chunk_fwd_default[1];  chunk_fwd_default = None
        return (contiguous, getitem_31)
""")

    def test_chunk_loop_retention(self):
        self.assertExpectedInline(rewritten_graph("chunk_loop_retention"), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_q_: "f32[2, 3, 8, 4]", L_k_: "f32[2, 3, 8, 4]", L_v_: "f32[2, 3, 8, 5]", L_log_gamma_: "f32[3]"):
        l_q_ = L_q_
        l_k_ = L_k_
        l_v_ = L_v_
        l_log_gamma_ = L_log_gamma_

        einsum: "f32[2, 8, 3, 4]" = torch.functional.einsum('bhtk->bthk', l_q_);  l_q_ = None
        einsum_1: "f32[2, 8, 3, 4]" = torch.functional.einsum('bhtk->bthk', l_k_);  l_k_ = None
        einsum_2: "f32[2, 8, 3, 5]" = torch.functional.einsum('bhtv->bthv', l_v_);  l_v_ = None
        chunk_fwd_default = torch.ops.gla_inductor.chunk_fwd.default(einsum, einsum_1, einsum_2, None, l_log_gamma_, None, 1.0, False, False);  einsum = einsum_1 = einsum_2 = l_log_gamma_ = None
        getitem_16: "f32[2, 8, 3, 5]" = chunk_fwd_default[0];  chunk_fwd_default = None
        permute: "f32[2, 3, 8, 5]" = torch.permute(getitem_16, (0, 2, 1, 3));  getitem_16 = None
        contiguous: "f32[2, 3, 8, 5]" = permute.contiguous();  permute = None
        return (contiguous,)
""")

    def test_loop_cache_writeback(self):
        self.assertExpectedInline(rewritten_graph("loop_cache_writeback"), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_q_: "f32[2, 9, 3, 4]", L_g_: "f32[2, 9, 3, 4]", L_cache_: "f32[2, 3, 4, 5]", L_k_: "f32[2, 9, 3, 4]", L_v_: "f32[2, 9, 3, 5]"):
        l_q_ = L_q_
        l_g_ = L_g_
        l_cache_ = L_cache_
        l_k_ = L_k_
        l_v_ = L_v_

        fused_recurrent_default: "f32[2, 9, 3, 5]" = torch.ops.gla_inductor.fused_recurrent.default(l_q_, l_k_, l_v_, l_g_, None, l_cache_, 1.0, False);  l_q_ = l_k_ = l_v_ = l_g_ = l_cache_ = None
        return (fused_recurrent_default,)
""")

    def test_loop_broadcast_setitem(self):
        self.assertExpectedInline(rewritten_graph("loop_broadcast_setitem"), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_q_: "f32[2, 9, 3, 4]", L_v_: "f32[2, 9, 3, 5]", L_g_: "f32[2, 9, 3, 4]", L_k_: "f32[2, 9, 3, 4]"):
        l_q_ = L_q_
        l_v_ = L_v_
        l_g_ = L_g_
        l_k_ = L_k_

        chunk_fwd_default = torch.ops.gla_inductor.chunk_fwd.default(l_q_, l_k_, l_v_, l_g_, None, None, 0.5, False, False);  l_q_ = l_k_ = l_v_ = l_g_ = None
        getitem_45: "f32[2, 9, 3, 5]" = chunk_fwd_default[0];  chunk_fwd_default = None
        return (getitem_45,)
""")

    def test_loop_matmul_stack_scalar(self):
        self.assertExpectedInline(rewritten_graph("loop_matmul_stack_scalar"), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_q_: "f32[2, 9, 3, 4]", L_v_: "f32[2, 9, 3, 5]", L_g_: "f32[2, 9, 3]", L_k_: "f32[2, 9, 3, 4]"):
        l_q_ = L_q_
        l_v_ = L_v_
        l_g_ = L_g_
        l_k_ = L_k_

        chunk_fwd_default = torch.ops.gla_inductor.chunk_fwd.default(l_q_, l_k_, l_v_, l_g_, None, None, 1.0, False, False);  l_q_ = l_k_ = l_v_ = l_g_ = None
        getitem_36: "f32[2, 9, 3, 5]" = chunk_fwd_default[0];  chunk_fwd_default = None

        mul_9: "f32[2, 9, 3, 5]" = getitem_36 * 0.5;  getitem_36 = None
        return (mul_9,)
""")

    def test_loop_head_first_keepdim_cat(self):
        self.assertExpectedInline(rewritten_graph("loop_head_first_keepdim_cat"), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_q_: "f32[2, 3, 9, 4]", L_v_: "f32[2, 3, 9, 5]", L_g_gamma_: "f32[3]", L_k_: "f32[2, 3, 9, 4]"):
        l_q_ = L_q_
        l_v_ = L_v_
        l_g_gamma_ = L_g_gamma_
        l_k_ = L_k_

        einsum: "f32[2, 9, 3, 4]" = torch.functional.einsum('bhtk->bthk', l_q_);  l_q_ = None
        einsum_1: "f32[2, 9, 3, 4]" = torch.functional.einsum('bhtk->bthk', l_k_);  l_k_ = None
        einsum_2: "f32[2, 9, 3, 5]" = torch.functional.einsum('bhtv->bthv', l_v_);  l_v_ = None
        chunk_fwd_default = torch.ops.gla_inductor.chunk_fwd.default(einsum, einsum_1, einsum_2, None, l_g_gamma_, None, 1.0, False, False);  einsum = einsum_1 = einsum_2 = l_g_gamma_ = None
        getitem_28: "f32[2, 9, 3, 5]" = chunk_fwd_default[0];  chunk_fwd_default = None
        permute: "f32[2, 3, 9, 5]" = torch.permute(getitem_28, (0, 2, 1, 3));  getitem_28 = None
        return (permute,)
""")

    def test_loop_no_gate_unbind(self):
        self.assertExpectedInline(rewritten_graph("loop_no_gate_unbind"), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_q_: "f32[2, 9, 3, 4]", L_v_: "f32[2, 9, 3, 5]", L_k_: "f32[2, 9, 3, 4]"):
        l_q_ = L_q_
        l_v_ = L_v_
        l_k_ = L_k_

        chunk_fwd_default = torch.ops.gla_inductor.chunk_fwd.default(l_q_, l_k_, l_v_, None, None, None, 0.5, False, False);  l_q_ = l_k_ = l_v_ = None
        getitem_54: "f32[2, 9, 3, 5]" = chunk_fwd_default[0];  chunk_fwd_default = None
        return (getitem_54,)
""")

    def test_loop_bmm_time_major(self):
        self.assertExpectedInline(rewritten_graph("loop_bmm_time_major"), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_q_: "f32[9, 6, 4]", L_v_: "f32[9, 6, 5]", L_g_: "f32[9, 6]", L_k_: "f32[9, 6, 4]"):
        l_q_ = L_q_
        l_v_ = L_v_
        l_g_ = L_g_
        l_k_ = L_k_

        einsum: "f32[6, 9, 4]" = torch.functional.einsum('tbk->btk', l_q_);  l_q_ = None
        getitem_45: "f32[6, 9, 1, 4]" = einsum[(slice(None, None, None), slice(None, None, None), None, slice(None, None, None))];  einsum = None
        expand: "f32[6, 9, 1, 4]" = getitem_45.expand(-1, -1, 1, -1);  getitem_45 = None
        einsum_1: "f32[6, 9, 4]" = torch.functional.einsum('tbk->btk', l_k_);  l_k_ = None
        getitem_46: "f32[6, 9, 1, 4]" = einsum_1[(slice(None, None, None), slice(None, None, None), None, slice(None, None, None))];  einsum_1 = None
        expand_1: "f32[6, 9, 1, 4]" = getitem_46.expand(-1, -1, 1, -1);  getitem_46 = None
        einsum_2: "f32[6, 9, 5]" = torch.functional.einsum('tbv->btv', l_v_);  l_v_ = None
        getitem_47: "f32[6, 9, 1, 5]" = einsum_2[(slice(None, None, None), slice(None, None, None), None, slice(None, None, None))];  einsum_2 = None
        expand_2: "f32[6, 9, 1, 5]" = getitem_47.expand(-1, -1, 1, -1);  getitem_47 = None
        einsum_3: "f32[6, 9]" = torch.functional.einsum('tb->bt', l_g_);  l_g_ = None
        getitem_48: "f32[6, 9, 1]" = einsum_3[(slice(None, None, None), slice(None, None, None), None)];  einsum_3 = None
        chunk_fwd_default = torch.ops.gla_inductor.chunk_fwd.default(expand, expand_1, expand_2, getitem_48, None, None, 1.0, False, False);  expand = expand_1 = expand_2 = getitem_48 = None
        getitem_49: "f32[6, 9, 1, 5]" = chunk_fwd_default[0];  chunk_fwd_default = None
        squeeze_9: "f32[6, 9, 5]" = torch.squeeze(getitem_49, 2);  getitem_49 = None
        permute: "f32[9, 6, 5]" = torch.permute(squeeze_9, (1, 0, 2));  squeeze_9 = None
        return (permute,)
""")

    def test_parallel_scalar_masked_fill(self):
        self.assertExpectedInline(rewritten_graph("parallel_scalar_masked_fill"), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_g_: "f32[2, 3, 9]", L_q_: "f32[2, 3, 9, 4]", L_k_: "f32[2, 3, 9, 4]", L_v_: "f32[2, 3, 9, 5]"):
        l_g_ = L_g_
        l_q_ = L_q_
        l_k_ = L_k_
        l_v_ = L_v_

        einsum: "f32[2, 9, 3, 4]" = torch.functional.einsum('bhtk->bthk', l_q_);  l_q_ = None
        einsum_1: "f32[2, 9, 3, 4]" = torch.functional.einsum('bhtk->bthk', l_k_);  l_k_ = None
        einsum_2: "f32[2, 9, 3, 5]" = torch.functional.einsum('bhtv->bthv', l_v_);  l_v_ = None
        einsum_3: "f32[2, 9, 3]" = torch.functional.einsum('bht->bth', l_g_);  l_g_ = None
        chunk_fwd_default = torch.ops.gla_inductor.chunk_fwd.default(einsum, einsum_1, einsum_2, einsum_3, None, None, 0.5, False, False);  einsum = einsum_1 = einsum_2 = einsum_3 = None
        getitem_2: "f32[2, 9, 3, 5]" = chunk_fwd_default[0];  chunk_fwd_default = None
        permute: "f32[2, 3, 9, 5]" = torch.permute(getitem_2, (0, 2, 1, 3));  getitem_2 = None
        return (permute,)
""")

    def test_parallel_constant_gate(self):
        self.assertExpectedInline(rewritten_graph("parallel_constant_gate"), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_q_: "f32[2, 3, 9, 4]", L_g_gamma_: "f32[3]", L_k_: "f32[2, 3, 9, 4]", L_v_: "f32[2, 3, 9, 5]"):
        l_q_ = L_q_
        l_g_gamma_ = L_g_gamma_
        l_k_ = L_k_
        l_v_ = L_v_

        einsum: "f32[2, 9, 3, 4]" = torch.functional.einsum('bhtk->bthk', l_q_);  l_q_ = None
        einsum_1: "f32[2, 9, 3, 4]" = torch.functional.einsum('bhtk->bthk', l_k_);  l_k_ = None
        einsum_2: "f32[2, 9, 3, 5]" = torch.functional.einsum('bhtv->bthv', l_v_);  l_v_ = None
        chunk_fwd_default = torch.ops.gla_inductor.chunk_fwd.default(einsum, einsum_1, einsum_2, None, l_g_gamma_, None, 1.0, False, False);  einsum = einsum_1 = einsum_2 = l_g_gamma_ = None
        getitem_4: "f32[2, 9, 3, 5]" = chunk_fwd_default[0];  chunk_fwd_default = None
        permute: "f32[2, 3, 9, 5]" = torch.permute(getitem_4, (0, 2, 1, 3));  getitem_4 = None
        return (permute,)
""")

    def test_parallel_vector_factored(self):
        self.assertExpectedInline(rewritten_graph("parallel_vector_factored"), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_g_: "f32[2, 3, 9, 4]", L_q_: "f32[2, 3, 9, 4]", L_k_: "f32[2, 3, 9, 4]", L_v_: "f32[2, 3, 9, 5]"):
        l_g_ = L_g_
        l_q_ = L_q_
        l_k_ = L_k_
        l_v_ = L_v_

        einsum: "f32[2, 9, 3, 4]" = torch.functional.einsum('bhtk->bthk', l_q_);  l_q_ = None
        einsum_1: "f32[2, 9, 3, 4]" = torch.functional.einsum('bhtk->bthk', l_k_);  l_k_ = None
        einsum_2: "f32[2, 9, 3, 5]" = torch.functional.einsum('bhtv->bthv', l_v_);  l_v_ = None
        einsum_3: "f32[2, 9, 3, 4]" = torch.functional.einsum('bhtk->bthk', l_g_);  l_g_ = None
        chunk_fwd_default = torch.ops.gla_inductor.chunk_fwd.default(einsum, einsum_1, einsum_2, einsum_3, None, None, 1.0, False, False);  einsum = einsum_1 = einsum_2 = einsum_3 = None
        getitem: "f32[2, 9, 3, 5]" = chunk_fwd_default[0];  chunk_fwd_default = None
        permute: "f32[2, 3, 9, 5]" = torch.permute(getitem, (0, 2, 1, 3));  getitem = None
        return (permute,)
""")

    def test_parallel_no_gate(self):
        self.assertExpectedInline(rewritten_graph("parallel_no_gate"), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_k_: "f32[2, 3, 9, 4]", L_q_: "f32[2, 3, 9, 4]", L_v_: "f32[2, 3, 9, 5]"):
        l_k_ = L_k_
        l_q_ = L_q_
        l_v_ = L_v_

        einsum: "f32[2, 9, 3, 4]" = torch.functional.einsum('bhtk->bthk', l_q_);  l_q_ = None
        einsum_1: "f32[2, 9, 3, 4]" = torch.functional.einsum('bhtk->bthk', l_k_);  l_k_ = None
        einsum_2: "f32[2, 9, 3, 5]" = torch.functional.einsum('bhtv->bthv', l_v_);  l_v_ = None
        chunk_fwd_default = torch.ops.gla_inductor.chunk_fwd.default(einsum, einsum_1, einsum_2, None, None, None, 0.25, False, False);  einsum = einsum_1 = einsum_2 = None
        getitem: "f32[2, 9, 3, 5]" = chunk_fwd_default[0];  chunk_fwd_default = None
        permute: "f32[2, 3, 9, 5]" = torch.permute(getitem, (0, 2, 1, 3));  getitem = None
        return (permute,)
""")


class TestFusedQKV(expecttest.TestCase):
    def test_loop_fused_qkv(self):
        self.assertExpectedInline(rewritten_graph("loop_fused_qkv"), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_qkv_: "f32[2, 9, 3, 3, 4]", L_g_: "f32[2, 9, 3, 4]"):
        l_qkv_ = L_qkv_
        l_g_ = L_g_

        select: "f32[2, 9, 3, 4]" = torch.select(l_qkv_, 2, 0)
        select_1: "f32[2, 9, 3, 4]" = torch.select(l_qkv_, 2, 1)
        select_2: "f32[2, 9, 3, 4]" = torch.select(l_qkv_, 2, 2);  l_qkv_ = None
        chunk_fwd_default = torch.ops.gla_inductor.chunk_fwd.default(select, select_1, select_2, l_g_, None, None, 1.0, False, False);  select = select_1 = select_2 = l_g_ = None
        getitem_48: "f32[2, 9, 3, 4]" = chunk_fwd_default[0];  chunk_fwd_default = None
        return (getitem_48,)
""")


class TestPostGradGraphs(expecttest.TestCase):
    def test_loop_forward_and_backward(self):
        fw, bw = post_grad_graphs("loop_broadcast_setitem")
        self.assertExpectedInline(fw, """\

def forward(self, primals_1, primals_2, primals_3, primals_4):
    chunk_fwd = torch.ops.gla_inductor.chunk_fwd.default(primals_1, primals_4, primals_2, primals_3, None, None, 0.5, False, False)
    getitem = chunk_fwd[0];  chunk_fwd = None
    return (getitem, primals_1, primals_2, primals_3, primals_4)
""")
        self.assertExpectedInline(bw, """\

def forward(self, primals_1, primals_2, primals_3, primals_4, tangents_1):
    chunk_bwd = torch.ops.gla_inductor.chunk_bwd.default(primals_1, primals_4, primals_2, primals_3, None, None, tangents_1, None, 0.5, False);  primals_1 = primals_4 = primals_2 = primals_3 = tangents_1 = None
    getitem_2 = chunk_bwd[0]
    getitem_3 = chunk_bwd[1]
    getitem_4 = chunk_bwd[2]
    getitem_5 = chunk_bwd[3];  chunk_bwd = None
    return (getitem_2, getitem_4, getitem_5, getitem_3)
""")

    def test_parallel_forward_and_backward(self):
        fw, bw = post_grad_graphs("parallel_vector_factored")
        self.assertExpectedInline(fw, """\

def forward(self, primals_1, primals_2, primals_3, primals_4):
    permute = torch.ops.aten.permute.default(primals_2, [0, 2, 1, 3]);  primals_2 = None
    permute_1 = torch.ops.aten.permute.default(primals_3, [0, 2, 1, 3]);  primals_3 = None
    permute_2 = torch.ops.aten.permute.default(primals_4, [0, 2, 1, 3]);  primals_4 = None
    permute_3 = torch.ops.aten.permute.default(primals_1, [0, 2, 1, 3]);  primals_1 = None
    chunk_fwd = torch.ops.gla_inductor.chunk_fwd.default(permute, permute_1, permute_2, permute_3, None, None, 1.0, False, False)
    getitem = chunk_fwd[0];  chunk_fwd = None
    permute_4 = torch.ops.aten.permute.default(getitem, [0, 2, 1, 3]);  getitem = None
    return (permute_4, permute, permute_1, permute_2, permute_3)
""")
        self.assertExpectedInline(bw, """\

def forward(self, permute, permute_1, permute_2, permute_3, tangents_1):
    permute_5 = torch.ops.aten.permute.default(tangents_1, [0, 2, 1, 3]);  tangents_1 = None
    chunk_bwd = torch.ops.gla_inductor.chunk_bwd.default(permute, permute_1, permute_2, permute_3, None, None, permute_5, None, 1.0, False);  permute = permute_1 = permute_2 = permute_3 = permute_5 = None
    getitem_2 = chunk_bwd[0]
    getitem_3 = chunk_bwd[1]
    getitem_4 = chunk_bwd[2]
    getitem_5 = chunk_bwd[3];  chunk_bwd = None
    permute_6 = torch.ops.aten.permute.default(getitem_5, [0, 2, 1, 3]);  getitem_5 = None
    permute_7 = torch.ops.aten.permute.default(getitem_4, [0, 2, 1, 3]);  getitem_4 = None
    permute_8 = torch.ops.aten.permute.default(getitem_3, [0, 2, 1, 3]);  getitem_3 = None
    permute_9 = torch.ops.aten.permute.default(getitem_2, [0, 2, 1, 3]);  getitem_2 = None
    return (permute_6, permute_9, permute_8, permute_7)
""")


# Spellings whose rewritten graph nearly copies a snapshot above: the same form, gate kind and
# layout, one op call that differs in its scalars or in the state tensors it takes. Instead of
# a snapshot each, the test pins that call (tensor arguments by role, the gate with its rank,
# scalars as they are), a graph with nothing of the naive code left (the op, its outputs and
# layout changes only), one rewrite of the spelling's form and its outputs against float64 eager
# (tests/recognize/test_recognize.py checks the gradients).
NEAR_COPIES = {
    # spelling: (the snapshot it nearly copies, the op call of its rewritten graph)
    "loop_reverse": (
        "loop_broadcast_setitem", "chunk_fwd(q, k, v, g[4d], None, None, 1.0, False, True)"),
    "loop_einsum_state": (
        "loop_broadcast_setitem", "chunk_fwd(q, k, v, g[4d], None, h0, 0.5, True, False)"),
    "parallel_scalar_neg_inf": (
        "parallel_scalar_masked_fill", "chunk_fwd(q, k, v, g[3d], None, None, 0.5, False, False)"),
    "parallel_scalar_float_mask": (
        "parallel_scalar_masked_fill", "chunk_fwd(q, k, v, g[3d], None, None, 1.0, False, False)"),
    # [B, T, H, D] inputs: the same call without the permutes around it
    "parallel_scalar_einsum_where": (
        "parallel_scalar_masked_fill", "chunk_fwd(q, k, v, g[3d], None, None, 1.0, False, False)"),
    "parallel_scalar_states": (
        "parallel_scalar_masked_fill", "chunk_fwd(q, k, v, g[3d], None, h0, 0.5, True, False)"),
    "parallel_vector_pairwise": (
        "parallel_vector_factored", "chunk_fwd(q, k, v, g[4d], None, None, 1.0, False, False)"),
    "parallel_reverse_states": (
        "parallel_vector_factored", "chunk_fwd(q, k, v, g[4d], None, h0, 1.0, True, True)"),
    # the same call without the scan's prologue (softplus, casts, time padding)
    "chunked_ssd_minimal": (
        "chunked_hf_einsum", "chunk_fwd(q, k, v, g[3d], None, h0, 1.0, False, False)"),
}
GLA_OPS = (torch.ops.gla_inductor.chunk_fwd.default, torch.ops.gla_inductor.fused_recurrent.default)
ROLES = ("q", "k", "v", "g", "g_gamma", "h0")


def op_call(gm) -> str:
    """The GLA op call of a rewritten graph, its tensor arguments named by role."""
    (node,) = [n for n in gm.graph.nodes if n.target in GLA_OPS]

    def show(i, arg):
        if not isinstance(arg, torch.fx.Node):
            return repr(arg)
        return f"g[{arg.meta['example_value'].dim()}d]" if ROLES[i] == "g" else ROLES[i]

    return f"{node.target._opname}({', '.join(show(i, a) for i, a in enumerate(node.args))})"


def is_layout(node) -> bool:
    """A node that moves values without computing: a view, permute, cast, one-operand einsum, or
    an output of the op."""
    name = getattr(node.target, "__name__", str(node.target))
    if name == "einsum":
        return len(node.args) == 2 and "," not in node.args[0]
    return name in ("getitem", "permute", "to")


@pytest.mark.parametrize("name", NEAR_COPIES)
def test_near_copy_rewrites_like_its_snapshot(name):
    snapshot, call = NEAR_COPIES[name]
    sp = BY_NAME[name]
    assert hasattr(TestRewrittenGraphs, f"test_{snapshot}") and BY_NAME[snapshot].form == sp.form
    counters.clear()
    gm, _, out, args = _rewritten(name)
    assert counters["gla_inductor"]["rewrites"] == 1 and counters["gla_inductor"][f"rewrites_{sp.form}"] == 1
    assert op_call(gm) == call
    computing = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")
                 and n.target not in GLA_OPS and not is_layout(n)]
    assert computing == [], computing
    want = outputs(sp.fn(*[a.double() for a in args]))
    for got, ref in zip(outputs(out), want, strict=True):
        assert rel_err(got, ref) <= FP32_TOL
