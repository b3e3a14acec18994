"""DTensor sharding rules for the GLA ops: heads (tensor parallel) and batch (data parallel).

GLA treats every (batch, head) pair on its own, so inputs sharded over heads or over the batch run
each rank's part locally with no communication, forward and backward:

    tensor     heads    batch    dims
    q, k, g    Shard(2) Shard(0) [B, T, H, K] ([B, T, G, K] for grouped q and k; g may be [B, T, H])
    v, do      Shard(2) Shard(0) [B, T, H, V]
    initial_state, state, dht
               Shard(1) Shard(0) [B, H, K, V]
    g_gamma, gate_a, gate_bias
               Shard(0) Replicate [H] ([H, K] for a vector gate's gate_bias)

Per mesh dimension the inputs choose one of three modes: all Replicate, heads or batch (Replicate
inputs join the mode of the others: DTensor slices them locally, no communication). Outputs follow:
o like v, the final state like initial_state; in the backward each gradient like its input, but
the gradient of a parameter replicated over a batch-sharded mesh dimension (g_gamma) is Partial
(each rank sums over its own batch rows).

Refused with a ValueError naming the tensor: a shard over time (``context_parallel_gla`` splits
the sequence), over K or V, Partial inputs, one mesh dimension mixing heads and batch, and grouped
q and k whose G heads do not split evenly with v's (each rank's v heads must read its own q/k
heads). ``fused_recurrent`` overwrites its state in place, so the state must already have the
placement of the chosen mode: a redistributed copy would take the update instead.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.experimental import register_sharding

__all__ = ["register_gla_sharding"]

REPLICATE, BATCH, HEADS = "replicate", "batch", "heads"

# (batch dim, head dim, time dim) of each tensor argument of the ops, by schema name
_DIMS: dict[str, tuple[Optional[int], int, Optional[int]]] = {
    "q": (0, 2, 1), "k": (0, 2, 1), "v": (0, 2, 1), "g": (0, 2, 1), "do": (0, 2, 1),
    "initial_state": (0, 1, None), "state": (0, 1, None), "dht": (0, 1, None),
    "g_gamma": (None, 0, None), "gate_a": (None, 0, None), "gate_bias": (None, 0, None),
}
_LAYOUTS = {
    "q": "[B, T, H, K]", "k": "[B, T, H, K]", "v": "[B, T, H, V]", "g": "[B, T, H(, K)]",
    "do": "[B, T, H, V]", "initial_state": "[B, H, K, V]", "state": "[B, H, K, V]",
    "dht": "[B, H, K, V]", "g_gamma": "[H]", "gate_a": "[H]", "gate_bias": "[H(, K)]",
}


def placement_for(name: str, mode: str):
    """The placement of tensor argument ``name`` on a mesh dimension in ``mode``."""
    batch_dim, head_dim, _ = _DIMS[name]
    if mode == HEADS:
        return Shard(head_dim)
    if mode == BATCH and batch_dim is not None:
        return Shard(batch_dim)
    return Replicate()


def _mode_of(op: str, name: str, placement, mesh_dim: int) -> Optional[str]:
    """The mode one input's placement asks for (None: Replicate, any mode), or a ValueError."""
    if isinstance(placement, Replicate):
        return None
    batch_dim, head_dim, time_dim = _DIMS[name]
    if type(placement) is Shard:  # not _StridedShard, a shard of a shard
        if placement.dim == head_dim:
            return HEADS
        if placement.dim == batch_dim:
            return BATCH
        if placement.dim == time_dim:
            raise ValueError(
                f"gla_inductor::{op}: {name} is {placement!r} on mesh dim {mesh_dim}, sharded over time; the op "
                f"shards heads (Shard({head_dim})) or batch only. For a sequence split over ranks call "
                "gla_inductor.distributed.context_parallel_gla")
    accepted = [f"Shard({head_dim}) (heads)"] + ([f"Shard({batch_dim}) (batch)"] if batch_dim is not None else [])
    raise ValueError(
        f"gla_inductor::{op}: {name} {_LAYOUTS[name]} is {placement!r} on mesh dim {mesh_dim}; expected "
        f"Replicate or {' or '.join(accepted)}: redistribute it first")


def mesh_dim_mode(op: str, placements: dict, mesh_dim: int) -> Optional[str]:
    """The one mode the inputs' placements on one mesh dim agree on (None where all are Replicate)."""
    chosen: dict[str, str] = {}
    for name, placement in placements.items():
        mode = _mode_of(op, name, placement, mesh_dim)
        if mode is not None:
            chosen.setdefault(mode, name)
    if len(chosen) > 1:
        (m1, n1), (m2, n2) = chosen.items()
        raise ValueError(
            f"gla_inductor::{op}: on mesh dim {mesh_dim} {n1} is {placements[n1]!r} ({m1}) but {n2} is "
            f"{placements[n2]!r} ({m2}); shard all GLA inputs of one mesh dim the same way")
    return next(iter(chosen), None)


def _modes(op: str, tensors: dict[str, DTensorSpec]) -> list[Optional[str]]:
    """Per mesh dimension, the one mode the inputs agree on (None where all are Replicate)."""
    ndim = next(iter(tensors.values())).mesh.ndim
    return [mesh_dim_mode(op, {n: s.placements[d] for n, s in tensors.items()}, d) for d in range(ndim)]


def check_groups(op: str, G: int, H: int, ranks: int) -> None:
    """Grouped q and k (G heads for v's H) split over heads only where every rank keeps whole groups."""
    if G != H and G % ranks:
        raise ValueError(
            f"gla_inductor::{op}: q and k have {G} heads shared by v's {H} heads (grouped); sharding heads over "
            f"{ranks} ranks needs G divisible by {ranks}, so that each rank's v heads read its own q/k heads")


def _bind(schema: torch.FunctionSchema, args: tuple, kwargs: dict) -> tuple[list[str], dict]:
    """The argument names in the order DTensor lists their placements (positional, then keyword),
    and every argument's value (DTensorSpec for tensors), defaults included."""
    names = [a.name for a in schema.arguments]
    values = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
    values.update(zip(names, args))
    values.update(kwargs)
    return names[: len(args)] + list(kwargs), values


def _strategies(op: str, order: list[str], values: dict, outputs) -> list[tuple[list, list]]:
    """register_sharding's answer: per mode in use (and Replicate), (output placements, input
    placements). DTensor expands it over the mesh dims and picks the combination that needs no
    redistribution, or else the first that costs no communication (Replicate inputs sliced)."""
    tensors = {n: values[n] for n in order if isinstance(values[n], DTensorSpec)}
    modes = _modes(op, tensors)
    if HEADS in modes and "q" in tensors:
        mesh = tensors["q"].mesh
        ranks = math.prod(mesh.size(d) for d, m in enumerate(modes) if m == HEADS)
        check_groups(op, tensors["q"].shape[2], tensors["v"].shape[2], ranks)
    if op == "fused_recurrent":
        _check_state_in_place(tensors, modes)
    return [(outputs(mode, values), [placement_for(n, mode) if n in tensors else None for n in order])
            for mode in dict.fromkeys([REPLICATE, *[m for m in modes if m is not None]])]


def _check_state_in_place(tensors: dict[str, DTensorSpec], modes: list[Optional[str]]) -> None:
    """fused_recurrent writes its state in place, so DTensor must not hand it a redistributed copy:
    the state must already be placed as the mode of every mesh dim asks."""
    state = tensors["state"]
    for d, mode in enumerate(modes):
        want = placement_for("state", mode or REPLICATE)
        if state.placements[d] != want:
            raise ValueError(
                f"gla_inductor::fused_recurrent: state is {state.placements[d]!r} on mesh dim {d} but the other "
                f"inputs are sharded over {mode}; the op updates the state in place, so place it as {want!r} "
                "before the call")


def _fwd_outputs(mode: str, values: dict) -> list:
    """o like v; the final state like initial_state, or Replicate for the [0] tensor returned
    when it was not asked for."""
    state = placement_for("initial_state", mode) if values["output_final_state"] else Replicate()
    return [placement_for("v", mode), state]


def _bwd_outputs(mode: str, values: dict) -> list:
    """Each gradient placed like its input; absent inputs get [0] tensors (Replicate)."""
    out = []
    for name in ("q", "k", "v", "g", "g_gamma", "initial_state"):
        if values[name] is None:
            out.append(Replicate())
        elif name == "g_gamma" and mode == BATCH:
            out.append(Partial())  # a replicated parameter's gradient, summed over this rank's batch rows
        else:
            out.append(placement_for(name, mode))
    return out


def _recurrent_outputs(mode: str, values: dict) -> list:
    return [placement_for("v", mode)]


_OUTPUTS = {"chunk_fwd": _fwd_outputs, "chunk_bwd": _bwd_outputs, "fused_recurrent": _recurrent_outputs}


def _rule(op: str):
    """The sharding function register_sharding calls with the op's arguments (specs for tensors)."""
    schema = getattr(torch.ops.gla_inductor, op).default._schema

    def rule(*args, **kwargs):
        order, values = _bind(schema, args, kwargs)
        return _strategies(op, order, values, _OUTPUTS[op])

    rule.__name__ = f"{op}_sharding"
    return rule


_REGISTERED = False


def register_gla_sharding() -> None:
    """Register the rules with DTensor (once; importing ``gla_inductor.distributed`` does it). The
    ops must be defined first: importing gla_inductor defines them."""
    global _REGISTERED
    if _REGISTERED:
        return
    for op in _OUTPUTS:
        register_sharding(getattr(torch.ops.gla_inductor, op).default)(_rule(op))
    _REGISTERED = True
