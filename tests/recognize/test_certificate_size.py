"""The chunked form's certificate at fewer batches and heads (recognize/certify/shrink.py): a scan whose
full-size certificate exceeds the memory budget is still rewritten, certified at 2 batches and
2 heads; code that treats one batch or head apart (alike at 2, not at full size) is refused
that shortcut; a refused subgraph is certified at full size within the budget, and rejected
past it; the real transformers Mamba2 mixer is rewritten through the shortcut.

Instead of huge tensors, the budget (certificate.CERT_BUDGET_BYTES) is patched down: the scans here
need ~20 KiB certified at 2 batches and 2 heads, several times that at full size. Outputs are
compared with the same code run eagerly in float64.
"""

import pytest
import torch
from torch._dynamo.utils import counters

from gla_inductor.backend import rewrite
from gla_inductor.recognize.certify import certificate, shrink, summed_products
from helpers import FP32_TOL, compile_rewritten, outputs, rel_err
from spellings import SPELLINGS, chunked_hf_broadcast, chunked_hf_einsum

B, T, H, G, N, P = 4, 9, 8, 2, 3, 5  # T = 9 over chunks of 4: a padded last chunk
BUDGET = 64 << 10  # above the reduced certificate's estimate (~20 KiB), below the full one's


@pytest.fixture(autouse=True)
def fresh(one_thread, seeded_compiler):
    certificate.CERTIFIED.clear()
    yield
    certificate.CERTIFIED.clear()


@pytest.fixture
def small_budget(monkeypatch):
    monkeypatch.setattr(certificate, "CERT_BUDGET_BYTES", BUDGET)


@pytest.fixture
def refusals(monkeypatch) -> list:
    """Why shrink.reduce refused, call by call."""
    seen = []
    real = shrink.reduce

    def spy(*args, **kwargs):
        try:
            return real(*args, **kwargs)
        except shrink.Refuse as e:
            seen.append(str(e))
            raise

    monkeypatch.setattr(shrink, "reduce", spy)
    return seen


def certificates() -> dict:
    c = counters["gla_inductor"]
    return {"reduced": c["certificates_reduced"], "full": c["certificates_full"]}


def run(fn, args) -> list:
    """Compile `fn` with the backend's rewrite (the rewritten graph runs eagerly), check its
    outputs against `fn` in float64, and return the reasons of the candidates left alone."""
    got, results = compile_rewritten(fn, [a.clone() for a in args], dynamic=False)
    want = outputs(fn(*[a.double() for a in args]))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert rel_err(g, w) <= FP32_TOL
    return [nm.reason for r in results for nm in r.near_misses]


def rewrites() -> int:
    return counters["gla_inductor"]["rewrites"]


# ---- the scan, with hooks -----------------------------------------------------------------------
ssd = chunked_hf_einsum  # with its hooks on the intra-chunk term and the final state


def ssd_inputs(b=B, h=H):
    return (torch.randn(b, T, h, P), torch.randn(b, T, h), -torch.rand(h), torch.randn(b, T, G, N),
            torch.randn(b, T, G, N), torch.randn(b, h, P, N))


# ---- (a) past the budget, certified at 2 batches and 2 heads --------------------------------------
def test_reduced_certificate_rewrites_past_the_budget(small_budget, refusals):
    assert run(ssd, ssd_inputs()) == []
    assert rewrites() == 1
    assert certificates() == {"reduced": 1, "full": 0}
    assert refusals == []


def test_full_size_certificate_past_the_budget_is_refused(small_budget, monkeypatch):
    """The premise of the test above: at full size the same scan exceeds the budget, and is
    left alone with the reason."""

    def refuse(*args, **kwargs):
        raise shrink.Refuse("switched off by the test")

    monkeypatch.setattr(shrink, "reduce", refuse)
    reasons = run(ssd, ssd_inputs())
    assert rewrites() == 0
    assert certificates() == {"reduced": 0, "full": 0}
    assert any("GiB at full size" in r and "switched off by the test" in r for r in reasons), reasons


@pytest.mark.parametrize("sp", [s for s in SPELLINGS if s.form == "chunked"], ids=lambda s: s.name)
def test_spellings_certify_at_fewer_heads(sp, refusals):
    """Every chunked spelling (einsums, broadcast-multiply-sums, chunk loops over matmuls,
    setitems and stacks) is admitted by the table: no full-size certificate."""
    run(sp.fn, sp.make(torch.float32))
    assert rewrites() == 1
    assert certificates()["full"] == 0 and certificates()["reduced"] >= 1, refusals


def test_certificate_cache_is_keyed_by_sizes():
    run(ssd, ssd_inputs())
    run(ssd, ssd_inputs())  # a recompile at the same sizes: the certificate is reused
    assert certificates() == {"reduced": 1, "full": 0}
    torch._dynamo.reset()
    run(ssd, ssd_inputs(b=6, h=4))
    assert rewrites() == 3
    assert certificates() == {"reduced": 2, "full": 0}


# ---- broadcast-multiply-sums, certified without their products ------------------------------------
def test_broadcast_products_are_not_materialized(monkeypatch):
    """transformers <= 5.17 spells the scan's contractions as broadcast products summed over an
    axis ([b, c, l, l, h, n] and larger at model sizes): the certificate evaluates each as an
    einsum, and its estimate counts no product. Here (state size 64) the reduced certificate
    needs ~227 KiB so, ~348 KiB with the products: a budget between them rewrites the scan,
    and only with the products left out."""
    monkeypatch.setattr(certificate, "CERT_BUDGET_BYTES", 288 << 10)
    args = (torch.randn(B, T, H, P), torch.randn(B, T, H), -torch.rand(H), torch.randn(B, T, G, 64),
            torch.randn(B, T, G, 64), torch.randn(B, H, P, 64))
    assert run(chunked_hf_broadcast, args) == []
    assert rewrites() == 1 and certificates() == {"reduced": 1, "full": 0}

    torch._dynamo.reset()
    certificate.CERTIFIED.clear()
    monkeypatch.setattr(summed_products, "is_summed_product", lambda n: False)
    assert any("GiB at full size" in r for r in run(chunked_hf_broadcast, args))
    assert rewrites() == 1


@pytest.mark.parametrize("a_shape, b_shape, dim, keepdim", [
    ((2, 3, 1, 5), (2, 1, 4, 5), -1, False),  # a broadcast outer product, summed over the last axis
    ((2, 3, 4, 1), (1, 3, 4, 6), 2, True),
    ((3, 4), (2, 3, 4), (0, 2), False),  # operands of different rank
    ((2, 1, 4), (2, 3, 1), None, False),  # a full sum
    ((2, 3, 1), (2, 3, 1), -1, False),  # a sum over a size-1 axis both share
])
def test_sum_of_product_is_the_sum_of_the_product(a_shape, b_shape, dim, keepdim):
    a, b = torch.randn(a_shape, dtype=torch.float64), torch.randn(b_shape, dtype=torch.float64)
    want = (a * b).sum() if dim is None else (a * b).sum(dim, keepdim=keepdim)
    got = summed_products.sum_of_product(a, b, dim, keepdim)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


# ---- (b) alike at 2 batches and 2 heads, not at full size ----------------------------------------
def head_scale(y):
    return y * torch.tensor([1.0, 1.0, 1.0, 2.0, 1.0, 1.0, 1.0, 1.0])[:, None]


def head_mask_from_arange(y):
    return y * (1 + (torch.arange(H) >= 3).to(y.dtype))[:, None]


def batch_scale(y):
    return y * torch.tensor([1.0, 1.0, 2.0, 2.0])[:, None, None, None, None]


@pytest.mark.parametrize("twist", [head_scale, head_mask_from_arange, batch_scale], ids=lambda f: f.__name__)
def test_constant_apart_for_some_heads_is_not_rewritten(twist, small_budget, refusals):
    """A constant that scales heads (or batches) 3.. differently: equal over the first two,
    so cut to 2 it would look GLA. Its values are checked: refused, then too large."""
    reasons = run(lambda *a: ssd(*a, on_diag=twist), ssd_inputs())
    assert rewrites() == 0
    assert any("differs between batches or heads" in r for r in refusals), refusals
    assert any("GiB at full size" in r for r in reasons), reasons


def final_heads_sliced(f):
    return torch.cat([f[:, :3], 2 * f[:, 3:]], dim=1)


def final_batches_sliced(f):
    return torch.cat([f[:2], 2 * f[2:]], dim=0)


def final_batches_flipped(f):
    return (f + f.flip(0)) / 2


def final_batches_summed(f):
    return f + f.sum(0, keepdim=True)


def final_head_indexed(f):
    return f * f[:, 3:4]


@pytest.mark.parametrize(
    "twist", [final_heads_sliced, final_batches_sliced, final_batches_flipped, final_batches_summed,
              final_head_indexed], ids=lambda f: f.__name__)
def test_final_state_apart_for_some_slices_is_not_taken(twist, small_budget, refusals):
    """A final-state candidate that slices, flips, sums or indexes across batches or heads is
    refused by the table (cut to 2, `f[:, 3:]` is empty and the slice looks GLA); the scan
    is rewritten with its own final state, which the twist then reads: outputs exact."""
    run(lambda *a: ssd(*a, on_final=twist), ssd_inputs())
    assert rewrites() == 1
    assert any("batch or head axis" in r for r in refusals), refusals


def diag_heads_cat(y):
    return torch.cat([y[:, :, :, :3], 2 * y[:, :, :, 3:]], dim=3)


def diag_heads_in_place(y):
    y[:, :, :, 3:] *= 2
    return y


def diag_batches_in_place(y):
    y[2:] *= 2
    return y


@pytest.mark.parametrize("twist", [diag_heads_cat, diag_heads_in_place, diag_batches_in_place],
                         ids=lambda f: f.__name__)
def test_intra_chunk_term_apart_for_some_slices_is_not_rewritten(twist, small_budget):
    run(lambda *a: ssd(*a, on_diag=twist), ssd_inputs())
    assert rewrites() == 0


# ---- (c) refused by the table: the full-size certificate within the budget -----------------------
def final_heads_rejoined(f):
    return torch.cat([f[:, :3], f[:, 3:]], dim=1)


def final_batches_rejoined(f):
    return torch.cat([f[:2], f[2:]], dim=0)


@pytest.mark.parametrize("twist", [final_heads_rejoined, final_batches_rejoined], ids=lambda f: f.__name__)
def test_full_size_certificate_when_the_table_refuses(twist, refusals):
    """The final state cut along heads (batches) and joined again: GLA, but a slice along a
    reduced axis is not admitted. Within the (default) budget the full-size certificate
    proves that reading."""
    run(lambda *a: ssd(*a, on_final=twist), ssd_inputs())
    assert rewrites() == 1
    assert certificates()["full"] >= 1
    assert any("acts along a batch or head axis" in r for r in refusals), refusals


# ---- (d) transformers' Mamba2 mixer ----------------------------------------------------------------
@pytest.mark.parametrize("groups", [1, 4])
def test_mamba2_mixer_certified_at_fewer_heads(groups, monkeypatch):
    """One Mamba2Mixer (B=2, T=512, 16 heads of 32, state 64, chunk 128), no cache, fp32: one
    rewrite certified at 2 heads under a budget below the full-size certificate's, and the
    output matches eager's."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer

    monkeypatch.setattr(certificate, "CERT_BUDGET_BYTES", 32 << 20)  # reduced ~14 MiB, full ~8x
    cfg = transformers.Mamba2Config(hidden_size=256, num_heads=16, head_dim=32, expand=2, state_size=64,
                                    n_groups=groups, chunk_size=128, conv_kernel=4, num_hidden_layers=1)
    mixer = Mamba2Mixer(cfg, layer_idx=0).eval()
    x = torch.randn(2, 512, 256)

    def backend(gm, example_inputs):
        rewrite(gm, example_inputs)
        return gm.forward

    with torch.no_grad():
        want = mixer(x)
        got = torch.compile(mixer, backend=backend, dynamic=False)(x)
    assert rewrites() == 1
    assert certificates()["full"] == 0 and certificates()["reduced"] >= 1
    assert rel_err(got, want) <= 1e-4
