"""A compiled decode loop whose fp32 cache is updated in place at a static address (as HF's static
caches are: ``torch._dynamo.mark_static_address``): the rewritten step runs as generated code
(``gla_inductor.lowerings.recurrent``), and under ``mode="reduce-overhead"`` it is captured in a
CUDA graph with no cudagraph skip; replays update the cache and match float64 eager.

The CUDA-graph tests need a GPU. On CPU the same loop compiles to code without an extern call of
the decode op: Inductor's C++ (the decomposition), or Triton under the interpreter (the template).
"""

import re

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

import gla_inductor

from helpers import rel_err

ON_GPU = torch.cuda.is_available()
EXTERN_CALL = re.compile(r"torch\.ops\.gla_inductor\.fused_recurrent\.default\(")
TEMPLATE_KERNEL = "GLA fused recurrence"  # a comment the template leaves in its kernel's source
TOL = 1e-5

pytestmark = pytest.mark.usefixtures("fresh_compiler")


def decode_step(q, k, v, g, cache):
    """One token: the naive recurrent step, the new state copied into the cache."""
    S = cache * g.exp()[..., None] + k[..., :, None] * v[..., None, :]
    cache.copy_(S)
    return (q[..., :, None] * S).sum(-2) * q.shape[-1] ** -0.5


def _token(B, H, K, V, device, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, H, K, generator=gen), torch.randn(B, H, K, generator=gen)
    v = torch.randn(B, H, V, generator=gen)
    g = torch.nn.functional.logsigmoid(torch.randn(B, H, K, generator=gen) + 2)
    return [x.to(device) for x in (q, k, v, g)]


def _static_cache(B, H, K, V, device):
    cache = torch.randn(B, H, K, V, generator=torch.Generator().manual_seed(99)).to(device)
    torch._dynamo.mark_static_address(cache)
    return cache


def _decode_loop(step, cache, steps, B, H, K, V, device):
    """Run `steps` tokens through step and float64 eager; every output and the cache after every
    token must match."""
    ref_cache = cache.detach().double().clone()
    for t in range(steps):
        token = _token(B, H, K, V, device, seed=t)
        o = step(*token, cache).clone()  # a CUDA graph's outputs are overwritten by its next replay
        ref_o = decode_step(*(x.double() for x in token), ref_cache)
        assert rel_err(o, ref_o) <= TOL, f"o at token {t}"
        assert rel_err(cache, ref_cache) <= TOL, f"the cache after token {t}"


# ----------------------------------------------------------------------------------------------
# CUDA graphs (run on a GPU)
# ----------------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("lowering", ["auto", "template", "decompose", "extern"])
def test_reduce_overhead_captures_the_in_place_decode(lowering):
    B, H, K, V = 4, 8, 64, 64
    cache = _static_cache(B, H, K, V, "cuda")
    address = cache.data_ptr()
    with torch.no_grad(), gla_inductor.config.patch(decode_lowering=lowering):
        step = torch.compile(decode_step, backend=gla_inductor.backend, mode="reduce-overhead", fullgraph=True)
        _decode_loop(step, cache, 4, B, H, K, V, "cuda")  # warm-up, recording, replays
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            _decode_loop(step, cache, 2, B, H, K, V, "cuda")
    assert counters["gla_inductor"]["rewrites"] == 1
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    assert cache.data_ptr() == address
    launches = [e.name for e in prof.events() if "cudaGraphLaunch" in e.name]
    assert len(launches) >= 2, "the replays launch the captured graph"


@pytest.mark.cuda
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_default_mode_runs_the_template_on_cuda():
    B, H, K, V = 4, 8, 64, 64
    cache = _static_cache(B, H, K, V, "cuda")
    with torch.no_grad():
        step = torch.compile(decode_step, backend=gla_inductor.backend, fullgraph=True)
        _, (code, *_) = run_and_get_code(_decode_loop, step, cache, 2, B, H, K, V, "cuda")
    assert TEMPLATE_KERNEL in code and not EXTERN_CALL.search(code), code


# ----------------------------------------------------------------------------------------------
# what CPU can check: the lowered code
# ----------------------------------------------------------------------------------------------


def test_cpu_loop_runs_inductors_cpp_without_an_extern_call():
    B, H, K, V = 2, 4, 16, 16
    cache = _static_cache(B, H, K, V, "cpu")
    with torch.no_grad():
        step = torch.compile(decode_step, backend=gla_inductor.backend, fullgraph=True)
        _, (code, *_) = run_and_get_code(_decode_loop, step, cache, 3, B, H, K, V, "cpu")
    assert counters["gla_inductor"]["rewrites"] == 1
    assert "cpp_fused" in code and not EXTERN_CALL.search(code), code


@pytest.mark.skipif(ON_GPU, reason="the interpreter check of the template; GPUs run the CUDA tests")
def test_cpu_loop_runs_the_template_under_the_interpreter(inductor_triton):
    pytest.importorskip("triton")
    B, H, K, V = 2, 4, 16, 16
    cache = _static_cache(B, H, K, V, "cpu")
    with torch.no_grad():
        step = torch.compile(decode_step, backend=gla_inductor.backend, fullgraph=True)
        _, (code, *_) = run_and_get_code(_decode_loop, step, cache, 3, B, H, K, V, "cpu")
    assert counters["gla_inductor"]["rewrites"] == 1
    assert TEMPLATE_KERNEL in code and not EXTERN_CALL.search(code), code
