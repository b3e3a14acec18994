"""GPU benchmark: decoding into a serving engine's state pool, under CUDA graphs.

    python benchmarks/_to_bench/pool_decode.py --out pool_decode.json [--batches 16,64,256] [--steps 1,4]
        [--pad 0.0] [--impls ours,fla]
    python benchmarks/_to_bench/pool_decode.py --smoke   # CPU, tiny shapes, Triton interpreter: checks the script

A pool [P, H, K, V] of recurrent states, P = 1024, H = 32, K = V = 128, and B sequences decoding one
step (or T short steps) each: sequence b reads and writes slot idx[b] in place, idx distinct random
slots (a fraction --pad of them -1: padded entries). bf16 q, k, v and vector gate (logsigmoid / 16,
as FLA's GLA layer), fp32 pool unless named otherwise. Rows:

  ours_pool_kv      fused_recurrent_gla(..., initial_state=pool, ssm_state_indices=idx, inplace_final_state=True)
  ours_pool_vk      the same on a V-first pool [P, H, V, K] (vLLM's and SGLang's layout), state_v_first=True
  ours_pool_kv_bf16 a bf16 pool
  ours_batch        the fused_recurrent op on a contiguous [B, H, K, V] state: the same work without a pool
  fla_pool          FLA's fused_recurrent_gla with ssm_state_indices, where its signature has them
  fla_gather        otherwise FLA the way a caller must use it: gather the slots, call with
                    output_final_state, scatter the final states back (index_copy_)

Each row is checked first against a float64 step on the touched slots (relative error of o and of
the updated slots) and for untouched slots left bit-equal; then timed as the median of CUDA-graph
replays (``triton.testing.do_bench_cudagraph``: no host overhead) and eagerly. The floor is a
device-to-device copy of the state bytes the call must move (B * H * K * V * bytes per element, read
once and written once), timed the same way, in the same process: ``pct_floor`` = floor time / time.
Target: >= 90 % at B >= 64.

JSON rows go to --out with the GPU, versions and date; a markdown table is printed last.
"""

import argparse
import datetime
import inspect
import json
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

P, H, K, V = 1024, 32, 128, 128


# ----------------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------------


def bench_eager(fn, smoke: bool) -> float:
    if smoke:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def bench_graph(fn, smoke: bool) -> float:
    """Median ms of fn replayed from a CUDA graph, or NaN where it does not capture."""
    if smoke:
        return float("nan")
    from triton.testing import do_bench_cudagraph

    try:
        return do_bench_cudagraph(fn, rep=100, return_mode="median")
    except Exception as e:  # a host sync or an allocation that capture refuses
        torch.cuda.synchronize()
        print(f"  capture failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        return float("nan")


def copy_ms(nbytes: int, device, smoke: bool, graph: bool = True) -> float:
    """Time of a device-to-device copy of nbytes (read once, written once)."""
    x = torch.empty(nbytes, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    return bench_graph(lambda: y.copy_(x), smoke) if graph else bench_eager(lambda: y.copy_(x), smoke)


# ----------------------------------------------------------------------------------------------
# inputs and the float64 check
# ----------------------------------------------------------------------------------------------


def make_inputs(B, T, shape, device, pad: float, seed=0):
    P_, H_, K_, V_ = shape
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*s, dtype=torch.bfloat16):
        return torch.randn(*s, generator=gen, device=device).to(dtype)

    q, k, v = randn(B, T, H_, K_), randn(B, T, H_, K_), randn(B, T, H_, V_)
    g = (F.logsigmoid(randn(B, T, H_, K_, dtype=torch.float32)) / 16).to(torch.bfloat16)
    idx = torch.randperm(P_, generator=gen, device=device)[:B].to(torch.int32)
    n_pad = int(round(pad * B))
    if n_pad:
        idx[torch.randperm(B, generator=gen, device=device)[:n_pad]] = -1
    return q, k, v, g, idx


def reference(q, k, v, g, h0, scale):
    """(o, final states) of a float64 time loop from h0 [B, H, K, V]."""
    S = h0.double()
    o = []
    for t in range(q.shape[1]):
        S = S * g[:, t].double().exp()[..., None] + k[:, t].double()[..., None] * v[:, t].double()[..., None, :]
        o.append((q[:, t].double()[..., None] * S).sum(-2) * scale)
    return torch.stack(o, 1), S


def rel_err(a, b) -> float:
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()


def check(impl, q, k, v, g, idx, scale) -> dict:
    """Run impl once on a copy of its pool: errors of o and of the touched slots against float64,
    and whether untouched slots and padded outputs are exact."""
    pool_kv = impl.kv(impl.pool)
    before = pool_kv.clone()
    valid = idx >= 0
    slots = idx[valid].long()
    h0 = torch.zeros(q.shape[0], *before.shape[1:], dtype=torch.float64, device=q.device)
    h0[valid] = before[slots].double()
    ref_o, ref_s = reference(q, k, v, g, h0, scale)
    o = impl.fn(q, k, v, g, idx, scale)
    touched = torch.zeros(before.shape[0], dtype=torch.bool, device=q.device)
    touched[slots] = True
    out = {
        "err_o": rel_err(o[valid], ref_o[valid]) if valid.any() else 0.0,
        "err_state": rel_err(pool_kv[slots], ref_s[valid]) if valid.any() else 0.0,
        "untouched_exact": bool(torch.equal(pool_kv[~touched], before[~touched])),
        "padded_zero": bool((o[~valid] == 0).all()),
    }
    pool_kv.copy_(before)
    return out


# ----------------------------------------------------------------------------------------------
# implementations: .fn(q, k, v, g, idx, scale) -> o, updating .pool in place
# ----------------------------------------------------------------------------------------------


class Impl:
    def __init__(self, name, pool, fn, v_first=False, state_bytes_per_elem=4, pooled=True):
        self.name, self.pool, self.fn, self.v_first = name, pool, fn, v_first
        self.elem = state_bytes_per_elem
        self.pooled = pooled

    def kv(self, x):
        return x.transpose(-1, -2) if self.v_first else x


def ours(shape, B, device):
    import gla_inductor

    P_, H_, K_, V_ = shape
    impls = []
    for name, dtype, v_first in (("ours_pool_kv", torch.float32, False), ("ours_pool_vk", torch.float32, True),
                                 ("ours_pool_kv_bf16", torch.bfloat16, False)):
        pool = torch.randn(P_, H_, V_, K_, device=device) if v_first else torch.randn(P_, H_, K_, V_, device=device)
        pool = pool.to(dtype)

        def fn(q, k, v, g, idx, scale, pool=pool, v_first=v_first):
            return gla_inductor.fused_recurrent_gla(q, k, v, g, scale=scale, initial_state=pool,
                                                    ssm_state_indices=idx, inplace_final_state=True,
                                                    state_v_first=v_first)[0]

        impls.append(Impl(name, pool, fn, v_first, torch.finfo(dtype).bits // 8))
    state = torch.randn(B, H_, K_, V_, device=device)

    def batch(q, k, v, g, idx, scale):
        return torch.ops.gla_inductor.fused_recurrent(q, k, v, g, None, state, scale, False)

    impls.append(Impl("ours_batch", state, batch, pooled=False))
    return impls


def fla(shape, device):
    try:
        from fla.ops.gla import fused_recurrent_gla
    except ImportError as e:
        print("FLA not available:", e, flush=True)
        return []
    P_, H_, K_, V_ = shape
    pool = torch.randn(P_, H_, K_, V_, device=device)
    # fused_recurrent_gla takes **kwargs and ignores unknown ones: only a named parameter counts
    if "ssm_state_indices" in inspect.signature(fused_recurrent_gla).parameters:
        def fn(q, k, v, g, idx, scale):
            return fused_recurrent_gla(q, k, v, gk=g, scale=scale, initial_state=pool, ssm_state_indices=idx,
                                       inplace_final_state=True)[0]

        return [Impl("fla_pool", pool, fn)]

    def gather(q, k, v, g, idx, scale):
        slots = idx.long()
        o, ht = fused_recurrent_gla(q, k, v, gk=g, scale=scale, initial_state=pool.index_select(0, slots),
                                    output_final_state=True)
        pool.index_copy_(0, slots, ht)
        return o

    return [Impl("fla_gather", pool, gather)]


# ----------------------------------------------------------------------------------------------
# the run
# ----------------------------------------------------------------------------------------------


def run(args, log):
    device = "cpu" if args.smoke else "cuda"
    shape = (16, 2, 32, 32) if args.smoke else (P, H, K, V)
    rows = []
    for T in args.steps:
        for B in args.batches:
            q, k, v, g, idx = make_inputs(B, T, shape, device, args.pad)
            scale = shape[2] ** -0.5
            impls = ours(shape, B, device) if "ours" in args.impls else []
            if "fla" in args.impls and not args.pad:  # FLA's gather cannot skip padded entries
                impls += fla(shape, device)
            for impl in impls:
                state_bytes = B * shape[1] * shape[2] * shape[3] * impl.elem
                floor = copy_ms(state_bytes, device, args.smoke)
                row = {"impl": impl.name, "B": B, "T": T, "P": shape[0], "H": shape[1], "K": shape[2],
                       "V": shape[3], "pad": args.pad, "state_mb": state_bytes / 1e6, "floor_ms": floor}
                try:
                    if impl.pooled:
                        row.update(check(impl, q, k, v, g, idx, scale))
                    else:
                        ref_o, ref_s = reference(q, k, v, g, impl.pool, scale)
                        row.update(err_o=rel_err(impl.fn(q, k, v, g, idx, scale), ref_o),
                                   err_state=rel_err(impl.pool, ref_s))
                    with torch.no_grad():
                        row["ms"] = bench_eager(lambda: impl.fn(q, k, v, g, idx, scale), args.smoke)
                        row["graph_ms"] = bench_graph(lambda: impl.fn(q, k, v, g, idx, scale), args.smoke)
                    row["graph_gbs"] = 2 * state_bytes / (row["graph_ms"] * 1e-3) / 1e9
                    row["pct_floor"] = 100 * floor / row["graph_ms"]
                except Exception as e:  # one failing impl must not hide the others
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                log(row)
                rows.append(row)
            del impls
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows


def markdown(meta, rows) -> str:
    lines = [f"{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, fla {meta['fla']}, {meta['date']}, "
             f"commit {meta['commit']}; P = {rows[0]['P'] if rows else '?'}, H, K, V as in the rows",
             "",
             "| impl | B | T | pad | state MB | graph ms | eager ms | floor ms | % floor | err o | err state | "
             "untouched exact | pads zero |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['impl']} | {r['B']} | {r['T']} | {r['pad']} | {r['state_mb']:.1f} | "
                         f"error: {r['error'][:80]} |")
            continue
        lines.append(
            f"| {r['impl']} | {r['B']} | {r['T']} | {r['pad']} | {r['state_mb']:.1f} | {r['graph_ms']:.4f} | "
            f"{r['ms']:.4f} | {r['floor_ms']:.4f} | {r['pct_floor']:.1f} | {r['err_o']:.1e} | "
            f"{r.get('err_state', float('nan')):.1e} | {r.get('untouched_exact', '-')} | {r.get('padded_zero', '-')} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="pool_decode.json")
    parser.add_argument("--batches", default="16,64,256", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--steps", default="1", type=lambda s: [int(x) for x in s.split(",")],
                        help="tokens per sequence per call (T)")
    parser.add_argument("--pad", default=0.0, type=float, help="fraction of padded entries (index -1)")
    parser.add_argument("--impls", default="ours,fla")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, no timing: checks the script")
    args = parser.parse_args()
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        args.batches = [4, 8]
    import triton

    try:
        import fla
        fla_version = getattr(fla, "__version__", "?")
    except ImportError:
        fla_version = "absent"
    meta = {
        "gpu": "cpu (smoke)" if args.smoke else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "fla": fla_version,
        "date": str(datetime.date.today()),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True).stdout.strip(),
        "copy_1gib_ms": float("nan") if args.smoke else copy_ms(1 << 30, "cuda", False, graph=False),
    }
    print(json.dumps(meta), flush=True)

    def log(row):
        print(json.dumps(row), flush=True)

    rows = run(args, log)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print()
    print(markdown(meta, rows))


if __name__ == "__main__":
    main()
