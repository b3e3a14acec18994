"""The backward's two walks (states and dual) run on two streams, overlapping, where
``configs.overlap_walks`` says so: the same gradients, bit for bit, as one after the other, also
captured in a CUDA graph and replayed on new inputs. The cases are small; the rule is patched on
for them."""

import contextlib

import pytest
import torch
import torch.nn.functional as F

from gla_inductor.contract import GLACall
from gla_inductor.kernels import chunk as kchunk, configs as kconfigs

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# (gate, lengths of packed sequences or None, B, T, H, K, V): the local schedule in segments (few
# heads, long T), the fused one (scalar gate), packed sequences of mixed lengths
CASES = {
    "vector-segments": ("vector", None, 1, 4096, 4, 128, 128),
    "vector-k64": ("vector", None, 4, 1024, 8, 64, 64),
    "scalar": ("scalar", None, 2, 2048, 4, 128, 128),
    "vector-packed": ("vector", [1500, 64, 1, 700, 3000], 1, 5265, 4, 128, 128),
    "scalar-packed": ("scalar", [1500, 64, 1, 700, 3000], 1, 5265, 4, 128, 128),
}
SCALE = 0.125


def _inputs(case, seed):
    gate, lengths, B, T, H, K, V = case
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k = (torch.randn(B, T, H, K, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2))
    v, do = (torch.randn(B, T, H, V, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2))
    g = F.logsigmoid(torch.randn((B, T, H, K) if gate == "vector" else (B, T, H), device="cuda", generator=gen)) / 16
    N = len(lengths) if lengths else B
    h0 = torch.randn(N, H, K, V, device="cuda", generator=gen)
    cu = None
    if lengths:
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    return q, k, v, g, h0, do, cu


def _backward(q, k, v, g, h0, do, cu):
    call = GLACall(q, k, v, g, None, h0, SCALE, reverse=False, cu_seqlens=cu)
    return kchunk.backward(call, do, None)


@pytest.fixture
def overlapping(monkeypatch, fresh_default_config):
    monkeypatch.setattr(kconfigs, "overlap_walks", lambda *shape: True)


@contextlib.contextmanager
def _one_stream(device, overlap):
    yield contextlib.nullcontext


def test_default_configs_overlap_where_the_walks_outlast_the_host():
    cuda = torch.device("cuda")
    assert kconfigs.default_config(4, 2048, 16, 128, 128, torch.bfloat16, True, cuda).overlap_walks
    assert not kconfigs.default_config(8, 1024, 8, 64, 64, torch.bfloat16, True, cuda).overlap_walks
    # packed: the tokens count, not sequences x total length
    assert not kconfigs.default_config(64, 8192, 8, 64, 64, torch.bfloat16, True, cuda, varlen=True).overlap_walks


@pytest.mark.parametrize("name", list(CASES))
def test_overlapped_walks_give_the_serial_gradients(monkeypatch, overlapping, name):
    inputs = _inputs(CASES[name], 0)
    overlapped = _backward(*inputs)
    streams = []
    carry, scan = kchunk._Launcher.carry, kchunk._Launcher.scan

    def on_stream(launch):
        def run(self, out, **kw):
            if not kw.get("write_out") or kw.get("dual"):
                streams.append((kw.get("dual"), torch.cuda.current_stream().cuda_stream))
            return launch(self, out, **kw)
        return run

    monkeypatch.setattr(kchunk._Launcher, "carry", on_stream(carry))
    monkeypatch.setattr(kchunk._Launcher, "scan", on_stream(scan))
    _backward(*inputs)
    # the states walk went to another stream than the dual walk
    assert len(streams) == 2 and streams[0][1] != streams[1][1], streams
    monkeypatch.setattr(kchunk, "_overlapped", _one_stream)
    serial = _backward(*inputs)
    for a, b in zip(overlapped, serial):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["vector-segments", "scalar-packed"])
def test_overlapped_walks_replay_in_a_cuda_graph(overlapping, name):
    static = _inputs(CASES[name], 0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: the kernels compiled outside the capture
        _backward(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _backward(*static)
    for seed in (1, 2):
        fresh = _inputs(CASES[name], seed)
        for s, f in zip(static, fresh):
            if s is not None:
                s.copy_(f)
        graph.replay()
        expected = _backward(*fresh)
        for a, b in zip(out, expected):
            assert torch.equal(a, b)
