"""The fused scans walked in segments (``ChunkConfig.scan_segments`` / ``bwd_scan_segments``;
gla_chunk_segsum, then gla_chunk_scan with SEGMENTS): where few (batch, head, value tile) programs
would walk a long sequence, each walk is cut into segments walked in parallel.

Numerics against the float64 time loop (forward, final state, every gradient) for every gate kind,
initial and final states, reverse, grouped heads, fused gates, 16-bit inputs, T not a multiple of
the chunk, more segments than chunks, the split schedule, packed sequences and non-finite values;
the launches really are segmented; the rule that picks the segments; the Inductor lowering. Under
the Triton interpreter on CPU (small shapes), compiled on a GPU.
"""

import dataclasses
import re
import types

import pytest
import torch
import torch.nn.functional as F

from gla_inductor.contract import GLACall
from gla_inductor.gates import GateFn, log_gate
from gla_inductor.kernels import chunk as kchunk, configs as kconfigs
from gla_inductor.reference import naive_recurrent_gla

from helpers import (assert_loop_exact, assert_rel_close, compiled_fwd_bwd, gla_inputs, loop_reference,
                     loop_reference_grads, placed, rel_norm_err)

triton = pytest.importorskip("triton")
pytest.importorskip("jinja2")
ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
KERNELS_RUN_HERE = ON_GPU or type(triton.language.cumsum).__name__ == "InterpretedFunction"
needs_kernels = pytest.mark.skipif(not KERNELS_RUN_HERE, reason="triton was imported without TRITON_INTERPRET=1")

TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
GRADS = ("q", "k", "v", "g", "g_gamma", "initial_state")


def _steep(shape, gen):
    """Log gates uniform in [-20, 0] (float64): chunk sums far beyond exp's range."""
    return -20 * torch.rand(shape, generator=gen, dtype=torch.float64)


@dataclasses.dataclass(frozen=True)
class Case:
    gate: str  # "vector" | "scalar" | "constant" | "none"
    T: int = 150
    B: int = 1
    H: int = 2
    G: int = 0  # heads of q and k (grouped heads); 0: H
    K: int = 16
    V: int = 24
    fwd: int = 3  # scan_segments
    bwd: int = 2  # bwd_scan_segments
    h0: bool = True
    reverse: bool = False
    dtype: torch.dtype = torch.float32
    split: bool = False
    steep: bool = False

    @property
    def id(self) -> str:
        flags = [n for n in ("reverse", "split", "steep") if getattr(self, n)] + ([] if self.h0 else ["no_h0"])
        grouped = f"-G{self.G}" if self.G else ""
        return "-".join([self.gate, f"B{self.B}-T{self.T}-H{self.H}{grouped}-K{self.K}-V{self.V}",
                         f"P{self.fwd}.{self.bwd}", str(self.dtype)[6:], *flags])


BT = 16  # the chunk these tests run: 150 steps are 10 chunks, the last one partial
CASES = [
    Case("scalar"),
    Case("scalar", reverse=True, fwd=4, bwd=3),
    Case("constant", B=2, fwd=2, bwd=4),
    Case("constant", reverse=True, h0=False),
    Case("none", fwd=4, bwd=3),
    Case("none", reverse=True),
    Case("vector", fwd=3, bwd=3),
    Case("vector", reverse=True, fwd=2, bwd=4),
    # grouped heads: q and k shared by pairs of heads
    Case("scalar", H=4, G=2, fwd=4, bwd=2),
    # more segments than chunks: the empty segments' programs only fold the others
    Case("scalar", T=40, fwd=8, bwd=4),
    Case("vector", T=1, fwd=2, bwd=2),
    Case("scalar", T=150, K=32, V=32, dtype=torch.bfloat16, fwd=4, bwd=4),
    Case("scalar", steep=True, reverse=True),
    # the split schedule: its states scans walk in segments too
    Case("scalar", split=True, fwd=3, bwd=3),
    Case("vector", split=True, reverse=True, fwd=2, bwd=3),
]


def _config(case: Case, B=None, T=None):
    cfg = kconfigs.default_config(B or case.B, T or case.T, case.H, case.K, case.V, case.dtype, case.gate == "vector",
                                  torch.device(DEVICE))
    return dataclasses.replace(cfg, block_t=BT, split=case.split, local=False, terms=False, scan_segments=case.fwd,
                               bwd_scan_segments=case.bwd)


def _inputs(case: Case) -> dict:
    g_fn = {"g_fn": _steep} if case.steep else {}
    return gla_inputs(case.gate, case.B, case.T, case.H, case.K, case.V, G=case.G or None, dtype=case.dtype,
                      with_h0=case.h0, **g_fn)


@pytest.fixture
def launches(monkeypatch):
    """The (template, SEGMENTS, grid) of every kernel launch of the test."""
    seen = []
    launch = kchunk._launch

    def record(template, options, tensors, out, grid, tiles):
        seen.append((template, options.get("SEGMENTS", 1), tuple(grid)))
        return launch(template, options, tensors, out, grid, tiles)

    monkeypatch.setattr(kchunk, "_launch", record)
    return seen


@needs_kernels
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_segmented_scans_match_the_loop(case: Case, launches):
    x = placed(_inputs(case), DEVICE)
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(case.B, case.T, case.H, case.V, generator=gen).to(case.dtype).to(DEVICE)
    dht = torch.randn(case.B, case.H, case.K, case.V, generator=gen).to(DEVICE)
    scale = case.K ** -0.5
    cfg = _config(case)
    args = (x["q"], x["k"], x["v"], x["g"], x["g_gamma"], x["initial_state"], scale)
    o, ht = kchunk.forward(GLACall(*args, True, case.reverse), config=cfg)
    fwd_launches = list(launches)
    grads = kchunk.backward(GLACall(*args, reverse=case.reverse), do, dht, config=cfg)

    # the segments' sums, then the walk in as many segments, forward and in both backward scans
    segsums = [s for t, s, _ in launches if t == "gla_chunk_segsum"]
    scans = [(s, grid[2]) for t, s, grid in launches if t == "gla_chunk_scan"]
    assert [s for t, s, _ in fwd_launches if t == "gla_chunk_segsum"] == [case.fwd]
    assert segsums == [case.fwd, case.bwd, case.bwd]
    assert scans == [(case.fwd, case.fwd), (case.bwd, case.bwd), (case.bwd, case.bwd)]

    ref_o, ref_ht, ref_grads = loop_reference_grads(x, do, dht, scale=scale, reverse=case.reverse)
    tol = TOL[case.dtype] * (10 if case.steep else 1)
    assert o.dtype == case.dtype
    assert_rel_close("o", o, ref_o, tol)
    assert_rel_close("ht", ht, ref_ht, tol)
    for name, grad in zip(GRADS, grads):
        if x[name] is None:
            assert grad.shape == (0,), name
            continue
        assert grad.dtype == x[name].dtype, name
        assert_rel_close(f"d{name}", grad, ref_grads[name], max(tol, TOL[grad.dtype]))


@needs_kernels
def test_first_segment_is_the_plain_walk():
    """The first segment starts from h0 with nothing to fold and walks the chunks the one walk
    walks first, with the same products: its outputs are those of the unsegmented scan (bit for
    bit under the interpreter; compiled, two kernels may round differently)."""
    case = Case("scalar", fwd=1, bwd=1)
    x = placed(_inputs(case), DEVICE)
    args = (x["q"], x["k"], x["v"], x["g"], None, x["initial_state"], 0.25, True, False)
    plain = dataclasses.replace(_config(case), scan_segments=1)
    cut = dataclasses.replace(plain, scan_segments=3)
    o1, ht1 = kchunk.forward(GLACall(*args), config=plain)
    o3, ht3 = kchunk.forward(GLACall(*args), config=cut)
    ref_o, ref_ht = loop_reference(x, scale=0.25)
    # the same chunks, the same products: the first segment's outputs are bitwise those of one walk
    first = (10 + 2) // 3 * BT
    if ON_GPU:
        assert rel_norm_err(o3[:, :first], o1[:, :first]) < 1e-6
    else:
        assert torch.equal(o1[:, :first], o3[:, :first])
    assert rel_norm_err(o3, ref_o) < 1e-5 and rel_norm_err(ht3, ref_ht) < 1e-5


@needs_kernels
@pytest.mark.parametrize("gate_fn", ["logsigmoid", "softplus"])
@pytest.mark.parametrize("gate", ["scalar", "vector"])
def test_fused_gates_in_segments(gate, gate_fn):
    """A fused gate (g is the function's input) reaches the segments' sums as it reaches the walk:
    o and the final state match the loop on the gate torch computes; with logsigmoid (no
    parameters) the backward's dg is x's gradient, checked too."""
    case = Case(gate, fwd=3, bwd=2)
    inputs = _inputs(case)
    gen = torch.Generator().manual_seed(3)
    xg = torch.randn(inputs["g"].shape, generator=gen, dtype=torch.float64)
    heads = xg.shape[2:]
    a = -torch.rand(heads[0], generator=gen, dtype=torch.float64) if gate_fn == "softplus" else None
    bias = torch.randn(heads, generator=gen, dtype=torch.float64) if gate_fn == "softplus" else None
    fn = GateFn(gate_fn, 0.5 if gate_fn == "logsigmoid" else 1.0, None, None)
    dev = {n: None if t is None else t.float().to(DEVICE) for n, t in dict(inputs, g=xg, a=a, bias=bias).items()}
    call = GLACall(dev["q"], dev["k"], dev["v"], dev["g"], None, dev["initial_state"], 0.25, True, False, gate=fn,
                   gate_a=dev["a"], gate_bias=dev["bias"])
    o, ht = kchunk.forward(call, config=_config(case))

    leaves = {n: None if t is None else t.detach().double().requires_grad_() for n, t in dev.items()}
    g64 = log_gate(leaves["g"], fn, leaves["a"], leaves["bias"], torch.float64)
    o64, ht64 = naive_recurrent_gla(leaves["q"], leaves["k"], leaves["v"], g64, scale=0.25,
                                    initial_state=leaves["initial_state"], output_final_state=True)
    assert_rel_close("o", o, o64.detach(), 1e-4)
    assert_rel_close("ht", ht, ht64.detach(), 1e-4)
    if gate_fn == "logsigmoid":
        do = torch.randn(o.shape, generator=gen).to(DEVICE)
        grads = kchunk.backward(call.replace(output_final_state=False), do, None, config=_config(case))
        (o64.double() * do.double().cpu()).sum().backward()
        assert_rel_close("dx", grads[3], leaves["g"].grad, 1e-4)
        assert_rel_close("dq", grads[0], leaves["q"].grad, 1e-4)


PACKED = [("scalar", "fused", False), ("constant", "fused", True), ("vector", "fused", False),
          ("vector", "local", False), ("vector", "local", True), ("scalar", "local", True), ("none", "local", False)]


@needs_kernels
@pytest.mark.parametrize("gate,schedule,reverse", PACKED, ids=lambda x: str(x))
def test_packed_sequences_in_segments(gate, schedule, reverse):
    """Packed sequences (cu_seqlens) on the fused scans in segments, and on the local schedule
    (gla_chunk_local over state slots, the carries per sequence, in segments): every sequence's walk
    is cut into its own segments (lengths with 7, 1 and 3 chunks, one empty sequence), each sequence
    as if alone, forward and backward."""
    lengths = [100, 16, 0, 37]
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    T, N, H, K, V = sum(lengths), len(lengths), 2, 16, 24
    x = gla_inputs(gate, 1, T, H, K, V, with_h0=False)
    h0 = torch.randn(N, H, K, V, generator=torch.Generator().manual_seed(2))
    x = placed(dict(x, initial_state=h0), DEVICE)
    gen = torch.Generator().manual_seed(4)
    do = torch.randn(1, T, H, V, generator=gen).to(DEVICE)
    dht = torch.randn(N, H, K, V, generator=gen).to(DEVICE)
    cfg = dataclasses.replace(_config(Case(gate), B=N, T=T), scan_segments=3, bwd_scan_segments=2,
                              local=schedule == "local", segments=3)
    args = (x["q"], x["k"], x["v"], x["g"], x["g_gamma"], x["initial_state"], 0.25)
    cu = offsets.to(DEVICE)
    o, ht = kchunk.forward(GLACall(*args, True, reverse, cu_seqlens=cu), config=cfg)
    dq, dk, dv, dg, dgg, dh0 = kchunk.backward(GLACall(*args, reverse=reverse, cu_seqlens=cu), do, dht, config=cfg)
    for n, (s, e) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist())):
        one = {name: None if t is None else t for name, t in x.items()}
        one.update(q=x["q"][:, s:e], k=x["k"][:, s:e], v=x["v"][:, s:e], initial_state=x["initial_state"][n:n + 1])
        if x["g"] is not None:
            one["g"] = x["g"][:, s:e]
        if e == s:
            torch.testing.assert_close(ht[n], x["initial_state"][n])
            torch.testing.assert_close(dh0[n], dht[n])
            continue
        ro, rht, rg = loop_reference_grads(one, do[:, s:e], dht[n:n + 1], scale=0.25, reverse=reverse)
        assert_rel_close(f"o[{n}]", o[:, s:e], ro, 1e-4)
        assert_rel_close(f"ht[{n}]", ht[n:n + 1], rht, 1e-4)
        for name, got in (("q", dq), ("k", dk), ("v", dv)):
            assert_rel_close(f"d{name}[{n}]", got[:, s:e], rg[name], 1e-4)
        if x["g"] is not None:
            assert_rel_close(f"dg[{n}]", dg[:, s:e], rg["g"], 1e-4)
        assert_rel_close(f"dh0[{n}]", dh0[n:n + 1], rg["initial_state"], 1e-4)


@needs_kernels
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_nonfinite_value_in_a_later_segment(value):
    """A non-finite value in the second of three segments: the poisoned programs redo their walk
    (from their folded start state) with the exact in-chunk product; o is non-finite exactly where
    the loop's is (NaN where it is NaN), and exact elsewhere, earlier segments untouched."""
    case = Case("scalar", fwd=3, h0=False)
    x = placed(_inputs(case), DEVICE)
    x["v"][0, 70, 1, 5] = value  # chunk 4 (of 10): segment 1, in the middle of its chunk
    o, ht = kchunk.forward(GLACall(x["q"], x["k"], x["v"], x["g"], None, None, 0.25, True, False),
                           config=_config(case))
    o64, ht64 = loop_reference(x, scale=0.25)
    for got, want in ((o, o64), (ht, ht64)):
        bad = ~torch.isfinite(want)
        assert bad.any() and torch.equal(~torch.isfinite(got), bad)
        if value != value:
            assert torch.equal(got.isnan(), want.isnan())
        assert rel_norm_err(got[~bad], want[~bad]) < 1e-5


# ----------------------------------------------------------------------------------------------
# the rule
# ----------------------------------------------------------------------------------------------


def test_scan_segments_rule_at_the_target_shapes():
    """Segments where the programs (value tiles of 64) fill less than 3/4 of the SMs, up to two
    programs per SM and segments of at least 4 chunks (132 SMs; 64-step chunks)."""
    rule = kconfigs.scan_segments
    assert rule(1, 16, 128, 64, 128, sms=132) == 8  # (1, 8192, 16, 128, 128): 32 programs
    assert rule(2, 16, 128, 64, 64, sms=132) == 4  # (2, 4096, 16, 128, 128): 64 programs
    assert rule(4, 16, 128, 64, 32, sms=132) == 1  # (4, 2048, 16, 128, 128): 128 programs, segments lost
    assert rule(8, 8, 64, 64, 16, sms=132) == 4  # (8, 1024, 8, 64, 64): 64, 4 chunks each
    assert rule(1, 96, 64, 64, 128, sms=132) == 2  # (1, 8192, 96, 64, 64): 96
    assert rule(8, 16, 128, 64, 32, sms=132) == 1  # (8, 2048, 16, 128, 128): 256 programs fill the SMs
    assert rule(1, 1, 64, 64, 7, sms=132) == 1  # too few chunks to cut


def test_default_config_segments_the_fused_scans_of_non_vector_gates(monkeypatch, fresh_default_config):
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(multi_processor_count=132))
    monkeypatch.delenv("GLA_INDUCTOR_SCAN_SEGMENTS", raising=False)
    cuda = torch.device("cuda")

    def config(B, T, H, K, V, vector=False):
        return kconfigs.default_config(B, T, H, K, V, torch.bfloat16, vector, cuda)

    few = config(1, 8192, 16, 128, 128)
    # the forward keeps value tiles of 64 in segments; the backward's scans keep one walk (unless
    # forced) and narrow their tiles to 32
    assert (few.scan_segments, few.scan.block_v) == (8, 64)
    assert (few.bwd_scan_segments, few.states.block_v) == (1, 32)
    assert few.segsum == kconfigs.TileConfig(block_v=64, num_warps=8, num_stages=2)
    main = config(8, 2048, 16, 128, 128)
    assert (main.scan_segments, main.bwd_scan_segments, main.scan.block_v) == (1, 1, 64)
    vector = config(1, 8192, 16, 32, 128, vector=True)
    assert (vector.scan_segments, vector.bwd_scan_segments) == (1, 1)
    # packed sequences: B is the sequence count
    assert config(1, 8192, 16, 128, 128).scan_segments == kconfigs.default_config(
        1, 8192, 16, 128, 128, torch.bfloat16, False, cuda, True).scan_segments


def test_environment_overrides_the_segments(monkeypatch, fresh_default_config):
    cpu = torch.device("cpu")
    monkeypatch.setenv("GLA_INDUCTOR_SCAN_SEGMENTS", "4,2")
    cfg = kconfigs.default_config(2, 4096, 16, 128, 128, torch.bfloat16, False, cpu)
    assert (cfg.scan_segments, cfg.bwd_scan_segments) == (4, 2)
    assert kconfigs.default_config(2, 4096, 16, 32, 128, torch.bfloat16, True, cpu).scan_segments == 1
    kconfigs.default_config.cache_clear()
    monkeypatch.setenv("GLA_INDUCTOR_SCAN_SEGMENTS", "8")
    cfg = kconfigs.default_config(2, 4096, 16, 128, 128, torch.bfloat16, False, cpu)
    assert (cfg.scan_segments, cfg.bwd_scan_segments) == (8, 8)
    kconfigs.default_config.cache_clear()
    monkeypatch.setenv("GLA_INDUCTOR_SCAN_SEGMENTS", "0")
    with pytest.raises(ValueError, match="GLA_INDUCTOR_SCAN_SEGMENTS"):
        kconfigs.default_config(2, 4096, 16, 128, 128, torch.bfloat16, False, cpu)


# ----------------------------------------------------------------------------------------------
# the lowering
# ----------------------------------------------------------------------------------------------

SCAN_KERNEL = "GLA chunk scan"
SEGSUM_KERNEL = "GLA segment sums"
EXTERN_CALL = re.compile(r"^\s*[\w, ]+ = torch\.ops\.gla_inductor\.\w+\.default\(", re.MULTILINE)


@needs_kernels
@pytest.mark.compat
@pytest.mark.parametrize("gate", ["scalar", "none"])
def test_lowering_runs_the_segmented_scans(gate, monkeypatch, inductor_triton):
    """In a compiled graph each segmented scan is two templates, the segments' sums then the walk:
    forward one pair, backward two; o, the final state and the gradients exact."""
    import gla_inductor
    from gla_inductor.lowerings import chunk as lowering

    def segmented(*args):
        return dataclasses.replace(kconfigs.default_config(*args), block_t=BT, local=False, terms=False, scan_segments=3,
                                   bwd_scan_segments=2)

    monkeypatch.setattr(lowering, "default_config", segmented)
    x = placed(gla_inputs(gate, 1, 100, 2, 16, 24), DEVICE, requires_grad=True)

    @torch.compile(fullgraph=True)
    def fwd(x):
        return gla_inductor.chunk_gla(**x, output_final_state=True, reverse=True)

    try:
        o, ht, fwd_code, bwd_code = compiled_fwd_bwd(fwd, x)
    finally:
        torch._dynamo.reset()
    assert not EXTERN_CALL.search(fwd_code + bwd_code)
    assert fwd_code.count(SEGSUM_KERNEL) == 1 and fwd_code.count(SCAN_KERNEL) == 1
    assert bwd_code.count(SEGSUM_KERNEL) == 2 and bwd_code.count(SCAN_KERNEL) == 2
    assert_loop_exact(x, o, ht, reverse=True)


@needs_kernels
@pytest.mark.compat
@pytest.mark.parametrize("segments", [1, 2])
def test_lowering_runs_the_local_schedule_on_packed_sequences(segments, monkeypatch, inductor_triton):
    """Packed sequences in a compiled graph take the local schedule where the config says so (vector
    gates from K = 64 on a GPU; forced here): the local template over state slots and the carries
    per sequence, in segments or not; o, the final states and every gradient as each sequence alone."""
    from torch._inductor.utils import run_and_get_code

    import gla_inductor
    from gla_inductor.lowerings import chunk as lowering
    from varlen_packing import make, reference

    def local(*args):
        return dataclasses.replace(kconfigs.default_config(*args), block_t=BT, local=True, segments=segments)

    monkeypatch.setattr(lowering, "default_config", local)
    p = make([37, 0, 5, 20], gate="vector", H=2, K=16, V=24, reverse=True)
    leaves = {n: x.detach().to(DEVICE).requires_grad_() for n, x in p.leaves.items()}
    cu = p.cu_seqlens.to(DEVICE)

    @torch.compile(fullgraph=True)
    def fwd(q, k, v, g, h0, cu_seqlens):
        return gla_inductor.chunk_gla(q, k, v, g, initial_state=h0, output_final_state=True, reverse=True,
                                      scale=p.scale, cu_seqlens=cu_seqlens)

    def fwd_bwd():
        o, ht = fwd(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["h0"], cu)
        (o.double().sum() + ht.double().square().sum()).backward()
        return o, ht

    try:
        (o, ht), (fwd_code, bwd_code) = run_and_get_code(fwd_bwd)
    finally:
        torch._dynamo.reset()
    assert not EXTERN_CALL.search(fwd_code + bwd_code)
    assert fwd_code.count("GLA chunk-local terms") == 1 and fwd_code.count("GLA inter-chunk scan") == segments
    assert bwd_code.count("GLA inter-chunk scan") == 2 * segments and SCAN_KERNEL not in bwd_code
    ref_o, ref_ht = reference(p)
    assert rel_norm_err(o, ref_o) < 1e-5 and rel_norm_err(ht, ref_ht) < 1e-5
    refs = torch.autograd.grad(ref_o.sum() + ref_ht.square().sum(), list(p.leaves.values()))
    for name, want in zip(p.leaves, refs):
        assert rel_norm_err(leaves[name].grad, want) < 1e-4, name


@needs_kernels
@pytest.mark.parametrize("schedule", ["scan", "carry"])
def test_fold_keeps_a_zero_state_zero_past_an_overflowing_segment_decay(schedule):
    """Positive log gates (+2 per step) whose product over a segment overflows fp32 while the state
    stays zero there (k = 0 in the first segments): the loop's state is exactly 0 until the keys
    start, and so is the fold's (0 * inf would be NaN), in the fused scan's segments and in the
    local schedule's carry."""
    case = Case("scalar", T=160, fwd=4, h0=False)
    x = placed(_inputs(case), DEVICE)
    x["g"] = torch.full_like(x["g"], 2.0)  # 64 steps: a factor of e^128, past fp32's range
    x["k"][:, :120] = 0.0  # segments 0-2 add nothing; the state grows from step 120 on
    cfg = _config(case)
    if schedule == "carry":
        cfg = dataclasses.replace(cfg, local=True, segments=4)
    o, ht = kchunk.forward(GLACall(x["q"], x["k"], x["v"], x["g"], None, None, 0.25, True, False), config=cfg)
    o64, ht64 = loop_reference(x, scale=0.25)
    assert torch.isfinite(o64).all() and torch.isfinite(ht64).all()  # e^80 at most: finite in fp32
    assert_rel_close("o", o, o64, 1e-4)
    assert_rel_close("ht", ht, ht64, 1e-4)
