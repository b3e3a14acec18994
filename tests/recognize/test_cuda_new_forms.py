"""The newer rewrites on a GPU, through the backend and Inductor (Triton templates): decay tables
in buffers behind their run-time check (``torch.cond`` back to the user's code), normalized
retention (one op call with a column of ones), and decode steps decayed by a computed factor.
Each compiled result against eager on the same device; the buffer cases also after the tables are
recomputed for another gate (the op follows) and after one is corrupted (the user's code runs).
CUDA only: on CPU the same cases run in tests/recognize (test_buffer_change_fallback.py,
test_normalized_retention.py, test_decode_decay_factor.py)."""

import pytest
import torch
from torch._dynamo.utils import counters

import gla_inductor

from helpers import rel_err
from test_buffer_change_fallback import CASES, inputs as buffer_inputs
from test_decode_decay_factor import make as decode_inputs, retnet_v_first
from test_normalized_retention import REWRITTEN, inputs as normalized_inputs

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.usefixtures("seeded_compiler")]

TOL = 1e-4  # fp32 on the GPU, relative


def _cuda(xs, grad=False):
    return [x.detach().cuda().requires_grad_(grad) for x in xs]


def _outputs_and_grads(fn, args):
    outs = fn(*args)
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    if not any(a.requires_grad for a in args):
        return [o.detach() for o in outs]
    gen = torch.Generator(device="cuda").manual_seed(1)
    loss = sum((o * torch.randn(o.shape, generator=gen, device="cuda")).sum() for o in outs)
    return [o.detach() for o in outs] + list(torch.autograd.grad(loss, args))


def _close(compiled, eager, args):
    for got, want in zip(_outputs_and_grads(compiled, args), _outputs_and_grads(eager, args)):
        assert rel_err(got, want) <= TOL


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("name", list(CASES))
def test_buffer_tables_follow_and_fall_back(name, grad):
    make, retune, corrupt = CASES[name]
    model = make().cuda()
    args = _cuda(buffer_inputs(), grad)
    compiled = torch.compile(model, backend=gla_inductor.backend, fullgraph=True, dynamic=False)
    _close(compiled, model, args)
    for change in (retune, corrupt, retune):
        change(model)
        _close(compiled, model, args)


@pytest.mark.parametrize("name", list(CASES))
def test_buffer_tables_rewritten_once(name):
    """One rewrite of the whole chunk loop (not one parallel form per chunk): the certificate's
    float64 run must take the replacement's GPU factories (positions for the tables' checks) to
    the CPU, where its inputs are."""
    make, _, _ = CASES[name]
    model = make().cuda()
    counters.clear()
    torch.compile(model, backend=gla_inductor.backend, fullgraph=True, dynamic=False)(*_cuda(buffer_inputs()))
    assert counters["gla_inductor"]["rewrites"] == 1, dict(counters["gla_inductor"])


@pytest.mark.parametrize("fn", REWRITTEN, ids=lambda f: f.__name__)
def test_normalized_retention(fn):
    args = _cuda(normalized_inputs("seq_first" in fn.__name__), grad=True)
    counters.clear()
    _close(torch.compile(fn, backend=gla_inductor.backend, fullgraph=True), fn, args)
    assert counters["gla_inductor"]["rewrites"] == 1


def test_decode_decayed_by_a_computed_factor():
    args = _cuda(decode_inputs())
    counters.clear()
    with torch.no_grad():
        _close(torch.compile(retnet_v_first, backend=gla_inductor.backend, fullgraph=True), retnet_v_first, args)
    assert counters["gla_inductor"]["rewrites"] == 1
