"""Where the time of the compiled GLA block's training step goes (GPU): the top CUDA kernels of one
forward+backward, for each variant of `gpu_block.py` (FLA's only where it is installed).

    PYTHONPATH=$PWD:$PWD/benchmarks python benchmarks/gpu_block_profile.py [--variants ours,ours-unfused]
"""

import argparse
import os

import torch
from torch.profiler import ProfilerActivity, profile

import gla_inductor
from gpu_block import compiled, fla_gla, make, naive_gla, step, warm_up_inductor


def kernel_table(fn, steps: int = 5, n: int = 18) -> str:
    """The top kernels by total CUDA time over `steps` calls (the table's times are per call once
    divided by `steps`, which the header says)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    return f"(totals over {steps} steps)\n" + prof.key_averages().table(
        sort_by="cuda_time_total", row_limit=n, max_name_column_width=80)


def write_code(folder: str, variant: str, fn) -> None:
    """The Inductor output code of the first call of fn (forward, then backward)."""
    from torch._inductor.utils import run_and_get_code

    os.makedirs(folder, exist_ok=True)
    _, codes = run_and_get_code(fn)
    for i, code in enumerate(codes):
        with open(os.path.join(folder, f"{variant}_{i}.py"), "w") as f:
            f.write(code)


def chosen_configs(pattern: str) -> list[str]:
    """The launch config each loaded Inductor kernel whose name holds `pattern` settled on."""
    from torch._inductor.codecache import PyCodeCache

    found = []
    for mod in list(PyCodeCache.modules):
        for name, obj in vars(mod).items():
            launchers = getattr(obj, "launchers", None)
            if pattern in name and launchers:
                found.append(f"{name}: {launchers[0].config}")
    return found


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--variants", default="ours,ours-unfused")
    p.add_argument("--shape", default="8,2048,16,128,128")
    p.add_argument("--configs", help="print the chosen launch configs of kernels whose names hold this")
    p.add_argument("--code", help="a folder to write each variant's generated code to")
    args = p.parse_args()
    shape = tuple(int(s) for s in args.shape.split(","))
    warm_up_inductor()
    for variant in args.variants.split(","):
        with gla_inductor.config.patch(fuse_gates=variant != "ours-unfused"):
            block, x, dy = make(fla_gla if variant == "fla" else naive_gla, shape, "cuda", torch.bfloat16)
            fn = compiled(variant, block)
            if args.code:
                write_code(args.code, variant, lambda: step(fn, x, dy))
            print(f"## {variant} {shape}\n{kernel_table(lambda: step(fn, x, dy))}", flush=True)
            if args.configs:
                print("\n".join(chosen_configs(args.configs)), flush=True)


if __name__ == "__main__":
    main()
