"""The CPU implementation's buffers kept between calls (gla_inductor/scratch.py): reused, never
an output, per thread, bounded, and usable whatever the autograd mode of the call."""

import threading

import pytest
import torch

from gla_inductor import config

from gla_inductor.impl import scratch
from gla_inductor.impl.chunked import BT
from gla_inductor.ops import chunk_gla

from helpers import gla_inputs, loop_reference, placed

GATES = ("vector", "scalar", "none")

pytestmark = pytest.mark.usefixtures("cpu_impl")  # the step loops keep the backward's buffer too


def make_inputs(gate, B=2, T=2 * BT, H=1, K=8, V=4, seed=0, grad=False):
    """chunk_gla's fp32 inputs (helpers.gla_inputs), leaves that require grad when grad."""
    return placed(gla_inputs(gate, B, T, H, K, V, seed=seed), requires_grad=grad)


def forward_backward(inputs):
    """o, the final state and the gradients of every input, detached."""
    o, ht = chunk_gla(**inputs, output_final_state=True)
    leaves = [x for x in inputs.values() if x is not None and x.requires_grad]
    grads = torch.autograd.grad((o * o).sum() + ht.sum(), leaves) if leaves else ()
    return [t.detach() for t in (o, ht, *grads)]


def storages() -> set:
    return {b.untyped_storage().data_ptr() for b in scratch._buffers().values()}


@pytest.fixture(autouse=True)
def fresh_buffers():
    scratch.clear()
    yield
    scratch.clear()


@pytest.mark.parametrize("gate", GATES)
def test_outputs_are_never_scratch_buffers(gate):
    # H = 1: the chunked output transposed back to [B, T, 1, V] is already contiguous, a view of
    # its buffer unless copied
    first = forward_backward(make_inputs(gate, grad=True))
    kept = [t.clone() for t in first]
    assert storages(), "the CPU path keeps its intermediates"
    assert not storages() & {t.untyped_storage().data_ptr() for t in first}
    forward_backward(make_inputs(gate, seed=1, grad=True))  # overwrites every buffer
    for a, b in zip(first, kept):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("gate", GATES)
def test_a_second_call_reuses_every_buffer(gate):
    forward_backward(make_inputs(gate, grad=True))
    before = {n: b.data_ptr() for n, b in scratch._buffers().items()}
    forward_backward(make_inputs(gate, seed=1, grad=True))
    assert {n: b.data_ptr() for n, b in scratch._buffers().items()} == before


def test_smaller_then_larger_then_smaller_shapes():
    for T in (BT, 3 * BT + 5, 17):
        inputs = make_inputs("vector", T=T, H=2)
        o, ht = chunk_gla(**inputs, output_final_state=True)
        ref_o, ref_ht = loop_reference(inputs)
        torch.testing.assert_close(o.double(), ref_o, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ht.double(), ref_ht, rtol=1e-5, atol=1e-5)


def test_inference_mode_then_training():
    # buffers first taken under inference mode stay writable outside it
    inputs = make_inputs("vector")
    with torch.inference_mode():
        o_inf = chunk_gla(**inputs)[0]
    grads = forward_backward(placed(inputs, requires_grad=True))
    torch.testing.assert_close(o_inf, grads[0], rtol=0, atol=0)
    with torch.inference_mode():
        torch.testing.assert_close(chunk_gla(**inputs)[0], o_inf, rtol=0, atol=0)


def test_threads_keep_their_own_buffers():
    inputs = [make_inputs(gate, seed=n, grad=True) for n, gate in enumerate(GATES * 2)]
    expected = [forward_backward(x) for x in inputs]
    results, start = [None] * len(inputs), threading.Barrier(len(inputs))

    def work(n):
        start.wait()
        results[n] = [forward_backward(inputs[n]) for _ in range(3)]

    threads = [threading.Thread(target=work, args=(n,)) for n in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for want, got in zip(expected, results):
        for run in got:
            for a, b in zip(run, want):
                torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_byte_limit():
    inputs = make_inputs("scalar", grad=True)
    want = forward_backward(inputs)
    scratch.clear()
    with config.patch(cpu_scratch_bytes=0):
        got = forward_backward(inputs)
    assert not scratch._buffers()
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
