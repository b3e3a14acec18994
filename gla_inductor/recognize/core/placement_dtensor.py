"""Which callable the GLA op call becomes when its inputs are DTensors sharded over time.

A naive GLA compiled on DTensors is rewritten on Dynamo's graph, whose example values are
DTensors: the canonical inputs the emitter builds ([B, T, H, D]) carry their placements. Sharded
over heads or batch (or replicated) they go to ``chunk_fwd`` as usual, and its sharding rules run
each rank's part locally. Sharded over time (``Shard(1)`` on some mesh dim), one rank's slice of
the sequence needs the states of the slices before it: the call goes to context parallelism
instead, a function taking ``chunk_fwd``'s arguments and returning (o, final state) like it.
``gla_inductor.distributed`` registers that function (this stage cannot import it); its
collectives are functional collectives that AOTAutograd traces into the graph.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ...contract import GLACall
from .consts import example_value
from .match import Reject

_TIME_SHARDED: Optional[Callable] = None
_SEQUENCE = ("q", "k", "v", "g")  # the op's inputs with a time axis (dim 1)


def register_time_sharded(fn: Callable) -> None:
    """``fn(*chunk_fwd args) -> (o, final state or None)`` for inputs sharded over time."""
    global _TIME_SHARDED
    _TIME_SHARDED = fn


def time_sharded(call: GLACall) -> list[str]:
    """The names of the call's sequence inputs that are DTensors sharded over time."""
    if not torch.distributed.is_available():
        return []
    from torch.distributed.tensor import DTensor, Shard

    names = []
    for name in _SEQUENCE:
        val = example_value(getattr(call, name))
        if isinstance(val, DTensor) and any(type(p) is Shard and p.dim == 1 for p in val.placements):
            names.append(name)
    return names


def chunk_fwd_target(call: GLACall):
    """``chunk_fwd``, or the registered context-parallel function where the call's inputs are
    sharded over time; raises Reject where the latter cannot take the call."""
    if not time_sharded(call) or _TIME_SHARDED is None:
        return torch.ops.gla_inductor.chunk_fwd.default
    if call.varlen or call.state_indices is not None:
        raise Reject("inputs sharded over time with packed sequences (cu_seqlens): context parallelism "
                     "splits one sequence per batch row")
    return _TIME_SHARDED
