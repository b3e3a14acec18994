"""The recurrent Triton kernel's state-pool launch (``kernels.recurrent.forward`` with
``call.state_indices``), on CPU tensors under the Triton interpreter (on CUDA with a GPU): what the
launcher checks, grouped heads, no final state, empty steps, 64-bit offsets, and that the kernel
without indices renders exactly as before."""

import pytest
import torch
import torch.nn.functional as F

from gla_inductor.contract import GLACall
from gla_inductor.reference import naive_recurrent_gla

triton = pytest.importorskip("triton")
pytest.importorskip("jinja2")
ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
if not (ON_GPU or type(triton.language.cumsum).__name__ == "InterpretedFunction"):
    pytest.skip("triton was imported without TRITON_INTERPRET=1", allow_module_level=True)

from gla_inductor.kernels import recurrent as recurrent_kernels  # noqa: E402
from gla_inductor.kernels import standalone  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

B, T, G, H, K, V, P = 3, 2, 1, 2, 16, 32, 5
SLOTS = [3, -1, 0]


def _inputs(groups: int = H, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, groups, K, generator=gen).to(DEVICE) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen).to(DEVICE)
    g = F.logsigmoid(torch.randn(B, T, H, K, generator=gen)).to(DEVICE)
    pool = torch.randn(P, H, K, V, generator=gen).to(DEVICE)
    return q, k, v, g, pool, torch.tensor(SLOTS, device=DEVICE)


def _expected_slots(q, k, v, g, pool, scale):
    """{b: (o_b, final state of b)} of the float64 loop, for the valid entries."""
    out = {}
    for b, slot in enumerate(SLOTS):
        if slot >= 0:
            out[b] = naive_recurrent_gla(*(x[b:b + 1].double().cpu() for x in (q, k, v, g)), scale=scale,
                                         initial_state=pool[slot:slot + 1].double().cpu(), output_final_state=True)
    return out


def _close(a, b, tol=1e-5) -> bool:
    return ((a.double().cpu() - b).norm() / b.norm()).item() <= tol


@pytest.mark.parametrize("store", [True, False], ids=["in_place", "no_final_state"])
@pytest.mark.parametrize("groups", [H, G], ids=["heads", "grouped"])
def test_kernel_reads_and_writes_slots(groups, store):
    """Grouped q/k heads read through the pool's slots too; without a final state, no slot changes."""
    q, k, v, g, pool, idx = _inputs(groups)
    before = pool.clone()
    expected = _expected_slots(q.repeat_interleave(H // groups, 2), k.repeat_interleave(H // groups, 2), v, g,
                               pool, 0.25)
    o = recurrent_kernels.forward(GLACall(q, k, v, g, None, pool, 0.25, state_indices=idx), pool if store else None)
    assert torch.equal(o[1], torch.zeros_like(o[1]))
    for b, (o_b, ht_b) in expected.items():
        assert _close(o[b:b + 1], o_b), f"o of entry {b}"
        if store:
            assert _close(pool[SLOTS[b]:SLOTS[b] + 1], ht_b), f"slot {SLOTS[b]}"
    for slot in range(P):
        if not store or slot not in SLOTS:
            assert torch.equal(pool[slot], before[slot]), f"slot {slot} changed"


def test_kernel_with_64_bit_offsets(monkeypatch):
    """INDEX_DTYPE int64 (pools past 2**31 elements): the slot offset is widened, not wrapped."""
    monkeypatch.setattr(recurrent_kernels, "needs_int64", lambda x: True)
    q, k, v, g, pool, idx = _inputs()
    expected = _expected_slots(q, k, v, g, pool, 0.25)
    o = recurrent_kernels.forward(GLACall(q, k, v, g, None, pool, 0.25, state_indices=idx.int()), pool)
    for b, (o_b, ht_b) in expected.items():
        assert _close(o[b:b + 1], o_b) and _close(pool[SLOTS[b]:SLOTS[b] + 1], ht_b)


def test_no_steps_touch_nothing():
    q, k, v, g, pool, idx = _inputs()
    before = pool.clone()
    o = recurrent_kernels.forward(GLACall(q[:, :0], k[:, :0], v[:, :0], g[:, :0], None, pool, 0.25,
                                          state_indices=idx), pool)
    assert o.shape == (B, 0, H, V) and torch.equal(pool, before)


def test_launcher_checks_the_pool():
    q, k, v, g, pool, idx = _inputs()
    forward = recurrent_kernels.forward
    with pytest.raises(ValueError, match=r"state_indices need an initial state"):
        forward(GLACall(q, k, v, g, None, None, 0.25, state_indices=idx), None)
    with pytest.raises(ValueError, match=r"state_out is|final states go to the pool itself"):
        forward(GLACall(q, k, v, g, None, pool, 0.25, state_indices=idx), pool.clone())
    with pytest.raises(ValueError, match=r"expected \[P, H, K, V\] = \[P, 2, 16, 32\] and \[B\] = \[3\]"):
        forward(GLACall(q, k, v, g, None, pool[:, :1], 0.25, state_indices=idx), None)
    with pytest.raises(ValueError, match=r"and \[B\] = \[3\]"):
        forward(GLACall(q, k, v, g, None, pool, 0.25, state_indices=idx[:2]), None)
    reason = recurrent_kernels.unsupported_reason(GLACall(q, k, v, g, None, pool, 0.25, state_indices=idx.float()))
    assert reason == "state_indices dtype torch.float32 (supported: int32, int64)"


def test_kernel_without_indices_renders_as_before():
    """The option only adds code: a launch without indices takes no index argument and reads the
    state at its batch entry."""
    options = recurrent_kernels.recurrent_options(K, V, "vector", 0.25, False, block_v=32, use_h0=True,
                                                  store_ht=True)
    ndims = {"q": 4, "k": 4, "v": 4, "g": 4, "h0": 4, "ht": 4, "idx": 1, standalone.OUT: 4}
    plain, helpers = standalone.render_source(("gla_recurrent", "gla_common"), "gla_recurrent", options, ndims)
    assert "idx" not in helpers.pointers and "i_slot" not in plain and "valid" not in plain
    pooled, helpers = standalone.render_source(("gla_recurrent", "gla_common"), "gla_recurrent",
                                               dict(options, USE_INDICES=True), ndims)
    assert helpers.pointers[-1] == "idx" and "i_slot" in pooled
