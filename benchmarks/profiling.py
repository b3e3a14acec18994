"""Where the time goes (``python -m benchmarks profile TOOL``).

  host     host time of eager ``gla_inductor.chunk_gla`` calls at --shape (forward; --bwd: training
           step): microseconds per call with the launch queue kept from filling (a synchronize every 8
           calls), the GPU time (CUDA graph), a cProfile of the calls; --decode adds decode-sized calls
           (the ``fused_recurrent`` op, ``chunk_gla`` at T=1, ``torch.add`` as a floor), unsynchronized;
           --trace a torch.profiler table of CPU and CUDA calls (syncs, copies).
  launch   host time of the eager forward with the standalone kernels' direct launches and through
           Triton's ``JITFunction.run``, interleaved rounds in one process (the host's speed drifts by
           tens of percent between runs).
  kernels  the CUDA kernels of eager forwards (--bwd: forward+backward) at --shape, by total time.
  block    the CUDA kernels of the compiled block's training step per variant (``benchmarks.block``);
           --code DIR writes Inductor's output code; --configs NAME the launch configs chosen.
  mixer    the compiled Mamba2 mixer: its top CUDA kernels, its output code (--code DIR), and the scan
           op alone at each fp32 dot precision with its error against float64.
  ncu      a few eager forwards at --shape for Nsight Compute, and the command lines to profile them.
  ncu-hot  summary of an Nsight Compute SASS source page (CSV), no GPU needed (``benchmarks.offline``).
  sm90     compile a kernel for sm_90 without a GPU: registers, spills, wgmma serialization
           (``benchmarks.offline``).
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import statistics
import time

import torch

from benchmarks import harness, inputs, report

TOOLS = ("host", "launch", "kernels", "block", "mixer", "ncu", "ncu-hot", "sm90")
OFFLINE = ("ncu-hot", "sm90")


def add_arguments(p) -> None:
    from benchmarks import offline

    p.add_argument("tool", choices=TOOLS)
    p.add_argument("--shape", help="B,T,H,K,V (default per tool)")
    p.add_argument("--gate", default="vector", choices=["vector", "scalar"])
    p.add_argument("--bwd", action="store_true", help="host, kernels: forward and backward")
    p.add_argument("--decode", action="store_true", help="host: decode-sized calls too")
    p.add_argument("--trace", action="store_true", help="host: a torch.profiler table too")
    p.add_argument("--rounds", type=int, default=12, help="launch: interleaved rounds")
    p.add_argument("--steps", type=int, default=10, help="kernels, block: profiled calls")
    p.add_argument("--variants", default="ours,ours-unfused", help="block: variants")
    p.add_argument("--configs", help="block: print the launch configs of kernels whose names hold this")
    p.add_argument("--code", metavar="DIR", help="block, mixer: write Inductor's output code into DIR")
    p.add_argument("--groups", type=int, default=1, help="mixer: B/C groups")
    offline.add_arguments(p)


def shape_of(args, default: str) -> tuple:
    return tuple(int(x) for x in (args.shape or ("2,256,4,64,64" if args.quick else default)).split(","))


def host_us(fn, n: int = 400) -> float:
    """Median over batches of 8 calls of the host time per call; each batch starts on an idle GPU, so
    a call never waits for a full launch queue."""
    times = []
    for _ in range(max(1, n // 8)):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(8):
            fn()
        times.append((time.perf_counter() - start) / 8 * 1e6)
    return statistics.median(times)


def unsynced_us(fn, n: int = 300) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / n * 1e6


def cprofile(fn, calls: int = 200, top: int = 25) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for i in range(calls):
        fn()
        if i % 8 == 7:
            torch.cuda.synchronize()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def kernel_table(fn, steps: int, n: int = 18, cpu: bool = False) -> str:
    """The top kernels by total CUDA time over ``steps`` calls (totals: divide by steps)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    acts = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if cpu else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    sort = "self_cpu_time_total" if cpu else "cuda_time_total"
    return f"(totals over {steps} calls)\n" + prof.key_averages().table(sort_by=sort, row_limit=n,
                                                                         max_name_column_width=80)


def chunk_call(args, shape):
    """An eager chunk_gla forward (or training step) at shape."""
    import gla_inductor

    xs = inputs.gla_inputs(*shape, gate=args.gate, gate_dtype=torch.bfloat16, requires_grad=args.bwd)
    do = torch.randn_like(xs[2])

    def call():
        if not args.bwd:
            with torch.no_grad():
                return gla_inductor.chunk_gla(*xs)[0]
        for x in xs:
            x.grad = None  # no gradient accumulation kernels
        gla_inductor.chunk_gla(*xs)[0].backward(do)

    return call


def run_host(args, result) -> None:
    import gla_inductor

    shape = shape_of(args, "8,1024,8,64,64")
    call = chunk_call(args, shape)
    for _ in range(20):
        call()
    gpu = None if args.bwd else harness.graph_ms(call)
    result.rows.append({"call": f"chunk_gla {'fwd+bwd' if args.bwd else 'fwd'} {shape} {args.gate}",
                        "host_us": host_us(call), "gpu_us": None if gpu is None else gpu * 1e3})
    text = [cprofile(call)]
    if args.decode:
        B, H, K, V = 64, 24, 128, 64
        q, k = (torch.randn(B, 1, H, K, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        v, g = torch.randn(B, 1, H, V, device="cuda", dtype=torch.bfloat16), -torch.rand(B, 1, H, device="cuda")
        state = torch.zeros(B, H, K, V, device="cuda")
        op = torch.ops.gla_inductor.fused_recurrent.default
        calls = {"fused_recurrent op (decode, unsynchronized)": lambda: op(q, k, v, g, None, state, 1.0, False),
                 "chunk_gla T=1 (unsynchronized)": lambda: gla_inductor.chunk_gla(q, k, v, g, scale=1.0),
                 "torch.add, a floor (unsynchronized)": lambda: torch.add(q, k)}
        with torch.no_grad():
            result.rows += [{"call": name, "host_us": unsynced_us(fn)} for name, fn in calls.items()]
            text.append(cprofile(calls["fused_recurrent op (decode, unsynchronized)"]))
    if args.trace:
        text.append(kernel_table(call, 20, 30, cpu=True))
    result.sections += [report.table(result.rows, [("call", "call", ""), ("host us per call", "host_us", ".1f"),
                                                   ("GPU us (graph)", "gpu_us", ".1f")])]
    result.sections += ["```\n" + t + "\n```" for t in text]


def run_launch(args, result) -> None:
    from benchmarks import internals

    shape = shape_of(args, "8,1024,8,64,64")
    args.bwd = False
    call = chunk_call(args, shape)
    with internals.launch_via_triton():
        via = call()
    if not torch.equal(call(), via):
        raise RuntimeError("direct launches and launches through Triton gave different outputs")
    samples = {"direct": [], "via Triton": []}
    for _ in range(args.rounds):
        samples["direct"].append(host_us(call, 160))
        with internals.launch_via_triton():
            samples["via Triton"].append(host_us(call, 160))
    for name, xs in samples.items():
        result.rows.append({"launch": name, "shape": list(shape), "median_us": statistics.median(xs),
                            "min_us": min(xs), "max_us": max(xs)})
    result.sections.append(report.table(result.rows, [
        ("launch", "launch", ""), ("host us per forward", "median_us", ".1f"), ("min", "min_us", ".1f"),
        ("max", "max_us", ".1f")]))


def run_kernels(args, result) -> None:
    shape = shape_of(args, "8,2048,4,256,512")
    table = kernel_table(chunk_call(args, shape), args.steps, 12)
    result.sections.append(f"{shape} {args.gate} {'fwd+bwd' if args.bwd else 'fwd'}\n\n```\n{table}\n```")


def run_block(args, result) -> None:
    import gla_inductor
    from benchmarks import block

    shape = shape_of(args, ",".join(map(str, block.SHAPE)))
    block.warm_up_inductor()
    for variant in args.variants.split(","):
        with gla_inductor.config.patch(fuse_gates=variant != "ours-unfused"):
            mod, x, dy = block.make(block.fla_gla if variant == "fla" else inputs.naive_pairwise_vector, shape, "cuda",
                                    torch.bfloat16)
            fn = block.compiled(variant, mod)
            if args.code:
                write_code(args.code, variant, lambda: block.step(fn, x, dy))
            text = kernel_table(lambda: block.step(fn, x, dy), args.steps)
            if args.configs:
                text += "\n" + "\n".join(chosen_configs(args.configs))
            result.sections.append(f"### {variant} {shape}\n\n```\n{text}\n```")


def write_code(folder: str, variant: str, fn) -> None:
    from torch._inductor.utils import run_and_get_code

    os.makedirs(folder, exist_ok=True)
    _, codes = run_and_get_code(fn)
    for i, code in enumerate(codes):
        with open(os.path.join(folder, f"{variant}_{i}.py"), "w") as f:
            f.write(code)


def chosen_configs(pattern: str) -> list:
    """The launch config each loaded Inductor kernel whose name holds ``pattern`` settled on."""
    from torch._inductor.codecache import PyCodeCache

    return [f"{name}: {obj.launchers[0].config}" for mod in list(PyCodeCache.modules) for name, obj in vars(mod).items()
            if pattern in name and getattr(obj, "launchers", None)]


def run_mixer(args, result) -> None:
    import gla_inductor
    from benchmarks import internals
    from benchmarks.models import QUICK_MIXER, MixerShape, mamba2_config
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer

    s = QUICK_MIXER if args.quick else MixerShape(groups=args.groups)
    torch.manual_seed(0)
    mixer = Mamba2Mixer(mamba2_config(s, layers=1), layer_idx=0).cuda().to(torch.bfloat16).eval()
    x = torch.randn(s.B, s.T, s.hidden, device="cuda", dtype=torch.bfloat16)
    fn = torch.compile(mixer, backend=gla_inductor.backend, dynamic=False)
    with torch.no_grad():
        if args.code:
            write_code(args.code, "mixer", lambda: fn(x))
        table = kernel_table(lambda: fn(x), 1, 15)
        result.rows.append({"what": "compiled mixer (ours)", "ms": harness.time_one(lambda: fn(x)).median})
        B, T, H, K, V = s.B, s.T, s.heads, s.state, s.head_dim
        q, k = (torch.randn(B, T, H, K, device="cuda") * K**-0.5 for _ in range(2))
        v, g = torch.randn(B, T, H, V, device="cuda"), -torch.rand(B, T, H, device="cuda") * 0.5
        part = [t[:1, :512] for t in (q, k, v, g)]
        want = gla_inductor.chunk_gla(*(t.double().cpu() for t in part), scale=1.0)[0]
        for precision in ("ieee", "tf32x3", "tf32"):
            with internals.f32_precision(precision):
                ms = harness.time_one(lambda: gla_inductor.chunk_gla(q, k, v, g, scale=1.0)).median
                got = gla_inductor.chunk_gla(*part, scale=1.0)[0]
            err = ((got.double().cpu() - want).abs().max() / want.abs().max()).item()
            result.rows.append({"what": f"scan alone, fp32 dots {precision}", "ms": ms, "max_rel_err": err})
    result.sections += [report.table(result.rows, [("what", "what", ""), ("ms", "ms", ".3f"),
                                                   ("max rel err", "max_rel_err", ".1e")]), f"```\n{table}\n```"]


def run_ncu(args, result) -> None:
    from benchmarks import internals

    shape = shape_of(args, "8,2048,4,256,512")
    q, k, v, g = inputs.gla_inputs(*shape, gate=args.gate, gate_dtype=torch.bfloat16)
    for _ in range(6):
        internals.chunk_fwd_kernel(q, k, v, g, scale=shape[3] ** -0.5)
    torch.cuda.synchronize()
    s = ",".join(map(str, shape))
    result.sections.append(
        "Six eager forwards ran. Under Nsight Compute:\n\n"
        f"    ncu --set full --import-source yes -k regex:gla_chunk_carry --launch-skip 3 -c 1 -f -o carry \\\n"
        f"        python -m benchmarks profile ncu --shape {s}\n"
        "    ncu --import carry.ncu-rep --page source --csv --print-source sass > sass.csv\n"
        "    python -m benchmarks profile ncu-hot --csv sass.csv\n\n"
        "An ablation variant instead: `python -m benchmarks tune ablate --once --only base` as the profiled command.")


def run(args):
    from benchmarks import offline

    if args.tool in OFFLINE:
        return offline.run(args)
    harness.require_cuda(f"profile {args.tool}")
    runners = {"host": run_host, "launch": run_launch, "kernels": run_kernels, "block": run_block,
               "mixer": run_mixer, "ncu": run_ncu}
    result = report.new_result(f"profile-{args.tool}", f"Profile: {args.tool}", "cuda")
    runners[args.tool](args, result)
    return result
