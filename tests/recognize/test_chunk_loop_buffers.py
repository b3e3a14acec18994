"""Chunk loops whose decays are tables held in module state (lightning attention, chunkwise
retention): computed once from per-head slopes in ``__init__``, read by the loop. The loop is
rewritten with its constant gate computed in the graph from the tables; a change of the tables
after compiling reaches the op when they are recomputed from new slopes, and runs the user's
loop instead (the run-time guard's fallback) when they stop being one gate's tables
(test_buffer_change_fallback.py covers it, with gradients and through Inductor)."""

import pytest
import torch
from torch._dynamo.utils import counters

from gla_inductor.recognize.forms import table_gate

from helpers import compile_rewritten, rel_err, rewrite_then_eager

pytestmark = [pytest.mark.usefixtures("seeded_compiler"), pytest.mark.compat]

TOL = 1e-5


class TableChunkLoop(torch.nn.Module):
    """A chunk loop over [B, H, T, D] with every decay precomputed before the loop: query,
    key, diagonal and block decays per head, as buffers. `five_d`: each chunk's output is
    written into a [B, H, n_chunks, C, V] buffer (else a list and cat)."""

    def __init__(self, heads: int, chunk: int, five_d: bool):
        super().__init__()
        self.chunk, self.five_d = chunk, five_d
        self.register_buffer("slope", torch.linspace(0.1, 0.7, heads))
        n = torch.arange(chunk, dtype=torch.float32)
        self.register_buffer("positions", n)
        for name in ("query_decay", "key_decay", "diagonal_decay", "block_decay"):
            self.register_buffer(name, torch.empty(0))
        self.retable()

    @torch.no_grad()
    def retable(self):
        """The tables from the slopes (in place: the compiled graph reads these tensors)."""
        g, n = -self.slope[:, None], self.positions
        d = n[:, None] - n[None, :]
        tables = {
            "query_decay": torch.exp(g * (n + 1))[..., None],
            "key_decay": torch.exp(g * (self.chunk - 1 - n))[..., None],
            "diagonal_decay": torch.exp(g[..., None] * d).masked_fill(d < 0, 0.0),
            "block_decay": torch.exp(g * self.chunk)[..., None],
        }
        for name, val in tables.items():
            buf = getattr(self, name)
            if buf.shape != val.shape:
                buf.resize_(val.shape)
            buf.copy_(val)

    def forward(self, q, k, v):
        B, H, T, K = q.shape
        C, N = self.chunk, q.shape[2] // self.chunk
        S = q.new_zeros(B, H, K, v.shape[-1])
        out = q.new_zeros(B, H, N, C, v.shape[-1]) if self.five_d else []
        for c in range(N):
            qc, kc, vc = (x[:, :, c * C:(c + 1) * C] for x in (q, k, v))
            o = ((qc @ kc.transpose(-1, -2)) * self.diagonal_decay) @ vc + (qc * self.query_decay) @ S
            if self.five_d:
                out[:, :, c] = o
            else:
                out.append(o)
            S = S * self.block_decay + (kc * self.key_decay).transpose(-1, -2) @ vc
        return (out.reshape(B, H, T, -1) if self.five_d else torch.cat(out, dim=2)), S


def inputs(B=2, H=3, T=16, K=8, V=6):
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(B, H, T, d, generator=gen) for d in (K, K, V))


@pytest.mark.parametrize("five_d", [False, True])
def test_rewritten_with_the_gate_read_from_the_tables(five_d):
    model = TableChunkLoop(heads=3, chunk=4, five_d=five_d)
    args = inputs()
    got, (res,) = compile_rewritten(model, args)
    assert [m.form for m in res.matches] == ["chunked"] and res.matches[0].gate == "constant"
    want = model(*args)
    for g, w in zip(got, want):
        assert rel_err(g, w) <= TOL


def test_tables_changed_after_compiling_are_followed_or_fall_back():
    model = TableChunkLoop(heads=3, chunk=4, five_d=False)
    args = inputs()
    compiled = torch.compile(model, backend=rewrite_then_eager, dynamic=False)
    compiled(*args)
    # new slopes, tables recomputed from them (a checkpoint loaded): the op follows
    model.slope.mul_(1.7)
    model.retable()
    for g, w in zip(compiled(*args), model(*args)):
        assert rel_err(g, w) <= TOL
    # one table alone changed: no longer one gate's tables, the user's loop runs
    model.key_decay.mul_(0.5)
    for g, w in zip(compiled(*args), model(*args)):
        assert rel_err(g, w) <= TOL


class MaskedTableChunkLoop(TableChunkLoop):
    """The diagonal decay unmasked, times a separate 0/1 causal mask buffer: a table that is no
    function of the gate, guarded by its fingerprint."""

    def __init__(self, heads: int, chunk: int):
        super().__init__(heads, chunk, five_d=False)
        self.register_buffer("mask", torch.ones(chunk, chunk).tril())
        with torch.no_grad():
            n = self.positions
            self.diagonal_decay.copy_(torch.exp(-self.slope[:, None, None] * (n[:, None] - n[None, :])))

    def forward(self, q, k, v):
        B, H, T, K = q.shape
        C, N = self.chunk, q.shape[2] // self.chunk
        S, out = q.new_zeros(B, H, K, v.shape[-1]), []
        for c in range(N):
            qc, kc, vc = (x[:, :, c * C:(c + 1) * C] for x in (q, k, v))
            decay = self.diagonal_decay * self.mask
            out.append(((qc @ kc.transpose(-1, -2)) * decay) @ vc + (qc * self.query_decay) @ S)
            S = S * self.block_decay + (kc * self.key_decay).transpose(-1, -2) @ vc
        return torch.cat(out, dim=2), S


def test_a_mask_buffer_is_guarded_by_value():
    model = MaskedTableChunkLoop(heads=3, chunk=4)
    args = inputs()
    compiled = torch.compile(model, backend=rewrite_then_eager, dynamic=False)
    counters.clear()
    for g, w in zip(compiled(*args), model(*args)):
        assert rel_err(g, w) <= TOL
    assert counters["gla_inductor"]["rewrites"] == 1
    model.mask[0, 1] = 1.0  # no longer causal: the user's loop runs
    for g, w in zip(compiled(*args), model(*args)):
        assert rel_err(g, w) <= TOL


def test_a_table_that_is_not_a_decay_is_fingerprinted():
    """A table that is no function of the gate (here: a 0/1 causal mask with a value off the
    triangle) is guarded by value: the fingerprint of its compile-time values."""
    x = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    t = table_gate._fit(_state_node(x), torch.tensor([-0.1, -0.3], dtype=torch.float64))
    assert t.kind == "same" and t.fingerprint == pytest.approx(float((x.reshape(-1) * table_gate._weights(4)).sum()))


def test_exponent_tables_are_fitted():
    g0 = torch.tensor([-0.1, -0.3], dtype=torch.float64)
    n = torch.arange(4, dtype=torch.float64)
    d = n[:, None] - n[None, :]
    diag = torch.exp(g0[:, None, None] * d).masked_fill(d < 0, 0).float()
    t = table_gate._fit(_state_node(diag), g0)
    assert t.kind == "exp" and t.head_axis == 0 and t.coefs == pytest.approx((0.0, 0.0, 1.0, -1.0), abs=1e-6)
    t = table_gate._fit(_state_node((-g0).float()[:, None]), g0)
    assert t.kind == "lin" and t.coefs == pytest.approx((-1.0, 0.0, 0.0), abs=1e-6)


def _state_node(value: torch.Tensor):
    """A placeholder that reads as module state holding `value`."""
    import torch.fx as fx

    class Arg:
        example = value

        class source:
            name = "L['self']._buffers['t']"

    node = fx.Graph().placeholder("t")
    node.meta["grapharg"] = Arg()
    return node
