"""GPU benchmark: gla_inductor's kernels side by side with FLA 0.6, in one process.

    python benchmarks/gpu_gla.py --out results.json [--impls ours,fla,naive,compiled] [--shapes 0,1]
        [--custom "2,4096,16,128,128;1,8192,16,128,128"]

Per shape (B, T, H, K, V), bf16, layout [B, T, H, D]:
  * ours: `gla_inductor.chunk_gla` (vector gate) and the scalar gate, forward and forward+backward;
  * fla: `fla.ops.gla.chunk_gla` and `fla.ops.simple_gla.chunk_simple_gla` (skipped if absent);
  * naive: the naive parallel scalar-gate form in eager mode (only where [B, H, T, T] fits);
  * compiled: the same naive form under default `torch.compile`.
Reports median ms (`triton.testing.do_bench`), the fraction of the byte floor (q, k, g, v read
once and o written once, over the copy bandwidth measured in the same run) and the peak extra
memory of forward+backward. `benchmarks/report.py` turns the JSON into markdown and a plot.
"""

import argparse
import datetime
import json
import subprocess
import time

import torch
import torch.nn.functional as F

SHAPES = [
    (8, 2048, 16, 128, 128),
    (1, 8192, 96, 128, 128),
    (8, 2048, 4, 256, 512),
    (4, 2048, 16, 128, 128),
    (8, 1024, 8, 64, 64),
    (2, 16384, 16, 128, 128),
]


def bench(fn, warmup=25, rep=100) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def graph_bench(fn) -> float | None:
    """Median ms of CUDA graph replays: the GPU time alone, without the host's launch overhead
    (which ``bench`` includes when the host is slower than the GPU); None if fn cannot be captured."""
    from triton.testing import do_bench_cudagraph

    try:
        return do_bench_cudagraph(fn, rep=50, return_mode="median")
    except Exception:  # noqa: BLE001 - e.g. an autotuner that synchronizes during capture
        return None


def copy_bandwidth() -> float:
    """Bytes read + written per second by a large device-to-device copy."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x))
    return 2 * x.numel() / (ms * 1e-3)


def inputs(B, T, H, K, V, gate):
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(B, T, H, K, device=dev, dtype=dt)
    k = torch.randn(B, T, H, K, device=dev, dtype=dt)
    v = torch.randn(B, T, H, V, device=dev, dtype=dt)
    if gate == "vector":
        g = (F.logsigmoid(torch.randn(B, T, H, K, device=dev, dtype=torch.float32)) / 16).to(dt)
    else:
        g = F.logsigmoid(torch.randn(B, T, H, device=dev, dtype=torch.float32)) / 16
    return [t.requires_grad_() for t in (q, k, v, g)]


def floor_ms(args, o_numel, bw) -> float:
    nbytes = sum(a.numel() * a.element_size() for a in args) + o_numel * 2
    return nbytes / bw * 1e3


def fwd_bwd(fn, args):
    o = fn(*args)
    do = torch.randn_like(o)

    def run():
        for a in args:
            a.grad = None
        fn(*args).backward(do)

    return run


def peak_extra_mib(run) -> float:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def impls(names):
    out = {}
    if "ours" in names:
        import gla_inductor

        # measure the kernels for every gate kind, whatever the dispatch trusts by default
        gla_inductor.config.triton_gates = ("vector", "scalar", "constant", "none")

        out["ours_vector"] = ("vector", lambda q, k, v, g: gla_inductor.chunk_gla(q, k, v, g)[0])
        out["ours_scalar"] = ("scalar", lambda q, k, v, g: gla_inductor.chunk_gla(q, k, v, g)[0])
    if "fla" in names:
        try:
            from fla.ops.gla import chunk_gla
            from fla.ops.simple_gla import chunk_simple_gla

            out["fla_chunk_gla"] = ("vector", lambda q, k, v, g: chunk_gla(q, k, v, g)[0])
            out["fla_chunk_simple_gla"] = ("scalar", lambda q, k, v, g: chunk_simple_gla(q, k, v, g)[0])
        except ImportError as e:
            print("FLA not available:", e)
    if "naive" in names or "compiled" in names:
        def naive(q, k, v, g):
            q, k, v, g = (x.transpose(1, 2).float() for x in (q, k, v, g))
            G = g.cumsum(-1)
            n = q.shape[2]
            mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
            D = torch.exp(G[..., :, None] - G[..., None, :]).masked_fill(~mask, 0)
            o = ((q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5 * D) @ v
            return o.transpose(1, 2).to(torch.bfloat16)

        if "naive" in names:
            out["naive_parallel_eager"] = ("scalar", naive)
        if "compiled" in names:
            out["naive_parallel_compiled"] = ("scalar", torch.compile(naive))
    return out


def run_shape(shape, fns, bw, log):
    B, T, H, K, V = shape
    rows = []
    for name, (gate, fn) in fns.items():
        if name.startswith("naive") and B * H * T * T * 4 * 3 > 40 * 2**30:
            continue  # the [B, H, T, T] matrices would not fit
        torch.manual_seed(0)
        args = inputs(B, T, H, K, V, gate)
        row = {"impl": name, "gate": gate, "shape": shape}
        try:
            start = time.perf_counter()
            run = fwd_bwd(fn, args)
            run()
            torch.cuda.synchronize()
            row["first_call_s"] = time.perf_counter() - start
        except Exception as e:  # a backward that refuses (FLA's chunk_simple_gla on Triton 3.6, its
            # issue #640) still leaves its forward to time
            row["bwd_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            run = None
        try:
            with torch.no_grad():
                row["fwd_ms"] = bench(lambda: fn(*args))
                row["fwd_graph_ms"] = graph_bench(lambda: fn(*args))
            row["floor_ms"] = floor_ms(args, B * T * H * V, bw)
            if run is not None:
                row["fwdbwd_ms"] = bench(run)
                row["peak_extra_mib"] = peak_extra_mib(run)
        except Exception as e:  # one failing impl must not hide the others
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        log(row)
        rows.append(row)
        torch.cuda.empty_cache()
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--impls", default="ours,fla,naive,compiled")
    parser.add_argument("--shapes", default=",".join(str(i) for i in range(len(SHAPES))))
    parser.add_argument("--custom", help="shapes 'B,T,H,K,V;...' to measure instead of --shapes")
    parser.add_argument("--gates", default="vector,scalar", help="gate kinds to measure (FLA's autotuning "
                        "takes minutes per kernel and shape: measure only what a run needs)")
    args = parser.parse_args()
    import triton

    bw = copy_bandwidth()
    meta = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": str(datetime.date.today()),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "copy_bandwidth_tbs": bw / 1e12,
    }
    gates = args.gates.split(",")
    fns = {name: impl for name, impl in impls(args.impls.split(",")).items() if impl[0] in gates}
    rows = []

    def log(row):
        print(json.dumps(row), flush=True)

    if args.custom:
        shapes = [tuple(map(int, shape.split(","))) for shape in args.custom.split(";")]
    else:
        shapes = [SHAPES[i] for i in map(int, args.shapes.split(","))]
    for shape in shapes:
        rows += run_shape(shape, fns, bw, log)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"\n{meta}")
    print(f"{'impl':26s} {'shape':24s} {'fwd ms':>8s} {'graph':>8s} {'fwd+bwd':>8s} {'floor%':>7s} {'MiB':>7s}")
    for r in rows:
        if "error" in r:
            print(f"{r['impl']:26s} {str(r['shape']):24s} ERROR {r['error'][:60]}")
            continue
        graph, fwdbwd, mib = (r.get(key) or float("nan") for key in ("fwd_graph_ms", "fwdbwd_ms", "peak_extra_mib"))
        print(f"{r['impl']:26s} {str(r['shape']):24s} {r['fwd_ms']:8.3f} {graph:8.3f} {fwdbwd:8.3f} "
              f"{100 * r['floor_ms'] / r['fwd_ms']:6.1f}% {mib:7.0f}")


if __name__ == "__main__":
    main()
