"""The two naive GLA definitions agree with each other and with hand-computed cases (float64)."""

import pytest
import torch
import torch.nn.functional as F

from gla_inductor.reference import naive_parallel_gla, naive_recurrent_gla

GATES = ["none", "scalar", "vector", "constant"]


pytestmark = pytest.mark.usefixtures("one_thread")

def make_inputs(gate, B=2, T=9, H=3, K=5, V=4, dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    q, k = torch.randn(B, T, H, K, dtype=dtype), torch.randn(B, T, H, K, dtype=dtype)
    v = torch.randn(B, T, H, V, dtype=dtype)
    gates = {
        "none": {},
        "scalar": {"g": F.logsigmoid(torch.randn(B, T, H, dtype=dtype))},
        "vector": {"g": F.logsigmoid(torch.randn(B, T, H, K, dtype=dtype))},
        "constant": {"g_gamma": F.logsigmoid(torch.randn(H, dtype=dtype))},
    }
    return q, k, v, gates[gate]


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("with_h0", [False, True])
def test_loop_matches_parallel(gate, reverse, with_h0):
    q, k, v, gate_kw = make_inputs(gate)
    h0 = torch.randn(2, 3, 5, 4, dtype=torch.float64) if with_h0 else None
    kw = dict(gate_kw, initial_state=h0, output_final_state=True, reverse=reverse, scale=0.7)
    o_loop, ht_loop = naive_recurrent_gla(q, k, v, **kw)
    o_par, ht_par = naive_parallel_gla(q, k, v, **kw)
    torch.testing.assert_close(o_loop, o_par, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ht_loop, ht_par, rtol=1e-10, atol=1e-10)


def test_single_step_closed_form():
    # one step: S = exp(g) * S0 + k^T v, o = scale * q S
    q, k, v, gate_kw = make_inputs("vector", B=1, T=1, H=1)
    h0 = torch.randn(1, 1, 5, 4, dtype=torch.float64)
    o, ht = naive_recurrent_gla(q, k, v, **gate_kw, initial_state=h0, output_final_state=True)
    S = gate_kw["g"][0, 0, 0].exp()[:, None] * h0[0, 0] + k[0, 0, 0][:, None] * v[0, 0, 0][None, :]
    torch.testing.assert_close(ht[0, 0], S)
    torch.testing.assert_close(o[0, 0, 0], 5**-0.5 * q[0, 0, 0] @ S)


def test_reverse_is_flipped_forward():
    q, k, v, gate_kw = make_inputs("vector")
    o_rev, ht_rev = naive_recurrent_gla(q, k, v, **gate_kw, reverse=True, output_final_state=True)
    o_flip, ht_flip = naive_recurrent_gla(
        q.flip(1), k.flip(1), v.flip(1), gate_kw["g"].flip(1), output_final_state=True
    )
    torch.testing.assert_close(o_rev, o_flip.flip(1))
    torch.testing.assert_close(ht_rev, ht_flip)


def test_compute_dtype():
    q, k, v, _ = make_inputs("none", dtype=torch.bfloat16)
    o, _ = naive_recurrent_gla(q, k, v)
    assert o.dtype == torch.float32
    o, ht = naive_recurrent_gla(q, k, v.double(), output_final_state=True)
    assert o.dtype == ht.dtype == torch.float64


def test_empty_sequence():
    q, k, v, _ = make_inputs("none", T=0)
    h0 = torch.randn(2, 3, 5, 4, dtype=torch.float64)
    o, ht = naive_recurrent_gla(q, k, v, initial_state=h0, output_final_state=True)
    assert o.shape == (2, 0, 3, 4)
    torch.testing.assert_close(ht, h0)
