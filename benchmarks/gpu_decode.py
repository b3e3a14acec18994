"""GPU benchmark of GLA decoding: the fused recurrent kernel side by side with FLA 0.6 and naive
PyTorch, in one process.

    python benchmarks/gpu_decode.py --out results.json [--impls ours,fla,naive,compiled] [--no-sweep]

1. Decode (T = 1), bf16 q, k, v, vector gate (logsigmoid / 16, as FLA's GLA layer), fp32 state
   [B, H, K, V] updated in place, K = V = 128; B in {64, 128, 256} at H = 32, and B = 128 at H = 16:
     * ours_op: the ``gla_inductor::fused_recurrent`` op, eager (dispatch + launcher + kernel);
     * ours_kernel: ``triton_recurrent.fused_recurrent_triton``, the launcher alone;
     * fla: ``fla.ops.gla.fused_recurrent_gla`` (skipped if FLA is absent; it writes a new final state);
     * naive: the recurrence step in eager PyTorch, fp32; compiled: the same under torch.compile.
   Each reports median ms (``triton.testing.do_bench``) and, where it captures, under a CUDA graph;
   GB/s over the state's bytes (read once + written once), and that as % of the bandwidth of a torch
   copy of a state-sized buffer measured in the same process. Every impl is checked against a float64
   step first (relative error in the row).
2. Tile sweep (unless --no-sweep): ours_kernel at T = 1 over BV x num_warps, to tune
   ``triton_recurrent.default_recurrent_config``.
3. T sweep (1, 4, 16, 32, 64, 128) at B = 64, H = 32: the recurrent kernel against the chunked kernel
   (``triton_chunk.chunk_fwd_triton``), both from an fp32 initial state to a fresh fp32 final state,
   to tune ``cuda_dispatch.RECURRENT_MAX_T`` (the longest T run on the recurrent kernel).

JSON rows go to --out with the GPU, versions and date; a markdown table is printed last.
"""

import argparse
import datetime
import json
import subprocess
import time

import torch
import torch.nn.functional as F

DECODE_SHAPES = [(64, 32, 128, 128), (128, 32, 128, 128), (256, 32, 128, 128), (128, 16, 128, 128)]  # B, H, K, V
T_SWEEP = (1, 4, 16, 32, 64, 128)
T_SWEEP_SHAPE = (64, 32, 128, 128)
TILE_SWEEP = [(bv, w) for bv in (16, 32, 64, 128) for w in (1, 2, 4, 8)]


def bench(fn, warmup=25, rep=100) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def bench_graph(fn) -> float:
    """Median ms of fn replayed from a CUDA graph (no host overhead), or NaN if it does not capture."""
    from triton.testing import do_bench_cudagraph

    try:
        return do_bench_cudagraph(fn, rep=100, return_mode="median")
    except Exception:  # a host sync or an allocator call that capture refuses
        torch.cuda.synchronize()
        return float("nan")


def copy_bandwidth(nbytes: int) -> float:
    """Bytes read + written per second by a device-to-device copy of nbytes."""
    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    return 2 * nbytes / (bench(lambda: y.copy_(x)) * 1e-3)


def inputs(B, T, H, K, V, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen, device="cuda").to(dtype)

    q, k, v = randn(B, T, H, K), randn(B, T, H, K), randn(B, T, H, V)
    g = (F.logsigmoid(randn(B, T, H, K, dtype=torch.float32)) / 16).to(torch.bfloat16)
    state = randn(B, H, K, V, dtype=torch.float32)
    return q, k, v, g, state


# ----------------------------------------------------------------------------------------------
# implementations: each takes (q, k, v, g, state, scale) and returns (o, final state)
# ----------------------------------------------------------------------------------------------


def naive_step(q, k, v, g, state, scale):
    """The recurrence as a model would write it, in the state's dtype, one step after another."""
    S, dt = state, state.dtype
    o = []
    for t in range(q.shape[1]):
        S = S * g[:, t].to(dt).exp()[..., None] + k[:, t].to(dt)[..., None] * v[:, t].to(dt)[..., None, :]
        o.append((q[:, t].to(dt)[..., None] * S).sum(-2) * scale)
    return torch.stack(o, 1).to(q.dtype), S


def impls(names):
    out = {}
    if "ours" in names:
        from gla_inductor import triton_recurrent  # importing gla_inductor registers the op

        def ours_op(q, k, v, g, state, scale):
            return torch.ops.gla_inductor.fused_recurrent(q, k, v, g, None, state, scale, False), state

        def ours_kernel(q, k, v, g, state, scale):
            return triton_recurrent.fused_recurrent_triton(q, k, v, g, None, state, state, scale, False), state

        out["ours_op"] = ours_op
        out["ours_kernel"] = ours_kernel
    if "fla" in names:
        try:
            from fla.ops.gla import fused_recurrent_gla

            def fla(q, k, v, g, state, scale):
                return fused_recurrent_gla(q, k, v, gk=g, scale=scale, initial_state=state, output_final_state=True)

            out["fla_fused_recurrent_gla"] = fla
        except ImportError as e:
            print("FLA not available:", e)
    if "naive" in names:
        out["naive_eager"] = naive_step
    if "compiled" in names:
        out["naive_compiled"] = torch.compile(naive_step)
    return out


def rel_err(actual, expected) -> float:
    return ((actual.double() - expected).norm() / expected.norm()).item()


def reference_error(fn, args, scale) -> float:
    """Max of the relative errors of o and the final state against a float64 step."""
    ref_o, ref_s = naive_step(*(x.double() for x in args), scale)
    q, k, v, g, state = args
    with torch.no_grad():
        o, s = fn(q, k, v, g, state.clone(), scale)
    return max(rel_err(o, ref_o), rel_err(s, ref_s))


# ----------------------------------------------------------------------------------------------
# the three parts
# ----------------------------------------------------------------------------------------------


def run_decode(fns, log):
    rows = []
    for B, H, K, V in DECODE_SHAPES:
        state_bytes = B * H * K * V * 4
        bw = copy_bandwidth(state_bytes)
        for name, fn in fns.items():
            args = inputs(B, 1, H, K, V)
            scale = K**-0.5
            row = {"part": "decode", "impl": name, "B": B, "T": 1, "H": H, "K": K, "V": V,
                   "copy_gbs": bw / 1e9, "state_mb": state_bytes / 1e6}
            try:
                start = time.perf_counter()
                row["rel_err"] = reference_error(fn, args, scale)
                torch.cuda.synchronize()
                row["first_call_s"] = time.perf_counter() - start
                with torch.no_grad():
                    row["ms"] = bench(lambda: fn(*args, scale))
                    row["graph_ms"] = bench_graph(lambda: fn(*args, scale))
                for key in ("", "graph_"):
                    row[f"{key}gbs"] = 2 * state_bytes / (row[f"{key}ms"] * 1e-3) / 1e9
                    row[f"{key}pct_copy"] = 100 * row[f"{key}gbs"] * 1e9 / bw
            except Exception as e:  # one failing impl must not hide the others
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            log(row)
            rows.append(row)
            torch.cuda.empty_cache()
    return rows


def run_tile_sweep(log):
    from gla_inductor import triton_recurrent

    rows = []
    for B, H, K, V in DECODE_SHAPES:
        q, k, v, g, state = inputs(B, 1, H, K, V)
        state_bytes = B * H * K * V * 4
        bw = copy_bandwidth(state_bytes)
        default = triton_recurrent.default_recurrent_config(B, H, K, V, q.device)
        for block_v, num_warps in TILE_SWEEP:
            cfg = triton_recurrent.RecurrentConfig(block_v=block_v, num_warps=num_warps)
            row = {"part": "tiles", "B": B, "H": H, "K": K, "V": V, "block_v": block_v, "num_warps": num_warps,
                   "default": cfg == default}
            try:
                ms = bench(lambda: triton_recurrent.fused_recurrent_triton(q, k, v, g, None, state, state, K**-0.5,
                                                                            False, config=cfg))
                row.update(ms=ms, pct_copy=100 * 2 * state_bytes / (ms * 1e-3) / bw)
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            log(row)
            rows.append(row)
    return rows


def run_t_sweep(log, fla_available):
    from gla_inductor import triton_chunk, triton_recurrent

    B, H, K, V = T_SWEEP_SHAPE
    rows = []
    for T in T_SWEEP:
        q, k, v, g, h0 = inputs(B, T, H, K, V)
        scale = K**-0.5
        ht = torch.empty_like(h0)

        def recurrent():
            return triton_recurrent.fused_recurrent_triton(q, k, v, g, None, h0, ht, scale, False), ht

        def chunked():
            return triton_chunk.chunk_fwd_triton(q, k, v, g, None, h0, scale, True, False)

        fns = {"recurrent": recurrent, "chunked": chunked}
        if fla_available:
            from fla.ops.gla import chunk_gla, fused_recurrent_gla

            fns["fla_fused_recurrent"] = lambda: fused_recurrent_gla(q, k, v, gk=g, scale=scale, initial_state=h0,
                                                                     output_final_state=True)
            fns["fla_chunk"] = lambda: chunk_gla(q, k, v, g, scale=scale, initial_state=h0, output_final_state=True)
        ref_o, ref_s = naive_step(*(x.double() for x in (q, k, v, g, h0)), scale)
        for name, fn in fns.items():
            row = {"part": "T sweep", "impl": name, "B": B, "T": T, "H": H, "K": K, "V": V}
            try:
                with torch.no_grad():
                    o, s = fn()
                    row["rel_err"] = max(rel_err(o, ref_o), rel_err(s, ref_s))
                    row["ms"] = bench(fn)
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            log(row)
            rows.append(row)
        torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------


def fmt(x, spec):
    return "—" if x is None or x != x else format(x, spec)


def markdown(meta, rows) -> str:
    lines = [f"GLA decode, {meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, {meta['date']}, "
             f"commit {meta['commit']}", "",
             "GB/s over the state's bytes (read + write); % of a copy of a state-sized buffer; eager / CUDA graph",
             "",
             "| impl | B | H | T | ms | graph ms | GB/s | % of copy | graph % of copy | rel. err |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["part"] != "decode":
            continue
        if "error" in r:
            lines.append(f"| {r['impl']} | {r['B']} | {r['H']} | 1 | error: {r['error'][:80]} | | | | | |")
            continue
        lines.append(f"| {r['impl']} | {r['B']} | {r['H']} | 1 | {fmt(r['ms'], '.4f')} | {fmt(r['graph_ms'], '.4f')} "
                     f"| {fmt(r['gbs'], '.0f')} | {fmt(r['pct_copy'], '.1f')} | {fmt(r['graph_pct_copy'], '.1f')} "
                     f"| {fmt(r['rel_err'], '.1e')} |")
    tiles = [r for r in rows if r["part"] == "tiles" and "error" not in r]
    if tiles:
        lines += ["", "| B | H | best BV | best warps | best % of copy | default BV, warps | default % of copy |",
                  "|---|---|---|---|---|---|---|"]
        for shape in sorted({(r["B"], r["H"]) for r in tiles}):
            mine = [r for r in tiles if (r["B"], r["H"]) == shape]
            best = max(mine, key=lambda r: r["pct_copy"])
            dflt = next((r for r in mine if r["default"]), None)
            lines.append(f"| {shape[0]} | {shape[1]} | {best['block_v']} | {best['num_warps']} | "
                         f"{best['pct_copy']:.1f} | {dflt and (dflt['block_v'], dflt['num_warps'])} | "
                         f"{fmt(dflt and dflt['pct_copy'], '.1f')} |")
    sweep = [r for r in rows if r["part"] == "T sweep"]
    if sweep:
        impls_ = list(dict.fromkeys(r["impl"] for r in sweep))
        lines += ["", f"T sweep at B, H, K, V = {T_SWEEP_SHAPE} (ms; rel. err)", "",
                  "| T | " + " | ".join(impls_) + " |", "|---|" + "---|" * len(impls_)]
        for T in T_SWEEP:
            cells = []
            for name in impls_:
                r = next((r for r in sweep if r["T"] == T and r["impl"] == name), None)
                cells.append("error" if r is None or "error" in r else f"{r['ms']:.4f} ({r['rel_err']:.0e})")
            lines.append(f"| {T} | " + " | ".join(cells) + " |")
        faster = [T for T in T_SWEEP if _ms(sweep, T, "recurrent") < _ms(sweep, T, "chunked")]
        lines += ["", f"recurrent faster than chunked at T in {faster}: set cuda_dispatch.RECURRENT_MAX_T to the "
                      "largest T below the crossover."]
    return "\n".join(lines)


def _ms(rows, T, impl) -> float:
    r = next((r for r in rows if r["T"] == T and r["impl"] == impl and "error" not in r), None)
    return float("inf") if r is None else r["ms"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--impls", default="ours,fla,naive,compiled")
    parser.add_argument("--no-sweep", action="store_true", help="skip the tile sweep")
    args = parser.parse_args()
    import triton

    meta = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": str(datetime.date.today()),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "copy_bandwidth_1gib_tbs": copy_bandwidth(1 << 30) / 1e12,
    }
    print(json.dumps(meta), flush=True)

    def log(row):
        print(json.dumps(row), flush=True)

    fns = impls(args.impls.split(","))
    rows = run_decode(fns, log)
    if "ours" in args.impls:
        if not args.no_sweep:
            rows += run_tile_sweep(log)
        rows += run_t_sweep(log, fla_available="fla_fused_recurrent_gla" in fns)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print()
    print(markdown(meta, rows))


if __name__ == "__main__":
    main()
