"""Inductor lowering of ``gla_inductor::fused_recurrent`` (the decode op): compiled graphs run a
decode step as generated code, with no Python on the hot path.

An extern call of the eager op costs a trip through the dispatcher into Python on every call, which
outweighs the step's own work at decode sizes. So the lowering emits, by ``config.decode_lowering``:

- "template": the recurrent kernel (``kernels/templates/gla_recurrent.py.jinja``, the one the eager
  CUDA path renders standalone) as a ``TritonTemplate``. The state is an input the template mutates
  (``mutated_inputs``): it reads and writes the caller's state, or the named slots of a pool, once
  for all T steps. Pointwise consumers of o fuse into its store.
- "decompose": the T steps as Inductor IR built from the aten lowerings (decay, outer-product
  update, a reduction over K for o, the final state copied into the state in place), which Inductor
  fuses as it fuses the naive step it replaced: the same code as not rewriting, by construction.
- "extern": the eager op.
- "auto": the template where Inductor generates Triton for the device (CUDA; CPU with
  ``cpu_backend="triton"``, the interpreter), else the decomposition up to ``DECOMPOSE_MAX_T``
  steps, else extern.

A call the chosen way cannot run lowers to the eager op, and the reason is logged once: the
template needs dtypes and sizes the kernel supports and a Python scale (symbolic head sizes and
head counts are specialized with guards: they set the kernel's tiles and group size); the
decomposition needs a static T of at most ``DECOMPOSE_MAX_T`` and no state pool (it has no slot
gather and masked scatter).
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Optional

import torch
from torch._inductor import config as inductor_config
from torch._inductor import ir
from torch._inductor.lowering import fallback_handler, lowerings, register_lowering, to_dtype
from torch._inductor.select_algorithm import SymbolicGridFn, TritonTemplate, autotune_select_algorithm
from torch._inductor.virtualized import V

from .. import config
from ..contract import RECURRENT_ARGS, GLACall
from ..kernels.recurrent import default_recurrent_config, keys_contiguous, recurrent_options
from ..kernels.standalone import load_template
from ..ops.dispatch import recurrent_unsupported_reason
from .chunk import _arg_names, _layout, _meta, _static

log = logging.getLogger("gla_inductor")
aten = torch.ops.aten
gla = torch.ops.gla_inductor

MODES = ("auto", "template", "decompose", "extern")
# The longest step the decomposition unrolls: each step is a pass over the state in the IR, as in
# the naive loop Dynamo unrolls; longer calls take the template or the eager op (the chunked path).
DECOMPOSE_MAX_T = 8


@SymbolicGridFn
def _recurrent_grid(V, BH, meta, *, cdiv):
    """One program per (value tile, batch * head), as ``kernels.recurrent.recurrent_grid``."""
    return (cdiv(V, meta["BV"]), BH, 1)


RECURRENT = TritonTemplate(name="gla_recurrent", grid=_recurrent_grid,
                           source=load_template("gla_recurrent") + "\n" + load_template("gla_common"))


# ----------------------------------------------------------------------------------------------
# which way
# ----------------------------------------------------------------------------------------------


def route(call: GLACall) -> tuple[str, Optional[str]]:
    """("template" | "decompose" | "extern", why not the configured way or None), for a call of IR
    nodes (its initial_state the state the op overwrites)."""
    mode = config.decode_lowering
    if mode not in MODES:
        raise ValueError(f"gla_inductor.config.decode_lowering is {mode!r}; expected one of {MODES}")
    if mode == "extern":
        return "extern", None
    template_reason = _template_reason(call)
    if mode == "template" or mode == "auto" and template_reason is None:
        return ("template", None) if template_reason is None else ("extern", template_reason)
    decompose_reason = _decompose_reason(call)
    if decompose_reason is None:
        return "decompose", None
    if mode == "decompose":
        return "extern", decompose_reason
    return "extern", f"no template ({template_reason}) and no decomposition ({decompose_reason})"


def _group_reason(call: GLACall) -> Optional[str]:
    G, H = call.q.get_size()[2], call.v.get_size()[2]
    if not V.graph.sizevars.statically_known_equals(G, H) and not (_static(G) and _static(H)):
        return "q/k shared by groups of heads, with dynamic head counts (the group size is a constant)"
    return None


def _template_group_reason(call: GLACall) -> Optional[str]:
    """Dynamic head counts are specialized (``_specialized``), so only their hints must divide."""
    hint = V.graph.sizevars.optimization_hint
    G, H = (hint(x.get_size()[2]) for x in (call.q, call.v))
    return None if G > 0 and H % G == 0 else f"{H} heads of v are not groups of q/k's {G}"


def _template_reason(call: GLACall) -> Optional[str]:
    q = call.q
    if q.get_device().type == "cpu" and inductor_config.cpu_backend != "triton":
        return "CPU tensors (Inductor's CPU backend is not Triton)"
    reason = _template_group_reason(call)
    if reason is not None:
        return reason
    if not isinstance(call.scale, (int, float)):
        return "a scale computed in the graph (the kernel folds a constant scale into q)"
    B, H = q.get_size()[0], call.v.get_size()[2]
    if any(V.graph.sizevars.statically_known_equals(s, 0) for s in (B, H)):
        return "an empty batch or head dimension"
    metas = {n: _meta(x) for n, x in call.tensors().items()}
    meta_call = call.replace(**metas, state_indices=_meta(call.state_indices))
    return recurrent_unsupported_reason(meta_call, meta_call.initial_state)


# Inductor of torch < 2.13 schedules the state's in-place copy before the output's reduction that
# reads the old state (a write-after-read on a graph input it does not order): seen on 2.11's C++
# backend, o then read the updated state.
_ORDERS_INPUT_MUTATION = torch.torch_version.TorchVersion(torch.__version__) >= (2, 13)


def _decompose_reason(call: GLACall) -> Optional[str]:
    if not _ORDERS_INPUT_MUTATION:
        return (f"torch {torch.__version__}: its Inductor may write the state before the output reads it "
                "(the decomposition needs torch >= 2.13)")
    if call.state_indices is not None:
        return "a state pool (state_indices): the decomposition has no slot gather and masked scatter"
    T = call.q.get_size()[1]
    if not _static(T) or int(T) > DECOMPOSE_MAX_T:
        return f"T = {T}: the decomposition unrolls static T <= {DECOMPOSE_MAX_T} steps"
    return _group_reason(call)


@functools.cache
def _note_fallback(reason: str) -> None:
    log.info("gla_inductor: fused_recurrent lowers to an extern call of the eager op: %s", reason)


# ----------------------------------------------------------------------------------------------
# the lowering
# ----------------------------------------------------------------------------------------------


@register_lowering(gla.fused_recurrent.default, type_promotion_kind=None)
def fused_recurrent(*args, **kwargs):
    call = GLACall.from_op_args(args, kwargs, names=RECURRENT_ARGS)
    way, reason = route(call)
    if way == "template":
        return _template(call)
    if way == "decompose":
        return _decompose(call)
    if reason is not None:
        _note_fallback(reason)
    return fallback_handler(gla.fused_recurrent.default, add_to_fallback_set=False)(*args, **kwargs)


def _realize(x):
    return None if x is None else ir.ExternKernel.realize_input(x)


def _group(call: GLACall) -> int:
    G, H = call.q.get_size()[2], call.v.get_size()[2]
    return 1 if V.graph.sizevars.statically_known_equals(G, H) else _specialized(H) // _specialized(G)


def _specialized(size) -> int:
    """A size the kernel compiles in (head sizes set its tiles, head counts its group size), as an
    int; where it is symbolic (``dynamic=True``) the graph is guarded on its value, so a model's
    decode loop compiled once for every batch size runs the template, not the eager op: head sizes
    and counts do not change between calls of one layer."""
    return int(size) if _static(size) else V.graph.sizevars.guard_int(size)


def _output_dtype(call: GLACall) -> torch.dtype:
    q, k, v = (x.get_dtype() for x in (call.q, call.k, call.v))
    return torch.promote_types(torch.promote_types(q, k), v)


def _template(call: GLACall):
    """o from the recurrent template; the state (or the pool's named slots) is written in place."""
    tensors = dict(q=call.q, k=call.k, v=call.v, g=call.g, g_gamma=call.g_gamma, h0=call.initial_state,
                   idx=call.state_indices)
    tensors = {n: _realize(x) for n, x in tensors.items() if x is not None}
    q, v = tensors["q"], tensors["v"]
    B, T, _, K = q.get_size()
    H, Vd = v.get_size()[2], v.get_size()[3]
    device = q.get_device()
    hint = V.graph.sizevars.optimization_hint
    K, Vd = _specialized(K), _specialized(Vd)
    h0 = tensors["h0"]
    # one step only where T is 1 in every call of the graph (the blocks take exactly one)
    steps = 1 if _static(T) and int(T) == 1 else None
    cfg = default_recurrent_config(hint(B), hint(H), K, Vd, device, h0.get_dtype(),
                                   keys_contiguous([hint(x) for x in h0.get_stride()]), steps)
    options = recurrent_options(K, Vd, call.gate_kind, call.scale, call.reverse, block_v=cfg.block_v,
                                use_h0=True, store_ht=True, group=_group(call),
                                use_indices=call.state_indices is not None, ht_is_h0=True, early_ht=cfg.early_state,
                                key_block=cfg.key_block, value_block=cfg.value_block)
    names = _arg_names(RECURRENT, options, tensors)
    nodes = [tensors[n] for n in names]
    layout = _layout(device, _output_dtype(call), (B, T, H, Vd))
    choices: list[Any] = []
    error = RECURRENT.maybe_append_choice(choices, input_nodes=nodes, layout=layout, mutated_inputs=[tensors["h0"]],
                                          call_sizes=[Vd, B * H], num_stages=cfg.num_stages,
                                          num_warps=cfg.num_warps, **options)
    if error is not None:
        raise error
    result = autotune_select_algorithm(RECURRENT.name, choices, nodes, layout)
    # torch 2.11 returns the node, 2.13+ a (node, choice) pair
    return result[0] if isinstance(result, tuple) else result


def _decompose(call: GLACall):
    """o from the steps as aten-level IR; the final state is copied into the state in place. Each
    step's reduction is realized before that copy, so that it reads the state as it was."""
    L = lowerings
    dtype = _compute_dtype(call)
    q, k, v = (to_dtype(x, dtype) for x in (call.q, call.k, call.v))
    T = int(call.q.get_size()[1])
    group = _group(call)
    if group > 1:
        q, k = _repeat_heads(q, group), _repeat_heads(k, group)
    S = to_dtype(call.initial_state, dtype)
    out_dtype = _output_dtype(call)
    outs: dict[int, Any] = {}
    for i, t in enumerate(reversed(range(T)) if call.reverse else range(T)):
        decay = _decay(call, t, dtype)
        if decay is not None:
            S = L[aten.mul.Tensor](S, decay)
        kv = L[aten.mul.Tensor](_unsqueeze(_step(k, t), -1), _unsqueeze(_step(v, t), -2))
        S = L[aten.add.Tensor](S, kv)
        if i < T - 1 and isinstance(S.data, ir.StorageBox):
            # read by the next step and by this step's output: realized where Inductor would
            # realize a value of two users (its rule for the naive loop's states)
            S.data.mark_reuse(2)
        o_t = L[aten.sum.dim_IntList](L[aten.mul.Tensor](_unsqueeze(_step(q, t), -1), S), [-2])
        o_t.realize()  # the reduction reads the state before the copy below overwrites it
        if call.scale != 1.0:
            o_t = L[aten.mul.Tensor](o_t, call.scale)
        o_t = to_dtype(o_t, out_dtype)
        outs[t] = o_t
    o = _stack([outs[t] for t in range(T)]) if T > 0 else _empty_output(call, out_dtype)
    L[aten.copy_.default](call.initial_state, S)
    return o


def _stack(steps: list):
    """The step outputs [B, H, V] as o [B, T, H, V] (one step: a view)."""
    rows = [_unsqueeze(o_t, 1) for o_t in steps]
    return rows[0] if len(rows) == 1 else lowerings[aten.cat.default](rows, 1)


def _compute_dtype(call: GLACall) -> torch.dtype:
    tensors = (call.q, call.k, call.v, call.g, call.g_gamma, call.initial_state)
    return torch.float64 if any(x is not None and x.get_dtype() == torch.float64 for x in tensors) else torch.float32


def _step(x, t: int):
    return lowerings[aten.select.int](x, 1, t)


def _unsqueeze(x, dim: int):
    return lowerings[aten.unsqueeze.default](x, dim)


def _decay(call: GLACall, t: int, dtype: torch.dtype):
    """exp of step t's log gate, shaped to scale a [B, H, K, V] state; None without a gate."""
    if call.g is not None:
        g_t = lowerings[aten.exp.default](to_dtype(_step(call.g, t), dtype))
        return _unsqueeze(g_t, -1) if len(call.g.get_size()) == 4 else _unsqueeze(_unsqueeze(g_t, -1), -1)
    if call.g_gamma is not None:
        gamma = lowerings[aten.exp.default](to_dtype(call.g_gamma, dtype))
        return _unsqueeze(_unsqueeze(gamma, -1), -1)
    return None


def _repeat_heads(x, group: int):
    """q or k [B, T, G, K] as [B, T, G * group, K], head h reading h // group (a view, no copy)."""
    B, T, G, K = x.get_size()
    expanded = lowerings[aten.expand.default](_unsqueeze(x, 3), [B, T, G, group, K])
    return lowerings[aten.view.default](expanded, [B, T, G * group, K])


def _empty_output(call: GLACall, dtype: torch.dtype):
    B, T = call.q.get_size()[:2]
    H, Vd = call.v.get_size()[2], call.v.get_size()[3]
    return lowerings[aten.empty.memory_format]([B, T, H, Vd], dtype=dtype, device=call.q.get_device())
