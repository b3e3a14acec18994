"""The recurrence as a PyTorch time loop, for decoding and short steps on CPU and as the CUDA
fallback of the ``fused_recurrent`` op: it updates the caller's state in place.

The loop passes over the whole [B, H, K, V] state three times per step; the chunked algorithm
touches the state once per chunk of 64 steps at the price of more setup, so it wins on longer
sequences: dispatch takes this loop up to ``STEP_LOOP_MAX_T`` steps.

With ``call.state_indices`` the state is a pool [P, H, K, V] and sequence b reads and writes slot
``state_indices[b]``: the loop runs on the gathered slots and scatters them back
(``gather_slots``/``scatter_slots``, also used around the chunked implementations). An index
outside [0, P) marks a padded entry: its output is zeros and no slot is touched. Nothing here
reads the indices on the host, so the calls stay capturable in a CUDA graph.
"""

from typing import Optional

import torch
from torch import Tensor

from ..contract import GLACall, repeat_groups

__all__ = ["STEP_LOOP_MAX_T", "gather_slots", "scatter_slots", "slot_validity", "step_loop", "zero_padded"]

STEP_LOOP_MAX_T = 64


def _step_decay(g: Optional[Tensor], g_gamma: Optional[Tensor], t: int, dtype: torch.dtype) -> Optional[Tensor]:
    """exp(g_t), shaped to scale a [B, H, K, V] state: [B, H, K, 1], [B, H, 1, 1], [H, 1, 1] or None."""
    if g is not None:
        g_t = g[:, t].to(dtype)
        return (g_t.unsqueeze(-1) if g.dim() == 4 else g_t[..., None, None]).exp()
    if g_gamma is not None:
        return g_gamma.to(dtype).view(-1, 1, 1).exp()
    return None


# ----------------------------------------------------------------------------------------------
# state pools: slots read and written through an index, without host synchronization
# ----------------------------------------------------------------------------------------------


def slot_validity(indices: Tensor, pool_size: int) -> tuple[Tensor, Tensor]:
    """(valid [B] bool, slot [B] int64): whether each entry names a slot of the pool, and that slot
    (0 for padded entries, so that every gather stays in bounds)."""
    valid = (indices >= 0) & (indices < pool_size)
    return valid, torch.where(valid, indices, 0).long()


def gather_slots(pool: Tensor, indices: Tensor, dtype: torch.dtype) -> Tensor:
    """A fresh [B, H, K, V] copy of the slots in dtype, zeros for padded entries."""
    valid, slot = slot_validity(indices, pool.shape[0])
    rows = pool.index_select(0, slot).to(dtype)
    return torch.where(valid.view(-1, 1, 1, 1), rows, rows.new_zeros(()))


def scatter_slots(pool: Tensor, indices: Tensor, states: Tensor) -> None:
    """Write states [B, H, K, V] into their slots of the pool, in the pool's dtype; padded entries
    write nothing.

    Without reading the indices on the host, every entry writes some slot: a padded one its stand-in
    slot 0. So each targeted slot gets one value, whoever writes it: that of the highest entry naming
    it validly, else its own unchanged bits. Duplicate writes then carry equal values, and a slot no
    valid entry names is rewritten bit for bit.
    """
    valid, slot = slot_validity(indices, pool.shape[0])
    B = slot.shape[0]
    entry = torch.where(valid, torch.arange(B, device=slot.device), -1)
    owner = torch.full((pool.shape[0],), -1, dtype=torch.long, device=slot.device)
    owner = owner.scatter_reduce(0, slot, entry, reduce="amax")[slot]  # [B]: who writes each entry's slot
    new = states.index_select(0, owner.clamp(min=0)).to(pool.dtype)
    kept = pool.index_select(0, slot)
    pool.index_copy_(0, slot, torch.where((owner >= 0).view(-1, 1, 1, 1), new, kept))


def zero_padded(o: Tensor, indices: Tensor, pool_size: int) -> Tensor:
    """o [B, T, H, V] with the rows of padded entries set to zero (whatever their inputs held)."""
    valid, _ = slot_validity(indices, pool_size)
    return torch.where(valid.view(-1, 1, 1, 1), o, o.new_zeros(()))


# ----------------------------------------------------------------------------------------------
# the time loop
# ----------------------------------------------------------------------------------------------


@torch.no_grad()
def step_loop(call: GLACall, state: Tensor) -> Tensor:
    """o [B, T, H, V] of ``call`` (a log gate; q and k with v's heads or shared by groups of them)
    from ``state``, which it overwrites with the final state; with ``call.state_indices``, from and
    into the pool's slots."""
    indices = call.state_indices
    if indices is not None:
        slots = gather_slots(state, indices, call.state_dtype)
        o = _loop(call, slots)
        scatter_slots(state, indices, slots)
        return zero_padded(o, indices, state.shape[0])
    return _loop(call, state)


def _loop(call: GLACall, state: Tensor) -> Tensor:
    q, k, v, g, g_gamma = call.q, call.k, call.v, call.g, call.g_gamma
    dtype = call.state_dtype
    B, T, _, _ = q.shape
    H = v.shape[2]
    # grouped q and k: repeated here (T is short: a few rows per step, against the state's K x V)
    q, k, v = repeat_groups(q.to(dtype), H), repeat_groups(k.to(dtype), H), v.to(dtype)
    # the running state: the caller's tensor itself when it has the compute dtype (it is overwritten
    # anyway), else a working copy written back at the end
    S = state if state.dtype == dtype else state.to(dtype)
    o = q.new_empty(B, T, H, v.shape[-1])
    for t in reversed(range(T)) if call.reverse else range(T):
        decay = _step_decay(g, g_gamma, t, dtype)
        if decay is not None:
            S.mul_(decay)
        S.addcmul_(k[:, t].unsqueeze(-1), v[:, t].unsqueeze(-2))
        o[:, t] = (q[:, t].unsqueeze(-2) @ S).squeeze(-2)
    if S is not state:
        state.copy_(S)
    return o.mul_(call.scale).to(call.output_dtype)
