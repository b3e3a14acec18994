"""Host launchers of the chunked GLA Triton kernels (forward and backward, every gate kind).

Kernels (sources in ``templates/``, rendered by ``standalone.py``; the design and the byte
and FLOP counts are in ``templates/README.md``). The schedules (``ChunkConfig``):

  fused (vector gates below K = 64; the backward of scalar, constant and no gates up to K = 128)
    forward   1 launch  gla_chunk_scan: o and the final state. One program per (V tile, batch*head)
                        walks the chunks with its state in registers; nothing per chunk goes to HBM.
    backward  3 launches gla_chunk_scan (states): h, the state entering every chunk;
                        gla_chunk_scan (dual): the reverse scan of dS = dL/dS, writing dv, dh (dS
                        leaving every chunk) and dh0;
                        gla_chunk_bwd_dqkg: dq, dk, dg, chunk-parallel from h and dh.
  split: the scans only materialize states, and gla_chunk_output computes o (dv) chunk-parallel:
    forward   2 launches (states scan, output); backward 4 (states, dual states, dual output, dqkg).
    More HBM traffic, but the per-chunk work no longer sits on the scans' sequential path.
  local (``ChunkConfig.local``, the default for vector gates from K = 64 and for other gates at
    K = 256, ``local_schedule``): gla_chunk_local computes
    every chunk's state-independent terms in parallel (decayed q and k, scores, chunk decay), and
    gla_chunk_carry scans them with three dots per chunk:
    forward   2 launches (local, carry); backward 4 (local with the scores' transpose, states carry,
              dual carry, dqkg). A long sequence with few heads cuts each carry's walk into
              segments walked in parallel (``carry_segments``), one more launch per carry.
  terms (``ChunkConfig.terms``, the default forward of scalar, constant and no gates up to K = 128):
    forward   1 launch  gla_chunk_carry computing its chunk terms from q, k and the gate (TERMS),
                        in segments (``segments``) 2; the backward is the fused one.

  segments (``ChunkConfig.scan_segments``, forward; ``bwd_scan_segments``, the backward's two
    scans; ``configs.scan_segments`` picks them for scalar, constant and no gates where the
    programs leave SMs idle): a gla_chunk_scan walk of the fused or split schedule is cut into P
    segments walked in parallel, after a gla_chunk_segsum launch that writes each segment's state
    from a zero start and its decay; each segment's program folds the ones before it into its start
    state. One more launch and one more read of k and v (q and do in the dual) per scan, for P times
    the programs, each walking NT / P chunks.

The backward's two walks (states and dual) read the same inputs and write different buffers: where
``configs.overlap_walks`` says it pays (``ChunkConfig.overlap_walks``), the states walk goes to a
second stream and overlaps the dual one, so that a walk that leaves SMs idle (few heads, a long
packed sequence among short ones) does not leave them idle for two walks in a row. Compiled graphs
run the same kernels one after the other: Inductor launches on one stream.

Packed sequences (``call.cu_seqlens``) run the fused or the local schedule (the split one is
dropped: its output kernel indexes fixed-length chunks). The scans and carries take one program
per (V tile, sequence * head), each walking its own sequence's chunks from offsets read on the
device (in segments too: each sequence's walk is cut into its own P segments, or, where the host
already read the offsets to check them and the longest sequence would outlast an even spread of
the pack's walks, the carries cut each sequence as its length asks: ``configs.packed_cuts``);
gla_chunk_local and gla_chunk_bwd_dqkg run over state slots (``varlen_state_slots``), each program
finding its sequence in the offsets, and the per-chunk terms (dl, h, dh) live at the slots. The
kernels never read the offsets on the host, so a packed call can be captured in a CUDA graph.

``forward(call)`` / ``backward(call, do, dht)`` follow the contract of the ``gla_inductor::chunk_fwd``
/ ``chunk_bwd`` custom ops for a ``GLACall``; the local schedule's may go on from its first half
computed already (``LocalParts``, ``kernels.parts``). They run on CUDA tensors, and on CPU tensors
under ``TRITON_INTERPRET=1``; ``configs.unsupported_reason`` says where they do not apply.
"""

import contextlib
import dataclasses
import functools
import math
from typing import Optional

import torch
from torch import Tensor

from ..contract import GLACall, packed_longest, sum_groups
from ..impl import prefix_states
from . import configs
from .configs import (ChunkConfig, TileConfig, carry_options, dqkg_block_k,
                      faulting_tile, interpreting, kernel_options, local_options, local_terms, scan_options,
                      segment_decays_shape, segsum_options, unsupported_reason)
from .standalone import OUT, needs_int64, render

__all__ = ["LocalParts", "backward", "chunk_grid", "forward", "forward_with_prefix_states", "scan_grid",
           "unsupported_reason", "varlen_state_slots"]


def scan_grid(B: int, H: int, V: int, block_v: int, segments: int = 1) -> tuple[int, int, int]:
    """(cdiv(V, BV), B * H, segments) for gla_chunk_scan and gla_chunk_carry.

    One program per value tile of one (batch, head). It walks all NT chunks in order and carries its
    [K, BV] slice of the state in registers, so chunks never exchange states through HBM. The
    sequence is not split: parallelism is B * H * cdiv(V, BV) programs, each doing NT dependent
    steps; narrower value tiles buy parallelism when B * H is small, at the price of recomputing
    the [BT, BT] intra-chunk scores once per tile. gla_chunk_carry may also cut the walk into
    segments (``carry_segments``).
    """
    return (math.ceil(V / block_v), B * H, segments)


def chunk_grid(B: int, T: int, H: int, block_t: int, n_tiles: int) -> tuple[int, int, int]:
    """(n_tiles, NT, B * H) for the chunk-parallel kernels gla_chunk_output (n_tiles = cdiv(V, BV))
    and gla_chunk_bwd_dqkg (cdiv(K, BK)).

    Once a scan has written the per-chunk states, chunks are independent: every (tile, chunk,
    batch*head) is its own program, B * H * NT * n_tiles in all.
    """
    return (n_tiles, math.ceil(T / block_t), B * H)


def varlen_state_slots(T: int, N: int, block_t: int) -> int:
    """The per-chunk state slots of a packed call of N sequences, T steps in all: T // BT + N.

    Sequence n (steps bos_n to eos_n - 1) keeps its NT_n = cdiv(eos_n - bos_n, BT) chunks' states
    at slots bos_n // BT + n onwards (gla_chunk_scan's c0), which never overlap the next
    sequence's: bos_n // BT + NT_n <= eos_n // BT + 1, since NT_n <= (eos_n - bos_n) // BT + 1; and
    the last slot used is below T // BT + N. So the kernels place every chunk from the offsets
    alone, and the buffers are sized from the shapes (for CUDA graphs and compiled graphs); a slot
    may hold no chunk (gla_chunk_bwd_dqkg's program for it exits).
    """
    return T // block_t + N


# ----------------------------------------------------------------------------------------------
# launching
# ----------------------------------------------------------------------------------------------


def _launch(template: str, options: dict, tensors: dict[str, Optional[Tensor]], out: Tensor, grid,
            tiles: TileConfig) -> None:
    present = {n: t for n, t in tensors.items() if t is not None}
    ndims = {n: t.dim() for n, t in present.items()}
    ndims[OUT] = out.dim()
    int64_index = any(needs_int64(t) for t in (*present.values(), out))
    kernel = render((template, "gla_common"), template, options, ndims, int64_index)
    kernel(grid, present, out, num_warps=tiles.num_warps, num_stages=tiles.num_stages)


class _Launcher:
    """Options shared by one forward or backward call, and its launches."""

    def __init__(self, cfg: ChunkConfig, call: GLACall):
        self.cfg = cfg
        self.device = call.q.device
        self.B, self.T, _, self.K = call.q.shape
        self.H, self.V = call.v.shape[2], call.v.shape[-1]  # q and k may have fewer heads (group_size)
        # every kernel that reads g also reads the fused gate's parameters (None unless "softplus")
        self.gates = dict(g=call.g, g_gamma=call.g_gamma, gate_a=call.gate_a, gate_bias=call.gate_bias)
        self.options = kernel_options(cfg, call.q.dtype, self.K, call.gate_kind, call.scale, call.reverse,
                                      interpreting(), call.gate, call.group_size, call.varlen)
        # packed sequences: the scans run one program per sequence (N of them) and read the offsets
        self.N = call.num_sequences
        self.cu_seqlens = None if not call.varlen else call.cu_seqlens.to(self.device, non_blocking=True)

    def states(self) -> Tensor:
        """An uninitialized [B, NT, H, K, V] per-chunk state buffer; [1, T // BT + N, H, K, V] for
        packed sequences (``varlen_state_slots``)."""
        NT = math.ceil(self.T / self.cfg.block_t)
        if self.cu_seqlens is not None:
            NT = varlen_state_slots(self.T, self.N, self.cfg.block_t)
        return torch.empty(self.B, NT, self.H, self.K, self.V, dtype=self.cfg.states_dtype, device=self.device)

    def scan(self, out: Tensor, *, write_out: bool, dual: bool, store_states: bool, q=None, k=None, v=None,
             h0=None, h=None, ht=None, hp=None, prefix_interval: int = 0, segments: int = 1) -> None:
        """gla_chunk_scan (see the template); with segments > 1, first the segments' sums
        (``segment_sums``), then the walk, both in parallel over the segments."""
        tiles = self.cfg.states if not write_out else self.cfg.dual if dual else self.cfg.scan
        if self.device.type == "cuda" and faulting_tile(self.options["BK"], tiles, self.options["USE_GK"]):
            raise ValueError(f"gla_inductor: {tiles} for a vector gate with K = {self.K} is known to fault on the "
                             "GPU (triton 3.6); use at least 8 warps")
        store_ht = ht is not None and ht.numel() > 0
        options = dict(scan_options(self.options, write_out=write_out, dual=dual, store_states=store_states,
                                    use_h0=h0 is not None, store_ht=store_ht), BV=tiles.block_v)
        if hp is not None:
            options["PREFIX_STATES"] = prefix_interval
        hs = ds = None
        if segments > 1:
            options["SEGMENTS"] = segments
            hs, ds = self.scan_segment_sums(q if dual else k, v, dual, segments)
        tensors = dict(q=q, k=k, v=v, **self.gates, h0=h0, h=h, ht=ht if store_ht else None, hp=hp,
                       cu_seqlens=self.cu_seqlens, hs=hs, ds=ds)
        grid = scan_grid(self.N, self.H, self.V, tiles.block_v, segments)
        _launch("gla_chunk_scan", options, tensors, out, grid, tiles)

    def scan_segment_sums(self, x: Tensor, v: Tensor, dual: bool, segments: int) -> tuple[Tensor, Optional[Tensor]]:
        """gla_chunk_segsum: (hs [N, P, H, K, V], ds [N, P, H(, K)] or None without a gate), the state
        each of the P segments of a scan's walk leaves from a zero start and the decay across it."""
        tiles = self.cfg.segsum
        hs = torch.empty(self.N, segments, self.H, self.K, self.V, dtype=torch.float32, device=self.device)
        ds = self._segment_decays(segments)
        options = dict(segsum_options(self.options, dual=dual, segments=segments), BV=tiles.block_v)
        tensors = dict(x=x, v=v, **self.gates, ds=ds, cu_seqlens=self.cu_seqlens)
        grid = scan_grid(self.N, self.H, self.V, tiles.block_v, segments)
        _launch("gla_chunk_segsum", options, tensors, hs, grid, tiles)
        return hs, ds

    def _segment_decays(self, segments: int) -> Optional[Tensor]:
        """An uninitialized ds, the decay across each segment (``segment_decays_shape``), or None."""
        shape = segment_decays_shape(self.options, self.N, segments, self.H, self.K)
        return None if shape is None else torch.empty(shape, dtype=torch.float32, device=self.device)

    def local(self, q: Tensor, k: Tensor, *, transpose: bool) -> tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
        """gla_chunk_local: (qs, ks, A, dl), see the template. Packed sequences: one program per
        (state slot, head), dl per slot."""
        NT = math.ceil(self.T / self.cfg.block_t)
        grid = (NT, self.B * self.H)
        if self.cu_seqlens is not None:
            NT = varlen_state_slots(self.T, self.N, self.cfg.block_t)
            grid = (NT, self.H)
        terms = local_terms(self.options, self.B, self.T, self.H, self.K, NT, self.cfg.block_t)
        qs, ks, A, dl = (None if terms[n] is None else torch.empty(terms[n][0], dtype=terms[n][1], device=self.device)
                         for n in ("qs", "ks", "A", "dl"))
        options = local_options(self.options, transpose, self.cfg.local_tile.num_warps)
        tensors = dict(q=q, k=k, **self.gates, qs=qs, ks=ks, dl=dl, cu_seqlens=self.cu_seqlens)
        _launch("gla_chunk_local", options, tensors, A, grid, self.cfg.local_tile)
        return qs, ks, A, dl

    def carry(self, out: Tensor, *, write_out: bool, dual: bool, store_states: bool, y: Tensor, v: Tensor,
              dl: Optional[Tensor], x=None, A=None, h0=None, h=None, ht=None, segments: int = 1,
              terms: bool = False, sums: Optional[tuple[Tensor, Optional[Tensor]]] = None) -> None:
        """gla_chunk_carry (see the template), on gla_chunk_local's terms, or with ``terms`` on q (x)
        and k (y) and the gate themselves (TERMS: scalar, constant and no gates); with segments > 1,
        first the segments' sums (``segment_sums``, unless given as ``sums``), then the walk, both
        in parallel over the segments."""
        tiles = self.cfg.carry
        store_ht = ht is not None and ht.numel() > 0
        splits = 1
        if sums is None and segments > 1:
            splits = self.cfg.sum_splits
            sums = self.segment_sums(y, v, dl, dual, segments, terms, splits=splits)
        hs, ds = sums or (None, None)
        options = dict(carry_options(self.options, write_out=write_out, dual=dual, store_states=store_states,
                                     use_h0=h0 is not None, store_ht=store_ht, segments=segments, terms=terms,
                                     splits=splits), BV=tiles.block_v)
        tensors = dict(x=x, A=A, y=y, v=v, dl=dl) if not terms else dict(q=x, k=y, v=v, **self.gates)
        tensors.update(h0=h0, hs=hs, ds=ds, h=h, ht=ht if store_ht else None, cu_seqlens=self.cu_seqlens)
        grid = scan_grid(self.N, self.H, self.V, tiles.block_v, segments)
        _launch("gla_chunk_carry", options, tensors, out, grid, tiles)

    def segment_sums(self, y: Tensor, v: Tensor, dl: Optional[Tensor], dual: bool, segments: int,
                     terms: bool = False, every: bool = False, splits: int = 1) -> tuple[Tensor, Optional[Tensor]]:
        """gla_chunk_carry's SEGMENT_SUMS mode: (hs [B, P, H, K, V], ds [B, P, H(, K)] or None), the
        state each of the P segments leaves from a zero start and the decay across it; the last
        segment's only with ``every`` (SUMS_ALL), which the walk never reads. With ``splits`` > 1
        each segment's in that many pieces (P * splits of them), which the walk folds."""
        tiles = self.cfg.carry
        pieces = segments * splits
        hs = torch.empty(self.N, pieces, self.H, self.K, self.V, dtype=torch.float32, device=self.device)
        ds = self._segment_decays(pieces)
        tensors = dict(k=y, v=v, **self.gates, ds=ds) if terms else dict(y=y, v=v, dl=dl, ds=ds)
        options = dict(carry_options(self.options, dual=dual, segments=segments, segment_sums=True, terms=terms,
                                     sums_all=every, splits=splits), BV=tiles.block_v)
        # no program for the last segment's pieces, which only SUMS_ALL stores
        grid = scan_grid(self.N, self.H, self.V, tiles.block_v, pieces if every else pieces - splits)
        _launch("gla_chunk_carry", options, dict(tensors, cu_seqlens=self.cu_seqlens), hs, grid, tiles)
        return hs, ds

    def output(self, out: Tensor, *, dual: bool, q: Tensor, k: Tensor, v: Tensor, h: Tensor) -> None:
        tiles = self.cfg.output
        options = dict(self.options, BV=tiles.block_v, DUAL=dual)
        grid = chunk_grid(self.B, self.T, self.H, self.cfg.block_t, math.ceil(self.V / tiles.block_v))
        _launch("gla_chunk_output", options, dict(q=q, k=k, v=v, **self.gates, h=h), out, grid, tiles)

    def dqkg(self, dq: Tensor, *, q, k, v, do, h, dh, dk, dg) -> None:
        tiles = self.cfg.dqkg
        block_k = dqkg_block_k(self.cfg, self.options)
        options = dict(self.options, BK=block_k, BV=tiles.block_v)
        grid = chunk_grid(self.B, self.T, self.H, self.cfg.block_t, math.ceil(self.K / block_k))
        tensors = dict(q=q, k=k, v=v, **self.gates, do=do, h=h, dh=dh, dk=dk, dg=dg)
        if self.cu_seqlens is not None:
            # (slots, K tiles, H): see the template
            grid = (h.shape[1], grid[0], self.H)
            tensors.update(cu_seqlens=self.cu_seqlens)
        _launch("gla_chunk_bwd_dqkg", options, tensors, dq, grid, tiles)


@contextlib.contextmanager
def _overlapped(device: torch.device, overlap: bool):
    """Launches in the block run after everything launched before it, and everything launched after
    it waits for them; with ``overlap``, those under the context it yields (``with aside():``) go
    to a second stream and overlap the block's others (``configs.overlap_walks`` says where that
    pays). CUDA graphs capture the fork and the join. Elsewhere (CPU, the interpreter) one stream."""
    if not overlap or device.type != "cuda":
        yield contextlib.nullcontext
        return
    main = torch.cuda.current_stream(device)
    side = _side_stream(device.index if device.index is not None else torch.cuda.current_device())
    side.wait_stream(main)
    try:
        yield lambda: torch.cuda.stream(side)
    finally:
        main.wait_stream(side)


@functools.lru_cache(maxsize=None)
def _side_stream(index: int) -> "torch.cuda.Stream":
    return torch.cuda.Stream(device=index)


def _head_grad(x: Tensor, v: Tensor) -> Tensor:
    """The buffer gla_chunk_bwd_dqkg writes the gradient of q or k into: like x, or, for a q or k shared
    by groups of heads, one fp32 gradient per head of v, which ``sum_groups`` then reduces. The heads
    of a group run in different programs: summing in the kernel would need atomics (nondeterministic,
    and rounding every partial sum to a 16-bit dtype)."""
    if x.shape[2] == v.shape[2]:
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return torch.empty(*x.shape[:2], v.shape[2], x.shape[3], dtype=torch.float32, device=x.device)


def _prepare(call: GLACall, config: Optional[ChunkConfig]) -> tuple[GLACall, ChunkConfig]:
    """The call with q, k, v in their promoted dtype (copies only when they differ), and the config
    (no split schedule for packed sequences)."""
    dtype = call.output_dtype
    call = call.replace(q=call.q.to(dtype), k=call.k.to(dtype), v=call.v.to(dtype))
    _, T, _, K = call.q.shape
    H, V = call.v.shape[2], call.v.shape[-1]
    # looked up on the module: tools and tests patch it there
    longest = packed_longest(call.cu_seqlens, T) if call.varlen else 0
    cfg = config or configs.default_config(call.num_sequences, T, H, K, V, dtype, call.gate_kind == "vector",
                                           call.q.device, call.varlen, longest)
    if call.varlen:  # the split schedule's output kernel indexes fixed-length chunks
        cfg = dataclasses.replace(cfg, split=False)
    return call, cfg


@dataclasses.dataclass(frozen=True)
class LocalParts:
    """What the local schedule computes of a forward (or backward) before its walk needs the state
    it starts from: gla_chunk_local's terms (qs, ks, A, the scores' transpose for the backward, and
    dl, None without a gate) and the sums of every segment of the walk on them (the forward's carry,
    or the backward's dual carry): hs, and ds, None without a gate (``_Launcher.segment_sums``)."""

    qs: Tensor
    ks: Tensor
    A: Tensor
    dl: Optional[Tensor]
    hs: Tensor
    ds: Optional[Tensor]

    @property
    def terms(self) -> tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
        return self.qs, self.ks, self.A, self.dl


def forward(call: GLACall, config: Optional[ChunkConfig] = None, parts: Optional[LocalParts] = None
            ) -> tuple[Tensor, Tensor]:
    """(o [B, T, H, V] in the promoted input dtype, final state fp32 [B, H, K, V] or an empty [0]).

    With a fused gate (``call.gate``), g is that function's input. ``parts``: the local schedule's
    terms and segment sums computed already (``kernels.parts``), under ``config``."""
    call, cfg = _prepare(call, config)
    assert parts is None or cfg.local and cfg.segments > 1
    q, k, v, initial_state = call.q, call.k, call.v, call.initial_state
    B, T, _, K = q.shape
    H, V = v.shape[2], v.shape[-1]
    o = q.new_empty(B, T, H, V)
    ht = q.new_empty((call.num_sequences, H, K, V) if call.output_final_state else (0,), dtype=torch.float32)
    if T == 0:
        if call.output_final_state:
            ht.copy_(initial_state if initial_state is not None else torch.zeros_like(ht))
        return o, ht
    run = _Launcher(cfg, call)
    if cfg.local:
        qs, ks, A, dl = run.local(q, k, transpose=False) if parts is None else parts.terms
        run.carry(o, write_out=True, dual=False, store_states=False, x=qs, A=A, y=ks, v=v, dl=dl, h0=initial_state,
                  ht=ht, segments=cfg.segments, sums=None if parts is None else (parts.hs, parts.ds))
    elif cfg.split:
        h = run.states()
        run.scan(h, write_out=False, dual=False, store_states=True, k=k, v=v, h0=initial_state, ht=ht,
                 segments=cfg.scan_segments)
        run.output(o, dual=False, q=q, k=k, v=v, h=h)
    elif cfg.terms:
        run.carry(o, write_out=True, dual=False, store_states=False, x=q, y=k, v=v, dl=None, h0=initial_state, ht=ht,
                  segments=cfg.segments, terms=True)
    else:
        run.scan(o, write_out=True, dual=False, store_states=False, q=q, k=k, v=v, h0=initial_state, ht=ht,
                 segments=cfg.scan_segments)
    return o, ht


def forward_with_prefix_states(call: GLACall, interval: int, config: Optional[ChunkConfig] = None
                               ) -> tuple[Tensor, Tensor, Tensor]:
    """(o, final state [N, H, K, V], prefix states [B, slots, H, K, V] fp32): the forward, also
    storing every ``interval`` steps (a power of two, at least 16) the state after the steps so far,
    for prefix caching (``impl.prefix_states`` and gla_chunk_scan's PREFIX_STATES say where). Fused
    schedule, not reverse."""
    call, cfg = _prepare(call, config)
    cfg = dataclasses.replace(cfg, local=False, split=False, terms=False, segments=1, scan_segments=1,
                              block_t=min(cfg.block_t, interval))
    q, k, v = call.q, call.k, call.v
    B, T, _, K = q.shape
    H, V = v.shape[2], v.shape[-1]
    o = q.new_empty(B, T, H, V)
    ht = q.new_empty(call.num_sequences, H, K, V, dtype=torch.float32)
    hp = q.new_empty(*prefix_states.slots(call, interval), H, K, V, dtype=torch.float32)
    run = _Launcher(cfg, call)
    run.scan(o, write_out=True, dual=False, store_states=False, q=q, k=k, v=v, h0=call.initial_state, ht=ht, hp=hp,
             prefix_interval=interval)
    return o, ht, hp


def backward(call: GLACall, do: Tensor, dht: Optional[Tensor], config: Optional[ChunkConfig] = None,
             parts: Optional[LocalParts] = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dg, dg_gamma, dh0), each like its input; an empty [0] where the input is None.

    With a fused gate, dg is the gradient w.r.t. g itself where ``gate.input_grad``, else the fp32
    gradient w.r.t. the log gate (``gates.gate_grads`` goes on). ``parts``: the local schedule's
    terms (scores transposed) and the dual walk's segment sums computed already, under ``config``."""
    q, k, v, g, g_gamma, initial_state, gate = call.q, call.k, call.v, call.g, call.g_gamma, call.initial_state, \
        call.gate
    dq, dk = (_head_grad(x, v) for x in (q, k))
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    dg_dtype = None if g is None else torch.float32 if gate.name and not gate.input_grad else g.dtype
    dg = q.new_empty(0) if g is None else torch.empty(g.shape, dtype=dg_dtype, device=g.device)
    dh0 = q.new_empty(0) if initial_state is None else torch.empty(
        initial_state.shape, dtype=initial_state.dtype, device=initial_state.device)
    G = q.shape[2]
    q_dtype, k_dtype = q.dtype, k.dtype
    call, cfg = _prepare(call, config)
    assert parts is None or cfg.local and cfg.segments > 1
    q, k, v = call.q, call.k, call.v
    B, T, H = v.shape[:3]
    if T == 0:
        for x in (dq, dk, dv, dg):
            x.zero_()
        if initial_state is not None:
            dh0.copy_(dht if dht is not None else torch.zeros_like(dh0))
        dq, dk = sum_groups(dq, G, q_dtype), sum_groups(dk, G, k_dtype)
        return dq, dk, dv, dg, (q.new_empty(0) if g_gamma is None else torch.zeros_like(g_gamma)), dh0

    run = _Launcher(cfg, call)
    h = run.states()
    dh = run.states()
    if cfg.local:
        # chunk-local terms once; the dual scan takes x = ks, y = qs and the scores' transpose
        qs, ks, At, dl = run.local(q, k, transpose=True) if parts is None else parts.terms
        with _overlapped(run.device, cfg.overlap_walks) as aside:
            run.carry(dv, write_out=True, dual=True, store_states=True, x=ks, A=At, y=qs, v=do, dl=dl, h0=dht,
                      h=dh, ht=dh0, segments=cfg.segments, sums=None if parts is None else (parts.hs, parts.ds))
            with aside():
                run.carry(h, write_out=False, dual=False, store_states=True, y=ks, v=v, dl=dl, h0=initial_state,
                          segments=cfg.segments)
        del qs, ks, At
    elif cfg.split:
        P = cfg.bwd_scan_segments
        with _overlapped(run.device, cfg.overlap_walks) as aside:
            run.scan(dh, write_out=False, dual=True, store_states=True, q=q, v=do, h0=dht, ht=dh0, segments=P)
            with aside():
                run.scan(h, write_out=False, dual=False, store_states=True, k=k, v=v, h0=initial_state, segments=P)
        run.output(dv, dual=True, q=q, k=k, v=do, h=dh)
    else:
        P = cfg.bwd_scan_segments
        with _overlapped(run.device, cfg.overlap_walks) as aside:
            run.scan(dv, write_out=True, dual=True, store_states=True, q=q, k=k, v=do, h0=dht, h=dh, ht=dh0,
                     segments=P)
            with aside():
                run.scan(h, write_out=False, dual=False, store_states=True, k=k, v=v, h0=initial_state, segments=P)
    # constant gate: per-step gradients [B, T, H], summed over batch and time below
    dg_steps = None if g_gamma is None else q.new_empty(B, T, H, dtype=torch.float32)
    run.dqkg(dq, q=q, k=k, v=v, do=do, h=h, dh=dh, dk=dk, dg=dg if g_gamma is None else dg_steps)
    dg_gamma = q.new_empty(0) if g_gamma is None else dg_steps.sum((0, 1)).to(g_gamma.dtype)
    return sum_groups(dq, G, q_dtype), sum_groups(dk, G, k_dtype), dv, dg, dg_gamma, dh0
