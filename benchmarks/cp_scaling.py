"""Context-parallel and tensor-parallel scaling of GLA over 1, 2 and 4 GPUs (NCCL).

Context parallel (issue targets: 4 GPUs >= 3.5x one GPU, 2 GPUs >= 1.8x, communication <= 5% of
the step): B=1, H=16, K=V=128, bf16, vector gate, sequence T (128k) split over W ranks. Per W, the
step is ``context_parallel_gla`` forward + backward on each rank's T/W steps (W=1: ``chunk_gla`` on
all T, the baseline), median over iterations, the slowest rank's (``step_ms_ranks``: every rank's,
to see an imbalance). The communication share, two ways: ``comm_in_step``: the time of the step's
NCCL kernels inside the step (one profiled step, the slowest rank; their waits for slower peers
included), over the step; ``comm_alone``: the step's collectives run by themselves (the forward's
all-gather of the packed [B, H, K, V + 1] fp32 states and decays of every rank, and the backward's
all-gather of the [B, H, K, V] fp32 entering-state gradients: the step asks for no final state),
over the step. ``--trace DIR`` writes each
rank's profiled step as a Chrome trace (DIR/cp_w{W}_rank{r}.json), where waits show as NCCL
kernels that start before the peers' matching ones.

Timing, two ways. ``step_ms``: before each timed step the ranks meet at a barrier and synchronize
their GPU, so every step starts from an idle GPU and a rank whose host launches late makes the
others wait at each collective. ``steady_ms``: ``--iters`` steps back to back after one barrier (as
a training loop runs them), per step: there the host runs ahead of the GPU wherever it is faster,
and the ranks' launch jitter is absorbed instead of waited for. The profiled step is timed as
``step_ms``, inside the profiler, after its start-up (which takes a different time on every rank:
a barrier before it would leave the first rank's collectives waiting for the others' start-up).

``--states-pass`` runs each rank's states-only passes (``chunk_final_state``) before the whole ops
instead of cutting chunk_fwd and chunk_bwd around the all-gathers (``gla_inductor.config.
context_parallel_cut``), for the comparison.

Tensor parallel (--mode tp; target: per-rank time within 1.05x of one GPU running that rank's
heads): H heads as DTensors sharded over W ranks, ``chunk_gla`` forward + backward, against
``chunk_gla`` on plain tensors with H/W heads on one rank (``tp-overhead`` splits this by pass).

Each W runs in W fresh processes (torch.multiprocessing spawn); every process sets
NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 (NVLink multicast off) before NCCL starts.
--device cpu runs gloo processes on CPU at a tiny size (checks the benchmark).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks import harness, report

CPU_SIZE = {"T": 256, "H": 2, "K": 16}


def add_arguments(p) -> None:
    p.add_argument("--mode", choices=("cp", "tp"), default="cp")
    p.add_argument("--worlds", default="1,2,4", help="process counts (those above the GPU count are left out)")
    p.add_argument("--T", type=int, default=131072)
    p.add_argument("--H", type=int, default=16)
    p.add_argument("--K", type=int, default=128, help="K = V")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--compile", action="store_true", help="torch.compile the GLA call")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--trace", default="", help="write each rank's profiled step as a Chrome trace here")
    p.add_argument("--states-pass", action="store_true",
                   help="run the states-only passes instead of cutting chunk_fwd and chunk_bwd around the "
                        "exchange (gla_inductor.config.context_parallel_cut off): the comparison")


def timed(fn, device, iters: int, warmup: int = 3) -> float:
    """Median milliseconds of fn() on this rank, ranks aligned by a barrier before each run."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def steady(fn, device, iters: int, warmup: int = 3) -> float:
    """Milliseconds per step of ``iters`` steps run back to back, the ranks aligned by one barrier
    before them (``step_ms`` aligns every step)."""
    for _ in range(warmup):
        fn()
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / iters


def slowest(ms: float, device) -> float:
    return max(every_rank(ms, device))


def every_rank(ms: float, device) -> list[float]:
    """ms of every rank, in rank order (after the timed region: the copy to the host waits)."""
    t = torch.tensor([ms], device=device)
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t)
    return [x.item() for x in gathered]


def gla_inputs(B, T, H, K, V, dtype, device, seed):
    gen = torch.Generator(device=device).manual_seed(seed)
    q, k = (torch.randn(B, T, H, K, generator=gen, device=device, dtype=dtype) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen, device=device, dtype=dtype)
    g = F.logsigmoid(torch.randn(B, T, H, K, generator=gen, device=device)).to(dtype) / 16
    return [x.requires_grad_() for x in (q, k, v, g)]


def step_fn(fn, tensors):
    do = torch.randn_like(tensors[2])

    def step():
        o, _ = fn(*tensors)
        o.backward(do)

    return step


def cp_rank(rank, world, args, device) -> dict:
    import gla_inductor
    from gla_inductor.distributed import context_parallel_gla

    gla_inductor.config.context_parallel_cut = not args.states_pass
    B, H, K, V = 1, args.H, args.K, args.K
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tensors = gla_inputs(B, args.T // world, H, K, V, dtype, device, seed=rank)
    gla = gla_inductor.chunk_gla if world == 1 else context_parallel_gla
    if args.compile:
        gla = torch.compile(gla, fullgraph=True)
    ranks_ms = every_rank(timed(step_fn(gla, tensors), device, args.iters), device)
    steady_ms = slowest(steady(step_fn(gla, tensors), device, args.iters), device)
    # the step's collectives alone: the forward's all-gather of the packed states and decays,
    # [B, H, K, V + 1] fp32 per rank, and the backward's of the entering-state gradients, [B, H, K, V]
    fwd, bwd = (torch.randn(n, device=device) for n in (B * H * K * (V + 1), B * H * K * V))
    fwd_all, bwd_all = (x.new_empty(world * x.numel()) for x in (fwd, bwd))

    def comm():
        dist.all_gather_into_tensor(fwd_all, fwd)
        dist.all_gather_into_tensor(bwd_all, bwd)

    comm_ms = slowest(timed(comm, device, args.iters), device) if world > 1 else 0.0
    trace = os.path.join(args.trace, f"cp_w{world}_rank{rank}.json") if args.trace else ""
    in_step = slowest(nccl_ms_in_step(step_fn(gla, tensors), device, trace), device) if world > 1 else 0.0
    return {"world": world, "T_per_rank": args.T // world, "step_ms": max(ranks_ms), "steady_ms": steady_ms,
            "step_ms_ranks": [round(x, 3) for x in ranks_ms], "comm_alone_ms": comm_ms, "comm_in_step_ms": in_step}


def nccl_ms_in_step(step, device, trace: str = "") -> float:
    """ms of the NCCL kernels of one profiled step on this rank (their waits for peers included);
    NaN on CPU, where gloo launches no kernels. The ranks meet inside the profiler (see the module
    docstring); the barrier's own all-reduce is left out (the step's collectives are all-gathers)."""
    if device.type != "cuda":
        return float("nan")
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        dist.barrier()
        torch.cuda.synchronize()
        step()
        torch.cuda.synchronize()
    if trace:
        os.makedirs(os.path.dirname(trace), exist_ok=True)
        prof.export_chrome_trace(trace)
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA and "nccl" in e.name.lower()
               and "allreduce" not in e.name.lower()]
    return sum(e.device_time_total for e in kernels) / 1e3


def tp_rank(rank, world, args, device) -> dict:
    import gla_inductor
    import gla_inductor.distributed  # noqa: F401  (sharding rules)
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    B, T, H, K = 1, args.T // 4, args.H, args.K
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    full = gla_inputs(B, T, H, K, K, dtype, device, seed=0)
    mesh = init_device_mesh(device.type, (world,))
    sharded = [distribute_tensor(x.detach(), mesh, [Shard(2)]).requires_grad_() for x in full]
    local = [x.to_local().detach().requires_grad_() for x in sharded]
    do_sharded = distribute_tensor(torch.randn(B, T, H, K, device=device, dtype=dtype), mesh, [Shard(2)])

    gla = torch.compile(gla_inductor.chunk_gla, fullgraph=True) if args.compile else gla_inductor.chunk_gla

    def dtensor_step():
        o, _ = gla(*sharded)
        o.backward(do_sharded)

    dt_ms = slowest(timed(dtensor_step, device, args.iters), device)
    local_ms = slowest(timed(step_fn(gla, local), device, args.iters), device)
    return {"world": world, "heads_per_rank": H // world, "dtensor_ms": dt_ms, "local_heads_ms": local_ms}


def rank_result(rank, world, args, device) -> dict:
    return (tp_rank if args.mode == "tp" else cp_rank)(rank, world, args, device)


def run(args):
    if args.device == "cuda":
        harness.require_cuda("cp-scaling")
    if args.device == "cpu":
        args.T, args.H, args.K = CPU_SIZE["T"], CPU_SIZE["H"], CPU_SIZE["K"]
    worlds = [int(w) for w in args.worlds.split(",")]
    notes = []
    if args.device == "cuda":
        dropped = [w for w in worlds if w > torch.cuda.device_count()]
        worlds = [w for w in worlds if w <= torch.cuda.device_count()]
        if dropped:
            notes.append(f"worlds {dropped} left out: {torch.cuda.device_count()} GPU(s) visible")
    if args.quick:
        args.iters = 2
    result = report.new_result(f"cp-scaling-{args.mode}", f"{'Context' if args.mode == 'cp' else 'Tensor'}-parallel "
                               "scaling of GLA", args.device, mode=args.mode, T=args.T, H=args.H, K=args.K,
                               compiled=args.compile, iters=args.iters, cut=not args.states_pass,
                               **harness.PROCESS_ENV)
    for w in worlds:
        if args.mode == "tp" and w == 1:
            continue
        print(f"[cp-scaling] {args.mode} W={w}", file=sys.stderr, flush=True)
        row = harness.run_ranks(rank_result, w, args)
        harness.log(row)
        result.rows.append(row)
    result.notes += notes
    result.sections.append(cp_table(result.rows) if args.mode == "cp" else tp_table(result.rows))
    return result


def cp_table(rows: list) -> str:
    base = next((r["step_ms"] for r in rows if r["world"] == 1), None)
    base_steady = next((r["steady_ms"] for r in rows if r["world"] == 1), None)
    for r in rows:
        r["speedup"] = base / r["step_ms"] if base else None
        r["steady_speedup"] = base_steady / r["steady_ms"] if base_steady else None
        r["comm_in_step_share"] = r["comm_in_step_ms"] / r["step_ms"]
        r["comm_alone_share"] = r["comm_alone_ms"] / r["step_ms"]
    return "Forward + backward per step, the slowest rank\n\n" + report.table(rows, [
        ("W", "world", "d"), ("T per rank", "T_per_rank", "d"), ("ms / step", "step_ms", ".2f"),
        ("speed-up vs 1", "speedup", ".2f"), ("steps back to back, ms / step", "steady_ms", ".2f"),
        ("speed-up vs 1 ", "steady_speedup", ".2f"), ("NCCL in step ms", "comm_in_step_ms", ".3f"),
        ("share", lambda r: 100 * r["comm_in_step_share"], ".1f"), ("collectives alone ms", "comm_alone_ms", ".3f"),
        ("share ", lambda r: 100 * r["comm_alone_share"], ".1f")])


def tp_table(rows: list) -> str:
    for r in rows:
        r["ratio"] = r["dtensor_ms"] / r["local_heads_ms"]
    return report.table(rows, [("W", "world", "d"), ("heads per rank", "heads_per_rank", "d"),
                               ("DTensor ms", "dtensor_ms", ".2f"), ("local heads ms", "local_heads_ms", ".2f"),
                               ("ratio", "ratio", ".3f")])
