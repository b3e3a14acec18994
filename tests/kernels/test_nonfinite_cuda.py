"""Non-finite values through the default chunked forward on the GPU (bf16): a NaN and an infinity in
v, each in one (batch, head), against the fp32 time loop on those heads. o and the final state are
non-finite exactly where the loop's are (NaN exactly where its NaNs are, for the NaN), close
elsewhere; a clean head stays finite; three runs give the same outputs (a race would not)."""

import pytest
import torch
import torch.nn.functional as F
from gla_inductor.contract import GLACall

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# K = 256: the default carry tiles are 128 values with 8 warps, where an earlier in-loop check raced;
# T = 2048 with two heads: the carry in segments
SHAPES = [(8, 256, 16, 256, 256), (8, 256, 16, 128, 128), (2, 2048, 2, 128, 128), (8, 256, 8, 64, 64)]
FINITE_TOL = 2e-2  # bf16 inputs against the fp32 loop, on the finite entries


def inputs(B, T, H, K, V, gate):
    """q, k, v, g, g_gamma (one of the gates None)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.randn(B, T, H, K, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(B, T, H, V, device="cuda", generator=gen, dtype=torch.bfloat16)
    if gate == "constant":
        return q, k, v, None, -torch.rand(H, device="cuda", generator=gen) / 16
    gshape = (B, T, H, K) if gate == "vector" else (B, T, H)
    g = (F.logsigmoid(torch.randn(gshape, device="cuda", generator=gen)) / 16).to(torch.bfloat16)
    return q, k, v, g, None


def assert_like_loop(got, want, nan_only: bool, what: str) -> None:
    bad_got, bad_want = ~torch.isfinite(got), ~torch.isfinite(want)
    assert bad_want.any(), f"{what}: the poisoned loop stayed finite (test set-up)"
    assert torch.equal(bad_got, bad_want), f"{what}: non-finite at {int((bad_got != bad_want).sum())} other places"
    if nan_only:
        assert torch.equal(got.isnan(), want.isnan()), f"{what}: NaN elsewhere than in the loop"
    ok = ~bad_want
    err = ((got[ok].float() - want[ok]).norm() / want[ok].norm()).item()
    assert err < FINITE_TOL, f"{what}: finite entries off by {err:.1e}"


@pytest.mark.parametrize("gate", ["vector", "scalar", "constant"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_nonfinite_values_propagate_as_in_the_loop(shape, gate):
    from gla_inductor.reference import naive_recurrent_gla
    from gla_inductor.kernels import chunk as kchunk

    B, T, H, K, V = shape
    q, k, v, g, g_gamma = inputs(B, T, H, K, V, gate)
    poison = {(0, 1): (T * 2 // 5, 7, float("nan")), (B - 1, 0): (T * 3 // 4, V - 3, float("inf"))}
    for (b, h), (t, c, value) in poison.items():
        v[b, t, h, c] = value
    runs = [kchunk.forward(GLACall(q, k, v, g, g_gamma, None, K**-0.5, True, False)) for _ in range(3)]
    for o, ht in runs[1:]:
        assert torch.equal(o.nan_to_num(), runs[0][0].nan_to_num()) and torch.equal(ht.nan_to_num(),
                                                                                     runs[0][1].nan_to_num())
    o, ht = runs[0]
    for (b, h), (t, c, value) in poison.items():
        sl = [None if x is None else x[b:b + 1, :, h:h + 1].float() for x in (q, k, v, g)]
        gamma = None if g_gamma is None else g_gamma[h:h + 1]
        o_ref, ht_ref = naive_recurrent_gla(*sl, g_gamma=gamma, scale=K**-0.5, output_final_state=True)
        nan_only = value != value
        assert_like_loop(o[b:b + 1, :, h:h + 1], o_ref, nan_only, f"o of head ({b}, {h})")
        assert_like_loop(ht[b:b + 1, h:h + 1], ht_ref, nan_only, f"final state of head ({b}, {h})")
    assert torch.isfinite(o[0, :, 0]).all() and torch.isfinite(ht[0, 0]).all(), "the clean head (0, 0) is not finite"
