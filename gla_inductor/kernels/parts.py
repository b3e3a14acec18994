"""The chunked kernels' forward and backward cut in two where context parallelism exchanges states.

A rank of a context-parallel step needs, before the states of the segments before its own are known,
its segment's state from a zero start (and, in the backward, the gradient w.r.t. the state entering
it); only then can it walk its chunks from the right state. Where the local schedule runs
(``configs.local_schedule``), the first half of a forward already computes what that needs:
gla_chunk_local's terms and the segment sums of the carry's walk, which fold into the whole walk's
state from a zero start (``impl.final_state.fold``). So ``sums`` runs that half (the sums of every
segment, the last one too: SUMS_ALL) and returns the folded state with the parts; after the
exchange, ``chunk.forward`` / ``chunk.backward`` go on from the parts (``LocalParts``) with the
entering state. The same kernels run as in one call, and no pass reads k, v and the gate a second
time (the states-only pass, ``final_state``, does).

The backward mirrors it: gla_chunk_local with the scores' transpose and the dual walk's segment sums
(on qs and do), folded into the gradient w.r.t. the entering state; the states walk, which needs the
entering state the forward already had, runs after the exchange, with the dual walk and dq, dk, dg.

Both halves run under one config (``config``: the call's own, walked in at least two segments), a
function of the shapes, so the halves (and the ops' fake implementations) agree on the parts.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
from torch import Tensor

from ..contract import GLACall
from ..impl.final_state import fold
from . import chunk
from .chunk import LocalParts
from .configs import (ChunkConfig, interpreting, kernel_options, local_schedule, local_terms, pow2,
                      segment_decays_shape)

__all__ = ["config", "cut", "local", "shapes", "sums"]


def local(call: GLACall) -> bool:
    """Whether the call's own schedule is the local one, so that cutting it costs no pass: a vector
    gate from K = 64, other gates at K > 128; not packed sequences. A function of the head size and
    the gate alone, not of T, so that ranks holding slices of different lengths agree."""
    return not call.varlen and local_schedule(max(16, pow2(call.q.shape[-1])), call.gate_kind == "vector")


def config(call: GLACall) -> ChunkConfig:
    """The call's own config, cut (``cut``)."""
    _, cfg = chunk._prepare(call, None)
    return cut(cfg)


def cut(cfg: ChunkConfig) -> ChunkConfig:
    """A local schedule's config for its two halves: the walks in at least two segments (one
    launch's sums, then the walk), as the Inductor lowerings also take it; each segment's sums in
    one piece (pieces are the terms carry's)."""
    return dataclasses.replace(cfg, local=True, split=False, terms=False, segments=max(2, cfg.segments),
                               sum_splits=1)


def shapes(call: GLACall) -> dict[str, Optional[tuple[tuple, torch.dtype]]]:
    """(shape, dtype) of each of ``LocalParts``' tensors (None where absent), and of the folded
    state S and decay D, for the call's config: what ``sums`` returns and the fakes build."""
    cfg = config(call)
    B, T, _, K = call.q.shape
    H, V = call.v.shape[2], call.v.shape[-1]
    options = kernel_options(cfg, call.output_dtype, K, call.gate_kind, call.scale, call.reverse,
                             interpreting(), call.gate, call.group_size)
    NT = math.ceil(T / cfg.block_t)
    out = dict(local_terms(options, B, T, H, K, NT, cfg.block_t))
    P = cfg.segments
    ds = segment_decays_shape(options, B, P, H, K)
    out.update(hs=((B, P, H, K, V), torch.float32), ds=None if ds is None else (ds, torch.float32),
               S=((B, H, K, V), torch.float32), D=None if ds is None else (ds[:1] + ds[2:], torch.float32))
    return out


def sums(call: GLACall, do: Optional[Tensor] = None) -> tuple[Tensor, Optional[Tensor], LocalParts]:
    """(S, D, parts). Without ``do``: the forward's parts, S the state the call's walk leaves from a
    zero state, D the decay across it ([B, H, K] for a vector gate, [B, H] for scalar and constant
    gates, None without a gate), as ``chunk_final_state``. With ``do``: the backward's parts, S the
    gradient w.r.t. the state entering the call, and D its dual walk's decay."""
    call, cfg = chunk._prepare(call, None)
    cfg = cut(cfg)
    dual = do is not None
    if call.q.shape[1] == 0:
        return _empty(call)
    run = chunk._Launcher(cfg, call)
    qs, ks, A, dl = run.local(call.q, call.k, transpose=dual)
    hs, ds = run.segment_sums(qs if dual else ks, do if dual else call.v, dl, dual, cfg.segments, every=True)
    S, D = fold(hs, ds)
    return S, (None if ds is None else D), LocalParts(qs, ks, A, dl, hs, ds)


def _empty(call: GLACall) -> tuple[Tensor, Optional[Tensor], LocalParts]:
    """``sums`` of a call with no steps: a zero state, no decay (ones); the parts are never read."""
    specs = shapes(call)

    def new(name: str, fill: float = 0.0) -> Optional[Tensor]:
        spec = specs[name]
        return None if spec is None else call.q.new_full(spec[0], fill, dtype=spec[1])

    parts = LocalParts(*(new(n) for n in ("qs", "ks", "A", "dl", "hs")), new("ds", 1.0))
    return new("S"), new("D", 1.0), parts
