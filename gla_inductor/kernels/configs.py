"""Tiles and options of the chunked GLA kernels, shared by the eager launchers (``kernels.chunk``)
and the Inductor lowerings, so that a compiled graph and an eager call run the same kernels with
the same configuration. The measurements behind each heuristic are in benchmarks/results/.
"""

import functools
import math
import os
import dataclasses
from dataclasses import dataclass
from importlib.util import find_spec
from typing import Optional

import torch

from ..contract import GLACall
from ..gates import GateFn

__all__ = [
    "ChunkConfig", "TRITON_INSTALLED", "TileConfig", "carry_options", "default_config", "dqkg_block_k",
    "faulting_tile", "kernel_options", "local_options", "local_terms", "scan_options", "scan_segments",
    "segment_decays_shape", "segsum_options", "unsupported_reason", "walk_segments",
]

MAX_K = 256  # the scans hold whole key rows ([BT, K] tiles and the [K, BV] state) on chip
MAX_V = 512
MAX_GRID_YZ = 65535  # CUDA limit of grid dimensions 1 and 2 (B * H, NT)
_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Looked up once: the support checks also run while Dynamo traces (context parallelism decides
# its passes there), which cannot trace importlib's lookup.
TRITON_INSTALLED = find_spec("triton") is not None



def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


# ----------------------------------------------------------------------------------------------
# configs
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TileConfig:
    """Tiles of one launch. block_k is used by gla_chunk_bwd_dqkg only (the others take all of K)."""

    block_v: int
    num_warps: int
    num_stages: int
    block_k: int = 0


@dataclass(frozen=True)
class ChunkConfig:
    """Everything the launchers choose; pass one to the launchers to override the defaults."""

    block_t: int
    scan: TileConfig  # gla_chunk_scan writing o (the fused forward)
    states: TileConfig  # gla_chunk_scan writing only states (h in the backward, the split schedule)
    dual: TileConfig  # gla_chunk_scan writing dv and dh (the fused backward)
    output: TileConfig  # gla_chunk_output (split schedule)
    dqkg: TileConfig  # gla_chunk_bwd_dqkg; block_k must cover K for scalar and constant gates
    states_dtype: torch.dtype  # the per-chunk states h and dh in HBM
    split: bool = False
    # the local schedule, forward and backward: gla_chunk_local (chunk-parallel: the gate, decayed q
    # and k, intra-chunk scores) then gla_chunk_carry (the scans, three dots per chunk); False: the
    # fused (or split) schedule of gla_chunk_scan
    local: bool = False
    # the forward of scalar, constant and no gates as one gla_chunk_carry that computes its chunk
    # terms itself (TERMS; its tile ``carry``, its segments ``segments``), instead of the fused scan;
    # the backward is unchanged
    terms: bool = False
    local_tile: TileConfig = TileConfig(block_v=0, num_warps=8, num_stages=2)
    carry: TileConfig = TileConfig(block_v=64, num_warps=4, num_stages=2)
    # segments of the carries' walks, each walked by its own programs (``carry_segments``); 1: one
    # walk over all chunks
    segments: int = 1
    # pieces of each carry segment's sums, each summed by its own program (more programs for the
    # sums' launch) and folded by the walk; 1: one per segment
    sum_splits: int = 1
    # packed sequences: the resident programs by which the carries count each sequence's segments
    # (at most ``segments``; gla_chunk_carry's SLOTS); 0: every sequence in ``segments``
    segment_slots: int = 0
    # segments of the fused (and split) schedules' gla_chunk_scan walks, each walked by its own
    # programs after a gla_chunk_segsum launch (``scan_segments``): the forward's scan, and the
    # backward's states and dual scans; 1: one walk over all chunks
    scan_segments: int = 1
    bwd_scan_segments: int = 1
    # gla_chunk_segsum's tile (its value tile is independent of the scan's: it writes whole states)
    segsum: TileConfig = TileConfig(block_v=64, num_warps=8, num_stages=2)
    # how fp32 operands multiply ("ieee", "tf32", "tf32x3"); None: "tf32x3" for fp32 inputs under
    # torch's "highest" matmul precision, else "tf32" (fp16 inputs use fp32 operands: fp16's range
    # cannot hold the kernels' gated factors, and TF32 keeps fp16's 10-bit mantissa). "tf32x3"
    # (three TF32 products of a split operand) stands for exact products: at Mamba2's scan shapes it
    # came within a few 1e-7 of "ieee"'s error against float64 in a tenth of its time (Triton's
    # "ieee" dots are FMA loops that spill; results/h100-2026-11-22-mixer-profile.txt)
    f32_precision: Optional[str] = None
    # the backward's two walks (states and dual) on two streams, overlapping (``overlap_walks``;
    # eager calls: compiled graphs launch their kernels on one stream)
    overlap_walks: bool = False


def forward_scan_tile(BK: int, BV: int, vector_gate: bool, fallback: TileConfig) -> TileConfig:
    """The forward scan's tile. Vector gates up to K = 128: wide value tiles (128) and 8 warps,
    fewer programs than SMs but each chunk's intra-chunk work done once per 128 values instead of
    64. Other gates up to K = 128: 4 warps and ``fallback``'s value tile, which narrows where tiles
    of 64 would leave SMs idle. Past K = 128 (where vector gates take the local schedule) the
    ``fallback``, whose stage count the others take too: there a fused scan with wide tiles asks
    for more shared memory than sm_90 has. Sweeps: results/archive/h100-2026-11-22-schedule.md,
    results/h100-2026-11-23-forward-tiles.md."""
    if vector_gate and BK <= 128:
        return TileConfig(block_v=min(BV, 128), num_warps=4 if BK <= 32 else 8, num_stages=fallback.num_stages)
    if BK <= 128:
        return TileConfig(block_v=fallback.block_v, num_warps=4, num_stages=fallback.num_stages)
    return fallback


def dqkg_tile(BK: int, BV: int, vector_gate: bool, warps: int, stages: int, sixteen_bit: bool) -> TileConfig:
    """gla_chunk_bwd_dqkg's tile. Vector gates from K = 128: key tiles of 32 with 4 warps (8 warps on
    [64, 64] tiles spill at 255 registers, one program per SM), and with 16-bit inputs past V = 128
    value tiles of 128 (fp32 operands would need twice the shared memory, so they keep 64). Scalar
    and constant gates take all of K: their dg sums over keys. Sweep: `python -m benchmarks tune
    dqkg`, results/h100-2026-11-22-k256-dqkg.md."""
    if not vector_gate:
        return TileConfig(block_v=min(BV, 64), num_warps=warps, num_stages=stages, block_k=BK)
    if BK >= 128:
        block_v = 128 if BV > 128 and sixteen_bit else min(BV, 64)
        return TileConfig(block_v=block_v, num_warps=4, num_stages=stages, block_k=32)
    return TileConfig(block_v=min(BV, 64), num_warps=warps, num_stages=stages, block_k=min(BK, 64))


def local_schedule(BK: int, vector_gate: bool) -> bool:
    """Whether the local schedule (gla_chunk_local, then gla_chunk_carry) beats the fused scan: for
    vector gates from K = 64 (from K = 128 at first, K = 64 too once the carries walked in
    segments), for the other gates at K = 256 only (at K = 128 the fused scan stayed ahead).
    Smaller keys keep the fused scan (not measured). Sweeps: results/archive/h100-2026-11-22-local.md,
    results/h100-2026-11-23-carry-t.md."""
    return BK >= 64 if vector_gate else BK > 128


def local_key_slice(BK: int) -> int:
    """Keys gla_chunk_local handles at once: whole keys up to K = 128 (slices there were slower);
    slices of 64 at K = 256, where whole-K [64, 256] tiles spill (sm_90, 8 warps) and the slices
    let the chunks be 64 steps long."""
    return BK if BK <= 128 else 64


def local_steep_slice(BKS: int) -> int:
    """Keys gla_chunk_local's exact pairwise path (steep chunks of vector gates) handles at once,
    reloading them from memory. The slice sets the registers of the whole kernel (sm_90, 8 warps,
    bf16, K = 128, triton 3.6: 255 per thread for slices of 128 keys, 125 for 8), and at 8 keys two
    programs share an SM, which made the forward and backward faster at every measured shape
    (results/h100-2026-11-23-segments.md). At K = 256 (slices of 64) the kernel keeps 172."""
    return min(BKS, 8)


def local_preload(BK: int, BKS: int) -> bool:
    """Whether gla_chunk_local loads a slice's q and k before its gate's sums (PRELOAD), so that the
    loads overlap the sums, or only on the common path after them, which keeps them out of the
    registers meanwhile. With one slice (K <= 128) the registers matter: 125 per thread without,
    162 with (sm_90, 8 warps, triton 3.6), one program per SM instead of two. With several, the
    kernel has more than 128 either way and the overlap wins (results/h100-2026-11-23-segments.md)."""
    return BKS < BK


def scan_options(options: dict, *, write_out: bool, dual: bool, store_states: bool, use_h0: bool,
                 store_ht: bool) -> dict:
    """gla_chunk_scan's mode options (see its template) on top of the shared ``options``."""
    return dict(options, WRITE_OUT=write_out, DUAL=dual, STORE_STATES=store_states, USE_H0=use_h0,
                STORE_HT=store_ht)


def segsum_options(options: dict, *, dual: bool, segments: int) -> dict:
    """gla_chunk_segsum's options: the shared ones, which scan it serves (DUAL), its segments."""
    return dict(options, DUAL=dual, SEGMENTS=segments)


def carry_options(options: dict, *, dual: bool, segments: int, segment_sums: bool = False, terms: bool = False,
                  sums_all: bool = False, splits: int = 1, **mode) -> dict:
    """gla_chunk_carry's options: the scan's modes (``mode``: write_out, store_states, use_h0,
    store_ht), its segments, SEGMENT_SUMS, which takes none of the modes (with SUMS_ALL, the last
    segment's sums too), and TERMS (the chunk terms computed from q, k and the gate)."""
    if segment_sums:
        mode = dict(write_out=False, store_states=False, use_h0=False, store_ht=False)
    options = dict(scan_options(options, dual=dual, **mode), SEGMENTS=segments, SEGMENT_SUMS=segment_sums,
                   TERMS=terms)
    if sums_all:  # only where asked: the other renders keep their sources (and compiled kernels)
        options["SUMS_ALL"] = True
    if splits > 1:
        options["SPLITS"] = splits
    return options


def segment_decays_shape(options: dict, N, segments: int, H, K) -> Optional[tuple]:
    """Shape of ds, the decay across each segment of a walk (gla_chunk_segsum, gla_chunk_carry's
    SEGMENT_SUMS): [N, P, H, K] for a vector gate, [N, P, H] for scalar and constant gates; None
    without a gate. Sizes may be symbolic (lowerings)."""
    if options["USE_GK"]:
        return (N, segments, H, K)
    if options["USE_G"] or options["USE_G_GAMMA"]:
        return (N, segments, H)
    return None


def local_options(options: dict, transpose: bool, warps: int) -> dict:
    """gla_chunk_local's options: the shared ones, the scores' orientation, its key slices, the
    order of its rows for a program of ``warps`` warps."""
    BKS = local_key_slice(options["BK"])
    return dict(options, TRANSPOSE=transpose, BKS=BKS, BKP=local_steep_slice(BKS),
                PRELOAD=local_preload(options["BK"], BKS), **local_row_order(options, BKS, warps))


def local_row_order(options: dict, BKS: int, warps: int) -> dict:
    """The warp-major row order of gla_chunk_local's vector gate (PERM_REPS, PERM_WARPS, PERM_LANES;
    see _gla_warp_cumsum), or 0s for time order. The order follows how Triton lays out a [BT, BKS]
    load of 16-bit values over ``warps`` warps: 8 values per thread (one 16-byte vector) along the
    keys, the rest of a warp's 32 threads along the rows, the warps after them, repeated. Other
    layouts (fp32 gates) give the same values with more sums across warps. Time order where the
    warps' rows would not fill the chunk, and for several key slices (K = 256), whose scores are
    summed over slices before they are stored."""
    lanes = 32 // min(32, max(1, BKS // 8))
    reps = options["BT"] // (lanes * warps)
    if not options["USE_GK"] or BKS != options["BK"] or reps < 1:
        return dict(PERM_REPS=0, PERM_WARPS=0, PERM_LANES=0)
    return dict(PERM_REPS=reps, PERM_WARPS=warps, PERM_LANES=lanes)


def local_terms(options: dict, B, T, H, K, NT, block_t: int) -> dict:
    """Shape and dtype of each of gla_chunk_local's outputs, for the kernel ``options``: A (its main
    output), qs, ks in the dot dtype; dl fp32, None without a gate. Sizes may be symbolic (lowerings)."""
    dtype = torch.bfloat16 if options["DOT_DTYPE"] == "tl.bfloat16" else torch.float32
    gated = options["USE_GK"] or options["USE_G"] or options["USE_G_GAMMA"]
    dl = ((B, NT, H, K) if options["USE_GK"] else (B, NT, H), torch.float32)
    return dict(qs=((B, T, H, K), dtype), ks=((B, T, H, K), dtype), A=((B, T, H, block_t), dtype),
                dl=dl if gated else None)


def walk_segments(programs: int, NT: int, slots: int, most: int = 16) -> int:
    """Segments P of a walk over NT chunks (a power of two, at most ``most``): doubled while twice as
    many segments of ``programs`` programs each still fit in ``slots`` and every segment keeps at
    least 4 chunks. The rules below choose the slots and when to cut at all."""
    segments = 1
    while segments < most and 2 * segments * programs <= slots and NT >= 8 * segments:
        segments *= 2
    return segments


def carry_segments(B: int, H: int, V: int, NT: int, sms: int) -> int:
    """Segments of the carries' walks (gla_chunk_carry's SEGMENTS): where the carries' programs
    (value tiles of 64) would fill at most half the SMs, the walk is cut in up to 8 segments of at
    least 4 chunks, for up to 4 programs per SM. Where the programs fill more than half the SMs,
    the segments' extra pass over ks and v (and each program's fold of the segments before it)
    costs more than it saves. Measured: results/h100-2026-11-23-segments.md."""
    programs = B * H * math.ceil(V / 64)
    return walk_segments(programs, NT, 4 * sms, most=8) if 2 * programs <= sms else 1


def scan_segments(B: int, H: int, V: int, block_v: int, NT: int, sms: int) -> int:
    """Segments of a fused scan's walk (gla_chunk_scan's SEGMENTS): where its B * H * cdiv(V, block_v)
    programs fill fewer than the SMs, the walk over the NT chunks is cut into P segments (a power of
    two, up to 16) walked in parallel, so that the programs fill up to two per SM, with segments of
    at least 4 chunks. The price: gla_chunk_segsum reads the walk's keys (queries) and values once
    more, and each program folds the segments before its own: with programs for 3/4 of the SMs or
    more the price was higher than the gain, below it the forward won up to 2.2x
    (results/h200-2026-11-27-scan-segments.md; the environment variable GLA_INDUCTOR_SCAN_SEGMENTS
    overrides it, ``env_scan_segments``)."""
    programs = B * H * math.ceil(V / block_v)
    return walk_segments(programs, NT, 2 * sms) if 4 * programs < 3 * sms else 1


def terms_segments(B: int, H: int, V: int, BK: int, NT: int, sms: int) -> int:
    """Segments of the forward's carry that computes its chunk terms (``ChunkConfig.terms``): the
    walk is cut in two while twice its B * H * cdiv(V, 64) programs (times the segments) still fit
    in 2 per SM for K > 64, or 8 per SM for K <= 64, and each segment keeps at least 4 chunks. At
    K > 64 a third program per SM would not be resident (255 registers per thread with 4 warps) and
    more segments lost to their sums' extra pass; at K = 64 eight per SM won, their shorter walks
    overlapping over waves (results/h200-2026-11-27-terms.md)."""
    return walk_segments(B * H * math.ceil(V / 64), NT, sms * (2 if BK > 64 else 8))


def packed_cuts(longest: int, T: int, N: int, H: int, V: int, block_t: int, block_v: int, slots: int) -> int:
    """In how many segments gla_chunk_carry's SLOTS rule cuts the walk of the longest of N packed
    sequences (T steps in all): as many as it takes to bring the walk down to L chunks, the walk each
    of ``slots`` resident programs would take were the pack's walks (at most T // BT + N chunks, each
    walked by H * cdiv(V, BV) programs) spread evenly, with segments of at least 4 chunks; 1: none.

    Where the host knows the longest sequence (``default_config``'s ``longest``) and it is cut, the
    carries walk packed sequences in up to two segments, each as its length asks (the kernel's rule
    per sequence, the sums of a segment in four pieces): a pack of mixed lengths lost to its longest
    sequence, walked by one program per head and value tile (12 sequences of 1 to 5999 tokens took
    2.5x the walk of 8 x 2048 for 1.57x the tokens, results/h200-2026-11-29-pool-blocks.md). Where
    no sequence is cut the sums' launch would only cost (8 x 2048's scalar forward 7% slower with
    the rule on the GPU: results/h200-2026-11-30-walks.md). Two programs per SM where K > 64
    (255 registers per thread), four below."""
    walks = (T // block_t + N) * H * math.ceil(V / block_v)
    even = max(math.ceil(walks / slots), 4)
    chunks = math.ceil(longest / block_t)
    return min(max(math.ceil(chunks / even), 1), max(chunks // 4, 1))


def overlap_walks(tokens: int, H: int, K: int, V: int) -> bool:
    """Whether the backward runs its states and dual walks on two streams, overlapping. They read
    the same terms and write different buffers, and where one walk leaves SMs idle (few heads, a
    long sequence among short packed ones) the other fills them: the backward gained 19% at
    (1, 8192, 16, 128, 128) with a scalar gate, 7% at (4, 2048, 16, 128, 128) with a vector one and
    4% on 12 packed sequences of mixed lengths, and stayed within 1% where each walk fills the GPU.
    The fork and the join cost host time, which an eager call shows where its kernels take less
    time than their launches: below 2^30 tokens x heads x K x V, where the walks gained at most 3%
    (results/h200-2026-11-29-overlap.md)."""
    return tokens * H * K * V >= 1 << 30


def env_scan_segments() -> Optional[tuple[int, int]]:
    """GLA_INDUCTOR_SCAN_SEGMENTS="P" or "P,Q": the forward's scan segments P and the backward's Q (P
    when not given) for every call that takes the fused schedule, instead of ``scan_segments`` (P
    only where the forward is the fused scan, with ``terms`` off); for A/B runs on a GPU (read when a
    config is made: set it before the first call). Unset: None."""
    text = os.environ.get("GLA_INDUCTOR_SCAN_SEGMENTS", "").strip()
    if not text:
        return None
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = []
    if len(values) not in (1, 2) or min(values) < 1:
        raise ValueError(f"GLA_INDUCTOR_SCAN_SEGMENTS={text!r}: expected 'P' or 'P,Q', positive integers")
    return values[0], values[-1]


def faulting_tile(BK: int, tile: TileConfig, vector_gate: bool) -> bool:
    """Vector-gate scans with 4 warps at K = 128 hit an illegal memory access on an H100 with triton
    3.6 (BV = 32; seen at HEAD before the fused gates too): a miscompile, avoided by never choosing
    fewer than 8 warps for vector gates with K >= 64."""
    return vector_gate and BK >= 64 and tile.num_warps < 8


@functools.lru_cache(maxsize=512)  # a launch's host time matters where the GPU work is short
def default_config(B: int, T: int, H: int, K: int, V: int, dtype: torch.dtype, vector_gate: bool,
                   device: torch.device, varlen: bool = False, longest: int = 0) -> ChunkConfig:
    """Tiles by head size. The backward's scans: chosen to compile without register spills for sm_90
    (bf16), value tiles narrowing while B * H * cdiv(V, BV) leaves SMs idle (untuned). The forward
    scan: measured (``forward_scan_tile``).

    Packed sequences (varlen; B is then the number of sequences, T their total length) take the
    same schedules but the split one, whose output kernel indexes chunks of fixed-length sequences
    (``kernels.chunk`` drops it); their segments are counted as if each sequence were T long, and
    where the host knows the ``longest`` sequence's length (0: not known), its walk may be cut
    (``packed_cuts``)."""
    BK = max(16, pow2(K))
    BV = max(16, pow2(V))
    # [BT, K] tiles of q, k, g and their gated copies dominate the registers of the fused scans; the
    # local schedule slices the keys (local_key_slice) and takes 64-step chunks at any K
    local = local_schedule(BK, vector_gate)
    wide_chunks = BK <= 128 or local and dtype != torch.float32  # fp32 at K > 128: see `stages`
    block_t = min(64 if wide_chunks else 32, max(16, pow2(T)))
    block_v = min(BV, 64 if BK <= 128 else 32)
    carry_v = 64
    segments = 1
    sum_splits = 1
    NT = math.ceil(T / block_t)
    # the fused scans' segments: scalar, constant and no gates where the fused schedule runs (vector
    # gates keep one walk: below K = 64 not measured, from K = 64 they take the local schedule)
    fwd_segments = bwd_segments = 1
    fused_scans = not vector_gate and not local
    forced = env_scan_segments() if fused_scans else None
    if forced is not None:
        fwd_segments, bwd_segments = forced
    scan_v = block_v  # the forward scan's value tile where it walks in segments (not narrowed)
    # the forward of the fused scans' gates as one carry computing its chunk terms: faster than the
    # fused scan at every measured shape but (8, 1024, 8, 64, 64) (0.025 against 0.022 ms), with no
    # register spills where the scan spilled (results/h200-2026-11-27-terms.md)
    terms = fused_scans
    terms_p = 1
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        terms_p = terms_segments(B, H, V, BK, NT, sms)
        if fused_scans and forced is None:
            fwd_segments = scan_segments(B, H, V, block_v, NT, sms)
        while block_v > 32 and B * H * math.ceil(V / block_v) < sms:
            block_v //= 2
        # the backward's scans keep one walk unless forced: segmented, the fwd+bwd step lost at
        # (8, 1024, 8, 64, 64) and (4, 2048, 16, 128, 128) (results/h200-2026-11-27-scan-segments.md)
        segments = carry_segments(B, H, V, NT, sms)
        # the carries walk all chunks one after another: with programs for at most half the SMs and
        # too few chunks for segments, halve their value tiles (results/h100-2026-11-23-segments.md)
        if segments == 1 and 2 * B * H * math.ceil(V / carry_v) <= sms:
            carry_v = 32
    # The carries' tiles: value tiles of 64 with 4 warps for 16-bit inputs (8 warps were slower);
    # fp32 at K = 256 keeps 8 (untimed; twice the operand bytes). At K > 128, tiles of 128 with 8
    # warps (a warp group per 64 values) read the chunks' qs and ks half as often, which won there
    # and lost at K = 128 (benchmarks/results/h100-2026-11-23-carry-t.md). Shapes with few programs
    # keep their tiles.
    carry_warps = 4 if BK <= 128 or dtype != torch.float32 else 8
    if BK > 128 and dtype != torch.float32 and segments == 1 and carry_v == 64 and V > 64:
        carry_v, carry_warps = 128, 8
    carry_stages = 1 if dtype == torch.float32 else 2  # `stages` below says why
    if terms:
        # value tiles of 64 with one warpgroup: 8 warps split the state's 64 rows of the dots between
        # two warpgroups and ran 2-3x slower; tiles of 128 with 8 warps read q and k once, but one
        # program per SM lost; tiles of 32 lost 1.2-2x (results/h200-2026-11-27-terms.md,
        # h200-2026-11-28-terms-bv32.md). Two stages: three (115 KB of shared memory at K = 128, one
        # program per SM) measured 4-8% faster in segments on an earlier tree, and 13-16% slower in
        # later A/B runs on an H100 and an H200 (results/h100-2026-11-28-terms-stages.md)
        carry_v, carry_warps, segments = 64, 4, terms_p
        # each segment's sums in two pieces where the walk has 2 or 4 segments at K > 64: the sums'
        # launch had 1-1.5 working programs per SM there, each summing a whole segment; twice the
        # programs of half the chunks took 25-29 -> 19-21 us, for twice the fold steps at each
        # walk's start. With 8 segments, or at K = 64, the longer folds cost more than that saved
        # (results/h200-2026-11-29-sum-splits.md)
        sum_splits = 2 if BK > 64 and segments in (2, 4) else 1
    segment_slots = 0
    if varlen and B > 1 and segments == 1 and longest and device.type == "cuda":
        slots = sms * (2 if BK > 64 else 4)
        if packed_cuts(longest, T, B, H, V, block_t, carry_v, slots) > 1:
            segments, sum_splits, segment_slots = 2, 4, slots
    warps = 4 if BK <= 32 else 8
    # fp32 operands take twice the shared memory of bf16 ones, and "tf32x3" dots (fp32 inputs under
    # the "highest" precision) stage a second, low part of each: at two stages some kernels asked
    # for up to 320 KB of the H100's 227 KB (vector gate, K = 96); one stage fits, and at K > 128
    # only with 32-step chunks (256 KB at 64)
    stages = 1 if dtype == torch.float32 else 2
    scan = TileConfig(block_v=block_v, num_warps=warps, num_stages=stages)
    # in segments the forward's programs are many: its value tiles stay wide (fewer re-reads of q, k
    # and recomputations of the scores per value)
    forward_fallback = scan if fwd_segments == 1 else dataclasses.replace(scan, block_v=scan_v)
    return ChunkConfig(
        block_t,
        scan=forward_scan_tile(BK, BV, vector_gate, forward_fallback),
        states=scan,
        dual=scan,
        output=TileConfig(block_v=min(BV, 64), num_warps=warps, num_stages=stages),
        dqkg=dqkg_tile(BK, BV, vector_gate, warps, stages, dtype != torch.float32),
        states_dtype=torch.bfloat16 if dtype == torch.bfloat16 else torch.float32,
        local=local,
        terms=terms,
        carry=TileConfig(block_v=carry_v, num_warps=carry_warps, num_stages=carry_stages),
        local_tile=TileConfig(block_v=0, num_warps=8, num_stages=stages),
        segments=segments,
        sum_splits=sum_splits,
        segment_slots=segment_slots,
        # the segments' sums do the states walk's work (one dot per chunk): value tiles of 64 make
        # as many programs as the forward's walk in segments (offline for sm_90 at K = 128: 112
        # registers with 8 warps, no spills; untimed)
        segsum=TileConfig(block_v=min(BV, 64), num_warps=warps, num_stages=stages),
        scan_segments=fwd_segments,
        bwd_scan_segments=bwd_segments,
        overlap_walks=device.type == "cuda" and overlap_walks(T if varlen else B * T, H, K, V),
    )


# ----------------------------------------------------------------------------------------------
# support check
# ----------------------------------------------------------------------------------------------


def unsupported_reason(call: GLACall) -> Optional[str]:
    """None when the chunked kernels handle the call's inputs, else the reason to fall back. The
    tensors may be tensors or anything with their dtype, shape, dim() and device (the lowerings'
    size hints)."""
    q, v = call.q, call.v
    if not TRITON_INSTALLED:
        return "triton is not installed"
    if q.device.type != "cuda" and not (q.device.type == "cpu" and interpreting()):
        return f"device {q.device.type} (CUDA, or CPU under TRITON_INTERPRET=1)"
    for name in ("q", "k", "v", "g", "g_gamma", "initial_state"):
        x = getattr(call, name)
        if x is not None and x.dtype not in _SUPPORTED_DTYPES:
            return f"{name} dtype {x.dtype} (supported: float32, float16, bfloat16)"
    B, T, _, K = q.shape
    H, V = v.shape[2], v.shape[-1]
    if call.cu_seqlens is not None:
        B = call.num_sequences  # the scans' programs: one per (value tile, sequence * head)
    if K > MAX_K:
        return f"K = {K} > {MAX_K}"
    if V > MAX_V:
        return f"V = {V} > {MAX_V}"
    if B * H > MAX_GRID_YZ:
        return f"B * H = {B * H} > {MAX_GRID_YZ}"
    return None


# ----------------------------------------------------------------------------------------------
# options
# ----------------------------------------------------------------------------------------------


def kernel_options(cfg: ChunkConfig, dtype: torch.dtype, K: int, gate: str, scale: float, reverse: bool,
                   interpreting: bool, gate_fn: GateFn = GateFn(), group: int = 1, varlen: bool = False) -> dict:
    """The options every GLA chunk kernel of one call shares (jinja variables and constexprs).

    ``gate`` is "vector", "scalar", "constant" or "none"; ``dtype`` the promoted q/k/v dtype;
    ``gate_fn`` the function the kernels apply to g as they read it; ``group`` the heads of v per
    head of q and k (``group_size``); ``varlen``: packed sequences (cu_seqlens; every kernel but
    gla_chunk_output)."""
    # The CPU interpreter multiplies bf16 tl.dot operands as raw integers; give it fp32 ones.
    on_bf16_cores = dtype == torch.bfloat16 and not interpreting
    f32_precision = cfg.f32_precision or (
        "tf32x3" if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest" else "tf32")
    return dict(
        BT=cfg.block_t,
        BK=max(16, pow2(K)),
        USE_GK=gate == "vector",
        USE_G=gate == "scalar",
        USE_G_GAMMA=gate == "constant",
        REVERSE=bool(reverse),
        SCALE=float(scale),
        DOT_DTYPE="tl.bfloat16" if on_bf16_cores else "tl.float32",
        F32_PRECISION=repr(f32_precision),  # options are code: a quoted string
        GROUP=int(group),
        IS_VARLEN=bool(varlen),
        **gate_fn.kernel_options(),
        # only where asked: the other renders keep their sources (and compiled kernels)
        **({"SLOTS": cfg.segment_slots} if varlen and cfg.segments > 1 and cfg.segment_slots else {}),
    )


def dqkg_block_k(cfg: ChunkConfig, options: dict) -> int:
    """K tile of gla_chunk_bwd_dqkg: a scalar or constant gate's dg sums over all keys, so one
    program must see them all."""
    vector_or_none = options["USE_GK"] or not (options["USE_G"] or options["USE_G_GAMMA"])
    return cfg.dqkg.block_k if vector_or_none else options["BK"]
