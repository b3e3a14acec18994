"""Retention programs for the spelling fuzzer (tests/recognize/test_fuzz.py): parallel GLA whose
decay depends only on positions and constants, as RetNet implementations spell it, and grouped
q/k heads repeated over v's heads in the user's code.

The decay D[h, i, j] = gamma_h ** (i - j) on the causal triangle (gamma_h = 1 - 2 ** (-c - h),
RetNet's per-head decays), built one of these ways:

  power           gamma ** (i - j), the future zeroed by masked_fill
  power_abs       gamma ** |i - j|, the future zeroed by masked_fill
  inf_exp_nan     masked_fill(future, +inf) of i - j, times log gamma, exp, nan_to_num (torchscale)
  exp2            exp2((i - j) * log2(gamma)), where(i >= j)
  exp_tril_ones   exp(tril(d)) * tril(ones), d = (i - j) * log gamma
  tril_exp_tril   d.tril().exp().tril()

applied to the scores as a product or as the third einsum operand ('bhqd,bhkd,hqk->bhqk'), in
head-first [B, H, T, D] or [B, T, H, D] layouts, q and k optionally with fewer heads than v.
Look-alikes that must not be rewritten: the mask strict (shifted by one: D[i, i] = 0), no mask
(non-causal), a negative base (the sign of the decay alternates). A decay growing instead
(gamma ** (j - i) on the triangle, a positive log gate) is GLA of other gates, and one scaled per
head (gamma ** (i - j - 1), a factor of every query row, foldable into q) GLA of another q:
``equivalent`` (rewritten where the factor is held by a tensor, forms/row_factor.py).
"""

from __future__ import annotations

from typing import Optional

import torch
from hypothesis import strategies as st

from fuzz_programs import SPREADS, Program, Src, dims, emit_spread

DECAYS = ["power", "power_abs", "inf_exp_nan", "exp2", "exp_tril_ones", "tril_exp_tril"]
APPLIES = ["product", "einsum3", "einsum_then"]
RETENTION_MUTATIONS = {
    "near": ["strict", "noncausal", "negative_base"],
    "equivalent": ["growth", "scaled"],
}


@st.composite
def grouped_dims(draw, at_least: Optional[dict] = None) -> dict:
    """dims() with the heads of q and k (G) and of v (H = 2 G)."""
    d = draw(dims(at_least=at_least))
    d["G"] = d["H"]
    d["H"] = 2 * d["G"]
    return d


@st.composite
def retention_program(draw, mutation: Optional[str] = None) -> Program:
    decays = DECAYS
    if mutation == "negative_base":
        decays = ["power", "power_abs"]  # an exp is never negative
    c = {
        "decay": draw(st.sampled_from(decays)),
        "apply": draw(st.sampled_from(APPLIES)),
        "out": draw(st.sampled_from(["matmul", "einsum"])),
        "layout": draw(st.sampled_from(["BHTD", "BTHD"])),
        "base": draw(st.sampled_from([2, 3, 5])),
        "scale": draw(st.sampled_from(["none", "q", "scores"])),
        "grouped": draw(st.sampled_from([None, None] + SPREADS)),
        "mutation": mutation,
    }
    # a strict mask or a per-head scale over K = 1 is still no GLA; non-causal needs T >= 2
    d = draw(grouped_dims() if c["grouped"] else dims())
    return make_retention(c, d, seed=draw(st.integers(0, 2**16)), train=draw(st.sampled_from([True, True, False])))


def make_retention(c: dict, d: dict, seed: int, train: bool = True) -> Program:
    qk_heads = d.get("G", d["H"])
    shape = {"BHTD": lambda h, x: (d["B"], h, d["T"], x), "BTHD": lambda h, x: (d["B"], d["T"], h, x)}[c["layout"]]
    args = [("q", shape(qk_heads, d["K"]), "randn"), ("k", shape(qk_heads, d["K"]), "randn"),
            ("v", shape(d["H"], d["V"]), "randn")]
    m = c["mutation"]
    kind = next((k for k, ms in RETENTION_MUTATIONS.items() if m in ms), "gla")
    return Program(kind=kind, name=f"retention/{m or c['decay']}", source=render_retention(c), args=args,
                   dtype=torch.float32, seed=seed, gate_dist="decay", choices=c, dims=d,
                   expected={"gla": 1, "near": 0}.get(kind), train=train)


def render_retention(c: dict) -> str:
    src = Src("q, k, v")
    head = c["layout"].index("H")
    src(f"B, T, K, H, V = q.shape[0], q.shape[{c['layout'].index('T')}], q.shape[-1], v.shape[{head}], v.shape[-1]")
    if c["layout"] == "BTHD":
        src("q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)")
    emit_spread(src, c["grouped"])
    sign = "-" if c["mutation"] == "negative_base" else ""
    src(f"gamma = {sign}(1 - 2.0 ** (-{c['base']} - torch.arange(H, dtype=torch.float32)))")
    _decay(src, c)
    if c["mutation"] == "scaled":
        src("D = D / gamma[:, None, None]  # gamma ** (i - j - 1): D[i, i] = 1 / gamma")
    if c["scale"] == "q":
        src("q = q * K ** -0.5")
    src({
        "product": "A = (q @ k.transpose(-1, -2)) * D",
        "einsum3": 'A = torch.einsum("bhqd,bhkd,hqk->bhqk", q, k, D)',
        "einsum_then": 'A = torch.einsum("bhid,bhjd->bhij", q, k) * D',
    }[c["apply"]])
    if c["scale"] == "scores":
        src("A = A * K ** -0.5")
    src("o = A @ v" if c["out"] == "matmul" else 'o = torch.einsum("bhij,bhjd->bhid", A, v)')
    src("return o.transpose(1, 2)" if c["layout"] == "BTHD" else "return o")
    return src.text()


def _decay(src: Src, c: dict) -> None:
    """D [H, T, T]: gamma ** (i - j) on the causal triangle (or its mutation)."""
    m, how = c["mutation"], c["decay"]
    causal = m != "noncausal"
    strict = m == "strict"
    dist = "(i[None, :] - i[:, None])" if m == "growth" else "(i[:, None] - i[None, :])"
    if how in ("power", "power_abs"):
        src("i = torch.arange(T)")
        src(f"dist = {dist}")
        src(f"D = gamma[:, None, None] ** {'dist.abs()' if how == 'power_abs' else 'dist'}")
        if causal:
            src(f"D = D.masked_fill(i[:, None] {'<=' if strict else '<'} i[None, :], 0)")
    elif how == "inf_exp_nan":
        src("i = torch.arange(T, dtype=torch.float32)")
        ones = "torch.ones(T, T)"
        src(f"causal = torch.tril({ones}{', -1' if strict else ''})")
        src(f"dist = torch.masked_fill({dist}, ~causal.bool(), float('inf'))" if causal else f"dist = {dist}")
        src("D = torch.nan_to_num(torch.exp(dist * torch.log(gamma)[:, None, None]))")
    elif how == "exp2":
        src("i = torch.arange(T, dtype=torch.float32)")
        src(f"D = torch.exp2({dist} * torch.log2(gamma)[:, None, None])")
        if causal:
            src(f"D = torch.where(i[:, None] {'>' if strict else '>='} i[None, :], D, 0.0)")
    else:
        src("i = torch.arange(T, dtype=torch.float32)")
        src(f"d = {dist} * torch.log(gamma)[:, None, None]")
        diag = "-1" if strict else ""
        if how == "exp_tril_ones":
            mask = f" * torch.tril(torch.ones(T, T){', -1' if strict else ''})" if causal else ""
            src(f"D = torch.exp(torch.tril(d)){mask}")
        else:
            src(f"D = d.tril().exp().tril({diag})" if causal else "D = d.tril().exp()")
