"""Context parallelism for GLA: the sequence split over ranks, one all-gather of states each way.

Each rank holds a contiguous slice of the sequence (or, with ``layout="head_tail"``, the two
segments torch's ``context_parallel`` gives it: r and 2W-1-r of 2W). GLA carries a state from
one segment to the next through a diagonal per-key decay: for segment s, run from a zero state,

    S_out = exp(D_s) * S_in + S_s         D_s = sum of the log gates over s ([B, H, K], or per head)

so each rank needs the states of the segments before its own, not their outputs. In two passes
(``_TwoPassCP``): a states-only pass (``chunk_final_state``: reads k, v, g, writes no o) gives each
segment's S_s and decay exp(D_s) from a zero state; all ranks all-gather every segment's pair (one
collective of W * B * H * K * (V + 1) floats) and scan them in segment order in the states' dtype
(fp32), as products of decays and states, never as differences of long sums; ``chunk_fwd`` from
each segment's entering state gives o (the kernels apply the state themselves). The backward is
the transpose: the dual states-only pass (reads q, do, g) gives the gradient of each segment's o
w.r.t. its entering state; one all-gather of those (and of the final state's gradients, where
the call returns a final state: every rank's call must agree on output_final_state); the scan
against processing order gives the gradient of the state leaving each segment; one ``chunk_bwd``
from the entering state with that gradient gives every input's gradient (a segment's inputs reach
the loss only through its o and its leaving state, so this is exact). A rank's step is chunk_gla's
forward and backward on its segments plus two passes that each read three of its [T, K]-sized
inputs once; nothing elementwise over [T, K] besides.

Where the kernels run the local schedule (``dispatch.chunk_parts_apply``: vector gates from K = 64),
the two passes are not extra: chunk_fwd's own first half (gla_chunk_local's terms and the segment
sums of its walk, ``kernels.parts``) gives S_s and exp(D_s), so ``chunk_sums`` runs it before the
all-gather and ``chunk_fwd_from_parts`` the rest after it; the backward's dual likewise
(``chunk_bwd_from_parts``). A rank's step is then chunk_gla's forward and backward alone.
``config.context_parallel_cut`` switches it off. The choice depends on the head size, gate, dtype
and device only, so every rank makes the same one (their graphs stay the same).

Eager calls on plain tensors run the Function with the ops' implementations called directly
(``dispatch``, no torch.library wrappers). Compiled code traces the same Function into one graph
under ``torch.compile(fullgraph=True)`` (Dynamo traces its forward and backward): the ops stay ops
(Inductor calls them as extern kernels), the all-gathers are functional collectives, and every
rank traces the same graph (NOTE:[CP uniform graph]). Every rank must run the backward, as with
any collective.

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
from ..gates import GateFn, check_gate_name, gate_grads
from . import tensor_parallel as tp

__all__ = ["context_parallel_gla", "chunk_fwd_over_time"]

LAYOUTS = ("contiguous", "head_tail")

# the all-gather without autograd: named all_gather_single from torch 2.10 on
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor

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


def _gathered(x: Tensor, group, world: int) -> Tensor:
    """x of every rank, [world, x.numel()]. Eager calls get an AsyncCollectiveTensor back, whose
    views stay that subclass: every later op on them would pass through its Python dispatch (tens of
    microseconds each, most of the eager step's host time); waited for here, the scans run on a
    plain tensor. Traced code gets a plain tensor and its wait already."""
    gathered = _all_gather(x, 0, group)
    if isinstance(gathered, funcol.AsyncCollectiveTensor):
        gathered = gathered.wait()
    return gathered.view(world, -1)


def _gather_states(S: Tensor, D: Optional[Tensor], group, world: int) -> tuple[Tensor, Optional[Tensor]]:
    """All-gather every rank's (S, D) (states, decays), packed into one buffer: [world, *S.shape],
    [world, *D.shape]. No autograd: the two-pass Function has its own backward."""
    parts = [S.flatten()] + ([] if D is None else [D.expand(S.shape[:2] + D.shape[2:]).flatten()])
    gathered = _gathered(torch.cat(parts), group, world)
    S_all = gathered[:, : S.numel()].view(world, *S.shape)
    if D is None:
        return S_all, None
    return S_all, gathered[:, S.numel():].view(world, *S.shape[:2], *D.shape[2:])


def _scan(S_all: Tensor, D_all: Optional[Tensor], h0: Optional[Tensor], seg: _Segments, reverse: bool,
          traced: bool = True) -> tuple[Tensor, Tensor]:
    """The states entering this rank's segments, stacked along the batch ([n * B, H, K, V], in the
    order of ``seg.own``), and the final state: h <- a_j * h + S_j over the global segments in
    processing order, from h0 (or zeros); a_j = D_all[j], segment j's decay exp(D_j) (None: 1).

    NOTE:[CP uniform graph] Where traced, every rank computes every entering state and picks its
    own through an index tensor, rather than taking a Python-chosen one: so every rank traces the
    same graph (only the index, a constant, differs) and its collectives pair up with the other
    ranks' by construction, whatever AOTAutograd's partitioner and Inductor then do with the graph.
    Eager calls (``traced=False``) pick the states in Python: there the index tensor would be a
    host-to-device copy, which waits for the stream (the all-gather included, so for the slowest
    rank) before the host may launch the rest of the forward.
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
        h = _step(S_all[r, rows], None if D_all is None else D_all[r, rows], h)
    return _pick(states, [position[j] for j in seg.own], traced), h


def _step(x: Tensor, a: Optional[Tensor], h: Tensor) -> Tensor:
    """x + a * h (a [B, H, K or 1] scales the rows of h), one kernel in eager mode."""
    return x + h if a is None else torch.addcmul(x, a.unsqueeze(-1), h)


def _pick(states: list[Tensor], picked: list[int], traced: bool) -> Tensor:
    """states[i] for i in picked, concatenated along the batch: through an index tensor where
    traced (NOTE:[CP uniform graph]), else in Python."""
    if not traced:
        return torch.cat([states[i] for i in picked])
    index = torch.tensor(picked, device=states[0].device)
    return torch.stack(states).index_select(0, index).flatten(0, 1)


def _local_cp(q, k, v, g=None, g_gamma=None, initial_state=None, gate_a=None, gate_bias=None, *, scale: float,
              fn: GateFn, output_final_state: bool, reverse: bool, group: Group, layout: str):
    group, rank, world = _group_info(group)
    seg = _Segments.of(layout, rank, world)
    n = len(seg.own)
    # the ops trust their callers: the checks chunk_gla makes
    validate_inputs(q, k, v, g, g_gamma, initial_state, api="context_parallel_gla", grouped=True)
    validate_gate(fn, q, g, gate_a, gate_bias, api="context_parallel_gla")
    direct = _direct_calls((q, k, v, g, g_gamma, initial_state, gate_a, gate_bias))
    q_, k_, v_, g_ = (_split(x, n) for x in (q, k, v, g))
    parts = dispatch.chunk_parts_apply(GLACall(q_, k_, v_, g_, g_gamma, None, scale=scale, gate=fn, gate_a=gate_a,
                                               gate_bias=gate_bias))
    spec = _Spec(scale, fn, reverse, output_final_state, group, rank, world, seg, direct, parts)
    o, ht = _TwoPassCP.apply(spec, q_, k_, v_, g_, g_gamma, initial_state, gate_a, gate_bias)
    return _merge(o, n), (ht if output_final_state else None)


# ----------------------------------------------------------------------------------------------
# the two-pass Function
# ----------------------------------------------------------------------------------------------

# How often the two-pass Function ran its forward and its backward on the ops' implementations
# (eager calls; compiled code runs its traced graphs instead; tests read it to see which ran).
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
    direct: bool  # call the ops' implementations, not the ops (``_direct_calls``)
    parts: bool  # cut chunk_fwd and chunk_bwd around the exchange (``dispatch.chunk_parts_apply``)


def _direct_calls(tensors) -> bool:
    """Whether the Function calls the ops' implementations directly (``dispatch``): eager calls on
    plain tensors, as ``chunk_gla``'s fast path. Compiled code, and tracing under a dispatch or
    function mode (fake or wrapped tensors), calls the ops, which trace as single nodes."""
    return _eager_fast_path(tensors)


class _TwoPassCP(torch.autograd.Function):
    """Context parallel GLA in two passes of the chunk kernels, with no elementwise work over [T, K].

    forward: each segment's final state from zero and its decay (``_sums``: the first half of
    chunk_fwd, or the states-only pass); one all-gather; the scan gives the state entering each
    segment; chunk_fwd (its second half) from that state gives o (the kernel applies the state
    itself).
    backward: the gradient of each segment's o w.r.t. its entering state (``_sums`` with do: the
    first half of chunk_bwd's dual walk, or the dual states-only pass on q, do and the gates); one
    all-gather of those and of the final state's gradients; the scan against processing order gives
    the gradient of the state leaving each segment; chunk_bwd (its second half) from the entering
    state with that gradient gives every input's gradient (a segment's inputs reach the loss only
    through its o and its leaving state, so this is exact).
    Dynamo traces both (fullgraph); the backward's all-gather stays in the backward graph.
    """

    @staticmethod
    def forward(ctx, spec: _Spec, q, k, v, g, g_gamma, initial_state, gate_a, gate_bias):
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None
        call = GLACall(q, k, v, g, g_gamma, None, scale=spec.scale, reverse=spec.reverse, gate=spec.fn,
                       gate_a=gate_a, gate_bias=gate_bias)
        S, D, parts = _sums(call, None, spec)
        S_all, D_all = _gather_states(S, D, spec.group, spec.world)
        h0 = None if initial_state is None else initial_state.to(S.dtype)
        h, ht = _scan(S_all, D_all, h0, spec.seg, spec.reverse, traced=not spec.direct)
        o = _chunk_fwd(call.replace(initial_state=h), parts, spec.direct)
        ctx.spec = spec
        ctx.initial_state = None if initial_state is None else (initial_state.shape, initial_state.dtype)
        ctx.save_for_backward(q, k, v, g, g_gamma, h, gate_a, gate_bias, D_all)
        if not spec.output_final_state:
            ctx.mark_non_differentiable(ht)
        if spec.direct:
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
        dh_loc, _, parts = _sums(call, do, spec)
        B = h.shape[0] // len(spec.seg.own)
        if spec.output_final_state:  # every rank's call asks for it or none does
            dht = h.new_zeros(B, *h.shape[1:]) if dht is None else dht.to(h.dtype)
        dh_all, dht_all = _gather_grads(dh_loc, dht if spec.output_final_state else None, spec.group, spec.world)
        # each rank's use of the final state counts: its gradient is the sum of the ranks'
        dht = h.new_zeros(B, *h.shape[1:]) if dht_all is None else dht_all.sum(0)
        dht_seg, dh0 = _scan_back(dh_all, dht, D_all, spec.seg, spec.reverse, traced=not spec.direct)
        dq, dk, dv, dg, dg_gamma, _ = _chunk_bwd(call, do, dht_seg, parts, spec.direct)
        da = dbias = None
        if call.fused_gate and not call.gate.input_grad:
            dg, da, dbias = gate_grads(dg, g, call.gate, gate_a, gate_bias)
            da = None if da is None else da.to(gate_a.dtype)
            dbias = None if dbias is None else dbias.to(gate_bias.dtype)
        dg = None if g is None else dg.to(g.dtype)
        dg_gamma = None if g_gamma is None else dg_gamma
        if spec.direct:
            two_pass_calls["backward"] += 1
        return None, dq, dk, dv, dg, dg_gamma, _initial_grad(ctx, dh0), da, dbias


def _initial_grad(ctx, dh0: Tensor) -> Optional[Tensor]:
    """The global initial state's gradient: all of it on the rank whose segment runs first, zeros on
    the others (each rank returns its share; the shares sum to the gradient). Traced, a product
    with 1 or 0, so that every rank's graph is the same (NOTE:[CP uniform graph])."""
    if ctx.initial_state is None:
        return None
    shape, dtype = ctx.initial_state
    spec = ctx.spec
    first = spec.rank == spec.seg.owner[-1 if spec.reverse else 0][0]
    if not spec.direct:
        return (dh0 * float(first)).to(dtype)
    return dh0.to(dtype) if first else dh0.new_zeros(shape, dtype=dtype)


def _sums(call: GLACall, do: Optional[Tensor], spec: _Spec) -> tuple[Tensor, Optional[Tensor], object]:
    """``_final_state``'s (S, D) and the parts the rest of the segment's chunk_fwd (chunk_bwd) goes on
    from: with ``spec.parts`` from the first half of that op itself, ``chunk_sums`` (``kernels.parts``),
    so that no pass reads the segment's inputs only for S; else from the states-only pass, parts None."""
    if not spec.parts:
        return (*_final_state(call, do, spec.direct), None)
    if spec.direct:
        S, D, parts = dispatch.chunk_sums(call, do)
    else:
        S, D, *parts = torch.ops.gla_inductor.chunk_sums(*call.final_state_op_args(do))
    return S, _decay(call, D), parts


def _final_state(call: GLACall, do: Optional[Tensor] = None, direct: bool = True) -> tuple[Tensor, Optional[Tensor]]:
    """The state a segment leaves from a zero state (do None), or the gradient of its o w.r.t. the
    state entering it (do given: scale * sum_t (q_t * exp(G_t))^T do_t, G_t the log gates from the
    segment's first processed step through t), from the states-only pass of ``chunk_final_state``
    (no o, no dual outputs); and the segment's decay exp(D) (``_decay``). Through the op unless
    ``direct``."""
    if not direct:
        S, D = torch.ops.gla_inductor.chunk_final_state(*call.final_state_op_args(do))
    else:
        S, D = dispatch.chunk_final_state(call, do)
    return S, _decay(call, D)


def _decay(call: GLACall, D: Optional[Tensor]) -> Optional[Tensor]:
    """A segment's decay as the scans take it: [n * B, H, K] or [n * B, H, 1] to broadcast against
    the states; None without a gate."""
    if call.gate_kind == "none":
        return None
    return D if call.gate_kind == "vector" else D.unsqueeze(-1)


def _chunk_fwd(call: GLACall, parts, direct: bool) -> Tensor:
    """o of chunk_fwd, or of chunk_fwd_from_parts where ``_sums`` gave parts: through the op, or
    (``direct``) its implementation."""
    if parts is None:
        return dispatch.chunk_fwd(call)[0] if direct else torch.ops.gla_inductor.chunk_fwd(*call.op_args())[0]
    if direct:
        return dispatch.chunk_fwd_from_parts(call, parts)[0]
    return torch.ops.gla_inductor.chunk_fwd_from_parts(parts, *call.op_args(full=True))[0]


def _chunk_bwd(call: GLACall, do: Tensor, dht: Tensor, parts, direct: bool) -> tuple[Tensor, ...]:
    """chunk_bwd, or chunk_bwd_from_parts where ``_sums`` gave parts: through the op, or
    (``direct``) its implementation."""
    if parts is None:
        return dispatch.chunk_bwd(call, do, dht) if direct else torch.ops.gla_inductor.chunk_bwd(
            *call.bwd_op_args(do, dht))
    if direct:
        return dispatch.chunk_bwd_from_parts(call, do, dht, parts)
    return torch.ops.gla_inductor.chunk_bwd_from_parts(parts, *call.bwd_op_args(do, dht))


def _gather_grads(dh_loc: Tensor, dht: Optional[Tensor], group, world: int) -> tuple[Tensor, Optional[Tensor]]:
    """All-gather every rank's (entering-state gradients, final-state gradient) in one buffer:
    [world, *dh_loc.shape], [world, *dht.shape] (None without a final state: half the bytes)."""
    parts = [dh_loc.flatten()] + ([] if dht is None else [dht.flatten()])
    gathered = _gathered(torch.cat(parts), group, world)
    n = dh_loc.numel()
    dh_all = gathered[:, :n].view(world, *dh_loc.shape)
    return dh_all, (None if dht is None else gathered[:, n:].view(world, *dht.shape))


def _scan_back(dh_all: Tensor, dht: Tensor, D_all: Optional[Tensor], seg: _Segments, reverse: bool,
               traced: bool = True) -> tuple[Tensor, Tensor]:
    """The gradients of the states leaving this rank's segments ([n * B, H, K, V], in the order of
    ``seg.own``) and of the global initial state: from the final state's gradient dht,
    lam <- dh_loc_j + a_j * lam over the global segments against processing order (the transpose of
    ``_scan``; D_all holds the decays a_j)."""
    n = len(seg.own)
    B = dh_all.shape[1] // n
    processing = list(reversed(range(len(seg.owner)))) if reverse else list(range(len(seg.owner)))
    lam, leaving, position = dht, [], {}
    for j in reversed(processing):
        position[j] = len(leaving)
        leaving.append(lam)
        r, i = seg.owner[j]
        rows = slice(i * B, (i + 1) * B)
        lam = _step(dh_all[r, rows], None if D_all is None else D_all[r, rows], lam)
    return _pick(leaving, [position[j] for j in seg.own], traced), lam


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
