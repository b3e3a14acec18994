"""One GPU, world of 1: context_parallel_gla's step against chunk_gla's, eager (the two-pass
Function on the ops' implementations) and compiled (the same Function traced, fullgraph), each with
chunk_fwd and chunk_bwd cut around the exchange and with the states-only passes.

    PYTHONPATH=. python benchmarks/cp_profile.py [T] [--profile]       (CUDA, NCCL world of 1)
    PYTHONPATH=. python benchmarks/cp_profile.py 256 --cpu             (gloo on CPU: checks the script)

Prints ms per forward + backward step of each, and with --profile the CUDA kernels of each.
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29577"),
                  NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
args = [a for a in sys.argv[1:] if not a.startswith("--")]
cpu, profile = "--cpu" in sys.argv, "--profile" in sys.argv
dev = "cpu" if cpu else "cuda"
if cpu:
    dist.init_process_group("gloo", rank=0, world_size=1)
else:
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))

import gla_inductor  # noqa: E402
from gla_inductor.distributed import context_parallel as cp  # noqa: E402

T = int(args[0]) if args else 32768
B, H, K = 1, (2 if cpu else 16), (16 if cpu else 128)
dtype = torch.float32 if cpu else torch.bfloat16
q, k, v = (torch.randn(B, T, H, K, device=dev, dtype=dtype, requires_grad=True) for _ in range(3))
g = (F.logsigmoid(torch.randn(B, T, H, K, device=dev)) / 16).to(dtype).requires_grad_()
do = torch.randn_like(v)


def step(fn):
    o, _ = fn(q, k, v, g, output_final_state=True)
    o.backward(do)


def sync():
    if not cpu:
        torch.cuda.synchronize()


def time_ms(fn, iters: int) -> float:
    import time
    for _ in range(3):
        step(fn)
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        step(fn)
    sync()
    return (time.perf_counter() - start) / iters * 1e3


def runs():
    """chunk_gla, then context_parallel_gla eager and compiled, with chunk_fwd and chunk_bwd cut around
    the exchange and with the states-only passes (gla_inductor.config.context_parallel_cut)."""
    yield "chunk_gla", gla_inductor.chunk_gla
    for cut in (True, False):
        with gla_inductor.config.patch(context_parallel_cut=cut):
            torch._dynamo.reset()  # the switch is read as the step is traced
            way = "cut" if cut else "states_pass"
            yield f"cp_w1_eager_{way}", cp.context_parallel_gla
            yield f"cp_w1_compiled_{way}", torch.compile(cp.context_parallel_gla, fullgraph=True)


for name, fn in runs():
    print(f"{name}: {time_ms(fn, 2 if cpu else 10):.2f} ms/step", flush=True)
    if profile:
        activities = [torch.profiler.ProfilerActivity.CPU] + ([] if cpu else [torch.profiler.ProfilerActivity.CUDA])
        with torch.profiler.profile(activities=activities) as p:
            for _ in range(3):
                step(fn)
            sync()
        sort = "cpu_time_total" if cpu else "cuda_time_total"
        print(p.key_averages().table(sort_by=sort, row_limit=18, max_name_column_width=60), flush=True)
print("two-pass Function calls:", dict(cp.two_pass_calls))
dist.destroy_process_group()
