"""The two naive GLA definitions agree with each other and with hand-computed cases (float64)."""

import pytest
import torch

from gla_inductor.reference import naive_parallel_gla, naive_recurrent_gla

from helpers import GATES, gla_inputs

pytestmark = pytest.mark.usefixtures("one_thread")


def make_inputs(gate, B=2, T=9, H=3, K=5, V=4, dtype=torch.float64, with_h0=True):
    """chunk_gla's inputs (helpers.gla_inputs), float64 by default."""
    return gla_inputs(gate, B, T, H, K, V, dtype=dtype, with_h0=with_h0)


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("with_h0", [False, True])
def test_loop_matches_parallel(gate, reverse, with_h0):
    x = make_inputs(gate, with_h0=with_h0)
    kw = dict(output_final_state=True, reverse=reverse, scale=0.7)
    o_loop, ht_loop = naive_recurrent_gla(**x, **kw)
    o_par, ht_par = naive_parallel_gla(**x, **kw)
    torch.testing.assert_close(o_loop, o_par, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ht_loop, ht_par, rtol=1e-10, atol=1e-10)


def test_single_step_closed_form():
    # one step: S = exp(g) * S0 + k^T v, o = scale * q S
    x = make_inputs("vector", B=1, T=1, H=1)
    q, k, v, g, h0 = x["q"], x["k"], x["v"], x["g"], x["initial_state"]
    o, ht = naive_recurrent_gla(**x, output_final_state=True)
    S = g[0, 0, 0].exp()[:, None] * h0[0, 0] + k[0, 0, 0][:, None] * v[0, 0, 0][None, :]
    torch.testing.assert_close(ht[0, 0], S)
    torch.testing.assert_close(o[0, 0, 0], 5**-0.5 * q[0, 0, 0] @ S)


def test_reverse_is_flipped_forward():
    x = make_inputs("vector", with_h0=False)
    o_rev, ht_rev = naive_recurrent_gla(**x, reverse=True, output_final_state=True)
    q, k, v, g = (x[n].flip(1) for n in ("q", "k", "v", "g"))
    o_flip, ht_flip = naive_recurrent_gla(q, k, v, g, output_final_state=True)
    torch.testing.assert_close(o_rev, o_flip.flip(1))
    torch.testing.assert_close(ht_rev, ht_flip)


def test_compute_dtype():
    x = make_inputs("none", dtype=torch.bfloat16)
    q, k, v = x["q"], x["k"], x["v"]
    o, _ = naive_recurrent_gla(q, k, v)
    assert o.dtype == torch.float32
    o, ht = naive_recurrent_gla(q, k, v.double(), output_final_state=True)
    assert o.dtype == ht.dtype == torch.float64


def test_empty_sequence():
    x = make_inputs("none", T=0)
    o, ht = naive_recurrent_gla(**x, output_final_state=True)
    assert o.shape == (2, 0, 3, 4)
    torch.testing.assert_close(ht, x["initial_state"])
