"""The cost rule: short steps without gradients are left to Inductor where the model says the
rewrite loses, with the estimate in explain's reason; long sequences and training are rewritten."""

import pytest
import torch

import gla_inductor
from gla_inductor import cost

pytestmark = pytest.mark.usefixtures("cost_rule")


def _decode(q, k, v, g, cache):
    S = cache * g.exp()[..., None] + k[..., None] * v[..., None, :]
    cache.copy_(S)
    return (q[..., None] * S).sum(-2)


def _loop(q, k, v, g):
    B, T, H, K = q.shape
    S = q.new_zeros(B, H, K, v.shape[-1])
    out = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None] + k[:, t, :, :, None] * v[:, t, :, None, :]
        out.append((q[:, t, :, :, None] * S).sum(-2))
    return torch.stack(out, 1)


def test_cpu_decode_is_left_to_inductor_with_the_estimate():
    B, H, K, V = 4, 8, 32, 32
    q, k, g = (torch.randn(B, H, K) for _ in range(3))
    v, cache = torch.randn(B, H, V), torch.randn(B, H, K, V)
    with torch.no_grad():
        report = gla_inductor.explain(_decode, q, k, v, torch.nn.functional.logsigmoid(g), cache.clone())
    assert report.matches == []
    reasons = [nm.reason for nm in report.near_misses]
    assert any(r.startswith("left to Inductor: T = 1, B·H = 32, K = 32, V = 32 on cpu, estimated") for r in reasons)


def test_long_loops_and_training_are_rewritten():
    q, k, v, g = (torch.randn(2, 80, 2, 8) for _ in range(4))
    g = torch.nn.functional.logsigmoid(g)
    assert len(gla_inductor.explain(_loop, q, k, v, g).matches) == 1  # T = 80
    short = [x[:, :4].clone().requires_grad_() for x in (q, k, v, g)]
    assert len(gla_inductor.explain(_loop, *short).matches) == 1  # T = 4, with gradients


def _reason(device, B, steps=1, H=32):
    return cost.unprofitable_reason(cost.Candidate(form="decode", steps=steps, batch_heads=B * H, K=128, V=128,
                                                   device=device, needs_grad=False))


def test_model_decisions_for_the_extern_op():
    with gla_inductor.config.patch(decode_lowering="extern"):
        assert not cost.lowered("cuda")
        # measured (H200): the eager op loses to Inductor's fused step at B = 64 and 128, wins at 256
        assert _reason("cuda", 64) is not None and _reason("cuda", 128) is not None and _reason("cuda", 256) is None
        assert _reason("cuda", 64, steps=4) is None  # one pass over the state against four
    long = cost.Candidate(form="loop", steps=512, batch_heads=8, K=64, V=64, device="cpu", needs_grad=False)
    assert cost.unprofitable_reason(long) is None
    unknown = cost.Candidate(form="decode", steps=None, batch_heads=8, K=64, V=64, device="cpu", needs_grad=False)
    assert cost.unprofitable_reason(unknown) is None and cost.estimate(unknown) is None


def test_model_decisions_for_the_lowered_op():
    """Lowered into the graph's code (a template launch on CUDA), the op's host cost is a kernel
    launch like Inductor's own: one pass over the state wins from small batches on, and where both
    sides are only host time the device time decides (what CUDA graphs replay: measured on an H200,
    B = 16 decode 0.016 ms rewritten against Inductor's 0.024; two steps 0.020 against 0.041). On
    CPU nothing changes: the lowered step is Inductor's own code."""
    assert cost.lowered("cuda") and not cost.lowered("cpu")
    for B in (1, 16, 64, 128, 256):
        for steps in (1, 2, 4, 8):
            assert _reason("cuda", B, steps) is None, (B, steps)
    assert _reason("cuda", 1, H=1) is None  # 128 KiB of state: a host-bound tie, won on the device
    est = cost.estimate(cost.Candidate(form="decode", steps=1, batch_heads=16 * 32, K=128, V=128, device="cuda",
                                       needs_grad=False))
    assert est.ours_ms == est.inductor_ms and est.ours_device_ms < est.inductor_device_ms and est.rewrite_wins()
    assert _reason("cpu", 16) is not None and _reason("cpu", 256) is not None and _reason("cpu", 16, steps=8) is not None


def test_a_step_that_stays_an_extern_call_pays_its_host_cost():
    """A computed scale keeps the decode op an extern call even with lowering on: then the
    eager op's host cost counts, and small batches stay with Inductor."""
    def candidate(B, lowered):
        return cost.Candidate(form="decode", steps=1, batch_heads=B * 32, K=128, V=128, device="cuda",
                              needs_grad=False, lowered=lowered)
    assert cost.unprofitable_reason(candidate(16, lowered=False)) is not None
    assert cost.unprofitable_reason(candidate(16, lowered=True)) is None
    assert cost.unprofitable_reason(candidate(256, lowered=False)) is None
