"""Context parallelism for GLA: the sequence split over ranks, one all-gather of states.

Each rank holds a contiguous slice of the sequence (or, with ``layout="head_tail"``, the two
segments torch's ``context_parallel`` gives it: r and 2W-1-r of 2W). GLA carries a state from
one segment to the next through a diagonal per-key decay: for segment s, run from a zero state,

    S_out = exp(D_s) * S_in + S_s         D_s = sum of the log gates over s ([B, H, K], or per head)

so each rank runs ``chunk_gla`` on its segments from zero (o_s and S_s in one call), all ranks
all-gather every segment's (S_s, D_s) (one collective of W * B * H * K * (V + 1) floats), and
each rank scans them in segment order in the states' dtype (fp32) as products of exp(D) and
states, never as differences of long sums. GLA is linear in its initial state, so the state h_s
entering segment s adds to the segment's outputs what a run from h_s adds to the run from zero:

    o_t += scale * (q_t * exp(G_t)) @ h_s   G_t = the log gates from the segment start through t

a [T, K] x [K, V] product per head instead of a second ``chunk_gla`` over the segment (whose
backward would cost a second ``chunk_bwd`` too). G_t is a cumulative sum within the segment: for
log gates <= 0 it decreases monotonically, without cancellation, and where it is large exp(G_t)
is negligible anyway.

The all-gather is a functional collective with autograd (its backward a reduce-scatter), so
gradients reach earlier ranks' states and decays through ordinary autograd, and the function
traces into one graph under ``torch.compile(fullgraph=True)``, the same graph on every rank
(NOTE:[CP uniform graph]). Every rank must run the backward, as with any collective.

That formulation is what compiled code runs: Inductor fuses its elementwise ops. Eager calls, whose
elementwise ops and their autograd would each be a pass over [B, T, H, K] in fp32, run the
textbook two passes instead (``_TwoPassCP``): the segments' final states and decays from zero (a
states-only pass, ``chunk_final_state``: it reads k, v, g and writes no o), the all-gather and
scan, then ``chunk_fwd`` from each segment's entering state; the backward gets the gradient of each
segment's o w.r.t. its entering state from the dual states-only pass (reads q, do, g), all-gathers
those, scans them against processing order into the gradient of the state leaving each segment,
and runs one ``chunk_bwd`` per rank from the entering state with that gradient. A rank's step is
then chunk_gla's forward and backward on its segments plus two passes that read three of its
[T, K]-sized inputs each. Both formulations give the same values and gradients under the
convention below.

Gradient convention for local tensors: the loss is the sum of the ranks' losses. A tensor given to
every rank (initial_state, g_gamma, gate_a, gate_bias) receives on each rank that rank's share of
its gradient (sum them over the group, as data parallel training does for parameters); the final
state is returned on every rank and each rank's use of it counts. With DTensor inputs the DTensor
conventions hold instead: replicated inputs get Partial gradients and the Replicate final state
counts once (its gradient flows through the copy of the rank that finishes the sequence).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from ..contract import GLACall, validate_gate, validate_inputs
from ..ops import chunk_gla, dispatch
from ..ops.chunk import _eager_fast_path
from ..gates import GateFn, check_gate_name, gate_grads, log_gate
from . import tensor_parallel as tp

__all__ = ["context_parallel_gla", "chunk_fwd_over_time"]

LAYOUTS = ("contiguous", "head_tail")

# the autograd all-gather: named all_gather_single_autograd from torch 2.10 on
_all_gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd

Group = Union[dist.ProcessGroup, DeviceMesh, tuple, None]


@dataclass(frozen=True)
class _Segments:
    """Where this rank's segments lie in the global order: ``own[i]`` is the global index of
    local segment i, ``owner[j]`` the (rank, local segment) of global segment j."""

    own: tuple[int, ...]
    owner: tuple[tuple[int, int], ...]

    @staticmethod
    def of(layout: str, rank: int, world: int) -> "_Segments":
        if layout == "contiguous":
            return _Segments((rank,), tuple((r, 0) for r in range(world)))
        heads = tuple((r, 0) for r in range(world))
        tails = tuple((r, 1) for r in reversed(range(world)))
        return _Segments((rank, 2 * world - 1 - rank), heads + tails)


def _group_info(group: Group) -> tuple[object, int, int]:
    """(the group as functional collectives take it, this rank's index in it, its size)."""
    if isinstance(group, tuple):
        mesh, dim = group
        return group, mesh.get_local_rank(dim), mesh.size(dim)
    if isinstance(group, DeviceMesh):
        return group, group.get_local_rank(), group.size()
    pg = group if group is not None else dist.group.WORLD
    return pg, dist.get_rank(pg), dist.get_world_size(pg)


def _split(x: Optional[Tensor], n: int) -> Optional[Tensor]:
    """[B, n * Ts, ...] -> [n * B, Ts, ...]: the segments of one rank as extra batch rows."""
    if x is None or n == 1:
        return x
    B, T = x.shape[:2]
    if T % n:
        raise ValueError(f"context_parallel_gla: layout='head_tail' needs each rank's T ({T}) divisible by {n}")
    return x.unflatten(1, (n, T // n)).transpose(0, 1).flatten(0, 1)


def _merge(x: Tensor, n: int) -> Tensor:
    """The inverse of ``_split``."""
    if n == 1:
        return x
    return x.unflatten(0, (n, -1)).transpose(0, 1).flatten(1, 2)


# Steps per block of the two-level time cumsum (``_time_cumsum``).
_SCAN_BLOCK = 256


def _time_cumsum(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``x.cumsum(1, dtype=dtype)`` in two levels: within blocks of ``_SCAN_BLOCK`` steps, then over
    the blocks' totals. A scan over a dim that is not the innermost runs one thread per inner
    element serially along all of T: with B * H * K threads and T in the ten thousands it is bound
    by memory latency, slower than the whole chunk_gla step; blocks give T / _SCAN_BLOCK times the
    parallelism. The carry is an exclusive sum of the totals (no difference of sums), so for log
    gates every partial sum stays a sum of terms of one sign."""
    T = x.shape[1]
    if T <= 2 * _SCAN_BLOCK:
        return x.cumsum(1, dtype=dtype)
    n = -(-T // _SCAN_BLOCK)
    xs = x.to(dtype)
    if n * _SCAN_BLOCK != T:
        xs = torch.cat([xs, xs.new_zeros(xs.shape[0], n * _SCAN_BLOCK - T, *xs.shape[2:])], 1)
    within = xs.unflatten(1, (n, _SCAN_BLOCK)).cumsum(2)
    totals = within[:, :-1, -1]
    carry = torch.cat([torch.zeros_like(within[:, :1, -1]), totals], 1).cumsum(1)
    return (within + carry.unsqueeze(2)).flatten(1, 2)[:, :T]


def _decays(g, g_gamma, fn: GateFn, gate_a, gate_bias, T: int, reverse: bool, dtype: torch.dtype
            ) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """A segment's whole decay exp(D), D the sum of its log gates ([B, H, K] for a vector gate,
    [B or 1, H, 1] otherwise, to broadcast against [B, H, K, V] states), and exp(G_t), G_t the log
    gates from the segment's first processed step through t ([B, T, H, K], [B, T, H] or [1, T, H]);
    (None, None) without a gate. Sums accumulate in ``dtype`` (the states'), read from g as it is
    where no gate function applies."""
    if g is not None:
        lg = log_gate(g, fn, gate_a, gate_bias, dtype) if fn.name else g
        D = lg.sum(1, dtype=dtype)
        G = _time_cumsum(lg.flip(1), dtype).flip(1) if reverse else _time_cumsum(lg, dtype)
        return (D if g.dim() == 4 else D.unsqueeze(-1)).exp(), G.exp()
    if g_gamma is not None:
        gamma = g_gamma.to(dtype)
        steps = torch.arange(1, T + 1, device=gamma.device, dtype=dtype)  # steps processed through t
        steps = steps.flip(0) if reverse else steps
        return (T * gamma).exp().view(1, -1, 1), (steps[:, None] * gamma).exp().unsqueeze(0)
    return None, None


def _gather_states(S: Tensor, D: Optional[Tensor], group, world: int) -> tuple[Tensor, Optional[Tensor]]:
    """All-gather every rank's (S, D) (states, decays), packed into one buffer: [world, *S.shape],
    [world, *D.shape]."""
    parts = [S.flatten()] + ([] if D is None else [D.expand(S.shape[:2] + D.shape[2:]).flatten()])
    gathered = _all_gather(torch.cat(parts), 0, group).view(world, -1)
    S_all = gathered[:, : S.numel()].view(world, *S.shape)
    if D is None:
        return S_all, None
    return S_all, gathered[:, S.numel():].view(world, *S.shape[:2], *D.shape[2:])


def _scan(S_all: Tensor, D_all: Optional[Tensor], h0: Optional[Tensor], seg: _Segments, reverse: bool,
          traced: bool = True) -> tuple[Tensor, Tensor]:
    """The states entering this rank's segments, stacked along the batch ([n * B, H, K, V], in the
    order of ``seg.own``), and the final state: h <- a_j * h + S_j over the global segments in
    processing order, from h0 (or zeros); a_j = D_all[j], segment j's decay exp(D_j) (None: 1).

    NOTE:[CP uniform graph] Every rank computes every entering state and picks its own through an
    index tensor, rather than taking a Python-chosen one: so every rank traces the same graph (only
    the index differs), and on every rank the gradient of the gathered states depends on the
    gradient of its o. Were the first rank's o independent of the gather (its entering state is
    h0), its share of the all-gather's backward would be a constant zero, which AOTAutograd's
    partitioner computes in the forward graph: that rank would run the reduce-scatter during the
    forward while the others run it in the backward, and the collectives would not pair up.
    Eager calls (``traced=False``, the two-pass Function, whose backward is its own) pick the
    states in Python: the index tensor would be a host-to-device copy, which waits for the stream
    (the all-gather included) before the host may launch the rest of the forward.
    """
    n = len(seg.own)
    B = S_all.shape[1] // n
    h = torch.zeros_like(S_all[0, :B]) if h0 is None else h0
    states, position = [], {}
    for j in reversed(range(len(seg.owner))) if reverse else range(len(seg.owner)):
        r, i = seg.owner[j]
        position[j] = len(states)
        states.append(h)
        rows = slice(i * B, (i + 1) * B)
        h = (h if D_all is None else D_all[r, rows].unsqueeze(-1) * h) + S_all[r, rows]
    if not traced:
        return torch.cat([states[position[j]] for j in seg.own]), h
    index = torch.tensor([position[j] for j in seg.own], device=h.device)
    return torch.stack(states).index_select(0, index).flatten(0, 1), h


def _entering_term(q: Tensor, e: Optional[Tensor], h: Tensor, scale: float, H: int, dtype: torch.dtype) -> Tensor:
    """scale * (q_t * exp(G_t)) @ h for every step, [B, T, H, V], multiplied in ``dtype``."""
    if q.shape[2] != H:  # grouped heads: head j reads q head j // (H // G)
        q = q.repeat_interleave(H // q.shape[2], dim=2)
    if e is not None:
        q = q * (e if e.dim() == 4 else e.unsqueeze(-1))  # in e's dtype, the states'
    return torch.einsum("bthk,bhkv->bthv", q.to(dtype), (h * scale).to(dtype))


def _local_cp(q, k, v, g=None, g_gamma=None, initial_state=None, gate_a=None, gate_bias=None, *, scale: float,
              fn: GateFn, output_final_state: bool, reverse: bool, group: Group, layout: str):
    group, rank, world = _group_info(group)
    seg = _Segments.of(layout, rank, world)
    n = len(seg.own)
    if _two_pass_applies((q, k, v, g, g_gamma, initial_state, gate_a, gate_bias)):
        # the ops trust their callers: the checks chunk_gla makes on the other path
        validate_inputs(q, k, v, g, g_gamma, initial_state, api="context_parallel_gla", grouped=True)
        validate_gate(fn, q, g, gate_a, gate_bias, api="context_parallel_gla")
        spec = _Spec(scale, fn, reverse, output_final_state, group, rank, world, seg)
        q_, k_, v_, g_ = (_split(x, n) for x in (q, k, v, g))
        o, ht = _TwoPassCP.apply(spec, q_, k_, v_, g_, g_gamma, initial_state, gate_a, gate_bias)
        return _merge(o, n), (ht if output_final_state else None)
    q_, k_, v_, g_ = (_split(x, n) for x in (q, k, v, g))
    return _correction_cp(q_, k_, v_, g_, g_gamma, initial_state, gate_a, gate_bias, scale=scale, fn=fn,
                          output_final_state=output_final_state, reverse=reverse, group=group, world=world,
                          seg=seg)


def _correction_cp(q_, k_, v_, g_, g_gamma, initial_state, gate_a, gate_bias, *, scale: float, fn: GateFn,
                   output_final_state: bool, reverse: bool, group, world: int, seg: _Segments):
    """The formulation traced under torch.compile: one chunk_gla from zero per segment, the entering
    states' term added with elementwise ops (which Inductor fuses), gradients through autograd."""
    n = len(seg.own)
    o, S = chunk_gla(
        q_, k_, v_, g_, g_gamma=g_gamma, scale=scale, output_final_state=True, reverse=reverse,
        gate_fn=fn.name or None, gate_scale=fn.scale, gate_lo=fn.lo, gate_hi=fn.hi, gate_a=gate_a,
        gate_bias=gate_bias)
    D, e = _decays(g_, g_gamma, fn, gate_a, gate_bias, q_.shape[1], reverse, S.dtype)
    S_all, D_all = _gather_states(S, D, group, world)
    h0 = None if initial_state is None else initial_state.to(S.dtype)
    entering, ht = _scan(S_all, D_all, h0, seg, reverse)
    o = _with_entering(o, q_, e, entering, scale)
    return _merge(o, n), (ht if output_final_state else None)


def _with_entering(o: Tensor, q: Tensor, e: Optional[Tensor], h: Tensor, scale: float) -> Tensor:
    """o plus the term of the states h entering the segments."""
    # fp16 / bf16 multiply in their own dtype (fp32 accumulation), as the chunk kernels read the
    # states (their h tiles cast to the inputs' dtype); fp32 and fp64 in the states' dtype
    dtype = o.dtype if o.dtype in (torch.float16, torch.bfloat16) else h.dtype
    term = _entering_term(q, e, h, scale, o.shape[2], dtype)
    return (o.to(dtype) + term).to(o.dtype)


# ----------------------------------------------------------------------------------------------
# eager calls: the two-pass formulation
# ----------------------------------------------------------------------------------------------

# How often the eager two-pass Function ran its forward and its backward (tests read it to see
# which formulation ran).
two_pass_calls: Counter = Counter()


@dataclass(frozen=True)
class _Spec:
    """The non-tensor arguments of ``_TwoPassCP``."""

    scale: float
    fn: GateFn
    reverse: bool
    output_final_state: bool
    group: object
    rank: int
    world: int
    seg: _Segments


def _two_pass_applies(tensors) -> bool:
    """Eager calls on plain tensors run ``_TwoPassCP``. Compiled code (and tracing under a dispatch
    or function mode, fake or wrapped tensors) keeps the correction formulation: it traces into one
    graph with functional collectives, and Inductor fuses its elementwise ops."""
    return _eager_fast_path(tensors)


class _TwoPassCP(torch.autograd.Function):
    """Context parallel GLA in two passes of the chunk kernels, with no elementwise work over [T, K].

    forward: each segment's final state from zero and its decay (the states-only pass,
    ``_final_state``); one all-gather; the scan gives the state entering each segment; ``chunk_fwd``
    from that state gives o (the kernel applies the state itself).
    backward: the gradient of each segment's o w.r.t. its entering state (the dual states-only
    pass on q, do and the gates); one all-gather of those and of the final state's gradients; the scan against processing order gives the
    gradient of the state leaving each segment; ``chunk_bwd`` from the entering state with that
    gradient gives every input's gradient (a segment's inputs reach the loss only through its o and
    its leaving state, so this is exact).
    """

    @staticmethod
    def forward(ctx, spec: _Spec, q, k, v, g, g_gamma, initial_state, gate_a, gate_bias):
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None
        call = GLACall(q, k, v, g, g_gamma, None, scale=spec.scale, reverse=spec.reverse, gate=spec.fn,
                       gate_a=gate_a, gate_bias=gate_bias)
        S, D = _final_state(call)
        S_all, D_all = _gather_states(S, D, spec.group, spec.world)
        h0 = None if initial_state is None else initial_state.to(S.dtype)
        h, ht = _scan(S_all, D_all, h0, spec.seg, spec.reverse, traced=False)
        o, _ = dispatch.chunk_fwd(call.replace(initial_state=h))
        ctx.spec = spec
        ctx.initial_state = None if initial_state is None else (initial_state.shape, initial_state.dtype)
        ctx.save_for_backward(q, k, v, g, g_gamma, h, gate_a, gate_bias, D_all)
        if not spec.output_final_state:
            ctx.mark_non_differentiable(ht)
        two_pass_calls["forward"] += 1
        return o, ht

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dht):
        spec = ctx.spec
        q, k, v, g, g_gamma, h, gate_a, gate_bias, D_all = ctx.saved_tensors
        call = GLACall(q, k, v, g, g_gamma, h, scale=spec.scale, reverse=spec.reverse, gate=spec.fn, gate_a=gate_a,
                       gate_bias=gate_bias)
        if do is None:
            do = v.new_zeros(v.shape, dtype=call.output_dtype)
        dh_loc, _ = _final_state(call, do)
        B = h.shape[0] // len(spec.seg.own)
        if dht is None or not spec.output_final_state:
            dht = h.new_zeros(B, *h.shape[1:])
        dh_all, dht_all = _gather_grads(dh_loc, dht.to(h.dtype), spec.group, spec.world)
        # each rank's use of the final state counts: its gradient is the sum of the ranks'
        dht_seg, dh0 = _scan_back(dh_all, dht_all.sum(0), D_all, spec.seg, spec.reverse)
        dq, dk, dv, dg, dg_gamma, _ = dispatch.chunk_bwd(call, do, dht_seg)
        da = dbias = None
        if call.fused_gate and not call.gate.input_grad:
            dg, da, dbias = gate_grads(dg, g, call.gate, gate_a, gate_bias)
            da = None if da is None else da.to(gate_a.dtype)
            dbias = None if dbias is None else dbias.to(gate_bias.dtype)
        dg = None if g is None else dg.to(g.dtype)
        dg_gamma = None if g_gamma is None else dg_gamma
        two_pass_calls["backward"] += 1
        return None, dq, dk, dv, dg, dg_gamma, _initial_grad(ctx, dh0), da, dbias


def _initial_grad(ctx, dh0: Tensor) -> Optional[Tensor]:
    """The global initial state's gradient: all of it on the rank whose segment runs first, zeros on
    the others (each rank returns its share; the shares sum to the gradient)."""
    if ctx.initial_state is None:
        return None
    shape, dtype = ctx.initial_state
    seg = ctx.spec.seg
    first = seg.owner[-1 if ctx.spec.reverse else 0][0]
    return dh0.to(dtype) if ctx.spec.rank == first else dh0.new_zeros(shape, dtype=dtype)


def _final_state(call: GLACall, do: Optional[Tensor] = None) -> tuple[Tensor, Optional[Tensor]]:
    """The state a segment leaves from a zero state (do None), or the gradient of its o w.r.t. the
    state entering it (do given: scale * sum_t (q_t * exp(G_t))^T do_t, G_t the log gates from the
    segment's first processed step through t), from the states-only pass of ``chunk_final_state``
    (no o, no dual outputs); and the segment's decay exp(D), [n * B, H, K] or [n * B, H, 1] to
    broadcast against the states, None without a gate."""
    S, D = dispatch.chunk_final_state(call, do)
    if call.gate_kind == "none":
        return S, None
    return S, (D if call.gate_kind == "vector" else D.unsqueeze(-1))


def _gather_grads(dh_loc: Tensor, dht: Tensor, group, world: int) -> tuple[Tensor, Tensor]:
    """All-gather every rank's (entering-state gradients, final-state gradient) in one buffer:
    [world, *dh_loc.shape], [world, *dht.shape]."""
    gathered = _all_gather(torch.cat([dh_loc.flatten(), dht.flatten()]), 0, group).view(world, -1)
    n = dh_loc.numel()
    return gathered[:, :n].view(world, *dh_loc.shape), gathered[:, n:].view(world, *dht.shape)


def _scan_back(dh_all: Tensor, dht: Tensor, D_all: Optional[Tensor], seg: _Segments, reverse: bool
               ) -> tuple[Tensor, Tensor]:
    """The gradients of the states leaving this rank's segments ([n * B, H, K, V], in the order of
    ``seg.own``) and of the global initial state: from the final state's gradient dht,
    lam <- dh_loc_j + a_j * lam over the global segments against processing order (the transpose of
    ``_scan``; D_all holds the decays a_j)."""
    n = len(seg.own)
    B = dh_all.shape[1] // n
    processing = list(reversed(range(len(seg.owner)))) if reverse else list(range(len(seg.owner)))
    lam, leaving = dht, {}
    for j in reversed(processing):
        leaving[j] = lam
        r, i = seg.owner[j]
        rows = slice(i * B, (i + 1) * B)
        lam = dh_all[r, rows] + (lam if D_all is None else D_all[r, rows].unsqueeze(-1) * lam)
    return torch.cat([leaving[j] for j in seg.own]), lam


_SEQ = ("q", "k", "v", "g")


def _cp_dim(tensors: dict[str, DTensor]) -> int:
    """The one mesh dim over which q, k, v, g are Shard(1), where the other inputs are Replicate."""
    q = tensors["q"]
    dims = [d for d, p in enumerate(q.placements) if p == Shard(1)]
    if len(dims) != 1:
        raise ValueError(f"context_parallel_gla: q is {tuple(q.placements)!r}; expected Shard(1) (over time) on "
                         "exactly one mesh dim")
    cp = dims[0]
    for name, x in tensors.items():
        want = Shard(1) if name in _SEQ else Replicate()
        if x.placements[cp] != want:
            raise ValueError(f"context_parallel_gla: {name} is {x.placements[cp]!r} on mesh dim {cp} where q is "
                             f"Shard(1); expected {want!r}")
    return cp


def _targets(tensors: dict[str, DTensor], cp: int) -> tuple[list, dict[str, list]]:
    """Per mesh dim the mode (None on the CP dim and all-Replicate dims), and each input's placements."""
    mesh = tensors["q"].device_mesh
    modes = [None if d == cp else tp.mesh_dim_mode("context_parallel_gla", {n: x.placements[d] for n, x in
                                                                             tensors.items()}, d)
             for d in range(mesh.ndim)]
    ranks = math.prod(mesh.size(d) for d, m in enumerate(modes) if m == tp.HEADS)
    tp.check_groups("context_parallel_gla", tensors["q"].shape[2], tensors["v"].shape[2], ranks)
    targets = {n: [(Shard(1) if n in _SEQ else Replicate()) if d == cp else tp.placement_for(n, m or tp.REPLICATE)
                   for d, m in enumerate(modes)] for n in tensors}
    return modes, targets


def _to_local(x: DTensor, target: list, modes: list, cp: int) -> Tensor:
    """x's local part; a replicated input used by every rank for its own rows gets a Partial gradient."""
    x = x.redistribute(x.device_mesh, target)
    grads = [Partial() if p == Replicate() and (d == cp or modes[d] == tp.BATCH) else p
             for d, p in enumerate(target)]
    return x.to_local(grad_placements=grads)


def _dtensor_cp(tensors: dict[str, DTensor], options: dict, layout: str, output_final_state: bool, reverse: bool):
    q, v = tensors["q"], tensors["v"]
    mesh = q.device_mesh
    cp = _cp_dim(tensors)
    modes, targets = _targets(tensors, cp)
    local = {n: _to_local(x, targets[n], modes, cp) for n, x in tensors.items()}
    group = (mesh, cp) if mesh.ndim > 1 else mesh
    o, ht = _local_cp(**local, **options, output_final_state=output_final_state, reverse=reverse, group=group,
                      layout=layout)
    o = DTensor.from_local(o, mesh, targets["v"], run_check=False, shape=v.shape, stride=_contiguous(v.shape))
    if ht is None:
        return o, None
    seg = _Segments.of(layout, mesh.get_local_rank(cp), mesh.size(cp))
    last = seg.owner[0 if reverse else -1][0]
    if mesh.get_local_rank(cp) != last:
        ht = ht.detach()  # a Replicate output's gradient is the same on every rank: count it once
    state = [Replicate() if d == cp else tp.placement_for("initial_state", m or tp.REPLICATE)
             for d, m in enumerate(modes)]
    B, H, K, V = q.shape[0], v.shape[2], q.shape[3], v.shape[3]
    return o, DTensor.from_local(ht, mesh, state, run_check=False, shape=(B, H, K, V), stride=(H * K * V, K * V, V, 1))


def _contiguous(shape) -> tuple[int, ...]:
    strides, n = [], 1
    for size in reversed(shape):
        strides.append(n)
        n *= size
    return tuple(reversed(strides))


def context_parallel_gla(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Optional[Tensor] = None,
    *,
    g_gamma: Optional[Tensor] = None,
    scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None,
    output_final_state: bool = False,
    reverse: bool = False,
    gate_fn: Optional[str] = None,
    gate_scale: float = 1.0,
    gate_lo: Optional[float] = None,
    gate_hi: Optional[float] = None,
    gate_a: Optional[Tensor] = None,
    gate_bias: Optional[Tensor] = None,
    group: Group = None,
    layout: str = "contiguous",
) -> tuple[Tensor, Optional[Tensor]]:
    """``gla_inductor.chunk_gla`` over a sequence split across the ranks of ``group``.

    Args as ``chunk_gla``, but q, k, v, g hold this rank's part of the time axis: a contiguous
    slice, slices in rank order (``layout="contiguous"``; T may differ between ranks), or
    segments r and 2W-1-r of 2W equal ones, concatenated (``layout="head_tail"``, the load-balanced
    layout of torch's ``context_parallel``). initial_state, g_gamma, gate_a and gate_bias are the
    global ones, the same on every rank. B, H, K, V must agree across ranks.

    group: a ProcessGroup (default: the world), a 1-D DeviceMesh, or (mesh, mesh_dim).
    reverse: the recurrence runs from the last rank's last step down to the first's first.

    DTensor inputs bring their mesh instead of ``group``: q, k, v, g Shard(1) on one mesh dim (the
    sequence), the other inputs Replicate there; other mesh dims may shard heads or batch as
    ``tensor_parallel`` describes (context and tensor parallel together). o comes back sharded like
    v, the final state Replicate over the sequence's mesh dim.

    Returns this rank's o [B, T_local, H, V] and the global final state [B, H, K, V] (fp32) on
    every rank, or None. See the module docstring for the gradients.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"context_parallel_gla: layout must be one of {LAYOUTS}, got {layout!r}")
    check_gate_name(gate_fn or "", "context_parallel_gla")
    fn = GateFn(gate_fn or "", float(gate_scale), None if gate_lo is None else float(gate_lo),
                None if gate_hi is None else float(gate_hi))
    if scale is None:
        scale = q.shape[-1] ** -0.5
    tensors = dict(q=q, k=k, v=v, g=g, g_gamma=g_gamma, initial_state=initial_state, gate_a=gate_a,
                   gate_bias=gate_bias)
    options = dict(scale=float(scale), fn=fn)
    if isinstance(q, DTensor):
        given = {n: x for n, x in tensors.items() if x is not None}
        plain = [n for n, x in given.items() if not isinstance(x, DTensor)]
        if plain:
            raise TypeError(f"context_parallel_gla: q is a DTensor but {', '.join(plain)} "
                            f"{'is' if len(plain) == 1 else 'are'} not; pass all tensors as DTensors on q's mesh")
        if group is not None:
            raise ValueError("context_parallel_gla: group is for local tensors; DTensors bring their mesh")
        return _dtensor_cp(given, options, layout, bool(output_final_state), bool(reverse))
    return _local_cp(**tensors, **options, output_final_state=bool(output_final_state), reverse=bool(reverse),
                     group=group, layout=layout)


def chunk_fwd_over_time(*args, **kwargs) -> tuple[Tensor, Optional[Tensor]]:
    """``context_parallel_gla`` called with ``chunk_fwd``'s arguments, for DTensor inputs sharded over
    time: what the GLA rewrite emits in the op's place for them (``recognize/core/placement_dtensor``).
    Returns (o, final state), the final state None where it was not asked for."""
    call = GLACall.from_op_args(args, kwargs)
    if call.varlen:
        raise ValueError("context_parallel_gla: packed sequences (cu_seqlens) cannot be split over time")
    call = call.replace(**_replicated(call.tensors(), call.q))
    fn = call.gate
    return context_parallel_gla(
        call.q, call.k, call.v, call.g, g_gamma=call.g_gamma, scale=call.scale, initial_state=call.initial_state,
        output_final_state=call.output_final_state, reverse=call.reverse, gate_fn=fn.name or None,
        gate_scale=fn.scale, gate_lo=fn.lo, gate_hi=fn.hi, gate_a=call.gate_a, gate_bias=call.gate_bias)


def _replicated(tensors: dict[str, Optional[Tensor]], like: DTensor) -> dict[str, DTensor]:
    """The plain tensors among the inputs (constants the rewrite made, the same on every rank) as
    DTensors replicated over q's mesh."""
    mesh = like.device_mesh
    return {n: DTensor.from_local(x, mesh, [Replicate()] * mesh.ndim, run_check=False)
            for n, x in tensors.items() if x is not None and not isinstance(x, DTensor)}
