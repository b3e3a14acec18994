"""The states-only pass on the Triton kernel (gla_chunk_segsum, ``kernels.final_state``: under the
interpreter on CPU) against the float64 time loop: the final state from zero, the dual's gradient
w.r.t. the initial state, and the decay, for every gate kind, reverse, grouped heads, walks cut
into segments (folded by ``impl.final_state.fold``), bf16 inputs; and the segment count."""

import pytest
import torch

import final_state_cases as cases
from gla_inductor.contract import GLACall
from gla_inductor.gates import GateFn
from gla_inductor.kernels import chunk
from gla_inductor.kernels import final_state as kernel
from gla_inductor.ops import dispatch

triton = pytest.importorskip("triton")
ON_GPU = torch.cuda.is_available()
KERNELS_RUN_HERE = ON_GPU or type(triton.language.cumsum).__name__ == "InterpretedFunction"
pytestmark = [pytest.mark.skipif(not KERNELS_RUN_HERE, reason="triton was imported without TRITON_INTERPRET=1"),
              pytest.mark.usefixtures("one_thread")]
DEVICE = "cuda" if ON_GPU else "cpu"


def _call(t: dict) -> GLACall:
    dev = {n: x.to(DEVICE) if isinstance(x, torch.Tensor) else x for n, x in t.items()}
    return GLACall(dev["q"], dev["k"], dev["v"], dev["g"], dev["g_gamma"], scale=t["scale"], reverse=t["reverse"],
                   gate=GateFn(t["gate_fn"]), gate_a=dev["gate_a"], gate_bias=dev["gate_bias"])


def _check(t: dict, dual: bool, segments, tol: float):
    assert dispatch.chunk_unsupported_reason(_call(t)) is None
    do = t["do"].to(DEVICE) if dual else None
    state, decay = kernel.final_state(_call(t), do, num_segments=segments)
    want_state, want_decay = cases.reference(t, dual)
    assert state.dtype == decay.dtype == torch.float32
    assert state.shape == want_state.shape and decay.shape == want_decay.shape
    err = (state.double().cpu() - want_state).abs().max().item()
    assert err <= tol * want_state.abs().max().item(), f"state: max error {err}"
    if want_decay.numel():
        err = (decay.double().cpu() - want_decay).abs().max().item()
        assert err <= tol * max(want_decay.abs().max().item(), 1e-30), f"decay: max error {err}"


@pytest.mark.parametrize("dual", [False, True], ids=["state", "dual"])
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("gate", cases.GATES)
def test_matches_the_time_loop(gate, reverse, dual):
    t = dict(cases.inputs(gate, T=150, K=16, V=8, dtype=torch.float32), reverse=reverse)
    _check(t, dual, segments=1, tol=1e-5)


@pytest.mark.parametrize("segments", [2, 3, 8])
@pytest.mark.parametrize("dual", [False, True], ids=["state", "dual"])
@pytest.mark.parametrize("gate", ["vector", "scalar", "none"])
def test_segments(gate, dual, segments):
    """The walk cut into segments (3 of 3 chunks: the last one short; 8: some segments empty)."""
    t = dict(cases.inputs(gate, T=150, K=16, V=8, dtype=torch.float32), reverse=dual)
    _check(t, dual, segments, tol=1e-5)


@pytest.mark.parametrize("dual", [False, True], ids=["state", "dual"])
def test_bf16(dual):
    t = cases.inputs("vector", T=100, K=16, V=16, dtype=torch.bfloat16)
    _check(t, dual, segments=2, tol=2e-2)


def test_no_steps():
    t = cases.inputs("vector", T=0, K=16, V=8, dtype=torch.float32)
    state, decay = kernel.final_state(_call(t), None)
    assert torch.equal(state, torch.zeros_like(state)) and torch.equal(decay, torch.ones_like(decay))


def test_segment_count():
    """Up to two programs per SM, segments of at least 4 chunks, at most 16."""
    assert kernel.segments(programs=32, NT=512, sms=132) == 8  # B=1, H=16, V=128 in value tiles of 64
    assert kernel.segments(programs=32, NT=16, sms=132) == 4  # 4 chunks each
    assert kernel.segments(programs=1, NT=10_000, sms=132) == 16
    assert kernel.segments(programs=512, NT=512, sms=132) == 1
    assert kernel.segments(programs=16, NT=512, sms=132, per_sm=1) == 8  # V = 128 in one value tile


@pytest.mark.parametrize("gate,dtype,K,want", [
    ("vector", torch.bfloat16, 128, (128, 8, 3, 1)),
    ("scalar", torch.bfloat16, 128, (128, 4, 2, 2)),
    ("vector", torch.bfloat16, 64, (64, 8, 3, 1)),
    ("vector", torch.float32, 128, None),  # fp32 operands: the scan's tile
    ("vector", torch.bfloat16, 256, None),  # a [256, V] state: the scan's tile
])
def test_tiles(gate, dtype, K, want):
    """The pass's own tiles: all of V (up to 128) in one value tile for 16-bit inputs at K <= 128."""
    t = cases.inputs(gate, T=64, K=K, V=K, dtype=dtype)
    call, cfg = chunk._prepare(_call(t), None)
    tile, per_sm = kernel.tiles(cfg, K, K, call.k.dtype, call.v.dtype, call.g.dtype if gate == "vector" else None)
    got = (tile.block_v, tile.num_warps, tile.num_stages, per_sm)
    assert got == (want or (cfg.segsum.block_v, cfg.segsum.num_warps, cfg.segsum.num_stages, 2))


@pytest.mark.parametrize("dual", [False, True], ids=["state", "dual"])
def test_head_size_128(dual):
    """The context-parallel benchmark's head size (K = V = 128, bf16, vector gate), segments as the
    launcher picks them: on a GPU its registers, on the CPU its shapes."""
    t = cases.inputs("logsigmoid", B=1, T=256, H=2, G=2, K=128, V=128, dtype=torch.bfloat16)
    _check(t, dual, segments=None, tol=2e-2)
