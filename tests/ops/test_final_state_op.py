"""The ``gla_inductor::chunk_final_state`` op on its PyTorch path (``impl.final_state``), in float64
against the time loop: the final state from zero and the dual's gradient w.r.t. the initial state,
the decay, for every gate kind, reverse, grouped heads, chunk edges; its fake implementation's
shapes and dtypes; the op's registration (``opcheck``)."""

import pytest
import torch

import final_state_cases as cases
from gla_inductor.impl import final_state as impl
from gla_inductor.ops import final_state as op_module  # noqa: F401  (registers the op)

TOL = 1e-12


def _run(t: dict, dual: bool):
    return torch.ops.gla_inductor.chunk_final_state(*cases.op_args(t, dual))


def _assert_close(got, want, name):
    assert got.shape == want.shape and got.dtype == want.dtype, f"{name}: {got.shape} {got.dtype}"
    if want.numel():
        err = (got - want).abs().max().item()
        assert err <= TOL * max(1.0, want.abs().max().item()), f"{name}: max error {err}"


@pytest.mark.parametrize("dual", [False, True], ids=["state", "dual"])
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("gate", cases.GATES)
def test_matches_the_time_loop(gate, reverse, dual):
    t = dict(cases.inputs(gate), reverse=reverse)
    state, decay = _run(t, dual)
    want_state, want_decay = cases.reference(t, dual)
    _assert_close(state, want_state, "state")
    _assert_close(decay, want_decay, "decay")


@pytest.mark.parametrize("T", [0, 1, 63, 64, 65, 128])
@pytest.mark.parametrize("dual", [False, True], ids=["state", "dual"])
def test_chunk_edges(T, dual):
    """Around the chunk length (impl.final_state.BT = 64), and no steps at all (zeros, decay 1)."""
    assert impl.BT == 64
    t = cases.inputs("vector", T=T, G=4)
    state, decay = _run(t, dual)
    want_state, want_decay = cases.reference(t, dual)
    _assert_close(state, want_state, "state")
    _assert_close(decay, want_decay if T else torch.ones_like(decay), "decay")


def test_a_reset_gate_cuts_the_state():
    """A log gate of -inf (a reset) at step t: the state holds only step t and those after it, no NaN."""
    t = cases.inputs("vector", T=100)
    t["g"][:, 70] = -float("inf")
    state, decay = _run(t, False)
    after = dict(t, **{n: t[n][:, 70:] for n in ("q", "k", "v", "g", "do")})
    _assert_close(state, cases.reference(after, False)[0], "state")
    assert torch.equal(decay, torch.zeros_like(decay))


@pytest.mark.parametrize("gate", ["vector", "scalar", "gamma", "none"])
def test_fake_shapes_and_dtypes(gate):
    from torch._subclasses.fake_tensor import FakeTensorMode

    t = cases.inputs(gate, dtype=torch.bfloat16)
    real = _run(t, True)
    with FakeTensorMode() as mode:
        fake_t = {n: mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for n, x in t.items()}
        fake = _run(fake_t, True)
    for r, f in zip(real, fake):
        assert r.shape == f.shape and r.dtype == f.dtype == torch.float32


@pytest.mark.parametrize("gate", ["vector", "gamma", "softplus"])
def test_opcheck(gate):
    t = cases.inputs(gate, T=20)
    for dual in (False, True):
        torch.library.opcheck(torch.ops.gla_inductor.chunk_final_state.default, cases.op_args(t, dual),
                              test_utils=("test_schema", "test_faketensor"))
