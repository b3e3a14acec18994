"""Context-parallel and tensor-parallel scaling of GLA over 1, 2 and 4 GPUs (NCCL).

    python benchmarks/_to_bench/cp_scaling.py [--worlds 1,2,4] [--T 131072] [--compile] [--out cp.json]
    python benchmarks/_to_bench/cp_scaling.py --device cpu --T 2048 --H 4 --K 32 --worlds 1,2   # smoke run

Context parallel (issue targets: 4 GPUs >= 3.5x one GPU, 2 GPUs >= 1.8x, communication <= 5% of
the step): B=1, H=16, K=V=128, bf16, vector gate, sequence T split over W ranks. Per W, the step is
``context_parallel_gla`` forward + backward on each rank's T/W steps (W=1: ``chunk_gla`` on all T,
the baseline), median over iterations, the slowest rank's. The communication share is the time of
the step's collectives run alone (one all-gather of the packed [B, H, K, V + 1] fp32 states and
decays of every rank, and the backward's reduce-scatter) over the step.

Tensor parallel (target: per-rank time within 1.05x of one GPU running that rank's heads): H heads
as DTensors sharded over W ranks, ``chunk_gla`` forward + backward, against ``chunk_gla`` on plain
tensors with H/W heads on one rank.

Every process sets NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 (NVLink multicast off).
"""

import argparse
import datetime
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

PROCESS_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


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


def slowest(ms: float, device) -> float:
    t = torch.tensor([ms], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


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

    B, H, K, V = 1, args.H, args.K, args.K
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tensors = gla_inputs(B, args.T // world, H, K, V, dtype, device, seed=rank)
    gla = gla_inductor.chunk_gla if world == 1 else context_parallel_gla
    if args.compile:
        gla = torch.compile(gla, fullgraph=True)
    step_ms = slowest(timed(step_fn(gla, tensors), device, args.iters), device)
    # the step's collectives alone: the all-gather of the packed states and decays, [B, H, K, V + 1]
    # in fp32 per rank, and the backward's reduce-scatter of their gradients
    packed = torch.randn(B * H * K * (V + 1), device=device)
    gathered = packed.new_empty(world * packed.numel())

    def comm():
        dist.all_gather_into_tensor(gathered, packed)
        dist.reduce_scatter_tensor(packed, gathered)

    comm_ms = slowest(timed(comm, device, args.iters), device) if world > 1 else 0.0
    return {"world": world, "T_per_rank": args.T // world, "step_ms": step_ms, "comm_ms": comm_ms}


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

    def dtensor_step():
        o, _ = gla_inductor.chunk_gla(*sharded)
        o.backward(do_sharded)

    dt_ms = slowest(timed(dtensor_step, device, args.iters), device)
    local_ms = slowest(timed(step_fn(gla_inductor.chunk_gla, local), device, args.iters), device)
    return {"world": world, "heads_per_rank": H // world, "dtensor_ms": dt_ms, "local_heads_ms": local_ms}


def worker(rank, world, port, args, queue):
    os.environ.update(PROCESS_ENV)
    device = torch.device(args.device, rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    result = (tp_rank if args.mode == "tp" else cp_rank)(rank, world, args, device)
    if rank == 0:
        queue.put(result)
    dist.destroy_process_group()


def run(world, args) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(worker, args=(world, port, args, queue), nprocs=world)
    return queue.get()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("cp", "tp"), default="cp")
    parser.add_argument("--worlds", default="1,2,4")
    parser.add_argument("--T", type=int, default=131072)
    parser.add_argument("--H", type=int, default=16)
    parser.add_argument("--K", type=int, default=128)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out")
    args = parser.parse_args()
    os.environ.update(PROCESS_ENV)
    worlds = [int(w) for w in args.worlds.split(",")]
    if args.device == "cuda":
        worlds = [w for w in worlds if w <= torch.cuda.device_count()]
    results = [run(w, args) for w in worlds if args.mode == "cp" or w > 1]
    if args.mode == "cp":
        base = next((r["step_ms"] for r in results if r["world"] == 1), None)
        print(f"CP, B=1 T={args.T} H={args.H} K=V={args.K}, forward + backward{' (compiled)' if args.compile else ''}")
        print(" W   ms/step   speedup   comm ms   comm share")
        for r in results:
            r["speedup"] = base / r["step_ms"] if base else None
            r["comm_share"] = r["comm_ms"] / r["step_ms"]
            speedup = f"{r['speedup']:.2f}x" if base else "-"
            print(f"{r['world']:2d} {r['step_ms']:9.2f} {speedup:>9} {r['comm_ms']:9.3f} {r['comm_share']:11.1%}")
    else:
        print(f"TP, B=1 T={args.T // 4} H={args.H} K=V={args.K}, forward + backward")
        print(" W   DTensor ms   local heads ms   ratio")
        for r in results:
            r["ratio"] = r["dtensor_ms"] / r["local_heads_ms"]
            print(f"{r['world']:2d} {r['dtensor_ms']:12.2f} {r['local_heads_ms']:16.2f} {r['ratio']:7.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
