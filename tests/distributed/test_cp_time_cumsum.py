"""The context-parallel decays' two-level time cumsum against a float64 cumsum (no process group)."""

import pytest
import torch
import torch.nn.functional as F

from gla_inductor.distributed.context_parallel import _SCAN_BLOCK, _time_cumsum


@pytest.mark.parametrize("T", [1, 2 * _SCAN_BLOCK, 2 * _SCAN_BLOCK + 1, 5 * _SCAN_BLOCK, 5 * _SCAN_BLOCK + 37])
@pytest.mark.parametrize("shape", [(2, 3, 4), (1, 3)], ids=["vector", "scalar"])
def test_time_cumsum_matches_cumsum(T, shape):
    x = F.logsigmoid(torch.randn(shape[0], T, *shape[1:], dtype=torch.float64))
    got = _time_cumsum(x.to(torch.bfloat16), torch.float32)
    want = x.to(torch.bfloat16).double().cumsum(1)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-6


def test_time_cumsum_gradient():
    x = torch.randn(1, 3 * _SCAN_BLOCK + 5, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: _time_cumsum(x, torch.float64), (x,))
