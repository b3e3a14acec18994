"""Tile sweeps of the chunked kernels (CUDA), bf16, gates ``logsigmoid(randn) / 16`` in bf16.

    python -m benchmarks tune TOOL [options]

  schedule  the forward's schedules and tiles (``chunk_fwd``): the fused scan over value tiles, warps,
            stages and 128-step chunks, and in segments ("fused P="); the split schedule over its
            output kernel's tiles, and its states scan in segments ("split P="); scalar gates: the
            forward as one carry computing its chunk terms ("terms P="); the local schedule
            over the carry's tiles and segments. Events clock (host time included; --graph: CUDA
            graph replays, GPU time), every
            config checked against the default one. Several shapes: --shapes 'B,T,H,K,V;...'.
  segments  the carries' segments (``ChunkConfig.segments``) and tiles of the local schedule, forward
            and backward, in CUDA graphs (GPU time); checked against the first config.
  slices    gla_chunk_local's key slices BKS:BKP[:p][:wN] (p: q and k loaded before the gate sums;
            wN: N warps), forward and backward in CUDA graphs; checked against the first.
  dqkg      gla_chunk_bwd_dqkg alone over (block_k, block_v, warps, stages), with and without a fused
            logsigmoid gate.
  ablate    time variants of the kernels that leave one stage out (``benchmarks.tune_ab``).
  ab        A/B of code versions, one process per version, interleaved (``benchmarks.tune_ab``).
A config that does not compile or faults becomes an error row; a kernel that faults the GPU poisons
the process: sweep such configs one per process (--only).
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import torch

from benchmarks import harness, inputs, report

TOOLS = ("schedule", "segments", "slices", "dqkg", "ablate", "ab")
MAIN, QUICK = inputs.SWEEP_MAIN, inputs.SWEEP_QUICK


def add_arguments(p) -> None:
    from benchmarks import tune_ab

    p.add_argument("tool", choices=TOOLS)
    p.add_argument("--shapes", help=f"'B,T,H,K,V;...' (default {MAIN}; segments: 2,16384,16,128,128)")
    p.add_argument("--gates", default="vector", help="vector,scalar")
    p.add_argument("--only", help="schedule, ablate: only configs whose names contain one of these '|'-separated "
                                  "strings (the baseline stays)")
    p.add_argument("--rounds", type=int, default=3)
    g = p.add_argument_group("segments")
    g.add_argument("--segments", default="1,2,4,8")
    g.add_argument("--carry-v", default="64", help="the carries' value tiles")
    g.add_argument("--warps", default="4", help="the carries' warps")
    g.add_argument("--stages", help="the carries' pipeline stages (default: the config's)")
    g.add_argument("--block-t", type=int, help="the chunk size (default: the config's)")
    g.add_argument("--local-warps", type=int, default=8, help="gla_chunk_local's warps")
    p.add_argument("--slices", default="128:16,128:8", help="slices: BKS:BKP[:p][:wN],...")
    p.add_argument("--gate-fns", default=",logsigmoid", help="dqkg: fused gate functions ('' none)")
    p.add_argument("--dqkg-stages", default="1,2", help="dqkg: pipeline stages")
    tune_ab.add_arguments(p)


def shapes_of(args, default: str):
    return harness.parse_shapes(args.shapes or (QUICK if args.quick else default))


def _tensors(outputs) -> list:
    """The non-empty tensors among outputs (each a tensor, a tuple of them, or None)."""
    flat = [t for o in outputs for t in (o if isinstance(o, (tuple, list)) else (o,))]
    return [t for t in flat if isinstance(t, torch.Tensor) and t.numel()]


def probe_and_time(named: dict, rounds: int, clock: str) -> list:
    """Rows for named = {config name: (fields, {"fwd": fn, "bwd": fn...})}: each config first run once
    and its outputs compared with the first config's, then the survivors timed in interleaved rounds,
    one measure per function kind."""
    rows, ok, reference = {}, {}, None
    for name, (fields, fns) in named.items():
        rows[name] = {"config": name, **fields}
        try:
            out = _tensors([fn() for fn in fns.values()])
            reference = out if reference is None else reference
            if out:
                rows[name]["rel_err_vs_ref"] = max(harness.rel_err(a, b) for a, b in zip(out, reference))
            ok[name] = fns
        except Exception as e:  # a config that does not compile (registers, shared memory)
            rows[name]["error"] = harness.error_text(e, 200)
    for kind in dict.fromkeys(k for fns in ok.values() for k in fns):
        errors = {}
        timed = harness.measure({n: fns[kind] for n, fns in ok.items()}, clock=clock, rounds=rounds, errors=errors)
        for n, t in timed.items():
            rows[n][f"{kind}_ms"] = None if t is None else t.median
            if n in errors:
                rows[n][f"{kind}_error"] = errors[n]
    for r in rows.values():
        harness.log(r)
    return list(rows.values())


def schedule_configs(base, vector_gate: bool = False) -> list:
    from benchmarks.internals import TileConfig

    rep = dataclasses.replace
    out = [("default", base)]
    for bv, w, s in itertools.product((32, 64, 128), (4, 8), (1, 2)):
        out.append((f"fused BV={bv} w={w} s={s}", rep(base, local=False, terms=False, scan=TileConfig(bv, w, s))))
    for bv, w in itertools.product((32, 64, 128), (4, 8)):
        out.append((f"split out BV={bv} w={w}",
                    rep(base, local=False, terms=False, split=True, output=TileConfig(bv, w, 2))))
    for bv, w in itertools.product((32, 64), (4, 8)):  # longer chunks: half the scan's steps, larger dots
        out.append((f"fused BT=128 BV={bv} w={w}",
                    rep(base, local=False, terms=False, block_t=128, scan=TileConfig(bv, w, 2))))
    for bv, w, s in itertools.product((32, 64), (4, 8), (1, 2)):  # one stage: half the shared memory
        out.append((f"local carry BV={bv} w={w} s={s}", rep(base, local=True, carry=TileConfig(bv, w, s), segments=1)))
    for p, bv in itertools.product((2, 4, 8, 16), (32, 64)):
        out.append((f"local carry P={p} BV={bv} w=4 s=2",
                    rep(base, local=True, carry=TileConfig(bv, 4, 2), segments=p)))
    # the fused scan walked in segments (gla_chunk_segsum, then the walk; ChunkConfig.scan_segments);
    # P=1 is the one walk at the same tile
    for p, bv, w in itertools.product((1, 2, 4, 8, 16), (32, 64), (4, 8)):
        out.append((f"fused P={p} BV={bv} w={w}",
                    rep(base, local=False, terms=False, scan=TileConfig(bv, w, 2), scan_segments=p)))
    # the forward as one carry computing its chunk terms (scalar, constant and no gates), in segments
    if not vector_gate:
        for p, bv, w in itertools.product((1, 2, 4, 8, 16), (32, 64, 128), (4, 8)):
            if bv == 128 and w == 4:
                continue  # spills (offline sm_90 compile: `profile sm90 --mode carry_terms`)
            out.append((f"terms P={p} BV={bv} w={w}",
                        rep(base, local=False, terms=True, carry=TileConfig(bv, w, 2), segments=p)))
        for p in (1, 2, 4, 8, 16):  # chunks of 32 steps: twice the walk's steps, each with a fourth of its dots
            out.append((f"terms BT=32 P={p} BV=64 w=4",
                        rep(base, local=False, terms=True, block_t=32, carry=TileConfig(64, 4, 2), segments=p)))
        for p in (1, 2, 4, 8, 16):  # three stages: 115 KB of shared memory at K = 128, one program per SM
            out.append((f"terms P={p} BV=64 w=4 s=3",
                        rep(base, local=False, terms=True, carry=TileConfig(64, 4, 3), segments=p)))
    # the split schedule with its states scan in segments, then the chunk-parallel output kernel
    for p, w in itertools.product((1, 2, 4, 8, 16), (4, 8)):
        out.append((f"split P={p} out BV=64 w={w}",
                    rep(base, local=False, terms=False, split=True, output=TileConfig(64, w, 2), scan_segments=p)))
    return out


def run_schedule(args, shape, gate) -> list:
    from benchmarks import internals

    q, k, v, g = inputs.sweep_inputs(shape, gate)
    B, T, H, K, V = shape
    base = internals.default_chunk_config(B, T, H, K, V, q.dtype, gate == "vector", q.device)
    configs = schedule_configs(base, gate == "vector")
    if args.only:
        configs = [(n, c) for n, c in configs if n == "default" or any(o in n for o in args.only.split("|"))]
    named = {n: ({}, {"fwd": lambda c=c: internals.chunk_fwd_kernel(q, k, v, g, scale=K**-0.5, config=c)[0]})
             for n, c in configs}
    return probe_and_time(named, args.rounds, "graph" if args.graph else "events")


def run_segments(args, shape, gate) -> list:
    from benchmarks import internals

    q, k, v, g = inputs.sweep_inputs(shape, gate)
    do = torch.randn_like(v)
    B, T, H, K, V = shape
    base = internals.default_chunk_config(B, T, H, K, V, q.dtype, gate == "vector", q.device)
    if args.block_t:
        base = dataclasses.replace(base, block_t=args.block_t)
    stages = [base.carry.num_stages] if args.stages is None else [int(s) for s in args.stages.split(",")]
    named = {}
    for bv, w, st, p in itertools.product(map(int, args.carry_v.split(",")), map(int, args.warps.split(",")), stages,
                                          map(int, args.segments.split(","))):
        cfg = dataclasses.replace(base, local=True, segments=p,
                                  carry=dataclasses.replace(base.carry, block_v=bv, num_warps=w, num_stages=st),
                                  local_tile=dataclasses.replace(base.local_tile, num_warps=args.local_warps))
        named[f"P={p} BV={bv} w={w} s={st}"] = ({"segments": p, "carry_v": bv, "warps": w, "stages": st}, {
            "fwd": lambda c=cfg: internals.chunk_fwd_kernel(q, k, v, g, scale=K**-0.5, config=c)[0],
            "bwd": lambda c=cfg: internals.chunk_bwd_kernel(q, k, v, g, do, scale=K**-0.5, config=c)[:4]})
    return probe_and_time(named, args.rounds, "graph")


def run_slices(args, shape, gate) -> list:
    from benchmarks import internals

    q, k, v, g = inputs.sweep_inputs(shape, "vector")
    do = torch.randn_like(v)
    B, T, H, K, V = shape
    named = {}
    for spec in args.slices.split(","):
        bks, bkp, *flags = spec.split(":")
        bks, bkp, preload = int(bks), int(bkp), "p" in flags
        cfg = internals.default_chunk_config(B, T, H, K, V, q.dtype, True, q.device)
        warps = next((int(f[1:]) for f in flags if f.startswith("w")), cfg.local_tile.num_warps)
        cfg = dataclasses.replace(cfg, local_tile=dataclasses.replace(cfg.local_tile, num_warps=warps))

        def fwd(c=cfg, s=(bks, bkp, preload)):
            with internals.local_slices(*s):
                return internals.chunk_fwd_kernel(q, k, v, g, scale=K**-0.5, config=c)[0]

        def bwd(c=cfg, s=(bks, bkp, preload)):
            with internals.local_slices(*s):
                return internals.chunk_bwd_kernel(q, k, v, g, do, scale=K**-0.5, config=c)[:4]

        named[spec] = ({"bks": bks, "bkp": bkp, "preload": preload, "local_warps": warps}, {"fwd": fwd, "bwd": bwd})
    return probe_and_time(named, args.rounds, "graph")


def run_dqkg(args, shape, gate) -> list:
    from benchmarks import internals

    B, T, H, K, V = shape
    ks = [32, 64, 128] if gate == "vector" else [max(16, 1 << (K - 1).bit_length())]
    rows = []
    for fn_name in args.gate_fns.split(","):
        gate_fn = internals.GateFn(fn_name, 1 / 16) if fn_name else internals.GateFn()
        q, k, v, g = inputs.sweep_inputs(shape, gate)
        if fn_name:  # g is the fused function's input
            g = torch.randn(g.shape, device="cuda", dtype=torch.bfloat16)
        do = torch.randn_like(v)
        base = internals.default_chunk_config(B, T, H, K, V, torch.bfloat16, gate == "vector", q.device)
        NT = math.ceil(T / base.block_t)
        h, dh = (torch.randn(B, NT, H, K, V, device="cuda", dtype=base.states_dtype) for _ in range(2))
        dq, dk = torch.empty_like(q), torch.empty_like(k)
        dg = torch.empty(g.shape, dtype=torch.float32 if fn_name else g.dtype, device="cuda")
        named = {}
        for bk, bv, w, st in itertools.product(ks, (32, 64, 128), (4, 8), map(int, args.dqkg_stages.split(","))):
            cfg = dataclasses.replace(base, dqkg=internals.TileConfig(bv, w, st, block_k=bk))
            named[f"{fn_name or '-'} BK={bk} BV={bv} w={w} s={st}"] = (
                {"gate_fn": fn_name or "-", "block_k": bk, "block_v": bv, "warps": w, "stages": st},
                {"dqkg": lambda c=cfg: internals.dqkg_kernel(c, gate_fn, q=q, k=k, v=v, g=g, do=do, h=h, dh=dh,
                                                             dq=dq, dk=dk, dg=dg, scale=K**-0.5)})
        rows += probe_and_time(named, args.rounds, "events")
    return rows


def run(args):
    harness.require_cuda("tune")
    if args.tool in ("ablate", "ab"):
        from benchmarks import tune_ab

        return tune_ab.run(args)
    runners = {"schedule": (run_schedule, MAIN), "segments": (run_segments, "2,16384,16,128,128"),
               "slices": (run_slices, MAIN), "dqkg": (run_dqkg, MAIN)}
    runner, default = runners[args.tool]
    result = report.new_result(f"tune-{args.tool}", f"Tile sweep: {args.tool}", "cuda", dtype="bfloat16")
    result.notes.append("rel_err_vs_ref: against the first config's outputs (schedule: the default config's)")
    for shape in shapes_of(args, default):
        for gate in args.gates.split(","):
            rows = [{"shape": list(shape), "gate": gate, **r} for r in runner(args, shape, gate)]
            result.rows += rows
            key = lambda r: r.get("fwd_ms") or r.get("dqkg_ms") or float("inf")  # noqa: E731
            result.sections.append(f"### {args.tool}, {gate} gate, {', '.join(map(str, shape))}\n\n" + report.table(
                sorted(rows, key=key), [("config", "config", ""), ("fwd ms", "fwd_ms", ".3f"),
                                        ("bwd ms", "bwd_ms", ".3f"), ("dqkg ms", "dqkg_ms", ".3f"),
                                        ("rel err vs ref", "rel_err_vs_ref", ".1e"),
                                        ("error", lambda r: (r.get("error") or "")[:80] or None, "")]))
    return result
