"""Parallel retention at long sequences: a decay mask built from positions and a per-head decay
buffer (torchscale's masked_fill(inf) + exp + nan_to_num, or gamma ** (i - j)) is proven along its
diagonals (recognize/forms/toeplitz_decay.py), O(H T) instead of an [H, T, T] float64 mask (also
divided by the root of its row sums, torchscale's row factor: recognize/forms/row_factor.py), so it
is rewritten at T = 4096 and 8192 in bounded time (its whole evaluation used to take seconds at
T = 2048 and was refused past the evaluator's size limit at T = 4096).

Soundness first: every diagonal is still evaluated, so a mask that differs from GLA's only far
from the diagonal (one distance, or every distance past some T) is not rewritten, and one that is
not Toeplitz (a single wrong entry) falls back to the whole evaluation, which refuses it at this
size. Recognition time is CPU time of the rewrite pass, bounded loosely (a shared 2-core runner).
"""

import time

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters

from gla_inductor.backend import rewrite
from gla_inductor.recognize.forms import static_decay
from helpers import rel_err

pytestmark = pytest.mark.usefixtures("fresh_compiler")

BOUND_S = 10.0  # recognition CPU time asserted (the target is well under 2 s)
K = V = 8


class Retention(nn.Module):
    """q k^T times a decay mask from positions and a buffer of log decays, then @ v. `twist`
    changes the distances before the mask is built (a look-alike)."""

    def __init__(self, H, spelling="torchscale", twist=None, base=5, rows=False):
        super().__init__()
        self.register_buffer("decay", torch.log(1 - 2.0 ** (-base - torch.arange(H, dtype=torch.float))))
        self.spelling, self.twist, self.rows = spelling, twist, rows

    def forward(self, q, k, v):
        T = q.shape[2]
        index = torch.arange(T).to(self.decay)
        dist = index[:, None] - index[None, :]
        if self.twist is not None:
            dist = self.twist(dist, index)
        if self.spelling == "torchscale":
            dist = torch.masked_fill(dist, index[:, None] < index[None, :], float("inf"))
            mask = torch.nan_to_num(torch.exp(dist * self.decay[:, None, None]))
        else:  # gamma ** (i - j), the future zeroed by tril
            mask = (self.decay.exp()[:, None, None] ** dist.clamp(min=0)).tril()
        if self.rows:  # torchscale's: each row divided by the root of its sum (folded into q)
            mask = torch.nan_to_num(mask / mask.sum(dim=-1, keepdim=True).sqrt())
        return (q @ k.transpose(-1, -2) * mask) @ v


def _compile(model, args, run=True):
    """(outputs or None, rewrite results, recognition CPU seconds). Without `run`, the backend
    stops after the rewrite: recognition at sizes whose eager attention would not fit."""
    results, seconds = [], []

    class Stop(Exception):
        pass

    def backend(gm, example_inputs):
        start = time.process_time()
        results.append(rewrite(gm, example_inputs))
        seconds.append(time.process_time() - start)
        if not run:
            raise Stop
        return gm.forward

    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)
    with torch.no_grad():
        if not run:
            with pytest.raises(Exception, match="Stop"):
                compiled(*args)
            return None, results, sum(seconds)
        return compiled(*args), results, sum(seconds)


def _inputs(B, H, T, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, T, d, generator=gen) for d in (K, K, V)]


def _no_whole_mask(monkeypatch):
    """The [H, T, T] evaluation must not run: the diagonals prove the mask."""
    def whole(*args, **kwargs):
        raise AssertionError("the decay mask was evaluated whole")

    monkeypatch.setattr(static_decay, "_evaluate", whole)


@pytest.mark.parametrize("spelling,rows", [("torchscale", False), ("power", False), ("torchscale", True)])
def test_rewritten_at_4096_equal_to_eager(spelling, rows, monkeypatch):
    _no_whole_mask(monkeypatch)
    model = Retention(2, spelling, base=8, rows=rows)
    args = _inputs(1, 2, 4096)
    got, _, seconds = _compile(model, args)
    assert counters["gla_inductor"]["rewrites"] == 1
    with torch.no_grad():
        want = model.double()(*[a.double() for a in args])
    assert rel_err(got, want) <= 1e-4
    assert seconds < BOUND_S


@pytest.mark.parametrize("rows", [False, True], ids=["mask", "row_normalized_mask"])
@pytest.mark.parametrize("B,H,T", [(8, 8, 4096), (8, 8, 8192)])
def test_recognized_at_model_sizes_in_bounded_time(B, H, T, rows, monkeypatch):
    """(B, H, T) = (8, 8, 8192): the whole mask would be 4 GiB in float64."""
    _no_whole_mask(monkeypatch)
    _, results, seconds = _compile(Retention(H, rows=rows), _inputs(B, H, T), run=False)
    assert [m.form for r in results for m in r.matches] == ["parallel"]
    assert seconds < BOUND_S, seconds


def one_distance_off(dist, index):
    return dist.masked_fill(dist == 3000, 2999.0)  # one diagonal a step short


def far_distances_off(dist, index):
    return torch.where(dist > 3500, dist + 1, dist)  # every distance past 3500 a step long


def one_entry_off(dist, index):
    return dist + 50 * (index[:, None] == 4000).float() * (index[None, :] == 10).float()  # not Toeplitz


@pytest.mark.parametrize("twist,rows", [(one_distance_off, False), (far_distances_off, False), (one_entry_off, False),
                                        (one_distance_off, True), (far_distances_off, True)],
                         ids=["one_distance_off", "far_distances_off", "one_entry_off", "one_distance_off_rows",
                              "far_distances_off_rows"])
def test_far_look_alikes_are_not_rewritten(twist, rows):
    """Wrong only far from the diagonal (gamma ** 3000 ~ 0.5 at this base: well above the check's
    tolerance): left alone with a reason, and the output is the user's."""
    model = Retention(2, twist=twist, base=12, rows=rows)
    args = _inputs(1, 2, 4096, seed=1)
    got, results, seconds = _compile(model, args)
    assert counters["gla_inductor"]["rewrites"] == 0
    reasons = [nm.reason for r in results for nm in r.near_misses]
    assert any("decay" in r for r in reasons), reasons
    with torch.no_grad():
        want = model(*args)
    assert rel_err(got, want) <= 1e-5
    if twist is not one_entry_off:  # (that one is evaluated whole, as before: seconds at this size)
        assert seconds < BOUND_S


def test_far_look_alike_reason_names_the_position():
    model = Retention(2, twist=one_distance_off, base=12)
    _, results, _ = _compile(model, _inputs(1, 2, 4096), run=False)
    reasons = [nm.reason for r in results for nm in r.near_misses]
    assert any("i=3000, j=0" in r and "not of the form gamma ** (i - j)" in r for r in reasons), reasons


# ---- the diagonals are the whole mask's -----------------------------------------------------------
MASKS = {
    "torchscale": lambda i, lg: torch.nan_to_num(torch.exp(
        torch.masked_fill(i[:, None] - i[None, :], i[:, None] < i[None, :], float("inf")) * lg[:, None, None])),
    "power_tril": lambda i, lg: (lg.exp()[:, None, None] ** (i[:, None] - i[None, :]).clamp(min=0)).tril(),
    "reverse_triu": lambda i, lg: torch.exp((i[None, :] - i[:, None]).abs() * lg[:, None, None]).triu(),
    "where_ge": lambda i, lg: torch.where(i[:, None] >= i[None, :], torch.exp2((i[:, None] - i[None, :]) *
                                                                                lg[:, None, None] / 0.6931), 0.0),
    "ones_tril": lambda i, lg: torch.ones(len(i), len(i)).tril() * lg.exp()[:, None, None] ** (i[:, None] - i[None, :]),
    "strict_shift": lambda i, lg: (i[:, None] > i[None, :] - 1).float() * torch.exp(
        (i[:, None] - i[None, :]).clamp(min=0) * lg[:, None, None]),
    "clamped_far": lambda i, lg: torch.exp((i[:, None] - i[None, :]).clamp(0, 5) * lg[:, None, None]).tril(),
    "row_normalized": lambda i, lg: (lambda m: torch.nan_to_num(m / m.sum(dim=-1, keepdim=True).sqrt()))(
        torch.exp((i[:, None] - i[None, :]) * lg[:, None, None]).tril()),
    "not_toeplitz": lambda i, lg: torch.exp((i[:, None] - i[None, :]) * lg[:, None, None]).tril() *
        (1 + (i[:, None] * i[None, :] == 6)),
}


@pytest.mark.parametrize("name", list(MASKS))
def test_diagonals_equal_the_whole_mask(name, monkeypatch):
    """Wherever the diagonals are taken, they are the whole mask's entries (both evaluations run
    on the decays of each spelling, GLA or not, at T = 9); a mask that is not Toeplitz (a product
    i * j) is evaluated whole."""
    from gla_inductor.recognize.forms import toeplitz_decay

    seen = []
    real = static_decay.checked_decay

    def both(an, factors, axes, state=None):
        got = toeplitz_decay.evaluate(an, factors, axes, state, rows=True)
        D = static_decay._evaluate(an, factors, axes, state)
        if got is not None:
            v, r = got
            T = D.shape[-1]
            diag = torch.arange(T)[:, None] - torch.arange(T)[None, :] + T - 1
            whole = v[..., diag] * (r[..., :, None] if r is not None else 1)
            # (to an ulp: pow's vectorized and scalar loops may round the last bit apart; the row
            # sums are added in another order)
            torch.testing.assert_close(whole, D, rtol=1e-12, atol=0, equal_nan=True)
        seen.append(got is not None)
        return real(an, factors, axes, state)

    monkeypatch.setattr(static_decay, "checked_decay", both)

    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("decay", torch.log(1 - 2.0 ** (-2 - torch.arange(3, dtype=torch.float))))

        def forward(self, q, k, v):
            i = torch.arange(q.shape[2]).to(self.decay)
            return (q @ k.transpose(-1, -2) * MASKS[name](i, self.decay)) @ v

    _compile(Masked(), _inputs(2, 3, 9))
    assert seen, "no static decay was checked"
    assert all(seen) == (name != "not_toeplitz"), seen
