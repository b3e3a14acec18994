"""The decode op with grouped q/k: ``gla_inductor::fused_recurrent`` takes q and k [B, T, G, K] with G
dividing v's H heads unrepeated (head h reads q/k head h // (H // G)), on CPU (the PyTorch step
loop), on the recurrent kernel (CUDA, or CPU under the Triton interpreter) and through the chunked
path; checked against the float64 time loop on the repeated inputs."""

import pytest
import torch

from gla_inductor.contract import GLACall
from gla_inductor.ops import dispatch

from helpers import GATES, assert_rel_close, gla_inputs, loop_reference, placed

triton = pytest.importorskip("triton")
ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
KERNELS_RUN_HERE = ON_GPU or type(triton.language.cumsum).__name__ == "InterpretedFunction"
needs_kernels = pytest.mark.skipif(not KERNELS_RUN_HERE, reason="triton was imported without TRITON_INTERPRET=1")

pytestmark = pytest.mark.usefixtures("one_thread")
SCALE = 0.3


def _inputs(gate, T=2, G=2, H=6, device="cpu", dtype=torch.float32):
    return placed(gla_inputs(gate, B=2, T=T, H=H, K=8, V=12, G=G, dtype=dtype, seed=1), device)


def _reference(x, reverse=False):
    # loop_reference reads grouped q and k by every head of their group
    return loop_reference(x, scale=SCALE, reverse=reverse)


def _op_args(x, state, reverse=False):
    return (x["q"], x["k"], x["v"], x["g"], x["g_gamma"], state, SCALE, reverse)


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("G", [1, 3])
def test_cpu_op_reads_groups_unrepeated(gate, G):
    x = _inputs(gate, G=G)
    state = x["initial_state"].clone()
    assert x["q"].shape[2] == G and x["v"].shape[2] == 6
    o = torch.ops.gla_inductor.fused_recurrent(*_op_args(x, state, reverse=gate == "scalar"))
    ref_o, ref_ht = _reference(x, reverse=gate == "scalar")
    assert o.shape == (2, 2, 6, 12)
    assert_rel_close("o", o, ref_o, 1e-5)
    assert_rel_close("state", state, ref_ht, 1e-5)


@needs_kernels
@pytest.mark.parametrize("gate", ["vector", "constant"])
def test_kernel_reads_groups_unrepeated(gate):
    x = _inputs(gate, T=3, G=2, device=DEVICE)
    state = x["initial_state"].clone()
    call = GLACall(x["q"], x["k"], x["v"], x["g"], x["g_gamma"], state, SCALE)
    assert dispatch.recurrent_unsupported_reason(call, state) is None
    o = dispatch.fused_recurrent_gpu(call, state)
    ref_o, ref_ht = _reference(x)
    assert_rel_close("o", o, ref_o, 1e-5)
    assert_rel_close("state", state, ref_ht, 1e-5)


def test_longer_steps_take_the_chunked_path_grouped():
    x = _inputs("vector", T=70, G=3)
    state = x["initial_state"].clone()
    o = torch.ops.gla_inductor.fused_recurrent(*_op_args(x, state))
    ref_o, ref_ht = _reference(x)
    assert_rel_close("o", o, ref_o, 1e-4)
    assert_rel_close("state", state, ref_ht, 1e-4)


def test_fake_and_registrations_with_groups():
    x = _inputs("scalar", G=2)
    torch.library.opcheck(torch.ops.gla_inductor.fused_recurrent.default, _op_args(x, x["initial_state"].clone()))


def test_heads_that_do_not_divide_are_refused():
    x = _inputs("vector", G=2, H=6)
    q = torch.randn(2, 2, 4, 8)  # 4 heads do not divide 6
    with pytest.raises(ValueError, match=r"expected q's heads \(dim 2\) to divide v's 6"):
        torch.ops.gla_inductor.fused_recurrent(q, q, x["v"], None, None, x["initial_state"], SCALE, False)
