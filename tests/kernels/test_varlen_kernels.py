"""Packed variable-length sequences (``cu_seqlens``) on the chunked GLA Triton kernels: the fused
scan's forward, states and dual modes and the chunk-parallel dq/dk/dg kernel over state slots.

Through the public ``chunk_gla`` with the ops routed to their GPU path (``dispatch.chunk_fwd_gpu``
/ ``chunk_bwd_gpu``: the kernels, under the Triton interpreter on CPU), against each sequence run
alone through the float64 time loop: values, final states, every gradient. Shapes are small: the
interpreter runs every program in Python.
"""

import dataclasses
import pytest
import torch

import gla_inductor
from gla_inductor import contract
from gla_inductor.contract import GLACall
from gla_inductor.impl import chunked
from gla_inductor.kernels import chunk as chunk_kernels
from gla_inductor.kernels import configs as kconfigs
from gla_inductor.kernels.configs import default_config
from gla_inductor.ops import dispatch
from varlen_packing import (C, EDGE_LENGTHS, assert_matches, assert_prefix_states, make, random_lengths, reference,
                            rel_err)

triton = pytest.importorskip("triton")
ON_GPU = torch.cuda.is_available()
KERNELS_RUN_HERE = ON_GPU or type(triton.language.cumsum).__name__ == "InterpretedFunction"
pytestmark = [pytest.mark.skipif(not KERNELS_RUN_HERE, reason="triton was imported without TRITON_INTERPRET=1"),
              pytest.mark.usefixtures("one_thread")]
DEVICE = "cuda" if ON_GPU else "cpu"


@pytest.fixture
def kernels(monkeypatch):
    """The ops run the kernels whatever the device (CPU tensors: the interpreter), and never the
    PyTorch fallback, which would hide a kernel that did not run."""
    def no_fallback(*args, **kwargs):
        raise AssertionError("the call fell back to the PyTorch implementation")

    monkeypatch.setattr(dispatch, "chunk_fwd", dispatch.chunk_fwd_gpu)
    monkeypatch.setattr(dispatch, "chunk_bwd", dispatch.chunk_bwd_gpu)
    monkeypatch.setattr(dispatch, "chunk_fwd_states", dispatch.chunk_fwd_states_gpu)
    monkeypatch.setattr(dispatch.prefix_states, "forward", no_fallback)
    monkeypatch.setattr(dispatch.chunked, "forward", no_fallback)
    monkeypatch.setattr(dispatch.chunked, "backward", no_fallback)


def _on_device(p):
    if ON_GPU:
        for name, x in p.leaves.items():
            setattr(p, name, x.detach().cuda().requires_grad_())
            p.leaves[name] = getattr(p, name)
        p.cu_seqlens = p.cu_seqlens.cuda()
    return p


def test_chunk_length_is_the_edge_cases():
    cfg = default_config(1, 1000, 2, 16, 16, torch.float32, True, torch.device("cpu"), True)
    assert cfg.block_t == C == chunked.BT and not cfg.local and not cfg.split


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("gate", ["vector", "scalar", "constant", "none"])
def test_packed_matches_each_sequence_alone(kernels, gate, reverse):
    p = _on_device(make(random_lengths(seed=len(gate) + reverse, extra=1), gate=gate, reverse=reverse, H=1, K=16,
                        V=16))
    o, ht = p.run(gla_inductor.chunk_gla)
    assert_matches(p, o, ht, tol=1e-4)


def test_grouped_heads_and_fused_gate(kernels):
    p = _on_device(make([C + 1, 0, 7, C - 1], gate="vector", H=2, G=1, K=16, V=16, gate_fn="logsigmoid",
                        reverse=True))
    o, ht = p.run(gla_inductor.chunk_gla)
    assert_matches(p, o, ht, tol=1e-4)


def test_softplus_gate_int64_offsets_no_initial_state(kernels):
    p = _on_device(make([1, C, 30], gate="scalar", K=16, V=16, gate_fn="softplus", offsets_dtype=torch.int64,
                        h0=False))
    o, ht = p.run(gla_inductor.chunk_gla)
    assert_matches(p, o, ht, tol=1e-4)
    o_only, none = gla_inductor.chunk_gla(p.q, p.k, p.v, p.g, **{**p.kwargs(), "output_final_state": False})
    assert none is None and torch.equal(o_only, o)


def test_strided_inputs(kernels):
    """q, k, v as [1, T, H, D] views of [1, H, T, D] storage: the sequences' offsets go through the
    time strides."""
    p = _on_device(make([C + 2, 0, 9], gate="vector", K=16, V=16))
    for name in ("q", "k", "v"):
        strided = getattr(p, name).detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
        setattr(p, name, strided)
        p.leaves[name] = strided
    assert not p.q.is_contiguous()
    o, ht = p.run(gla_inductor.chunk_gla)
    assert_matches(p, o, ht, tol=1e-4)


def test_states_v_first(kernels):
    """V-first initial and final states (state_v_first) reach the kernels as strided views: values
    and every gradient, the initial state's through the view."""
    p = _on_device(make([C + 1, 0, 7], gate="scalar", K=8, V=16, reverse=True))
    kwargs = dict(p.kwargs(), initial_state=p.h0.transpose(-1, -2), state_v_first=True)
    o, ht = gla_inductor.chunk_gla(p.q, p.k, p.v, p.g, **kwargs)
    assert ht.shape == (3, 2, 16, 8)
    assert_matches(p, o, ht.transpose(-1, -2), tol=1e-4)


def test_bfloat16(kernels):
    p = _on_device(make([C + 1, 20], gate="vector", K=16, V=16, dtype=torch.bfloat16))
    o, ht = p.run(gla_inductor.chunk_gla)
    assert o.dtype == torch.bfloat16 and ht.dtype == torch.float32
    assert_matches(p, o, ht, tol=2e-2)


def test_short_packed_call_runs_the_chunked_kernels(kernels):
    # 7 steps in all: a fixed-length call this short would take the recurrent kernel
    p = _on_device(make([3, 0, 4], gate="scalar", K=16, V=16))
    o, ht = p.run(gla_inductor.chunk_gla)
    assert_matches(p, o, ht, tol=1e-4)


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_local_schedule_at_large_heads(kernels, reverse):
    """K = 64 with a vector gate takes the local schedule, whose chunk-local kernel reads its rows in
    warp-major order (configs.local_row_order) at each sequence's offset."""
    lengths = [C + 3, 0, 9, 2 * C + 1]
    assert default_config(len(lengths), sum(lengths), 1, 64, 16, torch.float32, True, torch.device("cpu"), True).local
    p = _on_device(make(lengths, gate="vector", H=1, K=64, V=16, reverse=reverse))
    o, ht = p.run(gla_inductor.chunk_gla)
    assert_matches(p, o, ht, tol=1e-4)


def test_local_and_split_configs_run_the_fused_schedule():
    p = _on_device(make([C + 3, 9], gate="vector", K=16, V=16, h0=True))
    call = GLACall(p.q.detach(), p.k.detach(), p.v.detach(), p.g.detach(), None, p.h0.detach(), p.scale, True,
                   cu_seqlens=p.cu_seqlens)
    base = default_config(2, 76, 2, 16, 16, torch.float32, True, torch.device(DEVICE))
    for cfg in (dataclasses.replace(base, local=True, segments=2), dataclasses.replace(base, split=True)):
        o, ht = chunk_kernels.forward(call, cfg)
        ref_o, ref_ht = reference(p)
        assert rel_err(o, ref_o) < 1e-4 and rel_err(ht, ref_ht) < 1e-4


@pytest.mark.parametrize("segments, splits", [(2, 1), (3, 2)])
def test_terms_carry_in_segments_cuts_each_sequence(segments, splits):
    """The scalar forward's carry (TERMS) in segments, their sums in pieces: each sequence cut into
    its own, lengths 0, 1 and around the chunk's among them."""
    p = _on_device(make([2 * C + 3, 0, 1, C - 1, C, C + 1, 3 * C], gate="scalar", K=16, V=16, h0=True))
    call = GLACall(p.q.detach(), p.k.detach(), p.v.detach(), p.g.detach(), None, p.h0.detach(), p.scale, True,
                   cu_seqlens=p.cu_seqlens)
    base = default_config(7, 7 * C, 2, 16, 16, torch.float32, False, torch.device(DEVICE), True)
    cfg = dataclasses.replace(base, local=False, terms=True, segments=segments, sum_splits=splits)
    o, ht = chunk_kernels.forward(call, cfg)
    ref_o, ref_ht = reference(p)
    assert rel_err(o, ref_o) < 1e-4 and rel_err(ht, ref_ht) < 1e-4


def _assert_forward_backward_match(p, call, cfg, *, seed):
    """The kernels' forward and backward at ``cfg`` against each sequence run alone in float64:
    values, final states and every gradient, the initial state's included."""
    o, ht = chunk_kernels.forward(call, cfg)
    gen = torch.Generator().manual_seed(seed)
    do, dht = (torch.randn(x.shape, generator=gen).to(DEVICE) for x in (o, ht))
    dq, dk, dv, dg, _, dh0 = chunk_kernels.backward(call, do, dht, cfg)
    ref_o, ref_ht = reference(p)
    refs = torch.autograd.grad((ref_o * do).sum() + (ref_ht * dht).sum(), [p.q, p.k, p.v, p.g, p.h0])
    assert rel_err(o, ref_o) < 1e-4 and rel_err(ht, ref_ht) < 1e-4
    for name, mine, theirs in zip(["dq", "dk", "dv", "dg", "dh0"], [dq, dk, dv, dg, dh0], refs):
        assert rel_err(mine, theirs) < 1e-4, name


# lengths whose walks the length rule below cuts in 4, 2 and 1 segments (18, 9 and up to 3 chunks)
_BY_LENGTH = [17 * C + 5, 0, 1, C - 1, C, C + 1, 9 * C, 2 * C + 7]


def _by_length_config(p, schedule):
    """The rule of gla_chunk_carry's SLOTS at 16 resident programs: (31 chunks + 8 sequences) * 2
    heads = 78 walks, 5 chunks each; at most 4 segments of at least 4 chunks each."""
    base = default_config(len(_BY_LENGTH), sum(_BY_LENGTH), 2, 16, 16, torch.float32, schedule == "local",
                          torch.device(DEVICE), True)
    cfg = dataclasses.replace(base, local=schedule == "local", terms=schedule == "terms", split=False, segments=4,
                              sum_splits=2 if schedule == "terms" else 1, segment_slots=16,
                              carry=dataclasses.replace(base.carry, block_v=16))
    call = GLACall(p.q.detach(), p.k.detach(), p.v.detach(), p.g.detach(), None, p.h0.detach(), p.scale, True,
                   p.reverse, cu_seqlens=p.cu_seqlens)
    return call, cfg


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_terms_carry_cuts_each_sequence_by_its_length(reverse, monkeypatch):
    """Packed sequences cut as far as their lengths ask (ChunkConfig.segment_slots): the scalar
    forward's carry walks the 18-chunk sequence in segments of 6 chunks (4 asked, 3 non-empty), the
    9-chunk one in two, the short ones in one (no sums), each as if alone; the sums in two pieces.
    Which pieces were summed shows in their decays ds [N, pieces, H]: the buffers start as NaN, and
    the last segment of a sequence is never summed."""
    p = _on_device(make(_BY_LENGTH, gate="scalar", K=16, V=16, h0=True, reverse=reverse))
    call, cfg = _by_length_config(p, "terms")
    empty = torch.empty

    def nan_empty(*args, **kwargs):
        out = empty(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    monkeypatch.setattr(torch, "empty", nan_empty)
    sums = []
    segment_sums = chunk_kernels._Launcher.segment_sums
    monkeypatch.setattr(chunk_kernels._Launcher, "segment_sums",
                        lambda self, *a, **kw: sums.append(segment_sums(self, *a, **kw)) or sums[-1])
    o, ht = chunk_kernels.forward(call, cfg)
    ref_o, ref_ht = reference(p)
    assert rel_err(o, ref_o) < 1e-4 and rel_err(ht, ref_ht) < 1e-4
    (hs, ds), = sums
    summed = torch.zeros(len(_BY_LENGTH), 8, dtype=torch.bool)
    summed[0, :4] = True  # segments of 6 chunks in pieces of 3: the first two segments
    summed[6, :2] = True  # two segments of 6 and 3 chunks: the first
    assert torch.equal(torch.isfinite(ds).all(-1).cpu(), summed)


def test_local_carries_cut_each_sequence_by_its_length():
    """The same rule on the local schedule's carries (vector gate): the forward's walk, and the
    backward's states and dual walks; values, final states and every gradient."""
    p = _on_device(make(_BY_LENGTH, gate="vector", K=16, V=16, h0=True))
    _assert_forward_backward_match(p, *_by_length_config(p, "local"), seed=3)


def test_packed_cuts_rule_at_the_anchors():
    """The host's mirror of the SLOTS rule (configs.packed_cuts) at the benchmark's packs, H = 16,
    K = V = 128, 264 resident programs (132 SMs): 12 mixed lengths cut their 5999-step sequence in
    two (94 chunks against an even walk of 51), 8 x 2048 cut none (32 against 32)."""
    mixed = [4096, 517, 3001, 1024, 64, 2048, 5999, 1, 777, 2500, 3900, 1773]
    assert kconfigs.packed_cuts(max(mixed), sum(mixed), 12, 16, 128, 64, 64, 264) == 2
    assert kconfigs.packed_cuts(2048, 8 * 2048, 8, 16, 128, 64, 64, 264) == 1
    assert kconfigs.packed_cuts(4 * C, 4 * C, 1, 1, 16, C, 16, 264) == 1  # 4 chunks: no segment below 4
    assert kconfigs.packed_cuts(0, 0, 2, 16, 128, 64, 64, 264) == 1


def test_host_knows_the_longest_sequence_once_it_read_the_offsets():
    """contract.packed_longest: what the eager call's validation read (and nothing else): the
    longest sequence of the offsets it checked, 0 for other offsets, another T, or offsets changed
    in place since."""
    p = make([C + 3, 0, 2 * C + 1, 5], gate="scalar", K=8, V=8)
    with torch.no_grad():
        p.run(gla_inductor.chunk_gla)
    T = sum([C + 3, 0, 2 * C + 1, 5])
    assert contract.packed_longest(p.cu_seqlens, T) == 2 * C + 1
    assert contract.packed_longest(p.cu_seqlens.clone(), T) == 0
    assert contract.packed_longest(p.cu_seqlens, T + 1) == 0
    p.cu_seqlens[1] += 1
    assert contract.packed_longest(p.cu_seqlens, T) == 0


@pytest.mark.parametrize("block_t", [16, 32])
def test_short_chunks_find_their_sequences(block_t):
    """Many short sequences in chunks of 16 or 32 steps: state slots without a chunk among those
    with one, which gla_chunk_bwd_dqkg's programs tell apart by searching the offsets."""
    lengths = [0, 5, 16, 17, 0, 0, 33, 1, 31, 2]
    p = _on_device(make(lengths, gate="scalar", H=1, K=16, V=16, reverse=block_t == 32, seed=block_t))
    leaves = {n: x.detach() for n, x in p.leaves.items()}
    call = GLACall(leaves["q"], leaves["k"], leaves["v"], leaves["g"], None, leaves["h0"], p.scale, True, p.reverse,
                   cu_seqlens=p.cu_seqlens)
    cfg = dataclasses.replace(default_config(1, sum(lengths), 1, 16, 16, torch.float32, False, torch.device(DEVICE),
                                             True), block_t=block_t)
    assert chunk_kernels.varlen_state_slots(sum(lengths), len(lengths), block_t) == sum(lengths) // block_t + 10
    _assert_forward_backward_match(p, call, cfg, seed=2)


@pytest.mark.parametrize("interval", [16, C])
def test_prefix_states(kernels, interval):
    """The forward scan's prefix states: every interval steps of every packed sequence (interval 16:
    chunks of 16 steps; C: one state per chunk, the last one where a sequence ends on a chunk edge)."""
    p = _on_device(make([0, 1, 16, C, C + 17, 33], gate="scalar", H=1, K=16, V=16))
    with torch.no_grad():
        o, ht, states = p.run(lambda *a, **kw: gla_inductor.chunk_gla(*a, **kw, output_prefix_states=True,
                                                                       state_interval=interval))
    ref_o, ref_ht = reference(p)
    assert rel_err(o, ref_o) < 1e-4 and rel_err(ht, ref_ht) < 1e-4
    assert_prefix_states(p, states, interval, tol=1e-4)


def test_prefix_states_fixed_length(kernels):
    p = make([40, 40], gate="vector", H=1, K=16, V=16)
    q, k, v, g = (x.detach().view(2, 40, *x.shape[2:]).to(DEVICE) for x in (p.q, p.k, p.v, p.g))
    with torch.no_grad():
        _, _, states = gla_inductor.chunk_gla(q, k, v, g, initial_state=p.h0.detach().to(DEVICE), scale=p.scale,
                                              output_prefix_states=True, state_interval=16)
    assert states.shape == (2, 3, 1, 16, 16)
    assert_prefix_states(p, states.cpu(), 16, tol=1e-4, batched=True)


@pytest.mark.parametrize("gate", ["vector", "constant"])
def test_compiled_graphs_run_the_templates(inductor_triton, gate):
    """chunk_gla with cu_seqlens in a compiled graph lowers to the templates (no extern call of the
    eager op), forward and backward, with the pointwise consumer of o fused into the forward kernel."""
    import re

    from torch._inductor.utils import run_and_get_code

    p = _on_device(make([3, 0, C + 6, 5], gate=gate, H=2, G=1 if gate == "constant" else None, K=16, V=16,
                        reverse=True))

    @torch.compile(fullgraph=True)
    def fwd(q, k, v, g, g_gamma, h0, cu_seqlens):
        o, ht = gla_inductor.chunk_gla(q, k, v, g, g_gamma=g_gamma, initial_state=h0, output_final_state=True,
                                       reverse=True, scale=p.scale, cu_seqlens=cu_seqlens)
        return o * 2 + 1, ht

    def fwd_bwd():
        o, ht = fwd(p.q, p.k, p.v, p.g, p.g_gamma, p.h0, p.cu_seqlens)
        (o.double().sum() + ht.double().square().sum()).backward()
        return o, ht

    (o, ht), (fwd_code, bwd_code) = run_and_get_code(fwd_bwd)
    assert not re.search(r"torch\.ops\.gla_inductor\.\w+\.default\(", fwd_code + bwd_code)
    # the forward: one kernel, the fused scan (vector gates below K = 64) or the carry computing its
    # chunk terms (the others)
    forward_kernel = "GLA chunk scan" if gate == "vector" else "GLA inter-chunk scan"
    assert fwd_code.count(forward_kernel) == 1 and len(re.findall(r"def (triton_\w+)\(", fwd_code)) == 1
    assert bwd_code.count("GLA chunk scan") == 2 and bwd_code.count("GLA backward for q, k and the gate") == 1
    ref_o, ref_ht = reference(p)
    assert rel_err(o, ref_o * 2 + 1) < 1e-5 and rel_err(ht, ref_ht) < 1e-5
    leaves = list(p.leaves.values())
    refs = torch.autograd.grad((ref_o * 2 + 1).sum() + ref_ht.square().sum(), leaves)
    for name, x, want in zip(p.leaves, leaves, refs):
        assert rel_err(x.grad, want) < 1e-4, name


@pytest.mark.cuda
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
def test_cuda_graph_capture_reads_new_offsets():
    """A packed forward and backward captured once, replayed with other offsets (same count) and
    inputs: the kernels read the offsets on the device, nothing on the host."""
    lengths = [EDGE_LENGTHS[i % 5] + 37 * i for i in range(6)]
    p = _on_device(make(lengths, gate="vector", H=4, K=64, V=64, dtype=torch.bfloat16, reverse=False))
    static = {n: x.detach().clone().requires_grad_() for n, x in p.leaves.items()}
    cu = p.cu_seqlens.clone()

    def step():
        o, ht = gla_inductor.chunk_gla(static["q"], static["k"], static["v"], static["g"], scale=p.scale,
                                       initial_state=static["h0"], output_final_state=True, cu_seqlens=cu)
        loss = o.float().square().sum() + ht.square().sum()
        return (o, ht, *torch.autograd.grad(loss, list(static.values())))

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up: compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()

    lengths2 = lengths[::-1]
    p2 = _on_device(make(lengths2, gate="vector", H=4, K=64, V=64, dtype=torch.bfloat16, seed=1))
    for n, x in p2.leaves.items():
        static[n].data.copy_(x.detach())
    cu.copy_(p2.cu_seqlens)
    graph.replay()
    torch.cuda.synchronize()
    ref_o, ref_ht = reference(p2)
    assert rel_err(outs[0], ref_o) < 2e-2 and rel_err(outs[1], ref_ht) < 2e-2
    eager = step()
    for replayed, direct in zip(outs, eager):
        assert rel_err(replayed, direct) < 1e-3
