"""In-place mutation against the recognizer: programs where an in-place write (mul_, copy_,
setitem, `x *= y`, out=, inplace=True, _foreach_*, writes through views, .data or split parts)
changes what the naive code computes. The algebra reads node values, so every read after a
write must see the new version (or be opaque), and the op, which reads its inputs where it is
inserted, must see the values the code read. For each program the compiled result (outputs and
every input the program writes) equals eager, and the rewrite count is pinned: 0 where the write
makes the program something else or unprovable, 1 where the rewrite stays exact.

Thirteen of these were rewritten wrongly before (relative errors 0.03 to 1.4): a whole-write
read as the value before an earlier write, writes by `*=`, out=, inplace=True, _foreach_*, .data
and split parts not seen, equal nodes merged across a write, a buffer's alias not seen, and the
steps' outputs not compared for scale and layout."""

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_rewritten_like_eager

B, H, T, K, V = 2, 2, 5, 3, 4
TOL = 1e-5


pytestmark = [pytest.mark.usefixtures("one_thread", "fresh_compiler"), pytest.mark.compat]


def loop_inputs():
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, H, V, generator=gen)
    return [q, k, v, F.logsigmoid(torch.randn(B, T, H, K, generator=gen) + 2)]


def loop_cache_inputs():
    return loop_inputs() + [torch.randn(B, H, K, V, generator=torch.Generator().manual_seed(1))]


def decode_inputs():
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(B, H, K, generator=gen), torch.randn(B, H, K, generator=gen), torch.randn(B, H, V, generator=gen)
    return [q, k, v, F.logsigmoid(torch.randn(B, H, K, generator=gen)), torch.randn(B, H, K, V, generator=gen)]


def step(S, k, v, g, t):
    return S * g[:, t].exp()[..., None] + k[:, t, :, :, None] * v[:, t, :, None, :]


def read(q, S, t):
    return (q[:, t, :, :, None] * S).sum(-2)


# ---- the state and the cache ----------------------------------------------------------------
def decode_state_scaled_before_copy(q, k, v, g, cache):
    """The new state doubled in place, then copied into the cache, which the output reads: the
    copy holds the doubled state (the write-back's value was once read as the undoubled S). S is
    the program's own tensor, so its write reads as S * 2 (core/local_updates.py): rewritten."""
    S = cache * g.exp()[..., None] + k[..., :, None] * v[..., None, :]
    S.mul_(2)
    cache.copy_(S)
    return torch.einsum("bhk,bhkv->bhv", q, cache)


def decode_cache_scaled_after_copy(q, k, v, g, cache):
    """The cache scaled after the write-back and before the read."""
    S = cache * g.exp()[..., None] + k[..., :, None] * v[..., None, :]
    cache.copy_(S)
    cache.mul_(2)
    return torch.einsum("bhk,bhkv->bhv", q, cache)


def decode_key_scaled_after_step(q, k, v, g, cache):
    """k doubled after the step read it: the op (placed at the read) must use the old k."""
    k = k.clone()
    S = cache * g.exp()[..., None] + k[..., :, None] * v[..., None, :]
    cache.copy_(S)
    k.mul_(2)
    return torch.einsum("bhk,bhkv->bhv", q, cache), k


def loop_initial_state_scaled(q, k, v, g):
    """The initial state tensor tripled after the first step read it."""
    h0 = q.new_ones(B, H, K, V)
    S = h0
    outs = []
    for t in range(T):
        S = step(S, k, v, g, t)
        outs.append(read(q, S, t))
        if t == 0:
            h0.mul_(3)
    return torch.stack(outs, 1)


def loop_final_state_scaled(q, k, v, g):
    """The final state doubled after every read. The write reads as S * 2 (core/local_updates.py),
    a reader of the final state beside the output, which the loop form does not take (nor the
    same code written S * 2): left alone, equal to eager."""
    S = q.new_zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = step(S, k, v, g, t)
        outs.append(read(q, S, t))
    S.mul_(2)
    return torch.stack(outs, 1), S


def loop_cache_read_again(q, k, v, g, cache):
    """A short loop from a cache, its final state copied back, the cache read again after."""
    S = cache
    outs = []
    for t in range(T):
        S = step(S, k, v, g, t)
        outs.append(read(q, S, t))
    cache.copy_(S)
    return torch.stack(outs, 1), torch.einsum("bhk,bhkv->bhv", q[:, 0], cache)


def loop_cache_then_decode_step(q, k, v, g, cache):
    """The loop's final state copied back, then one more step from the cache and written back:
    the cache read after its write-back chains the step to the loop."""
    S = cache
    outs = []
    for t in range(T - 1):
        S = step(S, k, v, g, t)
        outs.append(read(q, S, t))
    cache.copy_(S)
    cache.copy_(cache * g[:, -1].exp()[..., None] + k[:, -1, ..., None] * v[:, -1, ..., None, :])
    return torch.stack(outs, 1), torch.einsum("bhk,bhkv->bhv", q[:, -1], cache)


# ---- inputs written mid-loop ----------------------------------------------------------------
def loop_query_imul(q, k, v, g):
    """`q0 *= 2` (operator.imul) on the tensor the loop slices, mid-loop."""
    q = q.clone()
    q0 = q
    S = q.new_zeros(B, H, K, V)
    outs = []
    for t in range(T):
        if t == 2:
            q0 *= 2
        S = step(S, k, v, g, t)
        outs.append(read(q, S, t))
    return torch.stack(outs, 1)


def loop_key_out_kwarg(q, k, v, g):
    """k overwritten by torch.mul(..., out=k) mid-loop."""
    k = k.clone()
    S = q.new_zeros(B, H, K, V)
    outs = []
    for t in range(T):
        if t == 2:
            torch.mul(q, 2, out=k)
        S = step(S, k, v, g, t)
        outs.append(read(q, S, t))
    return torch.stack(outs, 1)


def loop_key_split_part(q, k, v, g):
    """A part of k.split(...) scaled in place: a write into k through a view split made."""
    k = k.clone()
    _, k2 = k.split([2, 3], dim=1)
    S = q.new_zeros(B, H, K, V)
    outs = []
    for t in range(T):
        if t == 1:
            k2.mul_(3)
        S = step(S, k, v, g, t)
        outs.append(read(q, S, t))
    return torch.stack(outs, 1)


def loop_value_relu_inplace(q, k, v, g):
    """F.relu(v, inplace=True) mid-loop."""
    v = v.clone()
    S = q.new_zeros(B, H, K, V)
    outs = []
    for t in range(T):
        if t == 2:
            F.relu(v, inplace=True)
        S = step(S, k, v, g, t)
        outs.append(read(q, S, t))
    return torch.stack(outs, 1)


def loop_foreach_scaled(q, k, v, g):
    """torch._foreach_mul_([k, v], 2) mid-loop: both inputs written by one node."""
    k, v = k.clone(), v.clone()
    S = q.new_zeros(B, H, K, V)
    outs = []
    for t in range(T):
        if t == 2:
            torch._foreach_mul_([k, v], 2.0)
        S = step(S, k, v, g, t)
        outs.append(read(q, S, t))
    return torch.stack(outs, 1)


def loop_gate_recomputed_after_write(q, k, v, g):
    """sigmoid(a) recomputed every step, a halved mid-loop through a view: the steps' decays
    are equal nodes up to the write, and must not be merged across it."""
    a = g[:, 0, 0, 0].clone()
    av = a.view(-1)
    S = q.new_zeros(B, H, K, V)
    outs = []
    for t in range(T):
        if t == 2:
            av.mul_(0.5)
        S = S * torch.sigmoid(a)[:, None, None, None] + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append(read(q, S, t))
    return torch.stack(outs, 1)


# ---- outputs ------------------------------------------------------------------------------------
def loop_output_scaled_before_stack(q, k, v, g):
    """One step's output doubled in place after it was appended: the stack reads the new value."""
    S = q.new_zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = step(S, k, v, g, t)
        o = read(q, S, t)
        outs.append(o)
        if t == 1:
            o.mul_(2)
    return torch.stack(outs, 1)


def loop_output_buffer_is_a_view(q, k, v, g):
    """The written buffer is a transposed view of the returned tensor."""
    o = torch.zeros(B, H, T, V)
    ov = o.transpose(1, 2)
    S = q.new_zeros(B, H, K, V)
    for t in range(T):
        S = step(S, k, v, g, t)
        ov[:, t] = read(q, S, t)
    return o


def loop_output_buffer_scaled_after(q, k, v, g):
    """The filled buffer doubled in place after the loop, and a view of it taken before that."""
    S = q.new_zeros(B, H, K, V)
    o = torch.zeros_like(v)
    for t in range(T):
        S = step(S, k, v, g, t)
        o[:, t] = read(q, S, t)
    ov = o[:, 1]
    o.mul_(2)
    return o, ov


# ---- per-step structure -----------------------------------------------------------------------
def loop_one_step_scaled(q, k, v, g):
    """Step 1's output doubled (a different read coefficient in one step)."""
    S = q.new_zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = step(S, k, v, g, t)
        o = read(q, S, t)
        outs.append(o * 2 if t == 1 else o)
    return torch.stack(outs, 1)


def loop_one_step_transposed(q, k, v, g):
    """Step 1's output laid out [H, B, V] (B == H, so the stack still works)."""
    S = q.new_zeros(B, H, K, V)
    outs = []
    for t in range(T):
        S = step(S, k, v, g, t)
        outs.append(torch.einsum("bhk,bhkv->hbv" if t == 1 else "bhk,bhkv->bhv", q[:, t], S))
    return torch.stack(outs, 1)


# ---- the parallel form ------------------------------------------------------------------------
def parallel_query_written_through_data(q, k, v, g):
    """q doubled through .data after the scores read it, before the output is formed (where
    the op would read q)."""
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    A = q @ k.transpose(-1, -2)
    q.data.mul_(2)
    return A.tril() @ v


def parallel_copy_then_source_written(q, k, v, g):
    """The queries copied into a buffer, then the source doubled: the buffer holds the old q."""
    qq, kk, vv = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    c = torch.empty_like(qq)
    c.copy_(qq)
    qq.mul_(2)
    return (c @ kk.transpose(-1, -2)).tril() @ vv


def parallel_gate_source_written(q, k, v, g):
    """The log gate doubled after its cumsum: the op must not read the doubled gate."""
    q, k, v, g = (x.transpose(1, 2) for x in (q, k, v, g))
    g = g.clone()
    G = g.cumsum(2)
    g.mul_(2)
    A = ((q * G.exp()) @ (k * (-G).exp()).transpose(-1, -2)).tril()
    return A @ v, g


def parallel_reverse_cumsum_written(q, k, v, g):
    """The reverse cumsum's intermediate doubled in place before the last flip."""
    q, k, v, g = (x.transpose(1, 2) for x in (q, k, v, g))
    R = g.flip(2).cumsum(2)
    R.mul_(2)
    G = R.flip(2)
    A = ((q * G.exp()) @ (k * (-G).exp()).transpose(-1, -2)).triu()
    return A @ v


CASES = [
    (decode_state_scaled_before_copy, decode_inputs, 1),
    (decode_cache_scaled_after_copy, decode_inputs, 0),
    (decode_key_scaled_after_step, decode_inputs, 1),
    (loop_initial_state_scaled, loop_inputs, 0),
    (loop_final_state_scaled, loop_inputs, 0),
    (loop_cache_read_again, loop_cache_inputs, 1),
    (loop_cache_then_decode_step, loop_cache_inputs, 0),
    (loop_query_imul, loop_inputs, 0),
    (loop_key_out_kwarg, loop_inputs, 0),
    (loop_key_split_part, loop_inputs, 0),
    (loop_value_relu_inplace, loop_inputs, 0),
    (loop_foreach_scaled, loop_inputs, 0),
    (loop_gate_recomputed_after_write, loop_inputs, 0),
    (loop_output_scaled_before_stack, loop_inputs, 0),
    (loop_output_buffer_is_a_view, loop_inputs, 0),
    (loop_output_buffer_scaled_after, loop_inputs, 1),
    (loop_one_step_scaled, loop_inputs, 0),
    (loop_one_step_transposed, loop_inputs, 0),
    (parallel_query_written_through_data, loop_inputs, 0),
    (parallel_copy_then_source_written, loop_inputs, 0),
    (parallel_gate_source_written, loop_inputs, 0),
    (parallel_reverse_cumsum_written, loop_inputs, 0),
]


@pytest.mark.parametrize("fn,make,rewrites", CASES, ids=[c[0].__name__ for c in CASES])
def test_compiled_equals_eager(fn, make, rewrites):
    args = make()
    assert_rewritten_like_eager(fn, args, rewrites, TOL)
