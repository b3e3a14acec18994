"""Inductor lowerings of ``gla_inductor::chunk_fwd``, ``chunk_bwd``, ``chunk_final_state`` and the ops
of a run cut around an exchange of states (``chunk_sums``, ``chunk_fwd_from_parts``,
``chunk_bwd_from_parts``): the chunked GLA kernels as ``TritonTemplate`` choices, so compiled graphs
run them as generated code (epilogues fused into the main output's store, autotuned under
max-autotune) instead of an extern call to the eager op.

The templates are the jinja sources of ``gla_inductor/kernels/templates/``, which the eager CUDA path
renders standalone (``kernels/standalone.py``); tiles and options come from ``kernels.configs``, so a
compiled graph and an eager call run the same kernels with the same configuration, and the same
schedule: the fused one (forward: one scan; backward: states scan, dual scan, dq/dk/dg) or
the local one (forward: chunk-local terms, carry scan; backward: local terms, states and dual carry
scans, dq/dk/dg), or, for the forward of scalar, constant and no gates, the carry computing its
chunk terms (``ChunkConfig.terms``); each may cut its walks into segments (``ChunkConfig.segments``,
``scan_segments``), each then two templates. The split schedule is eager-only. Packed sequences
(cu_seqlens) take either schedule, as in eager calls.

Anything the kernels do not cover (CPU without Inductor's Triton backend, head sizes past the
kernels' limits, float64, a config switch) lowers to the eager op as an extern kernel; the reason is
logged once.
"""

from __future__ import annotations

import functools
import logging
import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch._inductor import config as inductor_config
from torch._inductor import ir
from torch._inductor.lowering import empty_strided, fallback_handler, lowerings, register_lowering, to_dtype
from torch._inductor.select_algorithm import SymbolicGridFn, TritonTemplate, autotune_select_algorithm
from torch._inductor.virtualized import V
from torch.utils._sympy.functions import CeilDiv, FloorDiv

from ..contract import CHUNK_BWD_ARGS, GLACall
from ..kernels import final_state as final_state_kernels
from ..kernels.chunk import varlen_state_slots
from ..kernels.configs import (ChunkConfig, TileConfig, carry_options, default_config, dqkg_block_k, faulting_tile,
                               kernel_options, local_options, local_terms, scan_options, segment_decays_shape,
                               segsum_options)
from ..kernels.parts import cut as parts_config
from ..kernels.standalone import OUT, load_template, render_source
from ..ops.dispatch import chunk_unsupported_reason
from ..ops.final_state import FINAL_STATE_ARGS, final_state_call
from ..ops.parts import PARTS

log = logging.getLogger("gla_inductor")
aten = torch.ops.aten
gla = torch.ops.gla_inductor

# ----------------------------------------------------------------------------------------------
# templates and grids
# ----------------------------------------------------------------------------------------------


@SymbolicGridFn
def _scan_grid(BH, V, meta, *, cdiv):
    """How are gla_chunk_scan, gla_chunk_segsum and gla_chunk_carry parallelized? One program per
    (value tile, batch * head) walks all chunks in order with its state slice on chip, or, in a walk
    cut into segments, the chunks of its segment (see ``kernels.chunk.scan_grid``)."""
    # the sums of segments in SPLITS pieces: a program per piece, none for the last segment's (which
    # only SUMS_ALL stores)
    if meta.get("SEGMENT_SUMS"):
        segments = meta["SEGMENTS"] if meta.get("SUMS_ALL") else meta["SEGMENTS"] - 1
        return (cdiv(V, meta["BV"]), BH, segments * meta.get("SPLITS", 1))
    return (cdiv(V, meta["BV"]), BH, meta.get("SEGMENTS", 1))


@SymbolicGridFn
def _local_grid(T, BH, meta, *, cdiv):
    """How is gla_chunk_local parallelized? One program per (chunk, batch * head); packed sequences:
    one per (state slot, head), T being the slots (``varlen_state_slots``)."""
    if meta.get("IS_VARLEN"):
        return (T, BH, 1)
    return (cdiv(T, meta["BT"]), BH, 1)


@SymbolicGridFn
def _dqkg_grid(K, T, BH, meta, *, cdiv):
    """How is gla_chunk_bwd_dqkg parallelized? One program per (key tile, chunk, batch * head): with
    the states in HBM the chunks are independent (see ``kernels.chunk.chunk_grid``). Packed
    sequences: one per (state slot, key tile, head), T being the slots (``varlen_state_slots``)."""
    if meta.get("IS_VARLEN"):
        return (T, cdiv(K, meta["BK"]), BH)
    return (cdiv(K, meta["BK"]), cdiv(T, meta["BT"]), BH)


def _template(name: str, grid) -> TritonTemplate:
    # a kernel's source is its template followed by the shared @triton.jit helpers
    return TritonTemplate(name=name, grid=grid, source=load_template(name) + "\n" + load_template("gla_common"))


SCAN = _template("gla_chunk_scan", _scan_grid)
LOCAL = _template("gla_chunk_local", _local_grid)
CARRY = _template("gla_chunk_carry", _scan_grid)
SEGSUM = _template("gla_chunk_segsum", _scan_grid)
DQKG = _template("gla_chunk_bwd_dqkg", _dqkg_grid)

# the named arguments each template writes with tl.store (its main output goes through store_output)
_WRITTEN = {SCAN.name: ("h", "ht"), LOCAL.name: ("qs", "ks", "dl"), CARRY.name: ("h", "ht"), DQKG.name: ("dk", "dg"),
            SEGSUM.name: ("ds",)}


def _written(template: TritonTemplate, options: dict) -> tuple[str, ...]:
    # a carry's segment decays ds: written by its SEGMENT_SUMS launch, read by the walk after it
    return _WRITTEN[template.name] + (("ds",) if options.get("SEGMENT_SUMS") else ())

# ----------------------------------------------------------------------------------------------
# when to lower to the templates
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Meta:
    """What ``chunk_unsupported_reason`` reads of a tensor, for an IR node (size hints)."""

    device: torch.device
    dtype: torch.dtype
    shape: tuple

    def dim(self) -> int:
        return len(self.shape)


def _meta(x) -> Optional[_Meta]:
    if x is None:
        return None
    sizes = tuple(V.graph.sizevars.optimization_hint(s) for s in x.get_size())
    return _Meta(x.get_device(), x.get_dtype(), sizes)


def _why_not(call: GLACall) -> Optional[str]:
    """None when the templates can run the call (of IR nodes), else the reason to fall back."""
    q, v = call.q, call.v
    device = q.get_device()
    if call.cu_seqlens is not None and call.cu_seqlens.get_device() != device:
        return f"cu_seqlens on {call.cu_seqlens.get_device()}, q on {device} (the eager op moves it)"
    if device.type == "cpu" and inductor_config.cpu_backend != "triton":
        return "CPU tensors (Inductor's CPU backend is not Triton)"
    K, Vd = q.get_size()[-1], v.get_size()[-1]
    if not (isinstance(K, int) or K.is_number) or not (isinstance(Vd, int) or Vd.is_number):
        return "dynamic head sizes (K and V set the kernels' tiles)"
    if any(V.graph.sizevars.statically_known_equals(s, 0) for s in q.get_size()[:3]):
        return "an empty batch, sequence or head dimension"
    G, H = q.get_size()[2], v.get_size()[2]
    if not V.graph.sizevars.statically_known_equals(G, H) and not (_static(G) and _static(H)):
        return "q/k shared by groups of heads, with dynamic head counts (the group size is a kernel constant)"
    metas = {n: _meta(x) for n, x in call.tensors().items()}
    return chunk_unsupported_reason(call.replace(**metas, cu_seqlens=_meta(call.cu_seqlens)))


def _static(s) -> bool:
    return isinstance(s, int) or s.is_number


def _group(q, v) -> int:
    """Heads of v per head of q and k (1 unless grouped; static where not 1, see ``_why_not``)."""
    G, H = q.get_size()[2], v.get_size()[2]
    return 1 if V.graph.sizevars.statically_known_equals(G, H) else int(H) // int(G)


@functools.cache
def _note_fallback(op: str, reason: str) -> None:
    log.info("gla_inductor: %s lowers to an extern call of the eager op: %s", op, reason)


def _fallback(op, reason: str, *args, **kwargs):
    _note_fallback(str(op), reason)
    return fallback_handler(op, add_to_fallback_set=False)(*args, **kwargs)


# ----------------------------------------------------------------------------------------------
# building template calls
# ----------------------------------------------------------------------------------------------


def _cdiv(a, b: int):
    return -(-a // b) if isinstance(a, int) else CeilDiv(a, b)


def _layout(device, dtype, size) -> ir.FixedLayout:
    return ir.FixedLayout(device, dtype, list(size))  # contiguous


def _empty(size, dtype, device):
    return empty_strided(list(size), None, dtype=dtype, device=device)


def _arg_names(template: TritonTemplate, options: dict, tensors: dict) -> tuple[str, ...]:
    """The template's kernel arguments, in its ``def_kernel`` order: its jinja decides which tensors a
    mode reads, so ask it (a standalone render is cheap) rather than repeating that logic here."""
    ndims = {n: len(t.get_size()) for n, t in tensors.items()}
    ndims[OUT] = 5  # any rank the main output may have
    _, helpers = render_source((template.name, "gla_common"), template.name, options, ndims)
    return helpers.pointers


def _tile_choices(default: TileConfig, V: int, BK: int, vector_gate: bool) -> list[TileConfig]:
    """The heuristic tiles, plus a small search space under max-autotune (without the tiles known to
    fault: autotuning runs every choice, and a fault would end the process)."""
    if not inductor_config.max_autotune:
        return [default]
    widest = max(16, 1 << max(V - 1, 0).bit_length())
    tiles = [default]
    for block_v in (32, 64, 128):
        for num_warps in (4, 8):
            t = TileConfig(block_v=min(block_v, widest), num_warps=num_warps, num_stages=default.num_stages,
                           block_k=default.block_k)  # one stage for fp32 (default_config says why)
            if t not in tiles and not faulting_tile(BK, t, vector_gate):
                tiles.append(t)
    return tiles


def _benchmark_inputs(gate_index: Optional[int], offsets_index: Optional[int], T):
    """Benchmark inputs for autotuning: gates as models make them (log-sigmoid), not randn, whose
    positive values would take the kernels' rare paths; packed-sequence offsets that are offsets
    (equal lengths summing to T), not random integers, which would send the kernels out of bounds."""
    hint = V.graph.sizevars.optimization_hint

    def gate(node):
        size = [hint(s) for s in node.get_size()]
        x = torch.randn(size, device=node.get_device(), dtype=torch.float32)
        return F.logsigmoid(x).to(node.get_dtype())

    def offsets(node):
        N = hint(node.get_size()[0]) - 1
        return torch.linspace(0, hint(T), N + 1, device=node.get_device()).round().to(node.get_dtype())

    gens = {gate_index: gate, offsets_index: offsets}
    return {i: fn for i, fn in gens.items() if i is not None} or None


class _Plan:
    """Sizes, tiles and shared options of one lowered forward or backward call."""

    def __init__(self, call: GLACall, dtype: torch.dtype, parts: bool = False):
        q, v = call.q, call.v
        self.device = q.get_device()
        self.B, self.T, _, self.K = q.get_size()
        self.H, self.V = v.get_size()[2], v.get_size()[-1]  # q and k may have fewer heads (grouped)
        self.group = _group(q, v)
        # packed sequences: N of them, whose programs the scans run (B otherwise)
        self.cu_seqlens = call.cu_seqlens
        self.N = self.B if call.cu_seqlens is None else call.cu_seqlens.get_size()[0] - 1
        hint = V.graph.sizevars.optimization_hint
        cfg = default_config(hint(self.N), hint(self.T), hint(self.H), int(self.K), int(self.V), dtype,
                             call.gate_kind == "vector", self.device, call.varlen)
        if call.varlen:  # no split schedule (kernels.chunk says why)
            cfg = dataclasses.replace(cfg, split=False)
        if parts:  # a run cut around an exchange of states: the eager halves' config
            cfg = parts_config(cfg)
        self.cfg: ChunkConfig = cfg
        interpreting = self.device.type == "cpu"  # CPU Triton runs under the interpreter only
        self.options = kernel_options(self.cfg, dtype, int(self.K), call.gate_kind, call.scale, call.reverse,
                                      interpreting, call.gate, self.group, call.varlen)
        self.gates = dict(g=call.g, g_gamma=call.g_gamma, gate_a=call.gate_a, gate_bias=call.gate_bias)
        self.fused_gate = call.fused_gate

    def states_size(self):
        if self.cu_seqlens is not None:
            return (self.B, self.slots(), self.H, self.K, self.V)
        return (self.B, _cdiv(self.T, self.cfg.block_t), self.H, self.K, self.V)

    def slots(self):
        """The per-chunk state slots of packed sequences (``varlen_state_slots``)."""
        block_t = self.cfg.block_t
        T = self.T
        return varlen_state_slots(T, self.N, block_t) if isinstance(T, int) else FloorDiv(T, block_t) + self.N

    def scan(self, layout, tiles: TileConfig, *, write_out: bool, dual: bool, store_states: bool, segments: int = 1,
             **tensors):
        """gla_chunk_scan (see its template): returns the main output; ``h`` and ``ht`` are written.
        With segments > 1, after the segments' sums (``scan_segment_sums``)."""
        tensors = {n: t for n, t in {**tensors, **self.gates, "cu_seqlens": self.cu_seqlens}.items() if t is not None}
        options = scan_options(self.options, write_out=write_out, dual=dual, store_states=store_states,
                               use_h0="h0" in tensors, store_ht="ht" in tensors)
        if segments > 1:
            options["SEGMENTS"] = segments
            hs, ds = self.scan_segment_sums(tensors["q" if dual else "k"], tensors["v"], dual, segments)
            tensors.update(hs=hs, **({} if ds is None else dict(ds=ds)))
        return self._select(SCAN, options, tensors, layout, [self.N * self.H, self.V],
                            [dict(BV=t.block_v, tiles=t)
                             for t in _tile_choices(tiles, int(self.V), self.options["BK"], self.options["USE_GK"])])

    def scan_segment_sums(self, x, v, dual: bool, segments: int):
        """gla_chunk_segsum: (hs, ds), the state each segment of a scan's walk leaves from a zero
        start (main output) and the decay across it (None without a gate)."""
        N, H, K = self.N, self.H, self.K
        o = self.options
        ds = self._segment_decays(segments)
        tensors = {n: t for n, t in dict(x=x, v=v, **self.gates, ds=ds, cu_seqlens=self.cu_seqlens).items()
                   if t is not None}
        tiles = self.cfg.segsum
        layout = _layout(self.device, torch.float32, (N, segments, H, K, self.V))
        hs = self._select(SEGSUM, segsum_options(o, dual=dual, segments=segments), tensors, layout,
                          [N * H, self.V], [dict(BV=tiles.block_v, tiles=tiles)])
        return hs, ds

    def _segment_decays(self, segments: int):
        """An empty ds, the decay across each segment (``segment_decays_shape``), or None."""
        shape = segment_decays_shape(self.options, self.N, segments, self.H, self.K)
        return None if shape is None else _empty(shape, torch.float32, self.device)

    def local(self, q, k, *, transpose: bool):
        """gla_chunk_local: (qs, ks, A, dl), the chunk-local terms (see the template); dl is None
        without a gate."""
        B, T, H, K, block_t = self.B, self.T, self.H, self.K, self.cfg.block_t
        # packed sequences: one program per (state slot, head), dl per slot
        NT, sizes = (_cdiv(T, block_t), [T, B * H]) if self.cu_seqlens is None else (self.slots(), [self.slots(), H])
        terms = local_terms(self.options, B, T, H, K, NT, block_t)
        qs, ks, dl = (None if terms[n] is None else _empty(*terms[n], self.device) for n in ("qs", "ks", "dl"))
        tensors = {n: t for n, t in dict(q=q, k=k, **self.gates, qs=qs, ks=ks, dl=dl, cu_seqlens=self.cu_seqlens).items()
                   if t is not None}
        A = self._select(LOCAL, local_options(self.options, transpose, self.cfg.local_tile.num_warps), tensors,
                         _layout(self.device, terms["A"][1], terms["A"][0]), sizes,
                         [dict(tiles=self.cfg.local_tile)])
        return qs, ks, A, dl

    def carry(self, layout, *, write_out: bool, dual: bool, store_states: bool, segments: int = 1,
              terms: bool = False, sums=None, **tensors):
        """gla_chunk_carry on gla_chunk_local's terms, or with ``terms`` on q, k and the gate
        themselves (TERMS): returns the main output; ``h`` and ``ht`` are written. With segments > 1,
        after the segments' sums (``segment_sums``, unless given as ``sums``). One tile (the eager
        default): its max-autotune space is not explored yet."""
        extra = dict(self.gates) if terms else {}
        tensors = {n: t for n, t in {**tensors, **extra, "cu_seqlens": self.cu_seqlens}.items() if t is not None}
        splits = 1
        if sums is None and segments > 1:
            y = tensors["k" if terms else "y"]
            splits = self.cfg.sum_splits
            sums = self.segment_sums(y, tensors["v"], tensors.get("dl"), dual, segments, terms, splits=splits)
        if sums is not None:
            hs, ds = sums
            tensors.update(hs=hs, **({} if ds is None else dict(ds=ds)))
        options = carry_options(self.options, write_out=write_out, dual=dual, store_states=store_states,
                                use_h0="h0" in tensors, store_ht="ht" in tensors, segments=segments, terms=terms,
                                splits=splits)
        tiles = self.cfg.carry
        return self._select(CARRY, options, tensors, layout, [self.N * self.H, self.V],
                            [dict(BV=tiles.block_v, tiles=tiles)])

    def segment_sums(self, y, v, dl, dual: bool, segments: int, terms: bool = False, every: bool = False,
                     splits: int = 1):
        """gla_chunk_carry's SEGMENT_SUMS mode: (hs, ds), the state each segment leaves from a zero
        start (main output) and the decay across it (None without a gate); the last segment's only
        with ``every`` (SUMS_ALL). With ``splits`` > 1 each segment's in that many pieces."""
        N, H = self.N, self.H  # the states' batch: the sequences, where packed
        ds = self._segment_decays(segments * splits)
        named = dict(k=y, v=v, **self.gates, ds=ds) if terms else dict(y=y, v=v, dl=dl, ds=ds)
        tensors = {n: t for n, t in dict(named, cu_seqlens=self.cu_seqlens).items() if t is not None}
        options = carry_options(self.options, dual=dual, segments=segments, segment_sums=True, terms=terms,
                                sums_all=every, splits=splits)
        tiles = self.cfg.carry
        layout = _layout(self.device, torch.float32, (N, segments * splits, H, self.K, self.V))
        hs = self._select(CARRY, options, tensors, layout, [N * H, self.V], [dict(BV=tiles.block_v, tiles=tiles)])
        return hs, ds

    def dqkg(self, layout, **tensors):
        """gla_chunk_bwd_dqkg: returns dq; ``dk`` and ``dg`` are written."""
        tensors = {n: t for n, t in {**tensors, **self.gates, "cu_seqlens": self.cu_seqlens}.items() if t is not None}
        block_k = dqkg_block_k(self.cfg, self.options)
        tiles = self.cfg.dqkg
        sizes = [self.K, self.T, self.B * self.H] if self.cu_seqlens is None else [self.K, self.slots(), self.H]
        return self._select(DQKG, dict(self.options), tensors, layout, sizes,
                            [dict(BK=block_k, BV=tiles.block_v, tiles=tiles)])

    def _select(self, template: TritonTemplate, options: dict, tensors: dict, layout, call_sizes, variants):
        names = _arg_names(template, {**options, **variants[0], "tiles": None}, tensors)
        nodes = [tensors[n] for n in names]
        written = [tensors[n] for n in names if n in _written(template, options)]
        choices: list[Any] = []
        for variant in variants:
            tiles = variant.pop("tiles")
            error = template.maybe_append_choice(
                choices, input_nodes=nodes, layout=layout, mutated_inputs=written or None, call_sizes=call_sizes,
                num_stages=tiles.num_stages, num_warps=tiles.num_warps, **{**options, **variant})
            if error is not None:
                raise error
        # a fused gate's input is not a log gate: random inputs are as good as any
        gate_index = names.index("g") if "g" in names and not self.fused_gate else None
        offsets_index = names.index("cu_seqlens") if "cu_seqlens" in names else None
        result = autotune_select_algorithm(template.name, choices, nodes, layout,
                                           input_gen_fns=_benchmark_inputs(gate_index, offsets_index, self.T))
        # torch 2.11 returns the node, 2.13+ a (node, choice) pair
        return result[0] if isinstance(result, tuple) else result


def _realized(call: GLACall) -> tuple[torch.dtype, GLACall]:
    """(q, k and v's promoted dtype, the call with q, k, v realized in it, a cast only where they
    differ, and its other tensors realized)."""
    dtype = torch.promote_types(torch.promote_types(call.q.get_dtype(), call.k.get_dtype()), call.v.get_dtype())
    q, k, v = (ir.ExternKernel.realize_input(x if x.get_dtype() == dtype else to_dtype(x, dtype))
               for x in (call.q, call.k, call.v))
    return dtype, call.replace(q=q, k=k, v=v, **{n: _realize(getattr(call, n)) for n in _OTHER_TENSORS})


def _realize(x):
    return None if x is None else ir.ExternKernel.realize_input(x)


_OTHER_TENSORS = ("g", "g_gamma", "initial_state", "gate_a", "gate_bias", "cu_seqlens")  # beside q, k, v


def _sum_groups(dx, group: int, dtype: torch.dtype):
    """Per-head fp32 gradients [B, T, H, K] of a q or k shared by groups of heads, summed over each
    group to [B, T, H / group, K] in dtype. The heads of a group are different programs of
    gla_chunk_bwd_dqkg, so their sum is a reduction across programs: an Inductor reduction here,
    not atomics in the kernel."""
    B, T, H, K = dx.get_size()
    split = lowerings[aten.view.default](dx, [B, T, H // group, group, K])
    return to_dtype(lowerings[aten.sum.dim_IntList](split, [3]), dtype)


# ----------------------------------------------------------------------------------------------
# the lowerings
# ----------------------------------------------------------------------------------------------


@register_lowering(gla.chunk_fwd.default, type_promotion_kind=None)
def chunk_fwd(*args, **kwargs):
    call = GLACall.from_op_args(args, kwargs)
    reason = _why_not(call)
    if reason is not None:
        return _fallback(gla.chunk_fwd.default, reason, *call.op_args(full=True))
    return _forward(call)


def _forward(call: GLACall, parts: Optional[list] = None):
    """chunk_fwd's templates; with ``parts`` (``chunk_sums``' outputs, ``kernels.parts``) the local
    schedule's second half on them."""
    dtype, call = _realized(call)
    q, k, v = call.q, call.k, call.v
    initial_state, output_final_state = call.initial_state, call.output_final_state
    plan = _Plan(call, dtype, parts=parts is not None)
    B, T, H, K, Vd = plan.B, plan.T, plan.H, plan.K, plan.V
    ht = _empty((plan.N, H, K, Vd) if output_final_state else (0,), torch.float32, plan.device)
    layout = _layout(plan.device, dtype, (B, T, H, Vd))
    if plan.cfg.local:
        qs, ks, A, dl, *sums = plan.local(q, k, transpose=False) if parts is None else _parts(call, parts)
        o = plan.carry(layout, write_out=True, dual=False, store_states=False, x=qs, A=A, y=ks, v=v, dl=dl,
                       h0=initial_state, ht=ht if output_final_state else None, segments=plan.cfg.segments,
                       sums=sums or None)
    elif plan.cfg.terms:
        o = plan.carry(layout, write_out=True, dual=False, store_states=False, q=q, k=k, v=v, h0=initial_state,
                       ht=ht if output_final_state else None, segments=plan.cfg.segments, terms=True)
    else:
        o = plan.scan(layout, plan.cfg.scan, write_out=True, dual=False, store_states=False, q=q, k=k, v=v,
                      h0=initial_state, ht=ht if output_final_state else None, segments=plan.cfg.scan_segments)
    return o, ht


@register_lowering(gla.chunk_bwd.default, type_promotion_kind=None)
def chunk_bwd(*args, **kwargs):
    named = dict(zip(CHUNK_BWD_ARGS, args), **kwargs)
    call = GLACall.from_op_args(args, kwargs, names=CHUNK_BWD_ARGS)
    reason = _why_not(call)
    if reason is not None:
        return _fallback(gla.chunk_bwd.default, reason, *call.bwd_op_args(named["do"], named.get("dht")))
    return _backward(call, named["do"], named.get("dht"))


def _backward(call: GLACall, do, dht, parts: Optional[list] = None):
    """chunk_bwd's templates; with ``parts`` (``chunk_sums``' outputs for do, ``kernels.parts``) the
    local schedule's second half on them."""
    # gradients keep their inputs' dtypes (the kernels convert on store)
    q_dtype, k_dtype, v_dtype = call.q.get_dtype(), call.k.get_dtype(), call.v.get_dtype()
    dtype, call = _realized(call)
    q, k, v = call.q, call.k, call.v
    g, g_gamma, initial_state, gate = call.g, call.g_gamma, call.initial_state, call.gate
    do, dht = _realize(do), _realize(dht)
    plan = _Plan(call, dtype, parts=parts is not None)
    cfg, device = plan.cfg, plan.device
    B, T, H, K, Vd = plan.B, plan.T, plan.H, plan.K, plan.V

    states = _layout(device, cfg.states_dtype, plan.states_size())
    dh = _empty(plan.states_size(), cfg.states_dtype, device)
    dh0 = (_empty(initial_state.get_size(), initial_state.get_dtype(), device) if initial_state is not None
           else _empty((0,), q_dtype, device))
    dv_layout = _layout(device, v_dtype, (B, T, H, Vd))
    # h: the state entering every chunk; then the dual scan of dS = dL/dS: dv (main output), dh (dS
    # leaving every chunk), dh0
    if cfg.local:
        qs, ks, At, dl, *sums = plan.local(q, k, transpose=True) if parts is None else _parts(call, parts)
        h = plan.carry(states, write_out=False, dual=False, store_states=True, y=ks, v=v, dl=dl, h0=initial_state,
                       segments=cfg.segments)
        dv = plan.carry(dv_layout, write_out=True, dual=True, store_states=True, x=ks, A=At, y=qs, v=do, dl=dl,
                        h0=dht, h=dh, ht=dh0 if initial_state is not None else None, segments=cfg.segments,
                        sums=sums or None)
    else:
        P = cfg.bwd_scan_segments
        h = plan.scan(states, cfg.states, write_out=False, dual=False, store_states=True, k=k, v=v, h0=initial_state,
                      segments=P)
        dv = plan.scan(dv_layout, cfg.dual, write_out=True, dual=True, store_states=True, q=q, k=k, v=do, h0=dht,
                       h=dh, ht=dh0 if initial_state is not None else None, segments=P)
    # dq (main output), dk, dg; a constant gate's per-step gradients are summed over batch and time.
    # q and k shared by groups of heads: dq and dk per head of v in fp32, summed over the groups below
    group = plan.group
    dk = _empty((B, T, H, K), k_dtype if group == 1 else torch.float32, device)
    if g is not None:
        # a fused gate's dg is x's gradient (gate.input_grad) or the log gate's, fp32 (the op's
        # autograd goes on to x)
        dg = _empty(g.get_size(), torch.float32 if gate.name and not gate.input_grad else g.get_dtype(), device)
    elif g_gamma is not None:
        dg = _empty((B, T, H), torch.float32, device)
    else:
        dg = None
    dq = plan.dqkg(_layout(device, q_dtype if group == 1 else torch.float32, (B, T, H, K)), q=q, k=k, v=v, do=do,
                   h=h, dh=dh, dk=dk, dg=dg)
    if group > 1:
        dq, dk = _sum_groups(dq, group, q_dtype), _sum_groups(dk, group, k_dtype)
    if g_gamma is not None:
        dg_gamma = to_dtype(lowerings[aten.sum.dim_IntList](dg, [0, 1]), g_gamma.get_dtype())
        dg = _empty((0,), q_dtype, device)
    else:
        dg_gamma = _empty((0,), q_dtype, device)
    if dg is None:
        dg = _empty((0,), q_dtype, device)
    return dq, dk, dv, dg, dg_gamma, dh0


@register_lowering(gla.chunk_final_state.default, type_promotion_kind=None)
def chunk_final_state(*args, **kwargs):
    """The states-only pass as gla_chunk_segsum (its own tiles, ``kernels.final_state.tiles``) and the
    fold of its segments as Inductor pointwise code: context parallelism's compiled step then calls
    no eager op (an extern call cost about as much host time as the kernel's GPU time there)."""
    named = dict(zip(FINAL_STATE_ARGS, args), **kwargs)
    call = final_state_call(named)
    reason = _why_not(call)
    if reason is not None:
        return _fallback(gla.chunk_final_state.default, reason, *args, **kwargs)
    dtype, call = _realized(call)
    q, k, v = call.q, call.k, call.v
    do = _realize(named.get("do"))
    dual = do is not None
    plan = _Plan(call, dtype)
    x, w = (q, do) if dual else (k, v)
    vector = call.gate_kind == "vector"
    hint = V.graph.sizevars.optimization_hint
    plan.cfg, P = final_state_kernels.launch_plan(plan.cfg, hint(plan.N), hint(plan.T), hint(plan.H), int(plan.K),
                                                  int(plan.V), dtype, w.get_dtype(),
                                                  call.g.get_dtype() if vector else None, plan.device)
    hs, ds = plan.scan_segment_sums(x, w, dual, P)
    return _fold(hs, ds, P, vector, plan.device)


@register_lowering(gla.chunk_sums.default, type_promotion_kind=None)
def chunk_sums(*args, **kwargs):
    """The first half of a forward (with do, a backward) cut around an exchange of states
    (``kernels.parts``): gla_chunk_local and the dual or forward walk's sums of every segment, folded
    as Inductor pointwise code; the parts go to the second half's lowering."""
    named = dict(zip(FINAL_STATE_ARGS, args), **kwargs)
    call = final_state_call(named)
    reason = _why_not(call)
    if reason is not None:
        return _fallback(gla.chunk_sums.default, reason, *args, **kwargs)
    dtype, call = _realized(call)
    q, k, v = call.q, call.k, call.v
    do = _realize(named.get("do"))
    dual = do is not None
    plan = _Plan(call, dtype, parts=True)
    P = plan.cfg.segments
    qs, ks, A, dl = plan.local(q, k, transpose=dual)
    hs, ds = plan.segment_sums(qs if dual else ks, do if dual else v, dl, dual, P, every=True)
    S, D = _fold(hs, ds, P, call.gate_kind == "vector", plan.device)
    empty = _empty((0,), torch.float32, plan.device)
    return (S, D, qs, ks, A, empty if dl is None else dl, hs, empty if ds is None else ds)


@register_lowering(gla.chunk_fwd_from_parts.default, type_promotion_kind=None)
def chunk_fwd_from_parts(parts, *args, **kwargs):
    call = GLACall.from_op_args(args, kwargs)
    reason = _why_not(call)
    if reason is not None:
        return _fallback(gla.chunk_fwd_from_parts.default, reason, parts, *args, **kwargs)
    return _forward(call, parts)


@register_lowering(gla.chunk_bwd_from_parts.default, type_promotion_kind=None)
def chunk_bwd_from_parts(parts, *args, **kwargs):
    named = dict(zip(CHUNK_BWD_ARGS, args), **kwargs)
    call = GLACall.from_op_args(args, kwargs, names=CHUNK_BWD_ARGS)
    reason = _why_not(call)
    if reason is not None:
        return _fallback(gla.chunk_bwd_from_parts.default, reason, parts, *args, **kwargs)
    return _backward(call, named["do"], named.get("dht"), parts)


def _parts(call: GLACall, parts: list) -> tuple:
    """(qs, ks, A, dl, hs, ds) of ``chunk_sums``' parts (``ops.parts.PARTS``), realized; dl and ds
    None without a gate."""
    named = {n: _realize(x) for n, x in zip(PARTS, parts)}
    if call.gate_kind == "none":
        named.update(dl=None, ds=None)
    return tuple(named[n] for n in PARTS)


def _fold(hs, ds, P: int, vector: bool, device):
    """(state, decay) after the P segments in order, S <- a_p * S + hs_p from zero and the product of
    the a_p (``impl.final_state.fold``), unrolled over the P (at most 16) segments: one pointwise
    kernel over [N, H, K, V]."""
    def segment(x, p):
        return lowerings[aten.select.int](x, 1, p)

    def rows(a):  # [N, H, K] per key, [N, H] per head -> broadcast over [N, H, K, V]
        a = lowerings[aten.unsqueeze.default](a, -1)
        return a if vector else lowerings[aten.unsqueeze.default](a, -1)

    state = segment(hs, 0)
    if ds is None:
        for p in range(1, P):
            state = lowerings[aten.add.Tensor](state, segment(hs, p))
        return state, _empty((0,), torch.float32, device)
    decay = segment(ds, 0)
    for p in range(1, P):
        a = segment(ds, p)
        state = lowerings[aten.add.Tensor](lowerings[aten.mul.Tensor](rows(a), state), segment(hs, p))
        decay = lowerings[aten.mul.Tensor](decay, a)
    return state, decay
