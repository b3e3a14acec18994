"""The fused recurrent GLA path: the Triton kernel (``gla_inductor.krecurrent``), the
``gla_inductor::fused_recurrent`` op (CPU implementation, CUDA dispatch, torch.compile in place),
``gla_inductor.fused_recurrent_gla``, and ``chunk_fwd``'s short-sequence routing to the kernel.

Every result is checked against the float64 time loop of ``gla_inductor.reference``. Without a GPU
the kernel runs on CPU tensors under the Triton interpreter (``conftest.py`` sets
``TRITON_INTERPRET=1``); with one, the kernel cases run compiled on CUDA.
"""

import re
from dataclasses import dataclass
from typing import Optional

import pytest
import torch
import torch.nn.functional as F

import gla_inductor
from gla_inductor.impl import recurrent as impl_recurrent
from gla_inductor.kernels import chunk as kchunk, configs as kconfigs
from gla_inductor.ops import dispatch

from helpers import GATES, assert_rel_close, loop_reference

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
triton = pytest.importorskip("triton")
pytest.importorskip("jinja2")
KERNELS_RUN_HERE = ON_GPU or type(triton.language.cumsum).__name__ == "InterpretedFunction"
needs_kernels = pytest.mark.skipif(not KERNELS_RUN_HERE, reason="triton was imported without TRITON_INTERPRET=1")

from gla_inductor.kernels import recurrent as krecurrent  # noqa: E402
from gla_inductor.contract import GLACall

pytestmark = pytest.mark.usefixtures("one_thread")

# relative (Frobenius) error bounds against float64, by the dtype of the result compared
TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
fp32, bf16, fp16 = torch.float32, torch.bfloat16, torch.float16


def _dtype_id(dtype: Optional[torch.dtype]) -> str:
    return "absent" if dtype is None else str(dtype)[6:]


@dataclass(frozen=True)
class Case:
    gate: str  # "vector" | "scalar" | "constant" | "none"
    T: int = 3
    B: int = 2
    H: int = 2
    K: int = 24
    V: int = 40
    dtype: torch.dtype = fp32  # q, k, v (and the gate unless gate_dtype)
    gate_dtype: Optional[torch.dtype] = None
    h0_dtype: Optional[torch.dtype] = fp32  # None: no initial state
    ht_dtype: Optional[torch.dtype] = fp32  # None: final state not stored
    in_place: bool = False  # the final state overwrites the initial one (same tensor)
    reverse: bool = False
    transposed: bool = False  # q, k, v, g from [B, H, T, D] storage and a [B, H, V, K] state
    block_v: Optional[int] = 32  # None: default_recurrent_config; 32 gives V = 40 two tiles
    key_block: int = 0  # one step in blocks of this many keys (T == 1)
    value_block: int = 0  # or values

    @property
    def id(self) -> str:
        parts = [self.gate, f"T{self.T}-K{self.K}-V{self.V}", _dtype_id(self.dtype)]
        if self.h0_dtype != fp32 or self.ht_dtype != fp32:
            parts.append(f"h0_{_dtype_id(self.h0_dtype)}-ht_{_dtype_id(self.ht_dtype)}")
        parts += [n for n in ("in_place", "reverse", "transposed") if getattr(self, n)]
        if self.block_v is None:
            parts.append("default_tiles")
        if self.key_block or self.value_block:
            parts.append(f"blocks{self.key_block}x{self.value_block}")
        return "-".join(parts)


# every gate kind, length and direction (the default tiles: one V tile, 4 programs)
CASES = [Case(gate, T=T, reverse=reverse, block_v=None) for gate in GATES for T in (1, 2, 7)
         for reverse in (False, True)]
CASES += [
    # two V tiles, the last one partial
    *(Case(gate, T=7, reverse=gate == "scalar") for gate in GATES),
    # 16-bit inputs, fp32 and 16-bit states
    *(Case(gate, dtype=bf16) for gate in GATES),
    Case("vector", T=2, dtype=bf16, gate_dtype=bf16, h0_dtype=bf16, ht_dtype=bf16, in_place=True),
    Case("scalar", T=3, dtype=bf16, h0_dtype=bf16, ht_dtype=bf16, in_place=True, reverse=True),
    Case("vector", T=3, dtype=fp32, h0_dtype=fp32, ht_dtype=bf16),
    Case("constant", T=2, dtype=fp16, h0_dtype=bf16, ht_dtype=fp32),
    # in place: the kernel reads each state slice before it writes it
    *(Case(gate, T=3, in_place=True, reverse=gate in ("scalar", "none")) for gate in GATES),
    # strided inputs and state
    Case("vector", T=3, transposed=True),
    Case("scalar", T=2, transposed=True, in_place=True, reverse=True),
    Case("constant", T=3, dtype=bf16, transposed=True),
    # no initial state / no final state
    Case("vector", T=3, h0_dtype=None),
    Case("scalar", T=2, ht_dtype=None),
    # the default tiles, odd K / V, one head
    Case("vector", T=3, K=40, V=24, block_v=None),
    Case("none", T=1, B=3, H=1, K=8, V=8, block_v=None, in_place=True),
    # one step in blocks of keys: every gate, padded keys (K = 24 in blocks of 8 and 16), a partial
    # value tile, 16-bit and strided states, in place
    *(Case(gate, T=1, key_block=8, reverse=gate == "none") for gate in GATES),
    Case("vector", T=1, K=24, V=32, key_block=16, block_v=64),
    Case("scalar", T=1, dtype=bf16, h0_dtype=bf16, ht_dtype=bf16, in_place=True, key_block=16),
    Case("vector", T=1, transposed=True, in_place=True, key_block=32),
    Case("constant", T=1, h0_dtype=None, key_block=8),
    # or in blocks of values (a V-first state), the last one partial
    *(Case(gate, T=1, value_block=16, reverse=gate == "scalar") for gate in GATES),
    Case("vector", T=1, transposed=True, in_place=True, value_block=8),
    Case("scalar", T=1, V=32, dtype=bf16, h0_dtype=bf16, ht_dtype=bf16, in_place=True, value_block=16),
    # V a multiple of BV: no masks along V (EVEN_V)
    Case("vector", T=3, K=24, V=32, in_place=True, reverse=True),
    Case("scalar", T=2, K=32, V=64, dtype=bf16, block_v=None, transposed=True),
    Case("constant", T=3, K=20, V=48, h0_dtype=None),
]


def _make_inputs(case: Case, device: str = DEVICE, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    B, T, H, K, V = case.B, case.T, case.H, case.K, case.V

    def seq(D, dtype=case.dtype, x=None):
        x = torch.randn(B, H, T, D, generator=gen) if x is None else x
        x = x.to(dtype).to(device)
        # strided: [B, H, T, D] storage seen as [B, T, H, D]
        return x.transpose(1, 2) if case.transposed else x.transpose(1, 2).contiguous()

    q, k, v = seq(K), seq(K), seq(V)
    gate_dtype = case.gate_dtype or fp32
    g = g_gamma = None
    if case.gate == "vector":
        g = seq(K, gate_dtype, F.logsigmoid(torch.randn(B, H, T, K, generator=gen)))
    elif case.gate == "scalar":
        g = seq(1, gate_dtype, F.logsigmoid(torch.randn(B, H, T, 1, generator=gen)))[..., 0]
    elif case.gate == "constant":
        g_gamma = F.logsigmoid(torch.randn(H, generator=gen)).to(gate_dtype).to(device)
    h0 = None
    if case.h0_dtype is not None:
        h0 = torch.randn(B, H, V, K, generator=gen).to(case.h0_dtype).to(device)
        h0 = h0.transpose(-1, -2) if case.transposed else h0.transpose(-1, -2).contiguous()
    return q, k, v, g, g_gamma, h0


def _reference(q, k, v, g, g_gamma, h0, scale, reverse):
    """(o, final state) of the float64 time loop on the op's arguments (helpers.loop_reference)."""
    return loop_reference(dict(q=q, k=k, v=v, g=g, g_gamma=g_gamma, initial_state=h0), scale=scale, reverse=reverse)


# ----------------------------------------------------------------------------------------------
# the kernel
# ----------------------------------------------------------------------------------------------


@needs_kernels
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_kernel_matches_reference(case: Case):
    q, k, v, g, g_gamma, h0 = _make_inputs(case)
    scale = case.K**-0.5
    ref_o, ref_ht = _reference(q, k, v, g, g_gamma, h0, scale, case.reverse)
    h0_before = None if h0 is None else h0.clone()
    if case.in_place:
        ht = h0
    elif case.ht_dtype is not None:
        ht = torch.full((case.B, case.H, case.K, case.V), float("nan"), dtype=case.ht_dtype, device=DEVICE)
    else:
        ht = None
    config = None if case.block_v is None else krecurrent.RecurrentConfig(block_v=case.block_v, num_warps=2,
                                                                          key_block=case.key_block,
                                                                          value_block=case.value_block)

    o = krecurrent.forward(GLACall(q, k, v, g, g_gamma, h0, scale, reverse=case.reverse), ht, config=config)

    assert o.dtype == case.dtype and o.shape == (case.B, case.T, case.H, case.V)
    assert_rel_close("o", o, ref_o, TOL[case.dtype])
    if ht is not None:
        assert_rel_close("final state", ht, ref_ht, TOL[ht.dtype])
    if h0 is not None and not case.in_place:
        assert torch.equal(h0, h0_before), "the initial state was modified"


@needs_kernels
def test_kernel_steep_gates_forget():
    """g = -20: each step forgets the state up to e^-20, so o_t = scale (q_t . k_t) v_t and the final
    state is k_T^T v_T, whatever the (large) initial state."""
    B, T, H, K, V = 1, 5, 2, 16, 16
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, T, H, D, generator=gen).to(DEVICE) for D in (K, K, V))
    h0 = 100 * torch.randn(B, H, K, V, generator=gen).to(DEVICE)
    for g in (torch.full((B, T, H, K), -20.0, device=DEVICE), torch.full((B, T, H), -20.0, device=DEVICE)):
        state = h0.clone()
        o = krecurrent.forward(GLACall(q, k, v, g, None, state, 0.25, reverse=False), state)
        assert_rel_close("o", o, (0.25 * (q * k).sum(-1, keepdim=True) * v).double(), 1e-5)
        assert_rel_close("final state", state, (k[:, -1, :, :, None] * v[:, -1, :, None, :]).double(), 1e-5)


@needs_kernels
def test_kernel_empty_sequence_copies_the_state():
    q, k = torch.randn(2, 0, 3, 8, device=DEVICE), torch.randn(2, 0, 3, 8, device=DEVICE)
    v = torch.randn(2, 0, 3, 4, device=DEVICE)
    h0 = torch.randn(2, 3, 8, 4, device=DEVICE)
    ht = torch.empty_like(h0)
    o = krecurrent.forward(GLACall(q, k, v, None, None, h0, 1.0, reverse=False), ht)
    assert o.shape == (2, 0, 3, 4)
    assert torch.equal(ht, h0)


@needs_kernels
def test_supports_reports_limits():
    q = torch.randn(1, 1, 2, 16, device=DEVICE)
    assert krecurrent.unsupported_reason(GLACall(q, q, q)) is None
    big_k = torch.randn(1, 1, 2, 320, device=DEVICE)
    assert "K = 320" in krecurrent.unsupported_reason(GLACall(big_k, big_k, q))
    big_v = torch.randn(1, 1, 2, 640, device=DEVICE)
    assert "V = 640" in krecurrent.unsupported_reason(GLACall(q, q, big_v))
    state64 = torch.zeros(1, 2, 16, 16, dtype=torch.float64, device=DEVICE)
    assert "state dtype torch.float64" in krecurrent.unsupported_reason(GLACall(q, q, q, initial_state=state64))


def test_default_config_tiles():
    """About 8192 state elements per program, 64 per thread, rows of 32 to 64 floats (BV = 64 with 4
    warps at K = 128 measured best on an H100); without a GPU no narrowing by SM count."""
    cpu = torch.device("cpu")
    expected = {(16, 16): (16, 1), (64, 64): (64, 2), (128, 128): (64, 4), (256, 512): (32, 4), (24, 40): (64, 1)}
    for (K, V), (block_v, num_warps) in expected.items():
        assert krecurrent.default_recurrent_config(64, 32, K, V, cpu) == krecurrent.RecurrentConfig(
            block_v=block_v, num_warps=num_warps), (K, V)


def test_default_config_by_state_layout_and_dtype():
    """Keys contiguous (a V-first pool read as its transpose): value tiles of 16, one warp; 16-bit
    states: halved value tiles, the final state stored before the output (measured on an H200)."""
    cpu = torch.device("cpu")
    Config = krecurrent.RecurrentConfig
    assert krecurrent.default_recurrent_config(64, 32, 128, 128, cpu, torch.float32, True) == Config(16, 1)
    assert krecurrent.default_recurrent_config(64, 32, 128, 128, cpu, torch.bfloat16, True) == Config(
        16, 1, early_state=True)
    assert krecurrent.default_recurrent_config(64, 32, 128, 128, cpu, torch.bfloat16) == Config(32, 2, early_state=True)
    pool = torch.zeros(8, 2, 128, 64).transpose(-1, -2)  # [P, H, V, K] memory as [P, H, K, V]
    assert krecurrent.keys_contiguous(pool.stride()) and not krecurrent.keys_contiguous(pool.contiguous().stride())


def test_one_step_blocks_by_pairs_dtype_and_layout():
    """One step (a GPU with 132 SMs): fewer than 4 (batch, head) pairs per SM walk blocks of 32 keys
    (K-first) or 16 values (V-first); more pairs keep whole tiles but for 16-bit states: K-first in
    blocks of 16 keys by 128 values, V-first in the few pairs' blocks of 16 values; block sizes
    never pass the padded head sizes."""
    Config = krecurrent.RecurrentConfig
    blocks = krecurrent._one_step_blocks
    assert blocks(16 * 32, 128, 128, 132, False, False) == Config(64, 2, 2, key_block=32)
    assert blocks(16 * 32, 128, 128, 132, True, True) == Config(32, 1, 2, value_block=16)
    assert blocks(64 * 32, 128, 128, 132, True, False) == Config(128, 2, 2, key_block=16)
    assert blocks(64 * 32, 128, 128, 132, False, False) is None
    assert blocks(64 * 32, 128, 128, 132, True, True) == Config(32, 1, 2, value_block=16)
    assert blocks(64 * 32, 128, 128, 132, False, True) is None
    assert blocks(64 * 32, 8, 16, 132, True, False) == Config(16, 2, 2, key_block=16)
    assert blocks(4, 8, 12, 132, False, False) == Config(16, 2, 2, key_block=16)
    assert blocks(32, 128, 128, 132, False, False) == Config(16, 2, 2, key_block=128)  # B = 1: 256 programs


@needs_kernels
@pytest.mark.parametrize("blocks", [dict(key_block=8), dict(value_block=8)], ids=["keys", "values"])
def test_blocks_take_one_step(blocks):
    """A config in blocks is refused, by name, for more than one step or blocks past the head size."""
    q, k, v = (torch.zeros(1, 2, 1, 16, device=DEVICE) for _ in range(3))
    config = krecurrent.RecurrentConfig(block_v=16, num_warps=1, **blocks)
    with pytest.raises(ValueError, match="needs T = 1 \\(got 2\\)"):
        krecurrent.forward(GLACall(q, k, v), None, config=config)
    with pytest.raises(ValueError, match="at most 16"):
        krecurrent.forward(GLACall(q[:, :1], k[:, :1], v[:, :1]), None,
                           config=krecurrent.RecurrentConfig(block_v=16, num_warps=1, key_block=32))


# ----------------------------------------------------------------------------------------------
# the op: CPU implementation, CUDA dispatch, registration
# ----------------------------------------------------------------------------------------------


OP_CASES = [
    *(Case(gate, T=T, reverse=T == 7, block_v=None) for gate in GATES for T in (1, 7)),
    Case("vector", T=7, dtype=bf16, h0_dtype=bf16, block_v=None),
    Case("scalar", T=2, transposed=True, block_v=None),
    Case("vector", T=7, dtype=torch.float64, h0_dtype=torch.float64, reverse=True, block_v=None),
    # longer than STEP_LOOP_MAX_T: through chunk_fwd
    Case("vector", T=impl_recurrent.STEP_LOOP_MAX_T + 3, H=1, K=8, V=8, reverse=True, block_v=None),
    Case("constant", T=impl_recurrent.STEP_LOOP_MAX_T + 3, H=1, K=8, V=8, dtype=bf16, h0_dtype=bf16, block_v=None),
]


@pytest.mark.parametrize("case", OP_CASES, ids=lambda c: c.id)
def test_op_cpu_matches_reference_in_place(case: Case):
    q, k, v, g, g_gamma, h0 = _make_inputs(case, "cpu")
    ref_o, ref_ht = _reference(q, k, v, g, g_gamma, h0, 0.3, case.reverse)
    state = h0  # overwritten by the op
    o = torch.ops.gla_inductor.fused_recurrent(q, k, v, g, g_gamma, state, 0.3, case.reverse)
    assert o.dtype == case.dtype
    assert_rel_close("o", o, ref_o, TOL[case.dtype])
    assert state.dtype == case.h0_dtype
    assert_rel_close("state", state, ref_ht, TOL[state.dtype])


def test_op_promotes_output_dtype_and_keeps_state_dtype():
    case = Case("vector", T=2, dtype=bf16, h0_dtype=bf16)
    q, k, v, g, _, state = _make_inputs(case, "cpu")
    v = v.float()
    ref_o, ref_ht = _reference(q, k, v, g, None, state, 0.5, False)
    o = torch.ops.gla_inductor.fused_recurrent(q, k, v, g, None, state, 0.5, False)
    assert o.dtype == fp32 and state.dtype == bf16
    assert_rel_close("o", o, ref_o, TOL[fp32])
    assert_rel_close("state", state, ref_ht, TOL[bf16])


def test_op_registrations():
    case = Case("vector", T=2)
    q, k, v, g, g_gamma, h0 = _make_inputs(case, "cpu")
    scalar = g[..., 0].contiguous()
    for args in ((q, k, v, g, None, h0.clone(), 0.3, False), (q, k, v, scalar, None, h0.bfloat16(), 0.3, True),
                 (q, k, v, None, None, h0.clone(), 1.0, False)):
        torch.library.opcheck(torch.ops.gla_inductor.fused_recurrent.default, args)


def test_op_refuses_grad_before_running():
    q, k, v, g, _, state = _make_inputs(Case("vector", T=1), "cpu")
    before = state.clone()
    with pytest.raises(RuntimeError, match=r"inference-only.*k, g require grad.*chunk_gla"):
        torch.ops.gla_inductor.fused_recurrent(q, k.requires_grad_(), v, g.requires_grad_(), None, state, 0.3, False)
    assert torch.equal(state, before), "the state was modified before the error"
    with torch.no_grad():
        o = torch.ops.gla_inductor.fused_recurrent(q, k, v, g, None, state, 0.3, False)
    assert not o.requires_grad and not torch.equal(state, before)


def test_op_checks_state_shape():
    q, k, v, g, _, state = _make_inputs(Case("vector", T=1), "cpu")
    with pytest.raises(ValueError, match=r"state has shape \(2, 2, 40, 24\).*\[B, H, K, V\] = \[2, 2, 24, 40\]"):
        torch.ops.gla_inductor.fused_recurrent(q, k, v, g, None, state.mT.contiguous(), 0.3, False)


def _cuda_entry(op_name: str, gpu_route):
    """The op on CUDA tensors with a GPU; without one, its GPU route on CPU tensors (the kernels then
    run under the interpreter), called with the op's arguments."""
    return getattr(torch.ops.gla_inductor, op_name) if ON_GPU else gpu_route


def _fused_recurrent_gpu(q, k, v, g, g_gamma, state, scale, reverse):
    return dispatch.fused_recurrent_gpu(GLACall(q, k, v, g, g_gamma, state, scale, reverse=reverse), state)


def _chunk_fwd_gpu(*args):
    return dispatch.chunk_fwd_gpu(GLACall.from_op_args(args))


@needs_kernels
@pytest.mark.parametrize("gate", GATES)
def test_cuda_impl_runs_the_kernel_in_place(gate, monkeypatch):
    case = Case(gate, T=2, reverse=gate == "scalar", block_v=None)
    q, k, v, g, g_gamma, state = _make_inputs(case)
    ref_o, ref_ht = _reference(q, k, v, g, g_gamma, state, 0.3, case.reverse)
    calls = _spy(monkeypatch, krecurrent, "forward")
    fused_recurrent = _cuda_entry("fused_recurrent", _fused_recurrent_gpu)
    o = fused_recurrent(q, k, v, g, g_gamma, state, 0.3, case.reverse)
    # in place: the kernel reads and writes the caller's state
    assert len(calls) == 1 and calls[0][0].initial_state.data_ptr() == calls[0][1].data_ptr() == state.data_ptr()
    assert_rel_close("o", o, ref_o, TOL[fp32])
    assert_rel_close("state", state, ref_ht, TOL[fp32])


@needs_kernels
def test_cuda_impl_falls_back(monkeypatch):
    """Switched off, an unsupported dtype, or a sequence past RECURRENT_MAX_T: no recurrent kernel."""
    q, k, v, g, _, h0 = _make_inputs(Case("vector", T=3))
    calls = _spy(monkeypatch, krecurrent, "forward")
    with gla_inductor.config.patch(triton_kernels=False):
        o = dispatch.fused_recurrent_gpu(GLACall(q, k, v, g, None, h0.clone(), 0.3, reverse=False), h0.clone())
    assert_rel_close("o (kernels off)", o, _reference(q, k, v, g, None, h0, 0.3, False)[0], TOL[fp32])
    o = dispatch.fused_recurrent_gpu(GLACall(q, k, v, g, None, h0.double(), 0.3, reverse=False), h0.double())
    assert o.dtype == fp32
    assert_rel_close("o (float64 state)", o, _reference(q, k, v, g, None, h0, 0.3, False)[0], TOL[fp32])
    monkeypatch.setattr(dispatch, "RECURRENT_MAX_T", 2)
    state = h0.clone()
    o = dispatch.fused_recurrent_gpu(GLACall(q, k, v, g, None, state, 0.3, reverse=False), state)
    ref_o, ref_ht = _reference(q, k, v, g, None, h0, 0.3, False)
    assert_rel_close("o (chunked)", o, ref_o, 1e-4)
    assert_rel_close("state (chunked)", state, ref_ht, 1e-4)
    assert calls == []


def _spy(monkeypatch, module, name):
    """Record the positional arguments of every call to module.name (looked up at call time)."""
    calls = []
    original = getattr(module, name)

    def spy(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return calls


# ----------------------------------------------------------------------------------------------
# torch.compile: functionalized, then reinplaced onto the caller's state
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lowering", ["extern", "auto"])
@pytest.mark.parametrize("layout", ["state", "cache_view"])
def test_compiled_op_updates_the_graph_input_in_place(layout, lowering):
    from gla_inductor.lowerings import recurrent as lrecurrent

    if lowering == "auto" and not lrecurrent._ORDERS_INPUT_MUTATION:
        pytest.skip("CPU tensors lower to the decomposition, which needs torch >= 2.13 (it falls back there)")
    """The graph input is the state itself, or a [B, H, V, K] cache whose transpose is the state;
    the op runs as an extern call, or lowered to Inductor's C++ (gla_inductor.lowerings.recurrent)."""
    from torch._inductor.utils import run_and_get_code

    case = Case("vector", T=2, K=8, V=12)
    q, k, v, g, _, h0 = _make_inputs(case, "cpu")
    ref_o, ref_ht = _reference(q, k, v, g, None, h0, 0.3, False)

    def as_state(x):
        return x if layout == "state" else x.transpose(-1, -2)

    def step(q, k, v, g, x):
        return torch.ops.gla_inductor.fused_recurrent(q, k, v, g, None, as_state(x), 0.3, False) * 2

    torch._dynamo.reset()
    x = as_state(h0).clone()  # the graph input
    with gla_inductor.config.patch(decode_lowering=lowering):
        compiled = torch.compile(step, backend="inductor", fullgraph=True)
        out, (code, *_) = run_and_get_code(compiled, q, k, v, g, x)
    assert_rel_close("o", out / 2, ref_o, TOL[fp32])
    assert_rel_close("state", as_state(x), ref_ht, TOL[fp32])  # the caller's tensor holds the final state
    # a second step continues from the updated state, as a decoding loop does
    ref_o2, ref_ht2 = _reference(q, k, v, g, None, ref_ht, 0.3, False)
    assert_rel_close("o (second step)", compiled(q, k, v, g, x) / 2, ref_o2, TOL[fp32])
    assert_rel_close("state (second step)", as_state(x), ref_ht2, TOL[fp32])
    if lowering == "auto":  # generated code writes the graph input: no extern call, no copy
        host = code[code.index("def call("):]
        assert "fused_recurrent.default(" not in host and "copy_" not in host and "clone" not in host, code
        return
    # reinplaced: the op's state argument is the graph input itself (argN_1, or a view of it), not a
    # buffer copied from it and back
    assert re.search(r"fused_recurrent\.default\(.*, None, (reinterpret_tensor\()?arg\d+_1\b", code), code
    assert "copy_" not in code and "clone" not in code, code


# ----------------------------------------------------------------------------------------------
# fused_recurrent_gla
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gate", GATES)
def test_fused_recurrent_gla_matches_reference(gate):
    case = Case(gate, T=7, reverse=gate == "vector", dtype=bf16, h0_dtype=bf16)
    q, k, v, g, g_gamma, h0 = _make_inputs(case, "cpu")
    before = h0.clone()
    o, ht = gla_inductor.fused_recurrent_gla(q, k, v, g, g_gamma=g_gamma, initial_state=h0, output_final_state=True,
                                             reverse=case.reverse)
    ref_o, ref_ht = _reference(q, k, v, g, g_gamma, h0, case.K**-0.5, case.reverse)
    assert torch.equal(h0, before), "initial_state was modified"
    assert o.dtype == bf16 and ht.dtype == fp32  # like chunk_gla
    assert_rel_close("o", o, ref_o, TOL[bf16])
    assert_rel_close("final state", ht, ref_ht, TOL[fp32])
    o2, none = gla_inductor.fused_recurrent_gla(q, k, v, g, g_gamma=g_gamma, reverse=case.reverse)
    assert none is None
    assert_rel_close("o (zero state)", o2, _reference(q, k, v, g, g_gamma, None, case.K**-0.5, case.reverse)[0],
                  TOL[bf16])


def test_fused_recurrent_gla_errors_name_the_tensor():
    q, k, v, g, g_gamma, h0 = _make_inputs(Case("vector", T=3), "cpu")
    with pytest.raises(ValueError, match=r"fused_recurrent_gla: v has shape \(2, 3, 2\).*\[B, T, H, V\]"):
        gla_inductor.fused_recurrent_gla(q, k, v[..., 0], g)
    with pytest.raises(ValueError, match=r"fused_recurrent_gla: initial_state .*\[B, H, K, V\] = \[2, 2, 24, 40\]"):
        gla_inductor.fused_recurrent_gla(q, k, v, g, initial_state=h0[:, :1])
    with pytest.raises(TypeError, match=r"fused_recurrent_gla: g has dtype torch.int64"):
        gla_inductor.fused_recurrent_gla(q, k, v, g.long())
    with pytest.raises(RuntimeError, match=r"inference-only.*q requires grad"):
        gla_inductor.fused_recurrent_gla(q.requires_grad_(), k, v, g)


# ----------------------------------------------------------------------------------------------
# chunk_fwd on CUDA: short sequences on the recurrent kernel
# ----------------------------------------------------------------------------------------------


@needs_kernels
@pytest.mark.parametrize("final_state", [False, True], ids=["no_ht", "ht"])
@pytest.mark.parametrize("gate", ["vector", "constant"])
def test_chunk_fwd_short_sequences_run_the_recurrent_kernel(gate, final_state, monkeypatch):
    case = Case(gate, T=7, dtype=bf16, h0_dtype=bf16, reverse=final_state)
    q, k, v, g, g_gamma, h0 = _make_inputs(case)
    assert dispatch.routes_to_recurrent(GLACall(q, k, v, g, g_gamma, h0))
    recurrent = _spy(monkeypatch, krecurrent, "forward")
    chunked = _spy(monkeypatch, kchunk, "forward")
    chunk_fwd = _cuda_entry("chunk_fwd", _chunk_fwd_gpu)
    o, ht = chunk_fwd(q, k, v, g, g_gamma, h0, 0.3, final_state, case.reverse)
    assert len(recurrent) == 1 and chunked == []
    ref_o, ref_ht = _reference(q, k, v, g, g_gamma, h0, 0.3, case.reverse)
    assert o.dtype == bf16
    assert_rel_close("o", o, ref_o, TOL[bf16])
    if final_state:
        assert ht.dtype == fp32  # chunk_fwd's contract, whatever the initial state's dtype
        assert_rel_close("final state", ht, ref_ht, TOL[fp32])
    else:
        assert ht.shape == (0,) and ht.dtype == fp32


@needs_kernels
def test_chunk_fwd_routing_decision(monkeypatch):
    q = torch.randn(1, dispatch.RECURRENT_MAX_T, 2, 16, device=DEVICE)
    longer = torch.randn(1, dispatch.RECURRENT_MAX_T + 1, 2, 16, device=DEVICE)
    assert dispatch.routes_to_recurrent(GLACall(q, q, q, None, None, None))
    assert not dispatch.routes_to_recurrent(GLACall(longer, longer, longer, None, None, None))
    assert not dispatch.routes_to_recurrent(GLACall(q[:, :0], q[:, :0], q[:, :0], None, None, None))
    assert not dispatch.routes_to_recurrent(GLACall(q.double(), q.double(), q.double(), None, None, None))
    with gla_inductor.config.patch(triton_gates=("vector",)):
        assert not dispatch.routes_to_recurrent(GLACall(q, q, q, None, None, None))
    monkeypatch.setattr(dispatch, "RECURRENT_MAX_T", 0)
    assert not dispatch.routes_to_recurrent(GLACall(q[:, :1], q[:, :1], q[:, :1], None, None, None))
