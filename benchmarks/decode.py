"""GLA decoding (CUDA): the fused recurrent kernel against FLA and naive PyTorch, in one process.

1. decode: T = 1, bf16 q, k, v, vector gate, fp32 state [B, H, K, V] updated in place, K = V = 128,
   B in {64, 128, 256} at H = 32 and B = 128 at H = 16:
     ours_op      ``torch.ops.gla_inductor.fused_recurrent`` eager (dispatch, launcher, kernel);
     ours_kernel  the kernel's launcher alone;
     fla          FLA's ``fused_recurrent_gla`` (writes a new final state; skipped where FLA is absent);
     naive_eager  the recurrence step in eager PyTorch, fp32; naive_compiled the same compiled.
   ms by CUDA events and in a CUDA graph, GB/s over the state's bytes (read once, written once), and
   that as % of a copy of a state-sized buffer measured in the same process; each implementation's
   relative error against a float64 step.
2. tiles (unless --no-tiles): the kernel over value tiles x warps, to tune its default tiles.
3. T sweep: T in (1, 4, 16, 32, 64, 128) at B = 64, H = 32: the recurrent kernel against the chunked
   kernels (fp32 initial state to a fresh final state), to place the dispatch's recurrent/chunked
   crossover (the longest T the recurrent kernel runs).
"""

from __future__ import annotations

import time

import torch

from benchmarks import harness, inputs, report

DECODE_SHAPES = [(64, 32, 128, 128), (128, 32, 128, 128), (256, 32, 128, 128), (128, 16, 128, 128)]  # B, H, K, V
T_SWEEP = (1, 4, 16, 32, 64, 128)
T_SWEEP_SHAPE = (64, 32, 128, 128)
TILES = [(bv, w) for bv in (16, 32, 64, 128) for w in (1, 2, 4, 8)]
QUICK = dict(shapes=[(16, 8, 64, 64)], t_sweep=(1, 16), t_shape=(16, 8, 64, 64), tiles=[(32, 2), (64, 4)])


def add_arguments(p) -> None:
    p.add_argument("--impls", default="ours,fla,naive,compiled")
    p.add_argument("--no-tiles", action="store_true", help="skip the tile sweep")
    p.add_argument("--no-t-sweep", action="store_true", help="skip the T sweep")


def decode_inputs(B, T, H, K, V):
    q, k, v, g = inputs.gla_inputs(B, T, H, K, V, gate="vector")
    return q, k, v, g, inputs.state(B, H, K, V)


def implementations(names: list, notes: list) -> dict:
    """name -> fn(q, k, v, g, state, scale) -> (o, final state)."""
    out = {}
    if "ours" in names:
        import gla_inductor  # noqa: F401 - registers the ops

        from benchmarks import internals

        def ours_op(q, k, v, g, state, scale):
            return torch.ops.gla_inductor.fused_recurrent(q, k, v, g, None, state, scale, False), state

        def ours_kernel(q, k, v, g, state, scale):
            return internals.recurrent_kernel(q, k, v, g, state_in=state, state_out=state, scale=scale), state

        out["ours_op"], out["ours_kernel"] = ours_op, ours_kernel
    if "fla" in names:
        fla, why = inputs.fla_ops()
        if fla is None:
            notes.append(why)
        else:
            out["fla_fused_recurrent_gla"] = lambda q, k, v, g, state, scale: fla.fused_recurrent_gla(
                q, k, v, gk=g, scale=scale, initial_state=state, output_final_state=True)
    if "naive" in names:
        out["naive_eager"] = inputs.naive_steps
    if "compiled" in names:
        out["naive_compiled"] = torch.compile(inputs.naive_steps)
    return out


def reference_error(fn, args, scale) -> float:
    """Max of the relative errors of o and the final state against a float64 step."""
    ref_o, ref_s = inputs.naive_steps(*(x.double() for x in args), scale)
    q, k, v, g, state = args
    with torch.no_grad():
        o, s = fn(q, k, v, g, state.clone(), scale)
    return max(harness.rel_err(o, ref_o), harness.rel_err(s, ref_s))


def run_decode(fns: dict, shapes: list, rounds: int) -> list:
    rows = []
    for B, H, K, V in shapes:
        state_bytes = B * H * K * V * 4
        bw = harness.copy_bandwidth(state_bytes)
        calls, by = {}, {}
        for name, fn in fns.items():
            args, scale = decode_inputs(B, 1, H, K, V), K**-0.5
            row = {"part": "decode", "impl": name, "B": B, "T": 1, "H": H, "K": K, "V": V,
                   "copy_gbs": bw / 1e9, "state_mb": state_bytes / 1e6}
            try:
                start = time.perf_counter()
                row["rel_err"] = reference_error(fn, args, scale)
                torch.cuda.synchronize()
                row["first_call_s"] = time.perf_counter() - start
                calls[name] = lambda fn=fn, args=args, scale=scale: fn(*args, scale)
            except Exception as e:  # one failing implementation must not hide the others
                row["error"] = harness.error_text(e)
            by[name] = row
        with torch.no_grad():
            for prefix, clock in (("", "events"), ("graph_", "graph")):
                errors = {}
                for name, t in harness.measure(calls, clock=clock, rounds=rounds, errors=errors).items():
                    if t is None:
                        by[name][f"{prefix}error"] = errors.get(name)
                        continue
                    by[name].update(t.fields(prefix))
                    gbs = 2 * state_bytes / (t.median * 1e-3) / 1e9
                    by[name].update({f"{prefix}gbs": gbs, f"{prefix}pct_copy": 100 * gbs * 1e9 / bw})
        for row in by.values():
            harness.log(row)
        rows += by.values()
        harness.free_memory()
    return rows


def run_tiles(shapes: list, tiles: list, rounds: int) -> list:
    from benchmarks import internals

    rows = []
    for B, H, K, V in shapes:
        q, k, v, g, state = decode_inputs(B, 1, H, K, V)
        state_bytes = B * H * K * V * 4
        bw = harness.copy_bandwidth(state_bytes)
        default = internals.default_recurrent_config(B, H, K, V, q.device)
        fns = {}
        for block_v, warps in dict.fromkeys([*tiles, (default.block_v, default.num_warps)]):
            cfg = internals.RecurrentConfig(block_v=block_v, num_warps=warps)
            fns[(block_v, warps)] = lambda cfg=cfg: internals.recurrent_kernel(
                q, k, v, g, state_in=state, state_out=state, scale=K**-0.5, config=cfg)
        for (block_v, warps), fn in fns.items():
            row = {"part": "tiles", "B": B, "H": H, "K": K, "V": V, "block_v": block_v, "num_warps": warps,
                   "default": (block_v, warps) == (default.block_v, default.num_warps)}
            try:
                ms = harness.time_one(fn, rounds=rounds).median
                row.update(ms=ms, pct_copy=100 * 2 * state_bytes / (ms * 1e-3) / bw)
            except Exception as e:  # a tile that does not compile
                row["error"] = harness.error_text(e, 200)
            harness.log(row)
            rows.append(row)
    return rows


def run_t_sweep(t_values, shape, fla, rounds: int) -> list:
    from benchmarks import internals

    B, H, K, V = shape
    rows = []
    for T in t_values:
        q, k, v, g, h0 = decode_inputs(B, T, H, K, V)
        scale, ht = K**-0.5, torch.empty_like(h0)
        fns = {
            "recurrent": lambda: (internals.recurrent_kernel(q, k, v, g, state_in=h0, state_out=ht, scale=scale), ht),
            "chunked": lambda: internals.chunk_fwd_kernel(q, k, v, g, scale=scale, h0=h0, output_final_state=True),
        }
        if fla is not None:
            fns["fla_fused_recurrent"] = lambda: fla.fused_recurrent_gla(q, k, v, gk=g, scale=scale, initial_state=h0,
                                                                         output_final_state=True)
            fns["fla_chunk"] = lambda: fla.chunk_gla(q, k, v, g, scale=scale, initial_state=h0, output_final_state=True)
        ref_o, ref_s = inputs.naive_steps(*(x.double() for x in (q, k, v, g, h0)), scale)
        ok, by = {}, {}
        with torch.no_grad():
            for name, fn in fns.items():
                by[name] = {"part": "T sweep", "impl": name, "B": B, "T": T, "H": H, "K": K, "V": V}
                try:
                    o, s = fn()
                    by[name]["rel_err"] = max(harness.rel_err(o, ref_o), harness.rel_err(s, ref_s))
                    ok[name] = fn
                except Exception as e:
                    by[name]["error"] = harness.error_text(e, 200)
            for name, t in harness.measure(ok, rounds=rounds).items():
                by[name]["ms"] = t.median
        for row in by.values():
            harness.log(row)
        rows += by.values()
        harness.free_memory()
    return rows


def run(args):
    harness.require_cuda("decode")
    notes = []
    names = args.impls.split(",")
    fns = implementations(names, notes)
    q = QUICK if args.quick else dict(shapes=DECODE_SHAPES, t_sweep=T_SWEEP, t_shape=T_SWEEP_SHAPE, tiles=TILES)
    rounds = 2 if args.quick else 5
    result = report.new_result("decode", "GLA decode: the fused recurrent kernel against FLA and naive PyTorch",
                               "cuda", copy_bandwidth_1gib_tbs=round(harness.copy_bandwidth(1 << 30) / 1e12, 3))
    result.notes += notes + ["GB/s over the state's bytes (read + write); % of a copy of a state-sized buffer; "
                             "ms by CUDA events (host time included where slower), graph: CUDA-graph replays"]
    result.rows += run_decode(fns, q["shapes"], rounds)
    if "ours" in names and not args.no_tiles:
        result.rows += run_tiles(q["shapes"], q["tiles"], rounds)
    if "ours" in names and not args.no_t_sweep:
        result.rows += run_t_sweep(q["t_sweep"], q["t_shape"], inputs.fla_ops()[0] if "fla" in names else None,
                                   rounds)
    result.sections += markdown(result.rows, q["t_shape"])
    return result


def markdown(rows: list, t_shape) -> list:
    out = [report.table([r for r in rows if r["part"] == "decode"], [
        ("impl", "impl", ""), ("B", "B", "d"), ("H", "H", "d"), ("ms", "ms", ".4f"), ("graph ms", "graph_ms", ".4f"),
        ("GB/s", "gbs", ".0f"), ("% of copy", "pct_copy", ".1f"), ("graph % of copy", "graph_pct_copy", ".1f"),
        ("rel. err", "rel_err", ".1e"), ("error", lambda r: (r.get("error") or "")[:80] or None, "")])]
    tiles = [r for r in rows if r["part"] == "tiles" and "error" not in r]
    summary = []
    for shape in sorted({(r["B"], r["H"]) for r in tiles}):
        mine = [r for r in tiles if (r["B"], r["H"]) == shape]
        best = max(mine, key=lambda r: r["pct_copy"])
        dflt = next((r for r in mine if r["default"]), None)  # None: the default tile failed
        summary.append({"B": shape[0], "H": shape[1], "best": (best["block_v"], best["num_warps"]),
                        "best_pct": best["pct_copy"], "dflt": dflt and (dflt["block_v"], dflt["num_warps"]),
                        "dflt_pct": dflt and dflt["pct_copy"]})
    if summary:
        out.append(report.table(summary, [("B", "B", "d"), ("H", "H", "d"), ("best BV, warps", "best", ""),
                                          ("best % of copy", "best_pct", ".1f"), ("default BV, warps", "dflt", ""),
                                          ("default % of copy", "dflt_pct", ".1f")]))
    sweep = [r for r in rows if r["part"] == "T sweep"]
    if sweep:
        impls = list(dict.fromkeys(r["impl"] for r in sweep))
        by = {(r["T"], r["impl"]): r for r in sweep}
        table = [{"T": T, **{n: by.get((T, n), {}) for n in impls}} for T in dict.fromkeys(r["T"] for r in sweep)]
        cell = lambda r: "error" if "ms" not in r else f"{r['ms']:.4f} ({r['rel_err']:.0e})"  # noqa: E731
        out.append(f"T sweep at B, H, K, V = {t_shape} (ms; rel. err)\n\n" + report.table(
            table, [("T", "T", "d")] + [(n, lambda r, n=n: cell(r[n]), "") for n in impls]))
        faster = [r["T"] for r in table if r["recurrent"].get("ms", 1e9) < r["chunked"].get("ms", 1e9)]
        out.append(f"recurrent faster than chunked at T in {faster}: the dispatch's longest recurrent T belongs "
                   "below the crossover.")
    return out
