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

Eager ``chunk_gla`` on DTensors already placed as their mode asks (every input Shard over heads,
say) skips DTensor's dispatch and torch.library's wrappers: one autograd Function runs the local
parts, forward and backward, and wraps the results with the placements the rules above give
(``_LocalChunkGLA``; everything else, Replicate inputs to slice included, takes the op). Compiled
graphs hold the ops, on the local tensors, and nothing of this module runs per compiled step: what
DTensors cost there beyond plain tensors is torch's, at the compiled region's boundary, the same
for a region of any content (guards on the specs, AOTAutograd's subclass wrappers of the outputs
and gradients and of o's gradient, the accumulation of DTensor gradients), more where the region
was compiled with dynamic shapes (the wrappers then compute symbolic sizes each step).

The rules are registered with every non-tensor argument in DTensor's sharding cache key:
``register_sharding`` keys only integer arguments, and a call with ``output_final_state`` flipped
would reuse the other call's placement for the final state.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
from torch.distributed.tensor.experimental import register_sharding

from ..contract import CHUNK_FWD_ARGS, compute_dtype, output_dtype
from ..ops.chunk import eager_backward, eager_forward, register_eager_route

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


def _schema_info(op: torch._ops.OpOverload) -> RuntimeSchemaInfo:
    """Every non-tensor argument (from the first on, and by name when passed by keyword) in the key
    of DTensor's sharding cache, and no pytree flattening (no argument is a list)."""
    args = op._schema.arguments
    static = [i for i, a in enumerate(args) if "Tensor" not in str(a.type)]
    return RuntimeSchemaInfo(static[0], [args[i].name for i in static], needs_pytree=False)


def register_gla_sharding() -> None:
    """Register the rules with DTensor and the eager route of ``chunk_gla`` on DTensors (once;
    importing ``gla_inductor.distributed`` does it). The ops must be defined first: importing
    gla_inductor defines them."""
    global _REGISTERED
    if _REGISTERED:
        return
    propagator = DTensor._op_dispatcher.sharding_propagator
    for name in _OUTPUTS:
        op = getattr(torch.ops.gla_inductor, name).default
        register_sharding(op)(_rule(name))
        propagator.register_op_strategy(op, propagator.op_strategy_funcs[op], _schema_info(op))
    register_eager_route(local_chunk_gla)
    _REGISTERED = True


# ---------------------------------------------------------------------------------------------
# eager chunk_gla on DTensors placed as their mode asks: the local parts, without DTensor's dispatch
# ---------------------------------------------------------------------------------------------

_TENSOR_ARGS = tuple(n for n in CHUNK_FWD_ARGS if n in _DIMS)  # cu_seqlens aside: never sharded


class _Plan(NamedTuple):
    """What a call with given input specs runs as: the specs of o and the final state, and of each
    argument's gradient (None for the non-tensor arguments and absent tensors)."""

    out_specs: tuple[DTensorSpec, DTensorSpec]
    grad_specs: tuple[Optional[DTensorSpec], ...]
    final_state: bool


def local_chunk_gla(args: tuple):
    """chunk_fwd's (o, ht) for its full arguments on DTensors, without DTensor's dispatch; None
    where the call needs it (a plain tensor among DTensors, packed sequences, inputs to
    redistribute, several meshes). Bad placements raise the rules' errors."""
    named = dict(zip(CHUNK_FWD_ARGS, args))
    if named.get("cu_seqlens") is not None:
        return None
    specs = {}
    for n in _TENSOR_ARGS:
        x = named[n]
        if isinstance(x, DTensor):
            specs[n] = x._spec
        elif x is not None:
            return None
    if not specs:
        return None
    plan = _plan(tuple(specs.items()), bool(named["output_final_state"]))
    return None if plan is None else _LocalChunkGLA.apply(plan, *args)


@functools.lru_cache(maxsize=1024)  # a training loop calls with a few specs again and again
def _plan(named_specs: tuple[tuple[str, DTensorSpec], ...], final: bool) -> Optional[_Plan]:
    """The plan of a call whose every DTensor already has its mode's placement on every mesh dim,
    else None (the errors of bad placements are not cached: each call raises them again)."""
    specs = dict(named_specs)
    mesh = specs["q"].mesh
    if any(s.mesh != mesh for s in specs.values()):
        return None
    modes = [m or REPLICATE for m in _modes("chunk_fwd", specs)]
    if any(s.placements != tuple(placement_for(n, m) for m in modes) for n, s in specs.items()):
        return None  # a Replicate input to slice: DTensor's dispatch does it
    if HEADS in modes:
        ranks = math.prod(mesh.size(d) for d, m in enumerate(modes) if m == HEADS)
        check_groups("chunk_fwd", specs["q"].shape[2], specs["v"].shape[2], ranks)
    metas = {n: s.tensor_meta for n, s in specs.items()}
    B, T, H, V = specs["v"].shape
    K = specs["q"].shape[-1]
    state_dtype = compute_dtype(*(metas.get(n) for n in ("q", "k", "v", "g", "g_gamma", "initial_state")))
    o = _spec(mesh, [placement_for("v", m) for m in modes], (B, T, H, V),
              output_dtype(metas["q"], metas["k"], metas["v"]))
    if final:
        ht = _spec(mesh, [placement_for("initial_state", m) for m in modes], (B, H, K, V), state_dtype)
    else:
        ht = _spec(mesh, [Replicate()] * mesh.ndim, (0,), state_dtype)
    grads = tuple(_grad_spec(specs[n], n, modes) if n in specs else None for n in CHUNK_FWD_ARGS)
    return _Plan((o, ht), grads, final)


def _grad_spec(spec: DTensorSpec, name: str, modes: list[str]) -> DTensorSpec:
    """The gradient of an input placed like the input, but Partial on a batch-sharded mesh dim for
    a parameter without a batch dim (g_gamma, gate_a, gate_bias): each rank sums its own rows."""
    placements = [Partial() if m == BATCH and _DIMS[name][0] is None else p for m, p in zip(modes, spec.placements)]
    return _spec(spec.mesh, placements, spec.shape, spec.tensor_meta.dtype)


def _spec(mesh, placements: list, shape: tuple, dtype: torch.dtype) -> DTensorSpec:
    """The spec of a contiguous tensor: the ops return contiguous tensors."""
    stride = torch.empty(shape, device="meta").stride()
    return DTensorSpec(mesh, tuple(placements), tensor_meta=TensorMeta(torch.Size(shape), stride, dtype))


def _local(grad: Optional[DTensor], spec: DTensorSpec):
    """The local part of an output's gradient, redistributed first where it comes placed otherwise
    (a Partial gradient from a later op, say)."""
    if grad is None:
        return None
    if grad.placements != spec.placements:
        grad = grad.redistribute(spec.mesh, spec.placements)
    return grad._local_tensor


class _LocalChunkGLA(torch.autograd.Function):
    """chunk_gla on DTensors as one autograd node: the eager implementation and formula on the
    local tensors, the outputs and gradients wrapped with the plan's specs."""

    @staticmethod
    def forward(ctx, plan: _Plan, *args):
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None, as through the op
        ctx.plan = plan
        local = tuple(x._local_tensor if isinstance(x, DTensor) else x for x in args)
        o, ht = (DTensor(x, spec, requires_grad=False) for x, spec in zip(eager_forward(ctx, local), plan.out_specs))
        if not plan.final_state:
            ctx.mark_non_differentiable(ht)
        return o, ht

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dht):
        plan = ctx.plan
        grads = eager_backward(ctx, _local(do, plan.out_specs[0]), _local(dht, plan.out_specs[1]))
        return (None, *(None if g is None or spec is None else DTensor(g, spec, requires_grad=False)
                        for g, spec in zip(grads, plan.grad_specs)))
